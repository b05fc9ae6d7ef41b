"""Runs inside vLLM's worker processes: a worker extension (vLLM's ``--worker-extension-cls``) that
loads new policy weights from a checkpoint directory, for servers that tidal's trainer updates.

A vLLM server started with ``--worker-extension-cls tidal.rollout.vllm_worker.TidalWorkerExtension``
and ``VLLM_SERVER_DEV_MODE=1`` exposes ``POST /collective_rpc``; tidal's server client
(``vllm_server.py``) calls ``{"method": "tidal_load_weights_from_dir", "args": [path]}`` on every
server after writing the trainer's weights to ``path`` (a shared filesystem across machines), then
``POST /reset_prefix_cache``. Only stdlib, torch and safetensors here: vLLM imports this module.
"""

from __future__ import annotations

from pathlib import Path


class TidalWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` holds the model)."""

    def tidal_load_weights_from_dir(self, path: str) -> int:
        """Load every ``*.safetensors`` tensor under ``path`` (Hugging Face names) into the model;
        returns the number of tensors read."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        count = 0
        for f in files:
            state = load_file(str(f))
            count += len(state)
            model.load_weights(weights=iter(state.items()))
        return count
