"""Wire a RunConfig into a ready Controller: base model, engines, rewards, trainer, trackers.

``check_inputs`` reads and checks everything the run reads that needs no run directory (the config, the
task's rows, the harness agent, ...): ``tidal train`` calls it before ``--overwrite`` deletes the previous
run, so a bad input is one line that leaves that run as it was. ``prepare`` then writes ``config.yaml``
next to the metrics, warm-starts (or loads) the base model, and, with ``resume=True``, restores the
latest checkpoint so the run continues exactly where it stopped (reusing the scored groups in
``journal.jsonl``).

``system.backend`` picks where rollouts and rewards run: in this process (``local``) or on Ray
actors (``ray``). The evaluation engine and the trainer stay in this process either way.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
from pathlib import Path

from tqdm.auto import tqdm

from tidal import config as config_lib
from tidal.distill.teacher import TeacherConfig, TeacherScorer, teacher_run_config
from tidal.envs import ENVS
from tidal.inspector.record import SampleRecorder
from tidal.inspector.samples import FILE_NAME as SAMPLES_FILE
from tidal.inspector.samples import SampleLog
from tidal.integrity.guard import SDCGuard, SilentDataCorruption, rollback
from tidal.models import catalog, lora, prompts, tiny, vlm
from tidal.models.quant import dequantize_state_dict
from tidal.models.tied import load_weights
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardPool
from tidal.rollout import ENGINES
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.evaluate import check_evaluation, greedy_samples
from tidal.rollout.local import LocalEngine
from tidal.rollout.requests import check_prompts_fit
from tidal.rollout.thinking import close_ids
from tidal.stages.warm_start import screened_accuracy, warm_start
from tidal.stages.warm_start import validate as validate_sft
from tidal.system.config import RolloutConfig, RunConfig
from tidal.system.controller import Controller, RunResult
from tidal.system.curriculum import build_task, run_reward
from tidal.system.journal import GroupJournal
from tidal.system.validate import validate_run_config
from tidal.train.checkpoint import TrainingState, latest_checkpoint
from tidal.train.trainer import Trainer
from tidal.utils.metrics import JsonlTracker, MlflowTracker, MultiTracker, TensorBoardTracker, WandbTracker
from tidal.utils.seeding import seed_everything


def run_tokenizer(cfg: RunConfig):
    """The tokenizer of the run's model (``model.path``'s, or the tiny model's), rendering prompts as
    ``model.prompt_format`` says (``models/prompts.py``)."""
    if not cfg.model.path:
        tokenizer = tiny.tokenizer_for(cfg.model)
    elif tiny.is_vision_checkpoint(path := catalog.resolve(cfg.model.path)):  # its processor rides on the tokenizer
        processor = vlm.load_processor(path)
        tokenizer = vlm.attach_processor(processor.tokenizer, processor)
    else:
        tokenizer = tiny.load_tokenizer(path)
    return prompts.attach(tokenizer, cfg.model.prompts())


def check_task_fits(cfg: RunConfig, task, max_train: int = 200_000) -> None:
    """Every eval prompt and the first ``max_train`` training prompts fit the model (its context, its
    vocabulary), checked before the warm start so a bad row is one line, not an out-of-memory crash."""
    tokenizer, context = run_tokenizer(cfg), model_context(cfg)
    if context is None:
        return

    def label(split: str, i: int, p) -> str:
        return f"task {cfg.task.name}, {split} prompt {i} ({p.text[:30]!r}{'...' if len(p.text) > 30 else ''})"

    rows = itertools.chain(((label("eval", i, p), p) for i, p in enumerate(task.eval_prompts())),
                           ((label("train", i, p), p) for i, p in
                            ((i, task.train_prompt(i)) for i in range(min(task.num_train, max_train)))))
    check_prompts_fit(tokenizer, rows, context, cfg.rollout.max_new_tokens)


def model_context(cfg: RunConfig) -> int | None:
    """The model's context in tokens (``max_position_embeddings``), None if its config has none."""
    if not cfg.model.path:
        return cfg.model.max_position_embeddings
    from transformers import AutoConfig

    path = catalog.resolve(cfg.model.path)
    config = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()  # a VLM's decoder's
    return getattr(config, "max_position_embeddings", None)


