"""A discrete-event simulator of the controller: predicts trained samples/s and device idle time of
``sync``, ``periodic`` and ``async`` RL at any scale from a cost model and a length distribution.

It runs the controller's real scheduling code on a simulated clock, not a re-implementation:
admission is ``system.staleness.StalenessManager`` (AReaL's capacity rule, driven with
``admit(want, timeout=0)`` as the generator's poll does), batches are drawn with
``system.batching.collect_batch`` (stream order, dynamic sampling, the staleness guard, slots given
back with ``release`` and short batches ``charge``d), and versions move with ``set_version``.
What the GPUs would do is ``engine.SimEngine`` (continuous batching, interruption) timed by
``costs.CostModel``.

The modes (what each waits for):
- ``sync``: eta = 0. Batch k is generated with version k on the whole pool (``sync_colocated``),
  scored, trained, published; the next batch starts only after that. A step costs
  gen(longest response of the batch) + train + sync.
- ``periodic`` (one-step off-policy: DeepCoder, verl's one_step_off_policy): eta = 1, devices split,
  generation batch by batch (the next batch starts when the engines have drained the current one
  and the bound allows it), weights applied only between batches (no interruption). Hides
  training behind generation but still waits for each batch's longest response.
- ``async`` (AReaL, arXiv 2505.24298): eta = ``max_staleness``, devices split, continuous
  batching (a group starts whenever an engine has slots and the bound admits it), every published
  version interrupts the engines (load + re-prefill). Neither side waits for the other while the
  bound holds; stragglers only hold their own slots.

Throughput is trained samples per second between the end of step ``warmup_steps`` and the last step
(``warmup_steps=0`` measures from the start, as ``tidal bench async`` does).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from tidal.sim.config import MODES, ModeResult, SimConfig
from tidal.sim.costs import device_speed, engine_costs, train_time
from tidal.sim.engine import Row, SimEngine
from tidal.sim.lengths import GroupStream
from tidal.system.batching import collect_batch, informative, too_stale
from tidal.system.staleness import StalenessManager


@dataclass
class _Group:
    """The duck-typed ``Group`` that ``collect_batch`` sees: oldest version and (fake) rewards."""

    index: int
    oldest_version: int
    seq_lens: list[int]
    rewards: tuple[float, ...]


class _Run:
    def __init__(self, cfg: SimConfig, mode: str):
        assert mode in MODES, f"mode must be one of {MODES}, got {mode!r}"
        w, lay, c = cfg.workload, cfg.layout, cfg.costs
        self.cfg, self.mode, self.w, self.c = cfg, mode, w, c
        self.batched = mode != "async"
        self.eta = {"sync": 0, "periodic": w.periodic_staleness, "async": w.max_staleness}[mode]
        colocated = mode == "sync" and lay.sync_colocated
        self.gen_devices = lay.devices if colocated else lay.gen_devices
        self.train_devices = lay.devices if colocated else lay.devices - lay.gen_devices
        assert self.gen_devices >= 1 and self.train_devices >= 1, (
            f"{mode}: need >= 1 generation and >= 1 training device (layout {lay})")
        self.shared = lay.shared_pool and not colocated
        if lay.engine_devices:  # data-parallel engine instances, each at speed 1
            num_engines, speed = self.gen_devices // lay.engine_devices, 1.0
            self.devices_per_engine = lay.engine_devices
            assert num_engines >= 1, f"{self.gen_devices} generation devices < engine_devices={lay.engine_devices}"
            gen_costs = c
        else:  # one engine whose threads span every generation device
            num_engines, self.devices_per_engine = 1, self.gen_devices
            gen_costs, speed = engine_costs(c, self.gen_devices)
        assert lay.max_batch >= w.group_size, "an engine must hold at least one whole group"
        self.gen_speed = speed
        self.engines = [SimEngine(gen_costs, speed, lay.max_batch) for _ in range(num_engines)]
        self.staleness = StalenessManager(w.prompts_per_step, self.eta)
        self.groups = GroupStream(w.lengths, w.group_size, w.drop_prob, cfg.seed)
        self.heap: list = []
        self.seq = 0
        self.next_group = 0  # generator's stream position
        self.batch_end = 0  # batched modes: the current generation batch ends before this group
        self.published = 0  # latest published policy version
        self.pending: dict[int, list] = {}  # group -> [rows left, oldest version, lengths, informative]
        self.buffer: dict[int, _Group] = {}
        self.cursor = 0  # trainer's stream position
        self.arrivals = 0  # groups scored so far (the buffer's index when consuming in completion order)
        self.step = 0  # the step the trainer works on next
        self.training = False  # a training step is running
        self.trainer_busy = False  # training or publishing: the trainer takes no new batch
        self.work_left = self.rate = self.last_t = 0.0
        self.lent = 0
        self.train_epoch = 0
        self.train_busy = self.lent_busy = 0.0  # device-seconds
        self.step_ends: list[float] = []
        self.trained: list[int] = []
        self.staleness_sum = self.staleness_count = self.staleness_max = 0
        self.snapshot: tuple[float, float, float, float] | None = None

    # ---- the event queue -------------------------------------------------------------------------
    def push(self, t: float, kind: str, a: int = 0, b: int = 0) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))
        self.seq += 1

    def schedule(self, i: int) -> None:
        e = self.engines[i]
        e.epoch += 1
        if self.shared:  # the speed for the next run of steps (re-read at every event of this engine)
            e.speed = self.gen_speed / (self.c.overlap_gen_slowdown if self.training else 1.0)
        t = e.next_finish_time()
        if t is not None:
            self.push(t, "finish", i, e.epoch)

    def run(self) -> ModeResult:
        self.admit_all(0.0)
        while len(self.step_ends) < self.cfg.steps:
            if not self.heap:
                raise RuntimeError(f"{self.mode}: simulation stalled at step {self.step} (no events): "
                                   f"check max_batch, group_size and the staleness bound")
            t, _, kind, a, b = heapq.heappop(self.heap)
            if kind == "finish" and b == self.engines[a].epoch:
                e = self.engines[a]
                self.on_rows(a, e.advance_to_next_finish())
                if self.batched and e.n == 0 and all(x.n == 0 for x in self.engines):
                    self.admit_all(e.t)  # the batch has drained: the next one may start on every engine
                else:
                    self.fill([a], e.t)
                    self.schedule(a)
                    self.activity_changed(e.t)
            elif kind == "reward":
                self.on_reward(t, a)
            elif kind == "train_done" and b == self.train_epoch:
                self.on_trained(t)
            elif kind == "publish":
                self.on_publish(t, a)
        return self.result()

    # ---- generation ----------------------------------------------------------------------------------
    def new_groups(self, n: int, version: int) -> list[tuple[int, list[int]]]:
        out = []
        for _ in range(n):
            index = self.next_group
            lengths, keep = self.groups[index]
            self.pending[index] = [len(lengths), version, lengths, keep]
            out.append((index, lengths))
            self.next_group += 1
        return out

    def take(self, n: int, now: float) -> int:
        """How many of ``n`` more groups may start now: the staleness manager's answer in async mode;
        in batched modes, what is left of the current batch (a new one starts once all engines drained)."""
        if not self.batched:
            return self.staleness.admit(n, timeout=0)
        if self.next_group == self.batch_end and all(e.n == 0 for e in self.engines):
            self.start_batch(now)
        return min(n, self.batch_end - self.next_group)

    def start_batch(self, now: float) -> None:
        """Batched modes: take up to one step's worth of groups the bound allows, with fresh weights."""
        n = self.staleness.admit(self.w.prompts_per_step, timeout=0)
        if n == 0:
            return
        self.batch_end = self.next_group + n
        for e in self.engines:
            e.wait_until(now)
            if e.version != self.published:
                e.load_weights(self.published)

    def fill(self, idxs: list[int], now: float) -> None:
        """The generator's poll: hand whole groups, one at a time, to whichever of these engines has the
        most free slots (a router's least-loaded choice), while slots and the bound allow."""
        g = self.w.group_size
        if len(idxs) == 1:  # one engine's own poll (after its rows finished): no choice to make
            e = self.engines[idxs[0]]
            if e.n == 0:
                e.wait_until(now)
            want = e.free // g
            n = self.take(want, e.t) if want else 0
            if n:
                e.admit(self.new_groups(n, e.version), self.w.prompt_len)
            return
        for i in idxs:
            if self.engines[i].n == 0:
                self.engines[i].wait_until(now)
        heap = [(-self.engines[i].free, i) for i in idxs if self.engines[i].free >= g]
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            e = self.engines[i]
            if self.take(1, e.t) == 0:
                break
            e.admit(self.new_groups(1, e.version), self.w.prompt_len)
            if e.free >= g:
                heapq.heappush(heap, (-e.free, i))

    def admit_all(self, now: float) -> None:
        """Every engine polls (idle ones catch up with ``now``), then gets its next event scheduled."""
        self.fill(list(range(len(self.engines))), now)
        for i in range(len(self.engines)):
            self.schedule(i)
        self.activity_changed(now)

    def on_rows(self, i: int, rows: list[Row]) -> None:
        t = self.engines[i].t
        for row in rows:
            left = self.pending[row.group]
            left[0] -= 1
            left[1] = min(left[1], row.first_version)
            if left[0] == 0:
                self.push(t + self.c.reward_s, "reward", row.group)

    def on_reward(self, t: float, index: int) -> None:
        _, oldest, lengths, keep = self.pending.pop(index)
        group = _Group(index, oldest, [self.w.prompt_len + n for n in lengths], (0.0, 1.0) if keep else (0.0, 0.0))
        if self.w.consume == "completion":  # AReaL's buffer: a batch is the next groups to finish
            index, self.arrivals = self.arrivals, self.arrivals + 1
        self.buffer[index] = group
        if self.w.dynamic_sampling and not informative(group):
            self.staleness.release()  # the scorer frees a doomed group's slot at once (controller.py)
            self.admit_all(t)
        self.try_train(t)

    # ---- training ------------------------------------------------------------------------------------
    def max_staleness(self) -> int | None:
        """The guard ``collect_batch`` applies: none in sync (as the controller), none when consuming in
        completion order (AReaL bounds the head of the stream only: a straggler may exceed eta)."""
        return None if self.mode == "sync" or self.w.consume == "completion" else self.eta

    def batch_ready(self) -> bool:
        """Whether ``collect_batch`` would find every group it draws already scored (its loop, dry)."""
        p, limit = self.w.prompts_per_step, self.w.prompts_per_step * (
            self.w.max_draws_per_step if self.w.dynamic_sampling else 1)
        kept = drawn = 0
        eta = self.max_staleness()
        while kept < p and drawn < limit:
            group = self.buffer.get(self.cursor + drawn)
            if group is None:
                return False
            drawn += 1
            stale = eta is not None and too_stale(group, self.step, eta)
            kept += not (self.w.dynamic_sampling and not informative(group)) and not stale
        return True

    def try_train(self, t: float) -> None:
        if self.trainer_busy or not self.batch_ready():
            return
        got = collect_batch(lambda i, _: self.buffer.pop(i), self.cursor, self.step, self.w.prompts_per_step,
                            self.w.dynamic_sampling, self.w.max_draws_per_step, self.max_staleness(),
                            on_stale=lambda g: self.staleness.release())
        self.cursor = got.cursor
        self.staleness.charge(got.shortfall)
        for group in got.groups:
            s = self.step - group.oldest_version
            assert s <= self.eta or self.w.consume == "completion", (
                f"{self.mode}: staleness {s} > eta={self.eta} at step {self.step}")
            self.staleness_sum += s * len(group.seq_lens)
            self.staleness_count += len(group.seq_lens)
            self.staleness_max = max(self.staleness_max, s)
        self.trained.append(sum(len(g.seq_lens) for g in got.groups))
        self.training = self.trainer_busy = True
        costly = [g for g in got.groups if informative(g) or not self.w.train_informative_only]
        self.work_left = train_time(self.c, [n for g in costly for n in g.seq_lens], 1.0)
        self.last_t, self.rate = t, 0.0
        self.activity_changed(t)

    def train_rate(self) -> tuple[float, int]:
        """Training speed and devices in use now (shared pools lend idle generation cores)."""
        gen_active = any(e.n for e in self.engines)
        if self.shared and not gen_active:
            return device_speed(self.train_devices + self.gen_devices, self.c.train_scaling), self.gen_devices
        slow = self.c.overlap_train_slowdown if self.shared and gen_active else 1.0
        return device_speed(self.train_devices, self.c.train_scaling) / slow, 0

    def activity_changed(self, t: float) -> None:
        """Re-time the training step in flight when its speed changes (work-based progress)."""
        if not self.training or (self.rate and not self.shared):  # only shared pools change speed mid-step
            return
        rate, lent = self.train_rate()
        if rate == self.rate:
            return
        elapsed = t - self.last_t
        self.work_left -= elapsed * self.rate
        self.train_busy += elapsed * self.train_devices
        self.lent_busy += elapsed * self.lent
        self.rate, self.lent, self.last_t = rate, lent, t
        self.train_epoch += 1
        self.push(t + max(self.work_left, 0.0) / rate, "train_done", 0, self.train_epoch)

    def on_trained(self, t: float) -> None:
        elapsed = t - self.last_t
        self.train_busy += (elapsed + self.c.weight_sync_s) * self.train_devices
        self.lent_busy += elapsed * self.lent
        self.training = False
        self.rate = 0.0
        self.push(t + self.c.weight_sync_s, "publish", self.step + 1)

    def on_publish(self, t: float, version: int) -> None:
        self.published = version
        self.step = version
        self.trainer_busy = False
        self.step_ends.append(t)
        if len(self.step_ends) == self.cfg.warmup_steps:
            self.snapshot = (t, self.gen_busy(), self.train_busy, self.lent_busy)
        self.staleness.set_version(version)
        if not self.batched:  # interruption: every engine applies the update at its next step boundary
            for i, e in enumerate(self.engines):
                self.on_rows(i, e.advance_to_boundary(t))
                e.load_weights(version)
        self.admit_all(t)
        self.try_train(t)

    # ---- results ---------------------------------------------------------------------------------------
    def gen_busy(self) -> float:
        return sum(e.busy_s for e in self.engines) * self.devices_per_engine

    def result(self) -> ModeResult:
        w0 = self.cfg.warmup_steps
        t0, gen0, train0, lent0 = self.snapshot if w0 else (0.0, 0.0, 0.0, 0.0)
        window = max(self.step_ends[-1] - t0, 1e-12)
        gen_busy, train_busy = self.gen_busy() - gen0, self.train_busy - train0
        colocated = self.mode == "sync" and self.cfg.layout.sync_colocated
        pool = self.cfg.layout.devices if colocated else self.gen_devices + self.train_devices
        decode_steps = sum(e.decode_steps for e in self.engines)
        return ModeResult(
            mode=self.mode,
            samples_per_s=sum(self.trained[w0 : self.cfg.steps]) / window,
            step_s=window / (len(self.step_ends) - w0),
            gen_idle_frac=max(0.0, 1 - gen_busy / (self.gen_devices * window)),
            train_idle_frac=max(0.0, 1 - train_busy / (self.train_devices * window)),
            device_idle_frac=max(0.0, 1 - (gen_busy + train_busy + self.lent_busy - lent0) / (pool * window)),
            gen_mean_batch=sum(e.row_steps for e in self.engines) / max(decode_steps, 1),
            staleness_mean=self.staleness_sum / max(self.staleness_count, 1),
            staleness_max=self.staleness_max,
            interruptions=sum(e.interruptions for e in self.engines),
            update_frac=sum(e.update_s for e in self.engines) / max(sum(e.busy_s for e in self.engines), 1e-12),
            wall_s=self.step_ends[-1],
            gen_devices=self.gen_devices,
            train_devices=self.train_devices,
        )


def simulate(cfg: SimConfig, mode: str) -> ModeResult:
    """Simulate ``cfg.steps`` training steps of one mode (deterministic given ``cfg.seed``)."""
    return _Run(cfg, mode).run()


def compare(cfg: SimConfig) -> dict:
    """Every mode of ``cfg.modes``, and each one's throughput relative to sync (when simulated)."""
    results = {mode: simulate(cfg, mode) for mode in cfg.modes}
    base = results.get("sync")
    speedup = {m: r.samples_per_s / base.samples_per_s for m, r in results.items()} if base else {}
    return {"results": results, "speedup_vs_sync": speedup}
