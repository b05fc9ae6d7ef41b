"""``tidal bench gpu``'s ``generate`` part (``benchmarks/gpu.py`` registers it): the local engine against HF
``generate`` on the same requests and weights, and the engine against its bandwidth roofline."""

from __future__ import annotations

import copy
import dataclasses

import torch

from tidal.bench import load
from tidal.utils.device import resolve_dtype

roofline = load("_roofline")


def engine_arm(model, tokenizer, requests, s, device: torch.device) -> tuple[int, float, list | None]:
    """(useful new tokens, seconds) of one timed ``LocalEngine.generate`` over every request, after a warm-up,
    and with ``profile`` the profiler's table of one more ``generate`` of the first batch."""
    from tidal.rollout.local import LocalEngine, SamplingConfig

    cfg = SamplingConfig(dtype=s.engine_dtype, max_new_tokens=s.gen_max_new_tokens, max_batch_size=s.gen_max_batch_size,
                         decode_attention=s.decode_attention)
    engine = LocalEngine(model, tokenizer, cfg, seed=s.seed)
    engine.eos_id = None  # ignore EOS: a random model would stop at random (the budget ends every request)
    engine.generate([dataclasses.replace(r, max_new_tokens=4) for r in requests[:8]])
    engine.prepare(requests)  # the slot cache sized and the CUDA-graph buckets recorded before the clock (issue 51)
    trajs, seconds = roofline.timed(lambda: engine.generate(requests), device)
    useful = sum(len(t.token_ids) for t in trajs)
    assert useful == sum(r.max_new_tokens for r in requests), "the engine stopped a request before its budget"
    few = requests[: s.gen_max_batch_size]
    profiled = roofline.profile_table(lambda: engine.generate(few), device) if s.profile else None
    return useful, seconds, profiled


def hf_arm(model, requests, s, device: torch.device) -> tuple[int, int, float]:
    """(useful new tokens, new tokens computed, seconds) of HF ``generate`` over the requests in batches of
    ``gen_max_batch_size`` rows (every prompt has the same length: no padding), each batch run to its longest
    budget; a row's tokens past its own budget are computed but not useful."""
    model.generation_config.eos_token_id = None  # ignore EOS, as the engine does
    ids = torch.tensor([r.prompt_ids for r in requests], device=device)
    budgets = [r.max_new_tokens for r in requests]

    def generate(rows: slice, max_new: int):
        torch.manual_seed(s.seed)
        out = model.generate(input_ids=ids[rows], attention_mask=torch.ones_like(ids[rows]), do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new, pad_token_id=0)
        return out.shape[1] - ids.shape[1]  # new columns, the same for every row

    with torch.no_grad():
        generate(slice(0, 8), 4)
        useful, computed, seconds = 0, 0, 0.0
        for start in range(0, len(requests), s.gen_max_batch_size):
            rows = slice(start, start + s.gen_max_batch_size)
            width, sec = roofline.timed(lambda rows=rows: generate(rows, max(budgets[rows])), device)
            useful += sum(min(b, width) for b in budgets[rows])
            computed += width * len(budgets[rows])
            seconds += sec
    return useful, computed, seconds


def part_generate(s, base: torch.nn.Module, device: torch.device, peaks: dict, gen_requests) -> dict:
    """tidal's engine against HF ``generate`` on the same requests and weights: useful tokens/s, the ratio, the
    engine's share of its bandwidth roofline and its decode step time (``gen_requests``: ``gpu.py``'s)."""
    from tidal.models import tiny

    dtype = resolve_dtype(s.engine_dtype, device, "engine_dtype")
    model = copy.deepcopy(base).to(device).eval()
    requests = gen_requests(s, model.config.vocab_size)
    engine_tokens, engine_s, profiled = engine_arm(model, tiny.build_tokenizer(), requests, s, device)
    model.to(dtype)
    hf_tokens, hf_computed, hf_s = hf_arm(model, requests, s, device)
    weight_bytes = roofline.matmul_params(model) * dtype.itemsize
    kv = roofline.kv_bytes_per_token(model.config, dtype)
    steps = roofline.decode_steps([len(r.prompt_ids) for r in requests], [r.max_new_tokens for r in requests],
                         s.gen_max_batch_size)
    ceiling = roofline.roofline_tokens_per_s(weight_bytes, kv, steps, peaks["copy_bandwidth_bytes_per_s"])
    engine_rate, hf_rate = engine_tokens / engine_s, hf_tokens / hf_s
    return {
        "engine_over_hf_generate": engine_rate / hf_rate, "engine_tokens_per_s": engine_rate,
        "hf_generate_tokens_per_s": hf_rate, "engine_roofline_frac": engine_rate / ceiling,
        "roofline_tokens_per_s": ceiling, "useful_tokens": engine_tokens, "hf_useful_tokens": hf_tokens,
        "hf_computed_tokens": hf_computed, "engine_s": engine_s, "hf_s": hf_s, "requests": len(requests),
        "decode_steps": len(steps), "decode_step_ms": engine_s * 1e3 / len(steps),
        "weight_bytes": weight_bytes, "kv_bytes_per_token": kv, "dtype": str(dtype),
        **({"profile": profiled} if profiled is not None else {}),
    }