def check_inputs(cfg: RunConfig):
    """Check what the run reads, before anything is written (or deleted by ``--overwrite``), and return
    the task. A bad input is one ConfigError naming it: the config's values, the task's rows
    (``task.path``), a prompt that does not fit the model, a thinking close its vocabulary cannot write,
    a task the warm start cannot train on, the reward, the rollout engine's name, the environment and the
    harness agent. Checks that need the run directory (``--resume``'s checkpoint) stay in ``prepare``."""
    validate_run_config(cfg)
    task = build_task(cfg)
    check_task_fits(cfg, task)
    close_ids(run_tokenizer(cfg), cfg.rollout.thinking)
    if not cfg.model.path:  # the warm start trains the base on the task's reference responses
        validate_sft(cfg.sft)
        task.sft_example(task.train_prompt(0))
    build_reward(*run_reward(cfg))
    ENGINES.get(cfg.rollout.engine)
    env_factory(cfg)
    if uses_harness(cfg):
        harness_function(cfg)
    return task


def uses_harness(cfg: RunConfig) -> bool:
    """Whether episodes run through the OpenAI endpoint: a harness agent, or a verifiers environment
    (``env.name=verifiers``, ``serve/verifiers_bridge.py``)."""
    return cfg.harness.enabled or cfg.env.name == "verifiers"


def env_factory(cfg: RunConfig):
    """A zero-argument factory of ``cfg.env.name`` environments (one per episode), or None for
    single-turn runs. Built once here so a bad name or parameter fails before any work."""
    if cfg.env.name in (None, "verifiers"):  # verifiers: the environment runs behind the endpoint
        return None
    cls, params = ENVS.get(cfg.env.name), dict(cfg.env.params)
    try:
        cls(**params)
    except (TypeError, ValueError) as e:  # an unknown parameter, or a value the environment rejects
        raise config_lib.ConfigError(f"env.params for {cfg.env.name!r}: {e}") from None
    return lambda: cls(**params)


def sampling_for(cfg: RunConfig, make_env) -> RolloutConfig:
    """``cfg.rollout``, plus the environment's stop strings (the close of a tool call ends a turn), and with
    ``trainer.moe.routing_replay=r3`` on the vLLM engine its routes asked for (``rollout.vllm.return_routes``:
    R3 replays them; the rollout and eval engines share one vLLM, started with the first options it gets)."""
    rollout = cfg.rollout
    if cfg.trainer.moe.routing_replay == "r3" and rollout.engine == "vllm" and not rollout.vllm.return_routes:
        rollout = dataclasses.replace(rollout, vllm=dataclasses.replace(rollout.vllm, return_routes=True))
    if make_env is None:
        return rollout
    extra = [s for s in make_env().stop if s not in rollout.stop]
    return dataclasses.replace(rollout, stop=[*rollout.stop, *extra])


def with_episodes(engine, cfg: RunConfig, tokenizer, make_env):
    """``engine`` itself for single-turn runs; for agent runs, an EpisodeEngine around it; for a
    harness run (``harness.function`` or ``harness.command``), a HarnessEngine: the user's agent behind
    the OpenAI endpoint."""
    if uses_harness(cfg):
        from tidal.serve.engine import HarnessEngine  # the harness extra (fastapi, uvicorn, openai)

        return HarnessEngine(engine, tokenizer, harness_function(cfg), cfg.harness, model_context(cfg) or 1 << 30,
                             cfg.rollout.max_new_tokens)
    if make_env is None:
        return engine
    context = model_context(cfg) or 1 << 30
    return EpisodeEngine(engine, tokenizer, make_env, cfg.env, context, cfg.seed, cfg.rollout.max_new_tokens)


