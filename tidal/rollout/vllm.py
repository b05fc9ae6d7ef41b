"""``ENGINES['vllm']``: the in-process vLLM engine (``vllm_engine.py``) or the client of vLLM servers
(``vllm_server.py``), one per trainer model."""

from __future__ import annotations

from tidal.models.tied import tied_names
from tidal.rollout.vllm_engine import _DRIVERS, VllmEngine, driver_for
from tidal.rollout.vllm_options import VllmOptions, hub_layout_of
from tidal.rollout.vllm_server import VllmServerEngine


def build_engine(model, tokenizer, cfg, seed: int = 0, version: int = 0):
    """``ENGINES['vllm']``: in-process, or the server client when ``rollout.vllm.servers`` is set.
    Engines built from the same trainer model share one vLLM instance (or one server client)."""
    options = getattr(cfg, "vllm", None) or VllmOptions()
    if options.servers:
        if model not in _DRIVERS:
            _DRIVERS[model] = VllmServerEngine(options.servers, tokenizer, cfg, seed=seed, version=version,
                                               options=options, tied=tied_names(model),
                                               to_hub=hub_layout_of(getattr(model, "config", None)))
        return _DRIVERS[model]
    return VllmEngine(driver_for(model, tokenizer, cfg, seed, version, options), tokenizer, cfg, seed=seed)
