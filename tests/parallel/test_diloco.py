"""DiLoCo: the outer step, AdLoCo's norm test and micro-batching by hand; torchft's run against them with
two gloo processes; a worker that crashes and rejoins while the other keeps training.

The worker functions run in spawned processes, which import this module: heavy imports (transformers via
tidal.models) stay inside the functions that need them, so a linear-model worker starts faster."""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tidal.parallel.diloco import (
    AdaptiveBatchConfig,
    DiLoCoConfig,
    accumulate_gradients,
    fragments,
    micro_batch_sizes,
    norm_test_batch_size,
    outer_step_reference,
    pseudo_gradient,
)

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft not installed (pip install -e '.[dev]')")


# ---- pure math, by hand ----------------------------------------------------------------------------
def test_outer_step_two_workers_two_rounds_by_hand():
    theta = [torch.tensor([1.0, 2.0])]
    # round 1: worker A moved to [0.8, 2.2], worker B to [0.6, 1.8]
    d_a = pseudo_gradient(theta, [torch.tensor([0.8, 2.2])])
    d_b = pseudo_gradient(theta, [torch.tensor([0.6, 1.8])])
    assert torch.allclose(d_a[0], torch.tensor([0.2, -0.2])) and torch.allclose(d_b[0], torch.tensor([0.4, 0.2]))
    # avg delta = [0.3, 0.0]; m = [0.3, 0.0]; theta = theta - 0.7 (0.3 + 0.9*0.3, 0) = [1 - 0.399, 2]
    theta, m = outer_step_reference(theta, [d_a, d_b], None, lr=0.7, mu=0.9)
    assert torch.allclose(theta[0], torch.tensor([0.601, 2.0])) and torch.allclose(m[0], torch.tensor([0.3, 0.0]))
    # round 2: deltas [0.1, 0.1] and [0.3, -0.1] -> avg [0.2, 0.0]; m = 0.9*[0.3, 0] + [0.2, 0] = [0.47, 0]
    # update = 0.2 + 0.9*0.47 = 0.623; theta = 0.601 - 0.7*0.623 = 0.1649
    theta, m = outer_step_reference(theta, [[torch.tensor([0.1, 0.1])], [torch.tensor([0.3, -0.1])]], m)
    assert torch.allclose(m[0], torch.tensor([0.47, 0.0]))
    assert torch.allclose(theta[0], torch.tensor([0.1649, 2.0]))


