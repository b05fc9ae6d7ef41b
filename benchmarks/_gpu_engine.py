"""``tidal bench gpu``'s ``host_reads`` part: the engine's decode step with ``rollout.host_reads=sync`` against ``late``
(``rollout/late_reads.py``, issue 51) on the ``generate`` part's requests (its prompts, long-tailed budgets, EOS
ignored, ``gen_max_batch_size`` slots).

Per arm, after a warm-up and ``LocalEngine.prepare`` (slots sized, graph buckets recorded before the clock): the timed
``generate``'s seconds over its decode steps (``decode_step_ms``: prefills included, as the ``generate`` part counts
them; the late arm runs a step more per finishing row), the engine's own ``decode_step_host_ms`` (host wall-clock time
inside a step) and ``decode_step_wait_ms`` (late: the host's wait for the previous step's tokens), and on CUDA
``syncs_per_step``: the host-device synchronizations ``torch.cuda.set_sync_debug_mode`` reports in one more, untimed
``generate``, per decode step (the synchronous arm reads every step; the late arm only at admissions and finishing
rows' retirement). ``late_speedup``: the synchronous arm's ``generate`` seconds over the late arm's (the late arm's
extra steps included). ``host_reads_same_tokens``: both arms sampled the same tokens (they must). Both arms decode
every row (``share_identical_rows`` off: a dynamic decode that shares rows needs the tokens on the host, so ``late``
would fall back to ``sync`` on a CPU; on CUDA static decode never shares)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import warnings

import torch

MODES = ("sync", "late")


def part_host_reads(s, base: torch.nn.Module, device: torch.device, peaks: dict, gen_requests, timed) -> dict:
    """The ``host_reads`` part (module docstring); ``gen_requests`` and ``timed`` are ``benchmarks/gpu.py``'s."""
    from tidal.models import tiny
    from tidal.rollout.local import LocalEngine, SamplingConfig

    model = copy.deepcopy(base).to(device).eval()
    requests = gen_requests(s, model.config.vocab_size)
    out: dict = {"requests": len(requests)}
    tokens = {}
    for mode in MODES:
        cfg = SamplingConfig(dtype=s.engine_dtype, max_new_tokens=s.gen_max_new_tokens,
                             max_batch_size=s.gen_max_batch_size, decode_attention=s.decode_attention,
                             share_identical_rows=False, host_reads=mode)
        engine = LocalEngine(model, tiny.build_tokenizer(), cfg, seed=s.seed)
        engine.eos_id, engine.end_ids = None, ()  # the budget ends every request
        engine.generate([dataclasses.replace(r, max_new_tokens=4) for r in requests[:8]])
        engine.prepare(requests)
        steps, host_s = engine.num_decode_steps, engine.decode_host_seconds
        late = engine._late
        waited, late_steps = (late.wait_seconds, late.num_steps) if late is not None else (0.0, 0)
        trajs, seconds = timed(lambda engine=engine: engine.generate(requests), device)
        steps = engine.num_decode_steps - steps
        arm = {"decode_step_ms": seconds * 1e3 / steps, "decode_steps": steps, "generate_s": seconds,
               "decode_step_host_ms": (engine.decode_host_seconds - host_s) * 1e3 / steps,
               "late_steps": late.num_steps - late_steps if late is not None else 0,
               "decode_step_wait_ms": (late.wait_seconds - waited) * 1e3 / steps if late is not None else None}
        if device.type == "cuda":
            arm["syncs_per_step"] = _syncs_per_step(engine, requests)
        out[mode] = arm
        tokens[mode] = [t.token_ids for t in trajs]
        del engine
        gc.collect()
    out["host_reads_same_tokens"] = tokens["sync"] == tokens["late"]
    out["decode_step_ms_by_host_reads"] = {mode: out[mode]["decode_step_ms"] for mode in MODES}
    out["late_speedup"] = out["sync"]["generate_s"] / out["late"]["generate_s"]  # the whole call's
    return out


def _syncs_per_step(engine, requests) -> float:
    """Host-device synchronizations per decode step of one ``generate``, as CUDA's sync debug mode warns of them."""
    steps = engine.num_decode_steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(requests)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs / max(engine.num_decode_steps - steps, 1)
