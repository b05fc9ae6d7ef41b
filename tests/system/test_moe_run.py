"""Mixture-of-experts runs end to end on a tiny Qwen3-MoE (issue 52): routes travel from the engine through the
journal and the batch to the trainer, samples.jsonl records them, r3 replays them, a run resumes exactly, and the
vLLM engine is asked for routes when r3 needs them."""

import json

import pytest

from tidal.config import apply_overrides
from tidal.inspector.samples import FILE_NAME
from tidal.models import moe
from tidal.recipes import RECIPES
from tidal.system.run import close, prepare, sampling_for

from .test_controller import comparable, run, run_interrupted_at, run_stopped_after, tiny_cfg

MOE = ("model.num_experts=4", "model.experts_per_token=2", "model.expert_intermediate_size=32", "log.samples.every=1")


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_a_sync_moe_run_measures_agreement_and_records_routes(tmp_path, replay):
    cfg = tiny_cfg(tmp_path, *MOE, "system.mode=sync", "rollout.dtype=bf16", f"trainer.moe.routing_replay={replay}")
    c, result = run(cfg, tmp_path / "run")
    assert moe.routing_of(c.trainer.model) is not None
    steps = [h for h in result.history if "train/loss" in h]  # the trained steps (a batch may have no signal)
    assert steps and all(h["moe/routing_compared"] > 0 for h in steps)  # sync: every step's samples are fresh
    assert all(0 < h["moe/routing_agreement"] <= 1 for h in steps)
    assert all("moe/load_balance_loss" in h and "train/logp_mismatch_kl" in h for h in steps)
    records = [json.loads(line) for line in (tmp_path / "run" / FILE_NAME).read_text().splitlines()]
    routed = [s for r in records for s in r.get("samples", []) if s.get("routes")]
    assert routed, "samples.jsonl records the routes of an MoE run's samples"


def test_a_sync_moe_run_with_r3_resumes_like_an_uninterrupted_one(tmp_path):
    cfg = lambda: tiny_cfg(tmp_path, *MOE, "system.mode=sync", "trainer.moe.routing_replay=r3")  # noqa: E731
    _, whole = run(cfg(), tmp_path / "whole")
    run_stopped_after(2, cfg(), tmp_path / "split")
    _, rest = run(cfg(), tmp_path / "split", resume=True)
    assert comparable(rest.history)[-2:] == comparable(whole.history)[-2:]


def test_an_interrupted_async_r3_run_resumes_with_the_journaled_groups_routes(tmp_path):
    """Ctrl-C mid-run: the groups generated but not trained come back from the journal with their routes (r3
    raises on a batch without them), and the run finishes."""
    out = tmp_path / "run"
    opts = (*MOE, "system.mode=async", "trainer.moe.routing_replay=r3", "checkpoint_every=100", "max_steps=4")
    controller = prepare(tiny_cfg(tmp_path, *opts), out)
    run_interrupted_at(controller, 2)
    journaled = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    assert journaled and all(t.get("routes") for g in journaled for t in g["group"]["trajectories"])
    resumed = prepare(tiny_cfg(tmp_path, *opts), out, resume=True)
    try:
        result = resumed.run()
    finally:
        close(resumed)
    assert result.steps == 4


def test_r3_on_the_vllm_engine_asks_vllm_for_routes():
    cfg = apply_overrides(RECIPES.get("quickstart")(), ["rollout.engine=vllm", "trainer.moe.routing_replay=r3"])
    assert sampling_for(cfg, None).vllm.return_routes
    assert not cfg.rollout.vllm.return_routes  # the run's own config is unchanged
    off = apply_overrides(RECIPES.get("quickstart")(), ["rollout.engine=vllm"])
    assert not sampling_for(off, None).vllm.return_routes


@pytest.mark.parametrize("extra", [("algo.advantage=gae",), ("algo.kl_coef=0.1",), ("trainer.share_prefixes=true",
                                   "trainer.activation_checkpointing=true", "trainer.micro_batch_tokens=64")])
def test_r3_runs_with_the_critic_the_reference_and_packed_checkpointed_passes(tmp_path, extra):
    cfg = tiny_cfg(tmp_path, *MOE, "system.mode=sync", "max_steps=2", "trainer.moe.routing_replay=r3", *extra)
    c, result = run(cfg, tmp_path / "run")
    trained = [h for h in result.history if "train/loss" in h]
    assert trained and all(h["moe/routing_agreement"] == 1.0 for h in trained)  # fp32 engine: the same experts
    if "algo.advantage=gae" in extra:
        assert moe.routing_of(c.trainer.critic.model.decoder).plan is None  # cleared after its passes