def test_outer_step_matches_torch_nesterov_sgd():
    """The reference is exactly torch.optim.SGD(nesterov=True) fed the average pseudo-gradient."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=g)
    p = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    ref, m = [theta], None
    for _ in range(3):
        deltas = [[torch.randn(5, generator=g)] for _ in range(3)]
        ref, m = outer_step_reference(ref, deltas, m)
        p.grad = torch.stack([d[0] for d in deltas]).mean(0)
        sgd.step()
    assert torch.allclose(p.detach(), ref[0], atol=1e-6)


def test_norm_test_by_hand():
    cfg = AdaptiveBatchConfig(initial_batch=4, max_batch=100, max_micro_batch=2, eta=0.5)
    # two micro-batches of 2 examples: g1 = [1, 0], g2 = [3, 0] -> g = [2, 0], ||g||^2 = 4
    # sigma^2 = (2*1 + 2*1) / (2 - 1) = 4 -> b = ceil(4 / (0.25 * 4)) = 4 (= current)
    g1, g2 = torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0])
    assert norm_test_batch_size([g1, g2], [2, 2], cfg, current=4) == 4
    # noisier: g1 = [0, 2], g2 = [2, -2] -> g = [1, 0], sigma^2 = 2*(1+4) + 2*(1+4) = 20 -> ceil(20/0.25) = 80
    assert norm_test_batch_size([torch.tensor([0.0, 2.0]), torch.tensor([2.0, -2.0])], [2, 2], cfg, 4) == 80
    # unequal sizes 1 and 3: g = (1*[0,2] + 3*[2,-2])/4 = [1.5, -1]; ||g||^2 = 3.25
    # sigma^2 = 1*(2.25 + 9) + 3*(0.25 + 1) = 15 -> ceil(15 / (0.25*3.25)) = ceil(18.46) = 19
    assert norm_test_batch_size([torch.tensor([0.0, 2.0]), torch.tensor([2.0, -2.0])], [1, 3], cfg, 4) == 19
    # capped at max_batch, never shrinks below current
    assert norm_test_batch_size([torch.tensor([1.0]), torch.tensor([-1.0])], [2, 2], cfg, 4) == 100
    assert norm_test_batch_size([g1, g2], [2, 2], cfg, current=50) == 50


def test_micro_batch_sizes_switch_to_accumulation():
    assert micro_batch_sizes(8, 64) == [4, 4]  # fits one pass, split in two for the variance
    assert micro_batch_sizes(130, 64) == [44, 43, 43]  # switch mode: ceil(130/64) = 3 passes
    assert micro_batch_sizes(1, 64) == [1]
    assert all(max(micro_batch_sizes(b, 7)) <= 7 and sum(micro_batch_sizes(b, 7)) == b for b in range(1, 60))


def test_accumulated_gradient_is_the_batch_mean_and_micro_grads_are_each_parts_own():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    x, y = torch.randn(7, 3), torch.randn(7, 1)
    loss_of = lambda a, b: ((model(x[a:b]) - y[a:b]) ** 2).mean()
    loss, micro = accumulate_gradients(model, loss_of, [4, 3])
    full = torch.autograd.grad(loss_of(0, 7), model.weight)[0].reshape(-1)
    first = torch.autograd.grad(loss_of(0, 4), model.weight)[0].reshape(-1)
    second = torch.autograd.grad(loss_of(4, 7), model.weight)[0].reshape(-1)
    assert math.isclose(loss, float(loss_of(0, 7).detach()), rel_tol=1e-5)
    assert torch.allclose(model.weight.grad.reshape(-1), full, atol=1e-6)
    assert torch.allclose(micro[0], first, atol=1e-6) and torch.allclose(micro[1], second, atol=1e-6)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="diloco.sync_every"):
        DiLoCoConfig(sync_every=10, num_fragments=3)
    with pytest.raises(ValueError, match="adaptive.initial_batch"):
        AdaptiveBatchConfig(initial_batch=0)


def test_fragments_cover_every_parameter_once():
    from tidal.models import tiny

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.ModelConfig(hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=2,
                                              intermediate_size=32), tok)
    parts = fragments(model, 2)
    ids = [id(p) for part in parts for p in part.parameters()]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    with pytest.raises(ValueError, match="num_fragments"):
        fragments(model, 5)


# ---- torchft, two gloo processes -------------------------------------------------------------------
H, ROUNDS, LR = 3, 2, 0.05


def _data(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(8, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) * (worker + 1)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _inner_step(model, opt, worker, step):
    x, y = _data(worker, step)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def _equal_rounds_worker(worker: int, addr: str, out: str) -> None:
    from tidal.parallel.diloco import diloco_worker

    torch.set_num_threads(1)
    model, opt = _model()
    with diloco_worker(model, opt, DiLoCoConfig(sync_every=H, timeout_s=20), addr, f"w{worker}") as (mgr, stats):
        for step in range(H * ROUNDS):
            _inner_step(model, opt, worker, step)
    torch.save({"params": [p.detach() for p in model.parameters()], "bytes": stats.bytes_sent,
                "step": mgr.current_step()}, out)


def _spawn(target, *args):
    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    return p


def _run_two_workers(target, tmp_path) -> list[dict]:
    """``target(worker, lighthouse_addr, out_path)`` in two processes under one lighthouse that waits for
    both; returns what each saved."""
    from tidal.parallel.diloco import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=2, join_timeout_ms=20000)
    try:
        procs = [_spawn(target, w, lighthouse.address(), str(tmp_path / f"w{w}.pt")) for w in (0, 1)]
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        lighthouse.shutdown()
    return [torch.load(tmp_path / f"w{w}.pt") for w in (0, 1)]


def load_params(model: torch.nn.Module, theta: list[torch.Tensor]) -> None:
    """Start a replica's next round from the global parameters."""
    with torch.no_grad():
        for p, t in zip(model.parameters(), theta, strict=True):
            p.copy_(t)


@needs_torchft
def test_torchft_diloco_matches_the_hand_written_outer_step(tmp_path):
    results = _run_two_workers(_equal_rounds_worker, tmp_path)

    # the same run in one process: each worker's inner AdamW (state kept across rounds), then the outer step
    workers = [_model() for _ in (0, 1)]
    theta = [p.detach().clone() for p in workers[0][0].parameters()]
    momentum = None
    for r in range(ROUNDS):
        deltas = []
        for w, (model, opt) in enumerate(workers):
            for step in range(r * H, (r + 1) * H):
                _inner_step(model, opt, w, step)
            deltas.append(pseudo_gradient(theta, [p.detach() for p in model.parameters()]))
        theta, momentum = outer_step_reference(theta, deltas, momentum)
        for model, _ in workers:
            load_params(model, theta)
    num_params = sum(t.numel() for t in theta)
    for res in results:
        assert res["step"] == ROUNDS
        assert res["bytes"] == ROUNDS * num_params * 4, "one fp32 all-reduce of the parameters per round"
        for got, want in zip(res["params"], theta):
            assert torch.allclose(got, want, atol=1e-5), (got, want)


