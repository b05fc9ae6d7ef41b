"""``tidal bench generate`` keeps its contract on a toy size, and counts only real new tokens."""

import json
from pathlib import Path

import pytest
import torch

from tidal import bench
from tidal.models import tiny


def test_count_new_tokens_stops_at_the_first_eos():
    module = bench.load("generate")
    eos, pad = 2, 0
    new = torch.tensor([
        [5, 2, pad, pad, pad],  # EOS second: 2 real tokens, the padding after it is waste
        [5, 6, 7, 8, 9],  # never stopped: all 5 count
        [2, pad, pad, pad, pad],  # EOS first: 1
        [7, 2, 2, 2, 2],  # pad id == EOS id (a common setup): still 2
    ])
    assert module.count_new_tokens(new, eos) == [2, 5, 1, 2]


@pytest.fixture
def one_thread():
    """Tiny shapes: a second thread only adds waiting when another process shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_hf_arm_counts_what_generate_returned(tokenizer, small_model, one_thread):
    """The HF arm's real-token count equals a row-by-row count of its own output (EOS inclusive)."""
    module = bench.load("generate")
    from tidal.rollout.requests import group_requests
    from tidal.types import Prompt

    s = module.Settings(max_new_tokens=12)
    requests = group_requests(tokenizer, [Prompt("a", "3*b=", "bbb"), Prompt("b", "12*c=", "c" * 12)], 3)
    arm = module.HFArm(small_model, tokenizer, requests, 4, s)
    real, computed = arm()
    outputs = []
    torch.manual_seed(s.seed)  # the arm seeds the same way: regenerate and count by hand
    for ids, mask in arm.batches:
        out = small_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=12,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        outputs += out[:, ids.shape[1] :].tolist()
    by_hand = []
    for row in outputs:
        by_hand.append(row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row))
    assert arm.lengths == by_hand and real == sum(by_hand)
    assert computed == sum(len(row) for row in outputs) >= real
    assert len(arm.batches) == 2 and [len(ids) for ids, _ in arm.batches] == [4, 2]  # 6 requests, batch 4


def test_generate_benchmark_runs(tmp_path):
    tokenizer = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    tiny.save(tiny.build_model(cfg, tokenizer), tokenizer, tmp_path / "model")
    module = bench.load("generate")
    toy = [f"model_path={tmp_path / 'model'}", "num_prompts=3", "group_size=2", "max_new_tokens=6",
           "hf_batch_sizes=[2, 4]", "engine_batch_sizes=[4]", "unshared_batch_sizes=[4]", "rounds=2",
           "threads=1", "vllm=false", "speculative_tasks=[]"]  # 1 thread: shared cores; no warm-started bases
    result = module.run(toy, tmp_path / "out" / "generate")
    rows = result["table"]
    assert [(r["arm"], r["batch_size"]) for r in rows] == [("hf", 2), ("hf", 4), ("engine", 4), ("engine-unshared", 4)]
    for r in rows:
        assert r["samples"] == 6 and 6 <= r["new_tokens"] <= 6 * 6  # at least one token (EOS) each, at most the cap
        assert r["new_tokens_per_s"] == r["new_tokens"] / r["seconds"] and 0 <= r["wasted_frac"] < 1
    assert rows[2]["wasted_frac"] == 0 and max(r["vs_best_hf"] for r in rows[:2]) == 1
    assert rows[2]["new_tokens"] == rows[3]["new_tokens"]  # sharing rows changes no sample
    assert result["shared_over_unshared"] == rows[2]["new_tokens_per_s"] / rows[3]["new_tokens_per_s"]
    assert all(len(t) == 2 for t in result["times_s"].values())
    assert Path(result["plot"]).stat().st_size > 0 and result["plot"].endswith("generate.png")
    json.dumps(result)  # the harness writes it as JSON
