"""The simulator against answers derived by hand.

Notation: a decode step costs ``a`` seconds whatever the batch (``decode_step_s``; per-row and
per-context costs 0 unless stated), so generating a batch whose longest response has L tokens takes
L * a when the engine holds the whole batch. A training step costs T seconds (``train_step_s``).
Prompts, prefills, weight sync and rewards cost 0 unless stated. Throughput is measured after
``warmup_steps`` (steady state).

1. Constant lengths, generation and training on *dedicated* devices (sync keeps the split):
   sync step = L a + T, async (and periodic) step = max(L a, T). The gain is pipelining,
   (L a + T) / max(L a, T): 2.0 when balanced. No stragglers are involved.
2. Constant lengths, one *shared* pool of N devices with perfect scaling (speed = devices): sync
   runs each phase on all N devices, W_g / N + W_t / N per step; async splits N = N_g + N_t and
   runs max(W_g / N_g, W_t / N_t). At the balanced split that equals the sync step: a single
   sequence length gives no async gain; any other split is slower than sync.
3. Bimodal lengths, generation only (T = 0), group size 1, R slots, R samples per step: sync waits
   for the longest response of every batch, R samples per a * E[max]; continuous batching keeps
   all R slots busy, R samples per a * mean. Gain = E[max] / mean, with
   E[max] = S + (L - S) (1 - (1 - p)^R) for short S, long L, P(long) = p; for the deterministic
   cycle [L, S x (R-1)] every batch holds exactly one long response: gain = L / mean.
"""

import dataclasses

import pytest

from tidal.sim.config import SimConfig, WorkloadConfig
from tidal.sim.costs import CostModel, Layout
from tidal.sim.simulator import compare, simulate

A = 1e-3  # seconds per decode step


def config(lengths: str, train_s: float, layout: Layout, steps=30, warmup=10, p=16, g=8, eta=2, **costs) -> SimConfig:
    return SimConfig(steps=steps, warmup_steps=warmup, costs=CostModel(decode_step_s=A, train_step_s=train_s, **costs),
                     layout=layout, workload=WorkloadConfig(prompts_per_step=p, group_size=g, prompt_len=0,
                                                            lengths=lengths, max_staleness=eta))


DEDICATED = Layout(devices=2, gen_devices=1, engine_devices=1, max_batch=128, sync_colocated=False)


@pytest.mark.parametrize("train_s", [0.05, 0.1, 0.3])
def test_constant_lengths_on_dedicated_devices_gain_only_the_overlap(train_s):
    gen_s = 100 * A
    out = compare(config("constant:100", train_s, DEDICATED))
    res, speedup = out["results"], out["speedup_vs_sync"]
    assert res["sync"].step_s == pytest.approx(gen_s + train_s, rel=1e-9)
    assert res["async"].step_s == pytest.approx(max(gen_s, train_s), rel=1e-9)
    assert res["periodic"].step_s == pytest.approx(max(gen_s, train_s), rel=1e-9)
    assert speedup["async"] == pytest.approx((gen_s + train_s) / max(gen_s, train_s), rel=1e-9)


def test_constant_lengths_on_a_shared_pool_with_perfect_scaling_give_no_async_gain():
    # N = 2 threads of one engine, speed = threads: generation W_g = 100 a, training W_t = 0.1 s (at speed 1).
    pool = Layout(devices=2, gen_devices=1, engine_devices=0, max_batch=128, sync_colocated=True)
    out = compare(config("constant:100", 0.1, pool))
    assert out["results"]["sync"].step_s == pytest.approx((100 * A + 0.1) / 2, rel=1e-9)
    assert out["speedup_vs_sync"]["async"] == pytest.approx(1.0, rel=1e-9)
    # An unbalanced split (training is 3x the generation work on equal halves): async is slower than sync.
    out = compare(config("constant:100", 0.3, pool))
    sync_step, async_step = (100 * A + 0.3) / 2, max(100 * A / 1, 0.3 / 1)
    assert out["speedup_vs_sync"]["async"] == pytest.approx(sync_step / async_step, rel=1e-9)
    assert out["speedup_vs_sync"]["async"] < 1


def test_bimodal_cycle_gives_the_closed_form_gain():
    r, short, long = 10, 10, 100  # every batch of 10: one response of 100 tokens, nine of 10
    lay = Layout(devices=2, gen_devices=1, engine_devices=1, max_batch=r, sync_colocated=False)
    cfg = config("cycle:" + ",".join(map(str, [long] + [short] * (r - 1))), 0.0, lay, steps=300, warmup=50, p=r,
                 g=1, eta=30)
    out = compare(cfg)
    mean = (long + short * (r - 1)) / r
    assert out["results"]["sync"].samples_per_s == pytest.approx(r / (long * A), rel=1e-9)
    assert out["speedup_vs_sync"]["async"] == pytest.approx(long / mean, rel=0.01)
    assert out["speedup_vs_sync"]["periodic"] == pytest.approx(1.0, rel=1e-9)  # batched: still waits for the tail