def _crash_rejoin_worker(worker: int, life: int, addr: str, tmp: str, rounds: int) -> None:
    """Worker 0 trains ``rounds`` rounds, waiting after round 4 until worker 1's second life is up (so the
    test's timing is deterministic). Worker 1's first life crashes (os._exit, no shutdown) after round 2;
    its second life starts from scratch, heals from worker 0 and trains to the end."""
    import os

    from tidal.parallel.diloco import diloco_worker

    torch.set_num_threads(1)
    tmp = Path(tmp)
    model, opt = _model()
    participants = {}
    cfg = DiLoCoConfig(sync_every=2, timeout_s=10)
    with diloco_worker(model, opt, cfg, addr, f"w{worker}") as (mgr, _):
        if life == 1:  # both first lives start together, so the first quorum has both
            (tmp / f"w{worker}_up").touch()
            while not (tmp / f"w{1 - worker}_up").exists():
                time.sleep(0.05)
        else:
            (tmp / "w1_back").touch()
        step = 0
        while mgr.current_step() < rounds:
            before = mgr.current_step()
            _inner_step(model, opt, worker, step)
            step += 1
            if mgr.current_step() != before or step % cfg.sync_every == 0:
                participants[before] = mgr.num_participants()
            if worker == 1 and life == 1 and mgr.current_step() >= 2:
                os._exit(3)
            if worker == 0 and mgr.current_step() >= 4:
                deadline = time.time() + 60
                while not (tmp / "w1_back").exists() and time.time() < deadline:
                    time.sleep(0.05)
    torch.save({"params": [p.detach() for p in model.parameters()], "step": mgr.current_step(),
                "participants": participants}, tmp / f"w{worker}_life{life}.pt")


@needs_torchft
def test_a_worker_crashes_and_rejoins_while_training_goes_on(tmp_path):
    from tidal.parallel.diloco import start_lighthouse

    rounds = 8
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=1000)
    try:
        addr = lighthouse.address()
        w0 = _spawn(_crash_rejoin_worker, 0, 1, addr, str(tmp_path), rounds)
        w1 = _spawn(_crash_rejoin_worker, 1, 1, addr, str(tmp_path), rounds)
        w1.join(60)
        assert w1.exitcode == 3, "worker 1's first life should have crashed"
        w1 = _spawn(_crash_rejoin_worker, 1, 2, addr, str(tmp_path), rounds)
        for p in (w0, w1):
            p.join(180)
        assert [w0.exitcode, w1.exitcode] == [0, 0]
    finally:
        lighthouse.shutdown()
    r0 = torch.load(tmp_path / "w0_life1.pt")
    r1 = torch.load(tmp_path / "w1_life2.pt")
    assert r0["step"] == r1["step"] == rounds
    alone = [s for s, n in r0["participants"].items() if n == 1]
    assert alone, f"worker 0 should have trained some rounds alone: {r0['participants']}"
    assert r0["participants"].get(rounds - 1) == 2, f"both should sync the last round: {r0['participants']}"
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b), "the rejoined worker must end on the same global parameters"


# ---- the RL trainer's step as DiLoCo's inner step ---------------------------------------------------
def _rl_trainer():
    from tidal.algo.config import AlgoConfig
    from tidal.models import tiny
    from tidal.optim import OptimConfig
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer

    tok = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
    return Trainer(tiny.build_model(cfg, tok), AlgoConfig(), OptimConfig(lr=3e-3), TrainerConfig())


def _rl_worker(worker: int, addr: str, out: str) -> None:
    from tests.parallel.test_fsdp import make_batch
    from tidal.parallel.diloco import diloco_worker

    torch.set_num_threads(1)
    trainer = _rl_trainer()
    with diloco_worker(trainer.model, trainer.optimizer, DiLoCoConfig(sync_every=2, timeout_s=20), addr,
                       f"w{worker}") as (mgr, _):
        for step in range(4):
            trainer.step(make_batch(seed=100 * worker + step))
    torch.save({"params": [p.detach() for p in trainer.model.parameters()], "step": mgr.current_step()}, out)


@pytest.mark.slow
@needs_torchft
def test_rl_trainer_ranks_run_diloco(tmp_path):
    """Each rank's ``Trainer.step`` (its own RL batches) is an inner step; two rounds of H=2 match the
    one-process reference of two trainers plus the hand-written outer step."""
    from tests.parallel.test_fsdp import make_batch

    _run_two_workers(_rl_worker, tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainers = [_rl_trainer() for _ in (0, 1)]
        theta = [p.detach().clone() for p in trainers[0].model.parameters()]
        start, momentum = [t.clone() for t in theta], None
        for r in range(2):
            deltas = []
            for w, trainer in enumerate(trainers):
                for step in range(2 * r, 2 * r + 2):
                    trainer.step(make_batch(seed=100 * w + step))
                deltas.append(pseudo_gradient(theta, [p.detach() for p in trainer.model.parameters()]))
            theta, momentum = outer_step_reference(theta, deltas, momentum)
            for trainer in trainers:
                load_params(trainer.model, theta)
    finally:
        torch.set_num_threads(threads)
    assert max((t - s).abs().max() for t, s in zip(theta, start)) > 1e-3, "the run should move the weights"
    for w in (0, 1):
        res = torch.load(tmp_path / f"w{w}.pt")
        assert res["step"] == 2
        for got, want in zip(res["params"], theta):
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
