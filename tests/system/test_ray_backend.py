"""The Ray backend on a local 2-CPU Ray instance: same trajectories and semantics as the local backend,
and a killed rollout or reward actor loses no sample."""

import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'tidal[ray]'")

from tidal.rollout.requests import group_requests  # noqa: E402
from tidal.system.run import close, prepare  # noqa: E402

from .test_controller import tiny_cfg  # noqa: E402

RAY = ("system.backend=ray", "system.rollout_workers=2", "reward.num_workers=0", "system.mode=async")
"""Rewards score inline unless a test needs reward actors: each actor start costs seconds here."""


@pytest.fixture(scope="module")
def ray_cluster(local_ray):
    """The session's local Ray instance (tests/conftest.py)."""
    return local_ray


def _record_training(controller, trained: list):
    real = controller._train_step

    def train_step(step, groups):
        trajs = [t for g in groups for t in g.trajectories]
        sampled = [[v for v in t.versions if v >= 0] for t in trajs]  # agent observation tokens carry -1
        assert all(v == sorted(v) for v in sampled), "versions within a sample never go back"
        assert all(max(t.versions) <= step for t in trajs), "no sample comes from a policy newer than the trainer's"
        out = real(step, groups)
        trained.append([g.prompt.uid for g in groups])
        return out

    controller._train_step = train_step


def _run(controller, trained):
    _record_training(controller, trained)
    try:
        return controller.run()
    finally:
        close(controller)


def _every_group_once(controller, trained):
    p = controller.cfg.rollout.prompts_per_step
    uids = [u for groups in trained for u in groups]
    assert uids == [controller.task.train_prompt(i).uid for i in range(len(trained) * p)], "each group once, in order"


def _same(a, b):
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.versions for t in a] == [t.versions for t in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def _engines(tmp_path, *extra):
    controller = prepare(tiny_cfg(tmp_path, *RAY, "rollout.max_new_tokens=8", *extra), tmp_path / "run")
    reqs = group_requests(controller.tokenizer, [controller.task.train_prompt(i) for i in range(8)], 4)
    return controller, controller.engine, controller.eval_engine, reqs


def test_workers_generate_what_the_local_engine_generates(ray_cluster, tmp_path):
    """Same weights, same keyed sampling noise: the same tokens on any worker, before and after a weight
    update through the object store, and after a worker died holding requests (re-queued)."""
    controller, engine, local, reqs = _engines(tmp_path)
    try:
        print(f"\n{engine.rcfg.num_workers} rollout actors started in {engine.start_s:.2f}s")
        _same(engine.generate(reqs), local.generate(reqs))
        state = {k: v + 0.05 * torch.randn_like(v) for k, v in controller.trainer.state_dict_for_engine().items()}
        t0 = time.perf_counter()
        engine.request_weight_update(state, 1)
        sync_s = time.perf_counter() - t0
        mb = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
        print(f"weight update of {mb:.2f} MB to {engine.num_alive} actors via ray.put: {sync_s * 1000:.0f} ms")
        local.request_weight_update(state, 1)
        after = engine.generate(reqs)
        assert all(set(t.versions) == {1} for t in after)
        _same(after, local.generate(reqs))

        ray.kill(engine.actors()[0])
        _same(engine.generate(reqs), local.generate(reqs))  # the dead worker's share went to the survivor
        assert engine.dispatch.num_requeued > 0 and engine.num_worker_deaths == 1 and engine.num_alive == 1
    finally:
        close(controller)


@pytest.mark.slow  # a replacement actor imports torch and transformers again: ~5 s idle, ~15 s under load
def test_a_dead_worker_is_replaced_and_joins_with_the_newest_weights(ray_cluster, tmp_path):
    controller, engine, local, reqs = _engines(tmp_path, "system.rollout_worker_restarts=1")
    try:
        state = {k: v + 0.05 * torch.randn_like(v) for k, v in controller.trainer.state_dict_for_engine().items()}
        engine.request_weight_update(state, 1)
        local.request_weight_update(state, 1)
        ray.kill(engine.actors()[0])
        _same(engine.generate(reqs), local.generate(reqs))
        t0 = time.perf_counter()
        while engine.num_alive < 2 and time.perf_counter() - t0 < 120:  # it joins during a stream
            engine.generate(reqs[:4])
        print(f"\nreplacement joined after {time.perf_counter() - t0:.1f}s")
        assert engine.num_alive == 2 and engine.num_worker_deaths == 1
        _same(engine.generate(reqs), local.generate(reqs))
        assert {w.stats.get("rollout/weight_updates") for w in engine._workers.values()} <= {0.0, 1.0}
    finally:
        close(controller)


def test_quickstart_on_ray_keeps_the_local_semantics(ray_cluster, tmp_path):
    trained: list = []
    controller = prepare(tiny_cfg(tmp_path, *RAY, "rollout.max_staleness=1", "max_steps=4"), tmp_path / "run")
    result = _run(controller, trained)
    assert result.steps == 4
    _every_group_once(controller, trained)
    rows = [r for r in result.history if "async/staleness_max" in r]
    assert max(r["async/staleness_max"] for r in rows) <= 1
    assert all(r["system/rollout_workers_alive"] == 2 and r["system/requeued_requests"] == 0 for r in rows)
    assert rows[-1]["rollout/weight_updates"] == 4
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows), "the test must actually train"


