"""The simulator's config (``tidal simulate --set key=value`` edits one) and its per-mode result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tidal.sim.costs import CostModel, Layout

MODES = ("sync", "periodic", "async")


@dataclass
class WorkloadConfig:
    """What one step trains on and how stale it may be (the controller's ``rollout`` settings)."""

    prompts_per_step: int = 16
    """Groups per training step (P)."""
    group_size: int = 8
    """Samples per prompt (G)."""
    prompt_len: int = 6
    """Prompt tokens per sample."""
    lengths: str = "one_over_n:48"
    """Response-length distribution (``lengths.parse_lengths``: constant, bimodal, cycle, one_over_n,
    lognormal, empirical:PATH), or recorded groups (groups:PATH)."""
    max_staleness: int = 2
    """eta of the ``async`` mode."""
    periodic_staleness: int = 1
    """eta of the ``periodic`` mode (one-step off-policy: 1)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: uninformative groups are dropped and more are drawn."""
    drop_prob: float = 0.0
    """Probability that a group is uninformative (all rewards equal), decided per group by seed."""
    train_informative_only: bool = False
    """Uninformative groups cost no training (``algo.skip_zero_adv_groups``) but count as trained."""
    max_draws_per_step: int = 4
    consume: Literal["stream", "completion"] = "stream"
    """Which groups a step trains: ``stream``, the next P of the prompt stream (tidal's controller:
    reproducible, a straggler holds its step back); ``completion``, the next P to finish (AReaL's
    replay buffer: nothing waits for a straggler, but only the head of the stream is bounded by eta)."""


@dataclass
class SimConfig:
    preset: str = "custom"
    """Which preset this config started from (``presets.PRESETS``); informational."""
    seed: int = 0
    steps: int = 40
    """Training steps simulated per mode."""
    warmup_steps: int = 0
    """Steps left out of the throughput window (pipeline fill)."""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    costs: CostModel = field(default_factory=CostModel)
    layout: Layout = field(default_factory=Layout)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)


@dataclass
class ModeResult:
    mode: str
    samples_per_s: float
    step_s: float
    """Mean wall time per step in the window."""
    gen_idle_frac: float
    """Share of generation-device time not spent decoding/prefilling/loading weights."""
    train_idle_frac: float
    """Share of training-device time not spent training or publishing weights."""
    device_idle_frac: float
    """Share of all device time spent on neither (the "GPU idle fraction")."""
    gen_mean_batch: float
    """Mean running sequences per decode step (low: memory-bound tail, see ``costs.py``)."""
    staleness_mean: float
    staleness_max: int
    interruptions: int
    update_frac: float
    """Share of generation busy time spent loading weights and re-prefilling interrupted rows."""
    wall_s: float
    gen_devices: int
    train_devices: int


def validate(cfg: SimConfig, async_plot: bool = False) -> SimConfig:
    """A ConfigError naming the key for a value the simulator cannot run (instead of an assertion or an
    IndexError deep inside it); returns ``cfg``. ``async_plot``: the eta sweep will simulate async
    whatever ``modes`` says."""
    import dataclasses

    from tidal.config import ConfigError
    from tidal.sim.lengths import GroupStream

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            raise ConfigError(f"{key}={node!r}: {rule}")

    w, lay = cfg.workload, cfg.layout
    need(cfg.steps >= 1, "steps", "simulate at least 1 step")
    need(0 <= cfg.warmup_steps < cfg.steps, "warmup_steps", f"must be >= 0 and < steps={cfg.steps}")
    need(bool(cfg.modes) and set(cfg.modes) <= set(MODES), "modes", f"a non-empty list of {', '.join(MODES)}")
    need(lay.devices >= 1, "layout.devices", "needs at least 1 device")
    split = any(m != "sync" for m in cfg.modes) or not lay.sync_colocated or async_plot
    need(lay.gen_devices >= 1 and (not split or lay.gen_devices < lay.devices), "layout.gen_devices",
         f"must be >= 1 and leave at least one of layout.devices={lay.devices} to train"
         + (" (--plot eta simulates async)" if async_plot else ""))
    need(0 <= lay.engine_devices <= lay.gen_devices, "layout.engine_devices",
         f"must be 0 (one engine) or at most layout.gen_devices={lay.gen_devices}")
    need(lay.max_batch >= w.group_size, "layout.max_batch", f"an engine must hold a whole group ({w.group_size})")
    for key in ("prompts_per_step", "group_size", "max_draws_per_step"):
        need(getattr(w, key) >= 1, f"workload.{key}", "must be >= 1")
    for key in ("prompt_len", "max_staleness", "periodic_staleness"):
        need(getattr(w, key) >= 0, f"workload.{key}", "must be >= 0")
    need(0 <= w.drop_prob < 1, "workload.drop_prob", "must be in [0, 1)")
    need(w.consume in ("stream", "completion"), "workload.consume", "stream or completion")
    for f in dataclasses.fields(cfg.costs):
        value = getattr(cfg.costs, f.name)
        need(not isinstance(value, (int, float)) or value >= 0, f"costs.{f.name}", "must be >= 0")
    try:
        GroupStream(w.lengths, w.group_size, w.drop_prob, cfg.seed)[0]
    except (ValueError, AssertionError, OSError, KeyError, TypeError) as e:
        raise ConfigError(f"workload.lengths={w.lengths!r}: {e}") from None
    return cfg
