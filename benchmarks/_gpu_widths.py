"""``tidal bench gpu``'s ``graph_widths`` part: the static decode step with ``rollout.graph_widths=full`` against
``buckets`` (``rollout/graphs.py``, issue 51) at a long length budget.

The slot cache is sized for prompt + the whole budget (``rollout/sizing.py``); with ``full`` every static decode step
attends over all of its columns, with ``buckets`` over the write column's power-of-two width bucket. The part sizes
each arm's engine for ``widths_rows`` rows of ``widths_prompt_len`` random tokens with a ``widths_budget``-token
budget (``LocalEngine.prepare``: the buffers and every (rows, width) graph, before the clock), then times the first
``widths_steps`` decode steps: ``decode_step_ms`` = (seconds of a ``widths_steps`` + 1 token generate - seconds of a
one-token generate, the prefill) / ``widths_steps``, each the faster of two runs, every row decoding (EOS ignored),
as the ``decode_attention`` part counts; ``decode_step_host_ms``: the engine's own host time per step over those
runs (all of a step's time on a CPU; on CUDA the time to issue it plus the wait for its tokens). Both arms run
static decode (``cuda_graphs=on``: CUDA graphs on a GPU, the same steps eagerly on a CPU, where the figures only
show the code path runs) under ``decode_attention`` (``--set decode_attention=fold`` measures the two levers
together). Per arm also ``prepare_s`` (sizing and recording), ``graph_recordings``,
``graph_late_steps`` (recordings decode had to make: 0 when the sizing held), ``widths`` (the width buckets built)
and ``kv_gb_per_step``: the keys and values the measured steps' attention reads per step on average (rows x width x
2 x layers x KV heads x head dim x bytes; what ``repeat_kv`` copies comes on top). Top level:
``decode_step_ms_by_graph_widths``, ``graph_widths_speedup`` (full's ms over buckets') and
``graph_widths_same_tokens`` (the arms sampled the same tokens; bf16 sums in another order may flip a rare near-tie,
so ``graph_widths_token_agreement`` gives the fraction of equal tokens).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import random
import statistics

import torch

ARMS = ("full", "buckets")


def part_graph_widths(s, base: torch.nn.Module, device: torch.device, peaks: dict, timed) -> dict:
    """The ``graph_widths`` part (module docstring); ``timed`` is ``benchmarks/_roofline.py``'s."""
    from tidal.api import GenRequest
    from tidal.models import tiny
    from tidal.rollout.graphs import width_bucket
    from tidal.rollout.local import LocalEngine, SamplingConfig
    from tidal.types import Prompt

    model = copy.deepcopy(base).to(device).eval()
    rng = random.Random(s.seed + 5)
    requests = [GenRequest(Prompt(f"w{i}", "", ""), tuple(rng.randrange(model.config.vocab_size)
                                                          for _ in range(s.widths_prompt_len)), 0, s.widths_budget)
                for i in range(s.widths_rows)]
    measured = [dataclasses.replace(r, max_new_tokens=s.widths_steps + 1) for r in requests]
    one = [dataclasses.replace(r, max_new_tokens=1) for r in requests]
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out: dict = {"rows": s.widths_rows, "prompt_len": s.widths_prompt_len, "budget": s.widths_budget,
                 "steps": s.widths_steps, "decode_attention": s.decode_attention}
    tokens = {}
    for arm in ARMS:
        cfg = SamplingConfig(dtype=s.engine_dtype, max_new_tokens=s.widths_budget, max_batch_size=s.widths_rows,
                             decode_attention=s.decode_attention, cuda_graphs="on", graph_widths=arm)
        engine = LocalEngine(model, tiny.build_tokenizer(), cfg, seed=s.seed)
        engine.eos_id, engine.end_ids = None, ()  # the budget ends every request
        _, prepare_s = timed(lambda engine=engine: engine.prepare(requests), device)
        engine.generate([dataclasses.replace(r, max_new_tokens=4) for r in requests])  # warm-up: kernels
        prefill_s = min(timed(lambda engine=engine: engine.generate(one), device)[1] for _ in range(2))
        steps, host_s = engine.num_decode_steps, engine.decode_host_seconds
        runs = [timed(lambda engine=engine: engine.generate(measured), device) for _ in range(2)]
        host_ms = (engine.decode_host_seconds - host_s) * 1e3 / max(1, engine.num_decode_steps - steps)
        trajs, total_s = min(runs, key=lambda run: run[1])
        assert all(t.num_tokens == s.widths_steps + 1 for t in trajs), "a row stopped before its budget"
        slots, stats = engine._slots, engine.stats()
        columns = slots.columns
        # decode step k writes column prompt_len + k (the rows joined together, left-aligned at the prefill's width)
        widths = [width_bucket(s.widths_prompt_len + k + 1, columns) if arm == "buckets" else columns
                  for k in range(s.widths_steps)]
        itemsize = slots.kv.element_size()
        out["columns"] = columns
        out[arm] = {"decode_step_ms": (total_s - prefill_s) * 1e3 / max(1, s.widths_steps), "prepare_s": prepare_s,
                    "decode_step_host_ms": host_ms,
                    "graph_recordings": stats["rollout/graph_recordings"],
                    "graph_late_steps": stats["rollout/graph_late_steps"],
                    "widths": sorted({w for _, w in slots.static._steps}),
                    "kv_gb_per_step": s.widths_rows * statistics.mean(widths) * 2 * config.num_hidden_layers
                    * kv_heads * head_dim * itemsize / 1e9}
        tokens[arm] = [t.token_ids for t in trajs]
        del engine, slots
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    pairs = [(a, b) for x, y in zip(tokens["full"], tokens["buckets"]) for a, b in zip(x, y)]
    out["graph_widths_same_tokens"] = tokens["full"] == tokens["buckets"]
    out["graph_widths_token_agreement"] = sum(a == b for a, b in pairs) / max(1, len(pairs))
    out["decode_step_ms_by_graph_widths"] = {arm: out[arm]["decode_step_ms"] for arm in ARMS}
    out["graph_widths_speedup"] = out["full"]["decode_step_ms"] / out["buckets"]["decode_step_ms"]
    return out


def table_rows(result: dict) -> list[tuple]:
    """``benchmarks/gpu.py``'s table rows (part, quantity, value, note) for this part, if it ran."""
    if "graph_widths" not in result:
        return []
    part = result["graph_widths"]
    rows = []
    for arm in ARMS:
        got = part.get(arm) or {}
        note = part.get("error") or (f"{part.get('rows')} rows, prompt {part.get('prompt_len')}, budget "
                                     f"{part.get('budget')}, first {part.get('steps')} steps; KV GB/step "
                                     f"{got.get('kv_gb_per_step')}, recordings {got.get('graph_recordings')}")
        rows.append(("graph_widths", f"decode step ms, {arm}", got.get("decode_step_ms"), note))
    return rows