_HARNESS_FUNCTIONS: dict[str, object] = {}


def harness_function(cfg: RunConfig):
    """The agent ``harness.function`` names, imported once per process (a file is executed once), or the
    one that runs ``harness.command`` per episode, or a verifiers environment's episodes."""
    if cfg.env.name == "verifiers":
        return verifiers_episodes(cfg)
    if cfg.harness.command is not None:
        from tidal.serve.process import process_agent

        return process_agent(cfg.harness.command, cfg.harness.episode_timeout_s)
    spec = cfg.harness.function
    if spec not in _HARNESS_FUNCTIONS:
        try:
            from tidal.serve.engine import load_function
        except ImportError as e:
            raise config_lib.ConfigError(f"harness.function needs the harness extra: pip install 'tidal[harness]' "
                                         f"({e})") from None
        _HARNESS_FUNCTIONS[spec] = load_function(spec, roots=[Path(__file__).resolve().parents[2]])
    return _HARNESS_FUNCTIONS[spec]


def verifiers_episodes(cfg: RunConfig):
    """``run_episode`` for ``env.verifiers``'s environment (one per process and config)."""
    from tidal.tasks.verifiers_task import loaded

    key = f"verifiers:{cfg.env.verifiers!r}:{cfg.harness.serve.model_name}"
    if key not in _HARNESS_FUNCTIONS:
        try:
            from tidal.serve.verifiers_bridge import VerifiersEpisodes
        except ImportError as e:
            raise config_lib.ConfigError(f"env.name=verifiers needs the harness and verifiers extras: pip install "
                                         f"'tidal[harness,verifiers]' ({e})") from None
        _HARNESS_FUNCTIONS[key] = VerifiersEpisodes(loaded(cfg.env.verifiers), cfg.harness.serve.model_name).run_episode
    return _HARNESS_FUNCTIONS[key]


def base_model_path(cfg: RunConfig, task, progress: bool = True) -> Path:
    """``model.path`` if given, else the cached warm-started tiny model (trained on first use until its
    held-out accuracy is in ``sft.accuracy_band``, read exactly as RL's evaluations read it)."""
    if cfg.model.path:
        return catalog.resolve(cfg.model.path)
    if cfg.sft.accuracy_band is None:
        return warm_start(cfg.model, task, cfg.task, cfg.sft, progress=progress)
    eval_prompts = task.eval_prompts()[: cfg.num_eval]
    pool = RewardPool(build_reward(*run_reward(cfg)), cfg.reward)

    make_env = env_factory(cfg)

    def evaluate(model, tokenizer) -> float:
        engine = with_episodes(LocalEngine(model, tokenizer, sampling_for(cfg, make_env), cfg.seed, 0), cfg,
                               tokenizer, make_env)

        def successes(some: list) -> int:  # as greedy_accuracy counts them: full reward
            trajs = greedy_samples(engine, tokenizer, some, pool)
            check_evaluation(trajs, "the warm start's held-out check")  # all failed: no band to read, stop now
            return sum(t.reward >= 1.0 for t in trajs)

        try:
            return screened_accuracy(successes, eval_prompts, cfg.sft.accuracy_band[0])
        finally:
            if uses_harness(cfg):
                engine.close()  # its HTTP servers (the model stays: the warm start goes on training it)

    try:
        return warm_start(cfg.model, task, cfg.task, cfg.sft, evaluate=evaluate, progress=progress)
    finally:
        pool.close()


def teacher_path(cfg: RunConfig, progress: bool = True, teacher: TeacherConfig | None = None) -> Path:
    """``distill.teacher``'s directory; for ``quickstart`` (or when asked for with no teacher set), the
    quickstart teacher of this run's task: a wider tiny model warm-started to high accuracy, built once
    and cached under ``sft.cache_dir`` like the warm-start bases (``distill/teacher.py``)."""
    if cfg.distill.teacher not in (None, "quickstart"):
        return Path(cfg.distill.teacher)
    tcfg = teacher_run_config(cfg, teacher or TeacherConfig())
    return base_model_path(tcfg, build_task(tcfg), progress=progress)