def test_killed_rollout_and_reward_actors_lose_no_sample(ray_cluster, tmp_path):
    """One run, two faults: a rollout worker dies holding requests (they go to the survivor) and a
    reward worker dies before a scoring call (it is replaced and the items re-scored)."""
    trained: list = []
    cfg = tiny_cfg(tmp_path, *RAY, "reward.num_workers=1", "rollout.max_staleness=1", "max_steps=5",
                   "rollout.max_new_tokens=12")
    controller = prepare(cfg, tmp_path / "run")
    engine, pool = controller.engine, controller.reward_pool
    real_assign, real_score = engine.dispatch.assign, pool.score
    killed, calls = [], []

    def assign_then_kill():  # the first worker given requests after step 1 dies holding them
        placed = real_assign()
        if placed and engine.version >= 1 and not killed:
            wid = next(iter(placed))
            killed.append(len(placed[wid]))
            ray.kill(engine._workers[wid].actor)
        return placed

    def kill_then_score(items):  # the third scoring call finds its worker dead
        calls.append(len(items))
        if len(calls) == 3:
            ray.kill(pool.workers[0])
        return real_score(items)

    engine.dispatch.assign, pool.score = assign_then_kill, kill_then_score
    result = _run(controller, trained)
    assert result.steps == 5 and killed and len(calls) > 3
    _every_group_once(controller, trained)
    last = result.history[-1]
    assert last["system/rollout_workers_alive"] == 1, "the run goes on with the survivor"
    assert last["system/requeued_requests"] >= killed[0] > 0
    assert max(r["async/staleness_max"] for r in result.history if "async/staleness_max" in r) <= 1
    assert pool.num_replaced == 1
    assert last["reward/errors"] == 0, "the dead reward worker's items were re-scored, not zeroed"


def test_agent_episodes_on_ray_workers(ray_cluster, tmp_path):
    """Episodes wrap the Ray engine: turns are decoded on the workers, environment steps run in the driver."""
    from .test_agentic_run import AGENT

    trained: list = []
    controller = prepare(tiny_cfg(tmp_path, *RAY, *AGENT, "rollout.max_staleness=1", "max_steps=3"), tmp_path / "run")
    result = _run(controller, trained)
    assert result.steps == 3
    _every_group_once(controller, trained)
    rows = [r for r in result.history if "agent/turns_mean" in r]
    assert len(rows) == 3 and all(r["agent/turns_mean"] == 3.0 for r in rows)


def test_a_harness_behind_the_endpoint_on_ray_workers(ray_cluster, tmp_path):
    """The OpenAI endpoint in front of the Ray engine: the agents' turns are decoded on the rollout
    workers, every episode is recorded and trained, and the staleness bound holds."""
    pytest.importorskip("fastapi", reason="the harness extra")
    from tests.serve.test_harness_run import cfg_for

    trained: list = []
    cfg = cfg_for(tmp_path, "harness.function=tests.serve.test_harness_engine:two_turn_agent", *RAY,
                  "rollout.max_staleness=1", "max_steps=3")
    controller = prepare(cfg, tmp_path / "run")
    assert type(controller.engine).__name__ == "HarnessEngine"
    assert type(controller.engine.engine).__name__ == "RayEngine"
    result = _run(controller, trained)
    _every_group_once(controller, trained)
    rows = result.history[1:]
    assert len(rows) == 3 and all(r["agent/turns_mean"] == 2.0 and r["agent/infra_failures"] == 0 for r in rows)
    assert all(r["harness/finished"] >= 12 * r["step"] for r in rows)


def test_a_replacement_worker_starts_from_a_tied_model_sent_once(small_model, tokenizer):
    """A replacement worker starts from the newest weights as the trainer sent them: a tied embedding once.
    Its model loads them and stays tied (the worker class itself, in this process: no actor needed)."""
    import copy

    from tidal.algo.config import AlgoConfig
    from tidal.optim import OptimConfig
    from tidal.rollout.local import SamplingConfig
    from tidal.system.ray_engine import RolloutWorker, to_arrays
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer

    trainer = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), TrainerConfig())
    with torch.no_grad():
        trainer.model.model.embed_tokens.weight.add_(1.0)
    sent = trainer.state_dict_for_engine()
    assert "lm_head.weight" not in sent
    worker = RolloutWorker("local", copy.deepcopy(small_model), tokenizer, SamplingConfig(), 0, 3, to_arrays(sent),
                           torch.get_num_threads())
    model = worker.engine.model
    assert worker.ready() == 3 and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, trainer.model.lm_head.weight)
