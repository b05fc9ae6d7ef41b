"""What a real run records into samples.jsonl: the trainer's own numbers, token by token, bounded and resumable."""

import json
import statistics

import pytest

from tidal.inspector.record import pick
from tidal.inspector.samples import read_samples
from tidal.models import tiny
from tidal.system.run import close, prepare

from ..system.test_controller import tiny_cfg
from .conftest import RECORD_ALL


def _records(run_dir):
    records, skipped = read_samples(run_dir / "samples.jsonl")
    assert skipped == 0
    return records


def test_pick_spreads_the_recorded_groups_over_the_batch():
    assert pick(128, 2) == [0, 64]
    assert pick(4, 4) == [0, 1, 2, 3]
    assert pick(3, 8) == [0, 1, 2]
    assert pick(5, 0) == [] and pick(0, 2) == []


def test_task_of_a_prompt():
    from tidal.inspector.record import task_of
    from tidal.types import Prompt

    assert task_of(Prompt("u", "q", "a"), "addition") == "addition"
    assert task_of(Prompt("u", "q", "a", {"task": "gsm8k"}), "files") == "gsm8k"
    assert task_of(Prompt("u", "q", "a", {"metadata": {"source_dataset": "chain_sum"}}), "reasoning_gym") == "chain_sum"


def test_train_records_hold_what_the_trainer_saw(inspector_runs):
    records = _records(inspector_runs["a"])
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 1, 2, 2, 3, 3]  # every step, 2 groups (log.samples.groups=2)
    assert [r["group"] for r in train[:2]] == [0, 2]  # 4 prompts per step: pick(4, 2)
    tokenizer = tiny.build_tokenizer()
    trained = 0
    for rec in train:
        assert rec["prompt"]["task"] == "addition" and rec["prompt"]["text"].endswith("=")
        rewards = [s["reward"] for s in rec["samples"]]
        assert len(rewards) == 4  # rollout.group_size=4
        for s in rec["samples"]:
            n = len(s["ids"])
            assert s["tokens"] == [tokenizer.decode([i]) for i in s["ids"]]
            assert len(s["behav_logp"]) == len(s["versions"]) == len(s["loss_mask"]) == n
            assert s["staleness"] == 0 and s["versions"] == [rec["step"] - 1] * n  # sync: sampled by this step's policy
            assert s["finish_reason"] in ("stop", "length") and s["policy_mask"] is None
            assert "correct" in s["details"]  # digit_match's details
        if not rec["trained"]:  # every reward equal: left out of the batch
            assert len(set(rewards)) == 1
            assert all(s["trainer_logp"] is None and s["advantage"] is None and set(s["loss_mask"]) <= {0}
                       for s in rec["samples"])
            continue
        trained += 1
        # GRPO by hand: (r - mean) / (sample std + 1e-6); rewards were recorded to 4 decimals
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        for s in rec["samples"]:
            assert s["advantage"] == pytest.approx((s["reward"] - mean) / (std + 1e-6), abs=2e-3)
            assert s["loss_mask"] == [1] * len(s["ids"])
            # sync: the engine sampled with the weights the trainer scores with, so only float rounding differs
            assert s["trainer_logp"] == pytest.approx(s["behav_logp"], abs=2e-3)
    assert trained >= 1, "the tiny run must train at least one recorded group"


def test_eval_records_are_the_greedy_answers_at_every_evaluation(inspector_runs):
    records = _records(inspector_runs["a"])
    evals = [r for r in records if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, 2, 3]  # base, eval_every=2, the last step
    by_step = {}
    for r in evals:
        by_step.setdefault(r["step"], []).append(r["prompt"]["text"])
        (s,) = r["samples"]
        assert s["correct"] == (s["reward"] >= 1.0)
        assert "trainer_logp" not in s and "staleness" not in s
    assert by_step[0] == by_step[2] == by_step[3] and len(by_step[0]) == 4  # the same first 4 held-out prompts
    rows = [json.loads(x) for x in (inspector_runs["a"] / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]


def test_agent_episodes_record_their_observations_as_not_trained(inspector_runs):
    train = [r for r in _records(inspector_runs["agent"]) if r["kind"] == "train"]
    seen_observation = False
    for rec in train:
        for s in rec["samples"]:
            mask = s["policy_mask"]
            assert mask is not None and len(mask) == len(s["ids"])
            assert s["episode"]["turns"] >= 1
            for j, sampled in enumerate(mask):
                if not sampled:  # an environment observation: no log-prob, no version, never in the loss
                    seen_observation = True
                    assert s["behav_logp"][j] == 0.0 and s["versions"][j] == -1 and s["loss_mask"][j] == 0
    assert seen_observation


def test_resume_appends_and_records_no_step_twice(tmp_path):
    out = tmp_path / "run"
    opts = (*RECORD_ALL, "checkpoint_every=2", "log.report=false")
    for resume, steps in ((False, 2), (True, 4)):
        controller = prepare(tiny_cfg(tmp_path, *opts, f"max_steps={steps}"), out, resume=resume)
        try:
            controller.run()
        finally:
            close(controller)
    records = _records(out)
    keys = [(r["step"], r["kind"], r.get("group"), r["prompt"]["uid"]) for r in records]
    assert len(keys) == len(set(keys)), "a resumed run recorded a step twice"
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("run/resumed")] == [3]  # the first step the resumed process logged


