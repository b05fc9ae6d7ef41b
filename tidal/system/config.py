"""The run config: one nested dataclass composed of each component's own config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tidal.algo.config import AlgoConfig
from tidal.distill.teacher import DistillConfig
from tidal.envs.config import EnvConfig
from tidal.inspector.samples import SampleLogConfig
from tidal.integrity.guard import SDCConfig
from tidal.models.tiny import ModelConfig
from tidal.optim import OptimConfig
from tidal.rewards.pool import RewardConfig
from tidal.rollout.local import SamplingConfig
from tidal.rollout.thinking import ThinkingConfig
from tidal.rollout.vllm_options import VllmOptions
from tidal.serve.config import HarnessConfig
from tidal.stages.warm_start import SFTConfig
from tidal.system.curriculum import CurriculumConfig
from tidal.system.length_growth import LengthGrowthConfig
from tidal.tasks.arithmetic import TaskConfig
from tidal.train.config import TrainerConfig
from tidal.train.critic import CriticConfig


@dataclass
class RolloutConfig(SamplingConfig):
    """Sampling (inherited) plus how rollouts are grouped and how stale they may be."""

    engine: str = "local"
    """``local`` (embedded) or ``vllm`` (in-process, or OpenAI-compatible servers with
    ``rollout.vllm.servers``; docs/scaling.md)."""
    vllm: VllmOptions = field(default_factory=VllmOptions)
    """How the vLLM engine starts and which servers it uses (``rollout.engine=vllm`` only)."""
    group_size: int = 8
    """Samples per prompt (GRPO's G; DAPO uses 16, DeepSeekMath 64)."""
    prompts_per_step: int = 16
    """Prompts (groups) per training step."""
    max_staleness: int = 1
    """eta: a sample is trained at most eta policy versions after its oldest token (AReaL)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (arXiv 2503.14476, sec. 3.2): drop groups whose rewards are all equal
    and keep drawing prompts until the step has ``prompts_per_step`` informative groups."""
    max_draws_per_step: int = 4
    """Dynamic sampling draws at most this many x ``prompts_per_step`` groups for one step, then
    trains on what it has (bounds the cost when most groups are solved or hopeless)."""
    length_schedule: list[list[int]] = field(default_factory=list)
    """Staged length scaling: ``[[from_step, max_new_tokens], ...]`` raises the response budget as
    training goes on (the staged context growth of DeepScaleR, MiniMax-M1 sec. 4); empty: fixed."""
    length_growth: LengthGrowthConfig = field(default_factory=LengthGrowthConfig)
    """Staged length growth driven by MiniMax-M1's indicator (p99 of response lengths near the cap)
    instead of fixed steps; ``stages`` non-empty replaces ``length_schedule`` (system/length_growth.py)."""
    thinking: ThinkingConfig = field(default_factory=ThinkingConfig)
    """Thinking budgets with budget forcing (s1): the engine closes ``<think>`` when a request's budget
    is spent (rollout/thinking.py; local engine only)."""
    weight_quant: Literal["none", "fp8_block"] = "none"
    """Weights sent to the rollout engine: ``none`` (the trainer's dtype) or ``fp8_block``
    (DeepSeek-V3's 128 x 128 e4m3 tiles, one float32 scale each: ~1/4 of float32's bytes per linear
    layer). The engine samples with the dequantized weights; the trainer keeps full precision and
    the off-policy correction (engine log-probs as behaviour log-probs) absorbs the gap. ``local``
    engine (and Ray rollout workers) only; docs/quantization.md."""


@dataclass
class SystemConfig:
    mode: Literal["sync", "async"] = "async"
    """``sync``: generate then train. ``async``: generate and train concurrently, bounded by eta."""
    device: str = "auto"
    """Where the policy, reference, critic, optimizer state and the local rollout engine (weights and KV
    cache) live: ``auto`` (CUDA when torch sees a GPU, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
    Reward workers stay CPU processes. The warm-started tiny base is built on the CPU either way
    (``utils/device.py``; precision: ``trainer.precision``, ``rollout.dtype``)."""
    num_threads: int = 2
    """torch threads in sync mode, where generation and training take turns on all cores."""
    async_threads: int = 1
    """torch intra-op threads in async mode. torch's thread pool is process-wide, so the generator
    and trainer threads each run their kernels with this many threads, at the same time: keep
    2 x async_threads <= cores (FACTS.md: oversubscription made a training step 21x slower). While
    the generator is blocked on the staleness bound with nothing to decode, it lends the pool to
    the trainer (``num_threads``) and takes it back the moment it is admitted again."""
    journal: bool = True
    """Async mode: append every scored group to ``RUN_DIR/journal.jsonl`` the moment it is scored,
    so Ctrl-C or a crash loses no finished group and ``--resume`` trains them instead of generating
    them again (``system/journal.py``)."""
    backend: Literal["local", "ray"] = "local"
    """``local``: engine, rewards and trainer in this process. ``ray``: rollout workers and reward
    workers run as Ray actors placed by the resources below; the trainer stays in this (driver)
    process (``system/ray_engine.py``, ``system/ray_rewards.py``). Needs ``pip install 'tidal[ray]'``."""
    ray_address: str | None = None
    """Ray cluster to join: ``auto`` (or ``HOST:6379``) after ``ray start --head``, ``ray://HOST:10001``
    for Ray Client. None starts a local Ray instance for the run and stops it at the end."""
    rollout_workers: int = 2
    """Ray backend: rollout worker actors, each holding its own ``rollout.engine``."""
    rollout_worker_cpus: float = 1.0
    """Ray backend: CPUs each rollout worker reserves (placement); Ray will not start more workers
    than the cluster has CPUs for."""
    rollout_worker_gpus: float = 0.0
    """Ray backend: GPUs each rollout worker reserves (fractions share a GPU). The ``local`` engine
    runs on CPU; GPUs are for engines that use them."""
    rollout_worker_threads: int = 1
    """Ray backend: torch intra-op threads in each rollout worker (keep the sum within the cores)."""
    rollout_worker_restarts: int = 0
    """Ray backend: a dead rollout worker is replaced up to this many times per worker (it joins
    with the newest weights). Either way its requests go to the survivors at once; 0 goes on with
    fewer workers (Gemini 2.5's lesson: keep going rather than stop)."""
    reward_worker_cpus: float = 0.0
    """Ray backend: CPUs each reward worker actor reserves (``reward.num_workers`` of them; 0 lets
    them share the cores, fine for cheap verifiers). A dead reward worker is always replaced."""


@dataclass
class LogConfig:
    tensorboard: bool = True
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (needs ``pip install 'tidal[wandb]'``)."""
    mlflow_experiment: str | None = None
    """Log to MLflow under this experiment (needs ``pip install 'tidal[mlflow]'``)."""
    progress: bool = True
    """Show a progress bar with live reward and accuracy."""
    report: bool = True
    """Write report.html and inspect.html (the rollout inspector) at the end of the run."""
    samples: SampleLogConfig = field(default_factory=SampleLogConfig)
    """Rollouts recorded into ``samples.jsonl`` for the inspector (``tidal inspect``, docs/inspect.md)."""


@dataclass
class RunConfig:
    """A complete run: ``tidal train RECIPE --set key=value`` edits one of these."""

    seed: int = 0
    max_steps: int = 200
    """Training steps (one policy version each)."""
    max_time_s: float | None = None
    """Stop after this much wall time (checked between steps)."""
    target_accuracy: float | None = None
    """Stop early once held-out greedy accuracy reaches this."""
    max_failed_steps: int = 3
    """Stop the run (exit 1, one line naming the cause) after this many steps in a row whose every group failed:
    every episode crashed or its reward raised, so nothing was trained. 3: one such step can be a transient, three
    cannot (``system/failures.py`` has the arithmetic)."""
    eval_every: int = 10
    """Steps between held-out evaluations (step 0 is always evaluated: the base model)."""
    num_eval: int | None = None
    """Evaluate on the first N held-out prompts only (None: all of task.num_eval)."""
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    """Write checkpoints in the background (``train/async_checkpoint.py``): the step pays for a copy of the
    state into host memory, a thread writes, hashes and renames it, one write at a time, and the run waits
    for the last one before it ends. Same files and ``--resume`` as a synchronous save; costs one host copy
    of the weights and optimizer state. On by default (DataStates-LLM, arXiv 2406.10707): a kill mid-write
    leaves the previous checkpoint, as a synchronous save does. ``false``: the step waits for the disk."""
    checkpoint_snapshot: str = "now"
    """When an asynchronous checkpoint copies the state into host memory: ``now`` (on the training thread, at
    the save: ~0.2 s per 2.35 GB on 2 CPU cores) or ``deferred`` (on the writer's thread, beside the next step's
    work; every optimizer step waits until the copy is done, so the checkpoint is the same). ``deferred`` needs
    ``async_checkpoint`` and one process (not under torchrun, not ``trainer.data_parallel=elastic``):
    ``train/async_checkpoint.py``."""
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn agent episodes in an environment (docs/agentic.md); ``env.name`` null: single-turn."""
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    """Train an agent written against the ``openai`` client through tidal's OpenAI-compatible endpoint
    (docs/harness.md); ``harness.function`` null: no harness."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Task mixtures scheduled over steps and online difficulty weighting (docs/curriculum.md)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of ``algo.advantage=gae`` (PPO with a learned critic); unused otherwise."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: a teacher scores every sampled token in the scorer (docs/distill.md)."""
    system: SystemConfig = field(default_factory=SystemConfig)
    sdc: SDCConfig = field(default_factory=SDCConfig)
    """Silent-data-corruption detection: per-step fingerprints, replay, rollback (docs/faults.md)."""
    log: LogConfig = field(default_factory=LogConfig)