def _rollout_model(cfg: RunConfig, trainer: Trainer):
    """The model the rollout engine starts from: the trainer's, or with ``rollout.weight_quant`` a copy
    holding the weights the engine will be sent (quantized, then dequantized), so version 0 is
    sampled the way every later version is. The evaluation engine keeps full precision: it measures
    the policy being trained."""
    quant = cfg.rollout.weight_quant
    if quant == "none":
        return trainer.model
    model = copy.deepcopy(trainer.model)
    load_weights(model, dequantize_state_dict(trainer.state_dict_for_engine(quant)))  # a tied head comes once
    return model


def prepare(cfg: RunConfig, out_dir: str | Path, resume: bool = False, faults=None, task=None) -> Controller:
    """The ready controller. ``task``: what ``check_inputs(cfg)`` returned (None: check the inputs here).
    ``faults``: ``integrity/faults.py`` bit flips to inject (tests, ``tidal bench faults``)."""
    if task is None:
        task = check_inputs(cfg)  # a bad input fails before any work, naming it
    out_dir = Path(out_dir)
    ckpt = latest_checkpoint(out_dir / "checkpoints") if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {out_dir / 'checkpoints'} to continue from "
                                "(start again with --overwrite)")
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    base = base_model_path(cfg, task, progress=cfg.log.progress)
    model, tokenizer = tiny.load(base)
    prompts.attach(tokenizer, cfg.model.prompts())
    # KL is measured against the base: a second copy, or with LoRA the policy with its adapters disabled
    ref_model = tiny.load(base)[0] if cfg.algo.kl_coef > 0 and not cfg.model.lora.enabled else None
    if cfg.model.lora.enabled:  # adapters on the frozen base (models/lora.py)
        model = lora.policy(model, cfg.model.lora, base, cfg.system.device)
    trainer = Trainer(model, cfg.algo, cfg.optim, cfg.trainer, ref_model=ref_model, critic=cfg.critic,
                      device=cfg.system.device, max_steps=cfg.max_steps)

    state = TrainingState(step=0, version=0, next_group=0, extra={})
    if ckpt is not None:
        state = trainer.load_checkpoint(ckpt)  # weights, optimizer, scheduler, RNG, version (and critic)
    # after the checkpoint accepted this config (a resume with another model.lora.rank is refused): the run's
    # config.yaml is never replaced by one it could not run with
    config_lib.save_yaml(cfg, out_dir / "config.yaml")

    make_engine = ENGINES.get(cfg.rollout.engine)
    make_env = env_factory(cfg)
    sampling = sampling_for(cfg, make_env)
    eval_engine = with_episodes(make_engine(trainer.model, tokenizer, sampling, cfg.seed, trainer.version), cfg,
                                tokenizer, make_env)
    reward_fn = build_reward(*run_reward(cfg))
    rollout_model = _rollout_model(cfg, trainer)
    if cfg.system.backend == "ray":
        from tidal.system.ray_backend import start_ray_backend

        engine, reward_pool = start_ray_backend(dataclasses.replace(cfg, rollout=sampling), rollout_model, tokenizer,
                                                trainer.version, reward_fn)
    else:
        engine = make_engine(rollout_model, tokenizer, sampling, cfg.seed, trainer.version)
        reward_pool = RewardPool(reward_fn, cfg.reward)
    engine = with_episodes(engine, cfg, tokenizer, make_env)
    journal = GroupJournal(out_dir / "journal.jsonl", fresh=not resume) if cfg.system.journal else None

    trackers: list = [JsonlTracker(out_dir / "metrics.jsonl", resume_after_step=state.step if resume else None)]
    if cfg.log.tensorboard:
        trackers.append(TensorBoardTracker(out_dir / "tensorboard", resume_after_step=state.step if resume else None))
    if cfg.log.wandb_project:
        trackers.append(WandbTracker(cfg.log.wandb_project, dataclasses.asdict(cfg), out_dir))
    if cfg.log.mlflow_experiment:
        trackers.append(MlflowTracker(cfg.log.mlflow_experiment, dataclasses.asdict(cfg)))
    # after the engines copied the model: the guard's hooks and shadow trainer are the trainer's alone
    sdc = SDCGuard(cfg.sdc, trainer, out_dir, state.step, faults)
    samples = SampleRecorder(SampleLog(out_dir / SAMPLES_FILE, cfg.log.samples.max_mb, state.step if resume else None),
                             cfg.log.samples, tokenizer, cfg.task.name)
    teacher = None
    if cfg.distill.teacher is not None:  # on-policy distillation: the teacher scores in the scorer thread
        teacher = TeacherScorer(teacher_path(cfg, cfg.log.progress), tokenizer, cfg.distill.micro_batch,
                                cfg.rollout.temperature)
    return Controller(cfg, task, engine, eval_engine, reward_pool, trainer, tokenizer, MultiTracker(trackers),
                      out_dir, state, journal=journal, samples=samples, sdc=sdc, teacher=teacher)