def test_random_bimodal_matches_the_expected_maximum():
    r, short, long, p = 16, 20, 200, 0.05
    lay = Layout(devices=2, gen_devices=1, engine_devices=1, max_batch=r, sync_colocated=False)
    out = compare(config(f"bimodal:{short},{long},{p}", 0.0, lay, steps=1500, warmup=100, p=r, g=1, eta=40))
    mean = (1 - p) * short + p * long
    expected_max = short + (long - short) * (1 - (1 - p) ** r)
    assert out["speedup_vs_sync"]["async"] == pytest.approx(expected_max / mean, rel=0.04)


def test_async_with_eta_zero_reproduces_sync_on_the_same_devices():
    cfg = config("one_over_n:48", 0.05, DEDICATED, eta=0)
    sync, async_ = simulate(cfg, "sync"), simulate(cfg, "async")
    assert async_.samples_per_s == pytest.approx(sync.samples_per_s, rel=1e-9)
    assert async_.staleness_max == 0


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_staleness_never_exceeds_eta(eta):
    cfg = config("lognormal:30,1.0,400", 0.02, DEDICATED, steps=25, warmup=0, eta=eta, prefill_per_token_s=1e-5,
                 weight_load_s=1e-3)
    res = simulate(cfg, "async")
    assert res.staleness_max <= eta
    assert res.interruptions > 0 or eta == 0
    assert simulate(cfg, "periodic").staleness_max <= 1


def test_dynamic_sampling_keeps_the_bound_and_fills_batches():
    cfg = config("one_over_n:48", 0.02, DEDICATED, steps=20, warmup=0, eta=2)
    cfg.workload = dataclasses.replace(cfg.workload, dynamic_sampling=True, drop_prob=0.5)
    for mode in ("sync", "periodic", "async"):
        res = simulate(cfg, mode)
        assert res.staleness_max <= {"sync": 0, "periodic": 1, "async": 2}[mode]
        assert res.samples_per_s > 0


def test_interruption_costs_slow_async_down():
    free = config("lognormal:30,1.0,400", 0.05, DEDICATED, steps=20, warmup=5)
    costly = config("lognormal:30,1.0,400", 0.05, DEDICATED, steps=20, warmup=5, prefill_per_token_s=2e-5,
                    weight_load_s=5e-3)
    assert simulate(costly, "async").samples_per_s < simulate(free, "async").samples_per_s


def test_deterministic_given_a_seed():
    cfg = config("lognormal:30,1.0,400", 0.05, DEDICATED, steps=15, warmup=3)
    assert compare(cfg)["results"] == compare(cfg)["results"]
    other = dataclasses.replace(cfg, seed=1)
    assert simulate(other, "sync").samples_per_s != simulate(cfg, "sync").samples_per_s


def test_a_generation_bound_run_scales_with_engines():
    # 128 rows of 100 tokens per step, 64 slots per engine: 2 engines make one batch per 100 a,
    # 8 engines four batches (eta = 8 lets them run ahead); training (1 ms) never binds.
    small = config("constant:100", 1e-3, Layout(devices=3, gen_devices=2, engine_devices=1, max_batch=64), eta=8)
    big = dataclasses.replace(small, layout=dataclasses.replace(small.layout, devices=9, gen_devices=8))
    assert simulate(small, "async").samples_per_s == pytest.approx(128 / (100 * A), rel=1e-6)
    assert simulate(big, "async").samples_per_s == pytest.approx(4 * 128 / (100 * A), rel=0.02)


def test_a_batch_that_cannot_fit_is_a_clear_error():
    with pytest.raises(AssertionError, match="whole group"):
        simulate(config("constant:5", 0.0, Layout(devices=2, gen_devices=1, engine_devices=1, max_batch=4)), "sync")


def test_completion_order_does_not_wait_for_stragglers():
    # eta = 1 and a 100-token straggler in every batch of 10: in stream order the trainer waits for it
    # (and the bound stops the generator), in completion order (AReaL's buffer) the next ten to finish train.
    r = 10
    lay = Layout(devices=2, gen_devices=1, engine_devices=1, max_batch=r, sync_colocated=False)
    cfg = config("cycle:" + ",".join(map(str, [100] + [10] * (r - 1))), 0.0, lay, steps=200, warmup=50, p=r, g=1, eta=1)
    stream = simulate(cfg, "async")
    completion = simulate(dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, consume="completion")),
                          "async")
    assert stream.staleness_max <= 1
    assert completion.samples_per_s > 1.2 * stream.samples_per_s
