"""The controller: runs the RL loop in ``sync`` or ``async`` mode with one set of semantics.

Step k trains on the next P groups of the prompt stream (P = prompts_per_step; with dynamic
sampling, the next P informative ones, see ``batching.py``) with policy version k and publishes
version k+1 to the rollout engine.

- ``sync``: generate batch k with version k, score it, train, repeat (generation and training
  take turns on all cores).
- ``async`` (AReaL): a generator thread keeps producing groups as long as the staleness manager
  admits them, a scorer thread runs the reward pool, and the trainer (this thread) consumes batches
  in order. A new version reaches the engine mid-generation (it interrupts, re-reads and resumes);
  no sample is trained more than eta versions after its oldest token. With eta = 0 it produces
  exactly the sync trajectories and parameters (tests pin this). The scorer journals every scored
  group (``journal.py``), so a stopped run resumes with the groups it had finished.

The data cursor (``state.next_group``) advances when a step completes, not when its batch is drawn,
so a checkpoint written on Ctrl-C in the middle of a step never skips that step's groups.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tidal.api import EngineFailed, RolloutEngine, Task, Tracker
from tidal.config import ConfigError
from tidal.distill.teacher import TeacherScorer, distill_metrics
from tidal.inspector.record import SampleRecorder
from tidal.integrity.guard import SDCGuard
from tidal.models import vlm
from tidal.rewards.monitor import LengthBiasHook, reward_metrics
from tidal.rewards.pool import RewardPool
from tidal.rollout.episodes import episode_metrics
from tidal.rollout.evaluate import accuracy_metrics, check_evaluation, greedy_samples, per_task_accuracy
from tidal.rollout.requests import group_requests
from tidal.rollout.thinking import close_ids, train_budget, with_budgets
from tidal.system.batching import collect_batch, informative, length_budget
from tidal.system.buffer import RolloutBuffer, take_one
from tidal.system.config import RunConfig
from tidal.system.curriculum import PromptSource
from tidal.system.failures import FailedSteps
from tidal.system.journal import GroupJournal
from tidal.system.length_growth import LengthGrowth
from tidal.system.staleness import StalenessManager
from tidal.train.async_checkpoint import AsyncCheckpointer
from tidal.train.batch import build_train_batch
from tidal.train.checkpoint import TrainingState
from tidal.train.guidance import Guidance, num_guided, sampled
from tidal.train.trainer import Trainer
from tidal.types import Group, Prompt, Trajectory
from tidal.utils import outputs
from tidal.utils.device import resolve_dtype
from tidal.utils.metrics import last_logged_step, logged_rows
from tidal.utils.progress import progress_bar


@dataclass
class RunResult:
    steps: int
    base_accuracy: float | None
    final_accuracy: float | None
    best_accuracy: float | None
    stopped_because: str
    history: list[dict] = field(default_factory=list)


class Controller:
    def __init__(self, cfg: RunConfig, task: Task, engine: RolloutEngine, eval_engine: RolloutEngine,
                 reward_pool: RewardPool, trainer: Trainer, tokenizer, tracker: Tracker, out_dir: Path,
                 state: TrainingState, journal: GroupJournal | None = None, samples: SampleRecorder | None = None,
                 sdc: SDCGuard | None = None, teacher: TeacherScorer | None = None):
        self.cfg = cfg
        self.task = task
        self.engine = engine
        self.eval_engine = eval_engine
        self.reward_pool = reward_pool
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.tracker = tracker
        self.out_dir = out_dir
        self.state = state
        self.journal = journal
        self.samples = samples  # records rollouts for the inspector (samples.jsonl)
        self.sdc = sdc  # silent-data-corruption guard: records, replays, raises SilentDataCorruption
        self.teacher = teacher  # on-policy distillation: scores every sampled token, beside the reward
        self._cursor = state.next_group  # the stream position after the current step's batch
        self._reloaded_groups = 0
        self.eval_prompts = task.eval_prompts()[: cfg.num_eval]
        self.history: list[dict] = []
        self._trained_samples = 0
        self._rl_seconds = 0.0
        self._elapsed_before = state.extra.get("elapsed_s", 0.0)  # RL time of the run before a resume
        self._unlogged: tuple[int, dict] | None = None  # (step, metrics) of a trained step not logged yet
        self._infra_failed = 0  # agent episodes left out because their environment failed
        self.failed_steps = FailedSteps(cfg.max_failed_steps)  # stops a run whose every group fails (failures.py)
        self._resumed = state.step > 0  # marks this process's first row (``run/resumed``): counters restart there
        # Weights go to a local engine already in its dtype (a bf16 engine is sent half the bytes); other
        # engines take the trainer's.
        self._engine_dtype = (resolve_dtype(cfg.rollout.dtype, trainer.device, "rollout.dtype")
                              if cfg.rollout.engine == "local" and getattr(trainer, "device", None) is not None
                              else None)
        # at most one checkpoint write in flight, in the background (``train/async_checkpoint.py``)
        self.ckpt_writer = (AsyncCheckpointer(deferred=cfg.checkpoint_snapshot == "deferred")
                            if cfg.async_checkpoint else None)
        agentic = cfg.env.name is not None or cfg.harness.enabled  # its demonstrations must be conversations
        guide = cfg.algo.guidance != "none"
        self.guidance = Guidance(task, tokenizer, cfg.algo.guidance_reward, agentic) if guide else None
        self._setup_curriculum()

    # ---- the curriculum: what is drawn, how long, how it is scored (restored on resume) -------------
    def _setup_curriculum(self) -> None:
        cfg, extra = self.cfg, self.state.extra
        self.source = PromptSource(self.task, cfg)
        self.source.load_state_dict(extra.get("curriculum", {}))
        self.length_growth = LengthGrowth(cfg.rollout.length_growth) if cfg.rollout.length_growth.stages else None
        if self.length_growth is not None and "length_growth" in extra:
            self.length_growth.load_state_dict(extra["length_growth"])
        bias = cfg.reward.length_bias
        self.length_bias = LengthBiasHook(bias) if bias.component else None
        if self.length_bias is not None:
            if bias.action == "lower_weight" and not _scale(self.reward_pool, bias.component, 1.0):
                raise ConfigError(f"reward.length_bias.component={bias.component!r}: reward {cfg.reward.name!r} has "
                                  "no term of that name whose weight could be lowered (use a compose reward)")
            if "length_bias" in extra:
                self.length_bias.load_state_dict(extra["length_bias"])
                if bias.action == "lower_weight" and self.length_bias.fired:  # the weight the run had reached
                    _scale(self.reward_pool, bias.component, bias.factor ** self.length_bias.fired)
        self._think_close = close_ids(self.tokenizer, cfg.rollout.thinking)
        self._stop_reason: str | None = None
        self._drawn: list[Group] = []  # every group the step drew, dropped ones too (online difficulty)

    def _curriculum_state(self) -> None:
        self.state.extra["curriculum"] = self.source.state_dict()
        if self.length_growth is not None:
            self.state.extra["length_growth"] = self.length_growth.state_dict()
        if self.length_bias is not None:
            self.state.extra["length_bias"] = self.length_bias.state_dict()

    def _after_update(self, step: int, trajs: list[Trajectory], metrics: dict[str, float]) -> None:
        """Learn from the step just trained (before its version is published, so the next draws see it):
        pass rates of every group drawn, the length-growth indicator, the length-bias hook."""
        self.source.observe(self._drawn)
        if self.length_growth is not None:
            message = self.length_growth.observe(step + 1, [t.num_tokens for t in trajs])
            if message:
                tqdm.write(message, file=sys.stderr)
            metrics.update(self.length_growth.metrics())
        if self.length_bias is not None:
            message = self.length_bias.check(step + 1, metrics)
            if message:
                tqdm.write(message, file=sys.stderr)
                bias = self.cfg.reward.length_bias
                if bias.action == "lower_weight":
                    _scale(self.reward_pool, bias.component, bias.factor)
                elif bias.action == "stop":
                    self._stop_reason = message
            metrics["reward/length_bias_fired"] = float(self.length_bias.fired)

    # ---- pieces shared by both modes -----------------------------------------------------------
    def _prepare_engine(self) -> None:
        """Size the engine's slot cache (and record its CUDA-graph buckets) for the first step's requests before its
        clock starts (issue 51): sync's ``generate`` would do it inside step 1, async's stream admission by admission
        (async sizes every slot, rows joining while others run). Engines without ``prepare`` (vLLM, agents) skip it."""
        prepare = getattr(self.engine, "prepare", None)
        if prepare is None:
            return
        r = self.cfg.rollout
        streams = self.cfg.system.mode != "sync"
        count = -(-r.max_batch_size // r.group_size) + 1 if streams else r.prompts_per_step
        prompts = self._prompts(self.state.next_group, count)  # measured only: no request of a step is built
        prepare(group_requests(self.tokenizer, prompts, r.group_size, self._budget(self.state.step)),
                joins_later=streams)

    def _prompts(self, start: int, count: int) -> list[Prompt]:
        return [self.source.prompt(i) for i in range(start, start + count)]

    def _budget(self, step: int) -> int:
        r = self.cfg.rollout
        if self.length_growth is not None:
            return self.length_growth.cap
        return length_budget(r.length_schedule, step, r.max_new_tokens)

    def _requests(self, prompts: list[Prompt], step: int):
        requests = group_requests(self.tokenizer, prompts, self.cfg.rollout.group_size, self._budget(step))
        thinking = self.cfg.rollout.thinking
        if not thinking.budgets:
            return requests
        return with_budgets(requests, lambda p: train_budget(thinking, self.cfg.seed, p.uid), self._think_close)

    def _generate_on_demand(self, step: int):
        """Sync mode's ``take``: when a group is missing, generate all the groups still needed."""
        ready: dict[int, Group] = {}

        def take(index: int, need: int) -> Group:
            if index not in ready:
                prompts = self._prompts(index, need)
                trajs = self.engine.generate(self._requests(prompts, step))
                ready.update(enumerate(self._score(prompts, trajs), start=index))
            return ready.pop(index)

        return take

    def _collect(self, take, step: int, max_staleness: int | None, on_stale=lambda g: None):
        r = self.cfg.rollout
        self._drawn: list[Group] = []  # every group the step draws, dropped ones too (online difficulty)

        def take_and_record(index: int, need: int) -> Group:
            group = take(index, need)
            self._drawn.append(group)
            return group if self.guidance is None else self.guidance.guide(group)

        got = collect_batch(take_and_record, self.state.next_group, step, r.prompts_per_step, r.dynamic_sampling,
                            r.max_draws_per_step, max_staleness, on_stale)
        self._cursor = got.cursor  # committed to the state when the step completes (_finish_step)
        return got.groups, got.metrics

    def _score(self, prompts: list[Prompt], trajs: list[Trajectory]) -> list[Group]:
        """Reward each sample with the reward pool, except agent episodes, which their environment or
        agent rewarded (a harness run with ``harness.reward=task`` has its final answers scored here too:
        ``Trajectory.score_text``); an episode whose environment failed is left out of its group (and so of its
        baseline: scoring it 0 would bias the healthy episodes' advantages) and counted."""
        n = self.cfg.rollout.group_size
        single = [(i, t) for i, t in enumerate(trajs) if t.score_text is not None]
        scores = self.reward_pool.score([(t.score_text, _with_length(prompts[i // n], t)) for i, t in single])
        for (_, t), (reward, details) in zip(single, scores):
            t.reward, t.reward_details = reward, details
        self.failed_steps.note(trajs)
        if self.teacher is not None:  # on the scorer thread in async mode: off the trainer's path
            self.teacher.score([t for t in trajs if not t.infra_failed])
        groups = []
        for i, p in enumerate(prompts):
            group = trajs[i * n : (i + 1) * n]
            self._infra_failed += sum(t.infra_failed for t in group)
            groups.append(Group(p, [t for t in group if not t.infra_failed]))
        return groups

    def _evaluate(self, step: int) -> dict[str, float]:
        self.eval_engine.request_weight_update(self.trainer.state_dict_for_engine(dtype=self._engine_dtype),
                                               self.trainer.version)
        budget = self.cfg.rollout.thinking.eval_budget
        trajs = greedy_samples(self.eval_engine, self.tokenizer, self.eval_prompts, self.reward_pool,
                               thinking=None if budget is None else (budget, self._think_close))
        if self.samples is not None:
            self.samples.record_eval(step, self.eval_prompts, trajs)
        check_evaluation(trajs, f"the held-out evaluation at step {step}")  # all failed: no accuracy to report
        return {**accuracy_metrics(trajs, len(self.eval_prompts)), **per_task_accuracy(trajs, self.eval_prompts)}

    def _train_step(self, step: int, groups: list[Group]) -> dict[str, float]:
        """Train on one batch (with its demonstrations: train/guidance.py), publish, return the samples' metrics."""
        trained_groups, groups = groups, sampled(groups)
        trajs = [t for g in groups for t in g.trajectories]
        staleness = [step - t.oldest_version for t in trajs] or [0]
        eta = self.cfg.rollout.max_staleness if self.cfg.system.mode == "async" else 0
        assert max(staleness) <= eta, f"staleness bound violated at step {step}: {max(staleness)} > {eta}"
        if not trajs:  # dynamic sampling found no informative group within its draw limit
            self._unlogged = (step + 1, {"algo/empty_step": 1.0})
            self.trainer.skip_step()
            self._after_update(step, trajs, self._unlogged[1])
            self.engine.request_weight_update(
                self.trainer.state_dict_for_engine(self.cfg.rollout.weight_quant, self._engine_dtype),
                self.trainer.version)
            return self._unlogged[1]
        rewards = [t.reward for t in trajs]
        metrics: dict[str, float] = {
            "reward/mean": sum(rewards) / len(rewards),
            "reward/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "rollout/response_len_mean": sum(t.num_tokens for t in trajs) / len(trajs),
            "rollout/response_len_max": float(max(t.num_tokens for t in trajs)),
            "rollout/truncated_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
            "rollout/early_stopped_frac": sum(t.finish_reason == "repetition" for t in trajs) / len(trajs),
            "rollout/interrupted_frac": sum(len({v for v in t.versions if v >= 0}) > 1 for t in trajs) / len(trajs),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
        }
        metrics.update(reward_metrics(rewards, [t.reward_details for t in trajs], [t.num_tokens for t in trajs]))
        metrics.update(episode_metrics(trajs))
        metrics.update(self.source.metrics(step, groups))  # per task: after the components' reward/<name>/mean
        if self.cfg.rollout.thinking.budgets:
            metrics["rollout/think_forced_frac"] = sum(
                t.episode is None and t.loss_mask is not None for t in trajs) / len(trajs)
        if self.teacher is not None:
            metrics.update(distill_metrics(trajs, self.teacher))
        if self.cfg.env.name is not None or self.cfg.harness.enabled:
            metrics["agent/infra_failures"] = float(self._infra_failed)
        batch, algo_metrics = build_train_batch(trained_groups, self.cfg.algo, self.tokenizer.pad_token_id,
                                                vlm.processor_of(self.tokenizer))  # a VLM's: its images
        metrics.update(algo_metrics)
        if self.guidance is not None:
            metrics["algo/guided_groups"] = float(num_guided(trained_groups))
        self._unlogged = (step + 1, metrics)  # filled in place: what a Ctrl-C after the update logs
        if batch is not None:
            version = self.trainer.version
            if self.sdc is not None:
                self.sdc.before_step(step + 1, batch)
            metrics.update(self.trainer.step(batch))
            if self.sdc is not None:
                logp_bt = getattr(self.trainer, "last_logp_bt", None)
                metrics.update(self.sdc.rollout_check(trained_groups, batch, logp_bt, version))
                metrics.update(self.sdc.after_step(step + 1, batch, metrics))
        else:
            self.trainer.skip_step()
        self._after_update(step, trajs, metrics)
        if self.samples is not None and self.samples.wants_train(step + 1):
            self.samples.record_train(step + 1, step, trained_groups, batch, self.trainer)
        t0 = time.perf_counter()
        self.engine.request_weight_update(
            self.trainer.state_dict_for_engine(self.cfg.rollout.weight_quant, self._engine_dtype), self.trainer.version)
        metrics["perf/weight_sync_s"] = time.perf_counter() - t0
        metrics.update(self.trainer.weight_sync_metrics)  # bytes handed over, time to build them
        metrics["reward/errors"] = float(self.reward_pool.num_errors)
        metrics["reward/timeouts"] = float(self.reward_pool.num_timeouts)
        self._trained_samples += len(trajs)
        return metrics

    def _finish_step(self, step: int, metrics: dict[str, float], step_start: float, bar) -> str | None:
        """Eval, log, checkpoint; return a stop reason or None."""
        cfg = self.cfg
        done = step + 1
        self.state.step, self.state.version, self.state.next_group = done, self.trainer.version, self._cursor
        step_s = time.perf_counter() - step_start
        self._rl_seconds += step_s
        metrics["perf/step_s"] = step_s
        metrics["perf/trained_samples_per_s"] = self._trained_samples / max(self._rl_seconds, 1e-9)
        metrics.update(self.engine.stats())
        metrics["time/elapsed_s"] = self._elapsed_before + self._rl_seconds
        if self._resumed:
            metrics["run/resumed"], self._resumed = 1.0, False
        stop = None
        if done % cfg.eval_every == 0 or done >= cfg.max_steps:
            metrics.update(self._evaluate(done))
            acc = metrics["eval/accuracy"]
            if cfg.target_accuracy is not None and acc >= cfg.target_accuracy:
                stop = f"reached target accuracy {acc:.3f} >= {cfg.target_accuracy}"
        if done >= cfg.max_steps:
            stop = stop or f"reached max_steps={cfg.max_steps}"
        stop = stop or self._stop_reason
        metrics["algo/failed_groups"] = float(self.failed_steps.observe(self._drawn))
        if cfg.max_time_s is not None and metrics["time/elapsed_s"] >= cfg.max_time_s:
            stop = stop or f"reached max_time_s={cfg.max_time_s}"
        self.tracker.log(done, metrics)
        self._unlogged = None
        self.history.append({"step": done, **metrics})
        self.failed_steps.check(done)  # logged first: the failed steps' rows show what happened
        if done % cfg.checkpoint_every == 0 or stop:
            self.checkpoint(metrics["time/elapsed_s"])
        if bar is not None:
            bar.update(1)
            post = {"reward": f"{metrics.get('reward/mean', 0.0):.3f}",
                    "stale": f"{metrics.get('async/staleness_mean', 0.0):.2f}"}
            last_acc = next((h["eval/accuracy"] for h in reversed(self.history) if "eval/accuracy" in h), None)
            if last_acc is not None:
                post["acc"] = f"{last_acc:.3f}"
            bar.set_postfix(post)
        return stop

    def checkpoint(self, elapsed_s: float) -> Path:
        self.state.extra["elapsed_s"] = elapsed_s
        self._curriculum_state()
        journal, start, out_dir = self.journal, self.state.next_group, self.out_dir

        def saved(_path) -> None:  # once the checkpoint is complete on disk (on the writer's thread if async)
            if journal is not None:  # the journal kept the groups this checkpoint trained until now
                journal.compact(start)
            outputs.sweep(out_dir)  # the run's record of the files it wrote (utils/outputs.py)

        path = self.trainer.save_checkpoint(self.out_dir / "checkpoints", self.tokenizer, self.state,
                                            keep=self.cfg.keep_checkpoints, writer=self.ckpt_writer,
                                            on_saved=saved)  # policy (and critic) state
        if self.sdc is not None:
            if self.ckpt_writer is not None:
                self.ckpt_writer.wait()  # the guard marks the checkpoint on disk and prunes by what is kept there
            self.sdc.on_checkpoint(path, self.state.step)
        return path

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint being written in the background (if any) is on disk; raise
        ``CheckpointError`` if its write failed."""
        if self.ckpt_writer is not None:
            self.ckpt_writer.wait()

    # ---- the loop ------------------------------------------------------------------------------
    def _earlier_rows(self) -> list[dict]:
        """On resume, the rows logged up to the checkpoint (``metrics.jsonl``, already cut there by the
        tracker), so the result covers the whole run: its base accuracy included."""
        rows = logged_rows(self.out_dir / "metrics.jsonl", self.state.step)
        if not any(r["step"] == 0 for r in rows) and "base_eval" in self.state.extra:
            rows.insert(0, {"step": 0, **self.state.extra["base_eval"]})
        return rows

    def run(self) -> RunResult:
        cfg = self.cfg
        if self.state.step > 0:
            self.history = self._earlier_rows() + self.history
        if self.state.step == 0:
            base = self.state.extra.get("base_eval")  # set when resuming a Ctrl-C before step 1: logged already
            if base is None:
                base = self.state.extra["base_eval"] = self._evaluate(0)
                self.tracker.log(0, base)
            self.history.append({"step": 0, **base})
        bar = progress_bar(cfg.log.progress, total=cfg.max_steps, initial=self.state.step,
                           desc=f"RL ({cfg.system.mode})", dynamic_ncols=True)
        try:
            if self.state.step < cfg.max_steps:
                self._prepare_engine()
            if self.state.step >= cfg.max_steps:
                stop = f"already at max_steps={cfg.max_steps}"
            elif cfg.system.mode == "sync":
                stop = self._run_sync(bar)
            else:
                stop = self._run_async(bar)
        except (KeyboardInterrupt, EngineFailed):  # stopped: keep what trained (a failed engine stops the run too)
            if self.trainer.version == self.state.version + 1:  # the step trained, then was stopped: it counts
                self.state.step, self.state.version = self.state.step + 1, self.trainer.version
                self.state.next_group = self._cursor
            last = last_logged_step(self.out_dir / "metrics.jsonl")
            if self._unlogged is not None and self._unlogged[0] == self.state.step != last:
                self.tracker.log(*self._unlogged)  # counted in the checkpoint: logged too, once
            self.checkpoint(self._elapsed_before + self._rl_seconds)
            self.wait_for_checkpoint()  # on disk before the caller says where it is
            raise
        except BaseException:
            if self.ckpt_writer is not None:
                self.ckpt_writer.wait_quietly()  # the run's own error stays the one raised
            raise
        finally:
            bar.close()
        self.wait_for_checkpoint()
        accs = [(h["step"], h["eval/accuracy"]) for h in self.history if "eval/accuracy" in h]
        return RunResult(
            steps=self.state.step,
            base_accuracy=accs[0][1] if accs and accs[0][0] == 0 else None,
            final_accuracy=accs[-1][1] if accs else None,
            best_accuracy=max(a for _, a in accs) if accs else None,
            stopped_because=stop,
            history=self.history,
        )

    def _run_sync(self, bar) -> str:
        torch.set_num_threads(self.cfg.system.num_threads)
        step = self.state.step
        while True:
            start = time.perf_counter()
            groups, collect_metrics = self._collect(self._generate_on_demand(step), step, max_staleness=None)
            metrics = {**collect_metrics, **self._train_step(step, groups)}
            stop = self._finish_step(step, metrics, start, bar)
            if stop:
                return stop
            step += 1

    def _reload_journal(self) -> dict[int, Group]:
        """Groups journaled before a resume that this run may train (``journal.py``), by index."""
        if self.journal is None:
            return {}
        groups, discarded = self.journal.reload(self.state.next_group, max_version=self.trainer.version)
        if groups or discarded:
            tqdm.write(f"journal: reusing {len(groups)} scored groups, generating {discarded} again "
                       f"(sampled by versions newer than the checkpoint's {self.trainer.version})", file=sys.stderr)
        return groups

    def _run_async(self, bar) -> str:
        cfg = self.cfg
        p = cfg.rollout.prompts_per_step
        torch.set_num_threads(cfg.system.async_threads)  # process-wide: shared by both threads
        # Everything before the cursor was trained or charged: version * P admitted groups exactly.
        staleness = StalenessManager(p, cfg.rollout.max_staleness, version=self.trainer.version,
                                     next_index=self.state.next_group)
        # eta = 0: no group starts beyond the current step's draw limit (the step sync would draw it in)
        draw_limit = p * (cfg.rollout.max_draws_per_step if cfg.rollout.dynamic_sampling else 1)
        exact = cfg.rollout.max_staleness == 0
        if exact:
            staleness.set_ceiling(self.state.next_group + draw_limit)
        buffer = RolloutBuffer()
        to_score: queue.Queue = queue.Queue()  # bounded in effect: admission caps groups in flight
        group_size = cfg.rollout.group_size
        reloaded = self._reload_journal()

        def publish(index: int, group: Group) -> None:
            if cfg.rollout.dynamic_sampling and not informative(group):
                staleness.release()  # will be dropped: free its slot right away
            buffer.put(index, group)

        def generate_forever() -> None:
            """Continuous batching: admit whole groups whenever the engine has room (and the
            staleness bound allows), hand each group to the scorer the moment its last sample ends."""
            next_group = self.state.next_group
            in_flight: dict[str, tuple[int, Prompt, dict[int, Trajectory]]] = {}

            def source(free_rows: int, block: bool):
                nonlocal next_group
                want = free_rows // group_size
                if want == 0:
                    if block:  # nothing running and still no room for one group: it never will be
                        raise ConfigError(f"rollout.max_batch_size={cfg.rollout.max_batch_size} is smaller than "
                                          f"rollout.group_size={group_size}: no group can ever be admitted")
                    return []
                if block:  # idle until the trainer publishes a version: lend it every core meanwhile
                    torch.set_num_threads(cfg.system.num_threads)
                n = staleness.admit(want, timeout=None if block else 0)
                if block:  # torch's pool is process-wide: take the cores back before our first kernel
                    torch.set_num_threads(cfg.system.async_threads)
                if n == 0:
                    return None if staleness.closed else []
                fresh = []
                for index in range(next_group, next_group + n):
                    if index in reloaded:  # journaled by the run before --resume: admitted, not generated
                        publish(index, reloaded.pop(index))
                        self._reloaded_groups += 1
                    else:
                        fresh.append(index)
                next_group += n
                prompts = [self.source.prompt(i) for i in fresh]
                for index, prompt in zip(fresh, prompts):
                    in_flight[prompt.uid] = (index, prompt, {})
                return self._requests(prompts, staleness.version)

            def on_done(request, traj: Trajectory) -> None:
                index, prompt, done = in_flight[request.prompt.uid]
                done[request.sample_index] = traj
                if len(done) == group_size:
                    del in_flight[request.prompt.uid]
                    to_score.put((index, [prompt], [done[j] for j in range(group_size)]))

            try:
                self.engine.stream(source, on_done)
            except BaseException as e:  # surface it in the trainer thread
                buffer.fail(e)
            finally:
                to_score.put(None)

        def score_forever() -> None:
            """Score every group that is waiting in one call: a teacher's forward (on-policy distillation)
            costs about as much for 8 rows as for 1,000 on a small model, so scoring group by group made
            it 5x slower than the trainer (``tidal bench distill``). Groups are published in queue order."""
            try:
                done = False
                while not done and (item := to_score.get()) is not None:
                    items = [item]
                    while True:
                        try:
                            more = to_score.get_nowait()
                        except queue.Empty:
                            break
                        if more is None:
                            done = True
                            break
                        items.append(more)
                    groups = self._score([p for _, ps, _ in items for p in ps], [t for _, _, ts in items for t in ts])
                    indices = [first + i for first, ps, _ in items for i in range(len(ps))]
                    for index, group in zip(indices, groups, strict=True):
                        if self.journal is not None:
                            self.journal.append(index, group)  # queued: written on the journal's thread
                        publish(index, group)
            except BaseException as e:
                buffer.fail(e)

        generator = threading.Thread(target=generate_forever, name="tidal-generate", daemon=True)
        scorer = threading.Thread(target=score_forever, name="tidal-score", daemon=True)
        generator.start()
        scorer.start()
        step = self.state.step
        try:
            while True:
                start = time.perf_counter()
                groups, metrics = self._collect(lambda i, _: take_one(buffer, i), step, cfg.rollout.max_staleness,
                                                on_stale=lambda g: staleness.release())
                staleness.charge(int(metrics["algo/shortfall_groups"]))
                if exact:  # after the charge: no room opens at this version for the next step's groups
                    staleness.set_ceiling(self._cursor + draw_limit)
                metrics.update(self._train_step(step, groups))
                staleness.set_version(self.trainer.version)
                metrics["async/buffered_groups"] = float(len(buffer))
                metrics["async/reloaded_groups"] = float(self._reloaded_groups)
                stop = self._finish_step(step, metrics, start, bar)
                if stop:
                    return stop
                step += 1
        finally:
            staleness.close()
            buffer.close()
            generator.join()  # finishes the rows it was decoding, then ends its stream
            scorer.join()


def _scale(pool, component: str, factor: float) -> bool:
    """Scale a composed reward's term weight in ``pool`` (False: the reward has no such term)."""
    return bool(getattr(getattr(pool, "fn", None), "scale_component", lambda *_: False)(component, factor))


def _with_length(prompt: Prompt, traj: Trajectory) -> Prompt:
    """The prompt as the reward sees it: its meta plus the response's token count and truncation."""
    meta = {**prompt.meta, "num_tokens": traj.num_tokens, "truncated": traj.finish_reason == "length"}
    return dataclasses.replace(prompt, meta=meta)