def close(controller: Controller) -> None:
    """Release what ``prepare`` started: trackers, the journal, reward workers, rollout workers (and
    the Ray instance the run started, if any). Each is closed even if another fails; the first
    failure is raised at the end."""
    closers = [controller.tracker.close, controller.reward_pool.close]
    if controller.sdc is not None:
        closers.append(controller.sdc.close)
    if controller.journal is not None:
        closers.insert(1, controller.journal.close)
    engine_close = getattr(controller.engine, "close", None)
    if engine_close is not None:
        closers.append(engine_close)
    error = None
    for closer in closers:
        try:
            closer()
        except Exception as e:  # close the rest, then report the first
            error = error or e
    if error is not None:
        raise error


def write_pages(out_dir: str | Path) -> None:
    """The run's ``inspect.html`` (its recorded rollouts and curves) and ``report.html``, which links to it."""
    from tidal.inspector.page import write_inspector
    from tidal.utils.report import write_report

    write_inspector([out_dir])
    write_report(out_dir)


def train(cfg: RunConfig, out_dir: str | Path, resume: bool = False, faults=None, task=None) -> RunResult:
    """Run RL to completion; always closes trackers and the reward pool, then writes the report. If the
    run itself failed (a full disk, Ctrl-C), that error is the one raised, not a later one from closing.
    ``task``: what ``check_inputs(cfg)`` returned, if the caller checked the inputs already.

    Silent data corruption found by the SDC guard (``integrity/guard.py``) rolls the run back to the last
    verified checkpoint (or the base model) and continues, at most ``sdc.max_rollbacks`` times."""
    rollbacks = 0
    while True:
        controller = prepare(cfg, out_dir, resume, faults=faults, task=task)
        task = None  # a rollback builds the run again from its config
        failed, again = True, False
        try:
            result = controller.run()
            failed = False
            return result
        except SilentDataCorruption as e:
            incident = e.incident
            rollbacks += 1
            if rollbacks > cfg.sdc.max_rollbacks:
                raise RuntimeError(f"{e} (rollback {rollbacks} > sdc.max_rollbacks={cfg.sdc.max_rollbacks}: "
                                   "a fault that keeps coming back; stopping)") from e
            again = True
        finally:
            try:
                close(controller)
                if cfg.log.report and not again:
                    write_pages(out_dir)
            except Exception:
                if not failed:
                    raise
        step = rollback(out_dir, incident["step"])
        tqdm.write(f"sdc: rolling back to {f'checkpoint step_{step}' if step is not None else 'the base model'} "
                   f"({incident['message']})", file=sys.stderr)
        resume = step is not None