def test_a_resume_drops_what_a_crash_recorded_after_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    opts = (*RECORD_ALL, "checkpoint_every=2", "log.report=false")
    controller = prepare(tiny_cfg(tmp_path, *opts, "max_steps=2"), out)
    try:
        controller.run()
    finally:
        close(controller)
    with open(out / "samples.jsonl", "a") as f:  # as if step 3 was recorded, then the process was killed mid-line
        f.write(json.dumps({"step": 3, "kind": "eval", "prompt": {"text": "x"}, "samples": []}) + "\n")
        f.write('{"step": 3, "kind": "tr')
    controller = prepare(tiny_cfg(tmp_path, *opts, "max_steps=3"), out, resume=True)
    try:
        controller.run()
    finally:
        close(controller)
    records, skipped = read_samples(out / "samples.jsonl")
    assert skipped == 0 and max(r["step"] for r in records) == 3
    assert not any(r["prompt"]["text"] == "x" for r in records)


def test_recording_stops_at_the_size_cap_and_says_so(tmp_path):
    controller = prepare(tiny_cfg(tmp_path, *RECORD_ALL, "log.samples.max_mb=0.004", "log.report=false"),
                         tmp_path / "run")
    try:
        controller.run()
    finally:
        close(controller)
    path = tmp_path / "run" / "samples.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert path.stat().st_size <= 4000 + 100  # the cap, plus the one line that says it was reached
    assert [x["kind"] for x in lines].count("capped") == 1 and lines[-1]["kind"] == "capped"


def test_default_rate_records_eval_answers_but_no_training_group_in_three_steps(tmp_path):
    controller = prepare(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=3"), tmp_path / "run")
    try:
        controller.run()
    finally:
        close(controller)
    records = _records(tmp_path / "run")
    assert {r["kind"] for r in records} == {"eval"}  # every=10: the first training record is at step 10
    assert len([r for r in records if r["step"] == 0]) == 16  # eval_prompts=16 (num_eval=16 in the tiny config)


def moe_samples(tokenizer, n_prompts=2):
    """Greedy answers of the tiny MoE model from the local engine (routes recorded), as eval records."""
    import torch

    from tidal.inspector.record import eval_records
    from tidal.rollout.local import LocalEngine, SamplingConfig
    from tidal.rollout.requests import group_requests
    from tidal.types import Prompt

    torch.manual_seed(0)
    model = tiny.build_model(tiny.ModelConfig(num_experts=8), tokenizer)
    prompts = [Prompt(f"q{i}", f"{i}+{i}=", str(2 * i)) for i in range(n_prompts)]
    trajs = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=6)).generate(
        group_requests(tokenizer, prompts, 1), greedy=True)
    return trajs, eval_records(0, prompts, trajs, tokenizer, "addition")


def test_moe_routes_are_recorded_per_response_token(tokenizer, small_model):
    """``routes``: the response tokens' experts in ``moe.encode_routes``' format (the inspector's own copy of it,
    which the layer table requires, writes the same bytes); a dense model's samples have none."""
    import torch

    from tidal.inspector.record import encode_routes, sample_record
    from tidal.inspector.samples import valid_record
    from tidal.models import moe
    from tidal.rollout.local import LocalEngine, SamplingConfig
    from tidal.rollout.requests import group_requests
    from tidal.types import Prompt

    trajs, records = moe_samples(tokenizer)
    for t, rec in zip(trajs, records):
        s = rec["samples"][0]
        response = t.routes[len(t.prompt_ids):]
        assert s["routes"] == moe.encode_routes(response) == encode_routes(response)
        got = moe.decode_routes(json.loads(json.dumps(s["routes"])))
        assert got.shape[0] == len(s["ids"]) and torch.equal(got, t.routes[len(t.prompt_ids):])
        assert (got[-1] == moe.NO_ROUTE).all() and (got[:-1] != moe.NO_ROUTE).all()
        assert valid_record(rec)
    dense = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=3)).generate(
        group_requests(tokenizer, [Prompt("d", "1+1=", "2")], 1))[0]
    assert "routes" not in sample_record(dense, [])
