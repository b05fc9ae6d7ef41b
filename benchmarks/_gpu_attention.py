"""``tidal bench gpu``'s ``decode_attention`` part (``benchmarks/gpu.py`` registers it): the engine's decode step
with each ``rollout.decode_attention`` arm (``repeat``, ``gqa``, ``fold``; ``tidal/rollout/decode_attention.py``), and
which SDPA kernel each arm's attention call gets at the engine's shapes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import random
import statistics

import torch

from tidal.utils.device import resolve_dtype


def part_decode_attention(s, base: torch.nn.Module, device: torch.device, peaks: dict, timed) -> dict:
    """Each ``rollout.decode_attention`` arm of ``attention_modes`` on the same ``attention_prompts`` x
    ``attention_group_size`` rows of ``attention_prompt_len`` random tokens, every row decoding
    ``attention_new_tokens`` tokens (EOS ignored). ``decode_step_ms_<mode>`` = (seconds of the whole generate -
    seconds of a one-token generate, the prefill) / (``attention_new_tokens`` - 1); ``decode_tokens_<mode>``: the
    arm's first row's tokens (the arms must sample the same ones; bf16 sums in another order may flip a rare
    near-tie). ``decode_kernels``: the SDPA backend each arm's call gets at these shapes, a decode step (q = 1) and
    a speculative verify step (q = 5), from ``torch._fused_sdp_choice`` (the math kernel is the slow fallback), and
    ``decode_call_ms``: one layer's attention call alone at those shapes, per arm (``decode_kernels``)."""
    from tidal.api import GenRequest
    from tidal.models import tiny
    from tidal.rollout.local import LocalEngine, SamplingConfig
    from tidal.types import Prompt

    model = copy.deepcopy(base).to(device).eval()
    rng = random.Random(s.seed + 3)
    requests = []
    for i in range(s.attention_prompts):
        ids = tuple(rng.randrange(model.config.vocab_size) for _ in range(s.attention_prompt_len))
        requests += [GenRequest(Prompt(f"a{i}", "", ""), ids, j, s.attention_new_tokens)
                     for j in range(s.attention_group_size)]
    one = [dataclasses.replace(r, max_new_tokens=1) for r in requests]
    kernels, call_ms = decode_kernels(model.config, len(requests), s.attention_prompt_len,
                                      resolve_dtype(s.engine_dtype, device, "engine_dtype"), device, timed)
    out: dict = {"rows": len(requests), "context": s.attention_prompt_len + s.attention_new_tokens,
                 "decode_kernels": kernels, "decode_call_ms": call_ms}
    for mode in s.attention_modes:
        cfg = SamplingConfig(dtype=s.engine_dtype, max_new_tokens=s.attention_new_tokens,
                             max_batch_size=len(requests), decode_attention=mode)
        engine = LocalEngine(model, tiny.build_tokenizer(), cfg, seed=s.seed)
        engine.eos_id = None
        engine.end_ids = ()
        engine.prepare(requests)  # the slot cache sized and the CUDA-graph buckets recorded before the clock
        engine.generate([dataclasses.replace(r, max_new_tokens=4) for r in requests])  # warm-up: kernels
        _, prefill_s = timed(lambda engine=engine: engine.generate(one), device)
        trajs, total_s = timed(lambda engine=engine: engine.generate(requests), device)
        assert all(t.num_tokens == s.attention_new_tokens for t in trajs), "a row stopped before its budget"
        out[f"decode_step_ms_{mode}"] = (total_s - prefill_s) * 1e3 / max(1, s.attention_new_tokens - 1)
        out[f"decode_tokens_{mode}"] = list(trajs[0].token_ids)
        del engine
        gc.collect()
    return out


def decode_kernels(config, rows: int, context: int, dtype: torch.dtype, device: torch.device, timed,
                   calls: int = 5) -> tuple[dict, dict]:
    """``{"<mode> q=<q>": backend}``: the SDPA backend ``torch._fused_sdp_choice`` picks for each arm's attention
    call at the engine's shapes (a strided K/V view and a boolean mask, as the slot cache hands them), and
    ``{"<mode> q=<q>": ms}``: one such call's time, K/V repeat (``repeat``) or mask copy (``fold``) included, the
    median of ``calls`` after one warm-up."""
    from torch.nn.attention import SDPBackend

    sdpa = torch.nn.functional.scaled_dot_product_attention

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n_rep = heads // kv_heads
    key = torch.randn(rows, kv_heads, context + 64, dim, dtype=dtype, device=device)[:, :, :context]
    value = torch.randn_like(key)

    def arm(mode: str, query: torch.Tensor, mask: torch.Tensor) -> tuple[tuple, dict]:
        """SDPA's arguments for ``mode``, built as its forward builds them (the copies included)."""
        q = query.shape[2]
        if mode == "repeat":
            kv = [x[:, :, None].expand(rows, kv_heads, n_rep, context, dim).reshape(rows, heads, context, dim)
                  for x in (key, value)]
            return (query, *kv, mask), {}
        if mode == "gqa":
            return (query, key, value, mask), {"enable_gqa": True}
        folded = mask if q == 1 else mask[:, :, None].expand(rows, 1, n_rep, q, context).reshape(rows, 1, -1, context)
        return (query.reshape(rows, kv_heads, n_rep * q, dim), key, value, folded), {}

    def call(mode: str, query: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        args, kw = arm(mode, query, mask)
        return sdpa(*args, **kw)

    kernels, call_ms = {}, {}
    for q in (1, 5):
        query = torch.randn(rows, q, heads, dim, dtype=dtype, device=device).transpose(1, 2)
        mask = torch.ones(rows, 1, q, context, dtype=torch.bool, device=device)
        for mode in ("repeat", "gqa", "fold"):
            name = f"{mode} q={q}"
            try:
                args, kw = arm(mode, query, mask)
                kernels[name] = SDPBackend(torch._fused_sdp_choice(*args, **kw)).name
                call(mode, query, mask)
                call_ms[name] = 1e3 * statistics.median(
                    timed(functools.partial(call, mode, query, mask), device)[1] for _ in range(calls))
            except Exception as e:  # noqa: BLE001 (a backend refusing the shapes is itself the answer)
                kernels[name] = f"{type(e).__name__}: {e}"
    return kernels, call_ms
