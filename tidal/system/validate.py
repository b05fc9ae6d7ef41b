"""Check a run config before any work: a value the run cannot use is one ``ConfigError`` naming the key.

``--set`` and a loaded ``config.yaml`` write fields directly (dataclass ``__init__`` checks never run),
so a group size of 0, 1 or -1, an empty ``optim.betas`` or a negative temperature used to surface
minutes later as a ZeroDivisionError, an IndexError, a run that trained nothing and exited 0, or a
generator that could never admit a group and spun forever. Every rule here is a plain range check
on one key (or two keys that must agree); checks that need the task or the tokenizer (prompt length
against the model's context, characters outside the vocabulary) run in ``run.check_inputs``. The rule
primitives are ``utils/rules.py``'s and the ``optim.*`` rules ``optim/rules.py``'s, shared with the stages
(``tidal sft|dpo|rm``), so a value refused here is refused there in the same words.
"""

from __future__ import annotations

import dataclasses

from tidal.algo import VALUE_ADVANTAGES
from tidal.config import ConfigError
from tidal.integrity.guard import SDCConfig
from tidal.models.lora import check_device as check_lora_device
from tidal.models.lora import check_run as check_lora
from tidal.optim.rules import OPTIM_RULES, check_betas
from tidal.rollout.decode_attention import DECODE_ATTENTION
from tidal.rollout.graphs import GRAPH_WIDTHS
from tidal.rollout.speculative import check_config as check_speculative
from tidal.system.config import RunConfig
from tidal.train.config import validate as validate_trainer
from tidal.utils.device import resolve_device, resolve_dtype
from tidal.utils.rules import COUNT, NONNEG, Rule, renamed
from tidal.utils.rules import at_least as _at_least
from tidal.utils.rules import check as _check
from tidal.utils.rules import fraction as _fraction
from tidal.utils.rules import number as _number
from tidal.utils.rules import optional as _optional
from tidal.utils.rules import positive as _positive
from tidal.utils.rules import unit as _unit

RULES: list[Rule] = [
    ("max_steps", COUNT, "an integer >= 1"),
    ("max_time_s", _optional(_positive), "> 0 seconds (or null)"),
    ("target_accuracy", _optional(_unit), "in [0, 1] (or null)"),
    ("max_failed_steps", COUNT, "an integer >= 1 (steps in a row whose every group failed before the run stops)"),
    ("eval_every", COUNT, "an integer >= 1"),
    ("num_eval", _optional(COUNT), "an integer >= 1 (or null: all held-out prompts)"),
    ("checkpoint_every", COUNT, "an integer >= 1"),
    ("keep_checkpoints", NONNEG, ">= 0 (0 keeps every checkpoint)"),
    ("task.num_eval", COUNT, "an integer >= 1"),
    ("rollout.temperature", _positive, "> 0 (RL samples; the trainer divides logits by it)"),
    ("rollout.top_p", lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    ("rollout.max_new_tokens", COUNT, "an integer >= 1"),
    ("rollout.group_size", _at_least(2), "an integer >= 2 (a group of one sample has no advantage to learn "
     "from)"),
    ("rollout.prompts_per_step", COUNT, "an integer >= 1"),
    ("rollout.max_staleness", NONNEG, "an integer >= 0"),
    ("rollout.max_draws_per_step", COUNT, "an integer >= 1"),
    ("rollout.early_stop_run", _optional(COUNT), "an integer >= 1 (or null)"),
    ("rollout.early_stop_prob", lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    ("reward.num_workers", NONNEG, "an integer >= 0 (0 scores inline)"),
    ("reward.timeout_s", _positive, "> 0 seconds"),
    ("log.samples.every", NONNEG, "an integer >= 0 (0 records no training groups)"),
    ("log.samples.groups", NONNEG, "an integer >= 0"),
    ("log.samples.eval_prompts", NONNEG, "an integer >= 0"),
    ("log.samples.max_mb", _positive, "> 0 megabytes"),
    ("algo.adv_eps", NONNEG, ">= 0"),
    ("algo.eps_low", _optional(NONNEG), ">= 0 (or null)"),
    ("algo.eps_high", _optional(NONNEG), ">= 0 (or null)"),
    ("algo.dual_clip", _optional(lambda v: _number(v) and v > 1.0), "> 1 (or null)"),
    ("algo.eps_low_is", NONNEG, ">= 0"),
    ("algo.eps_high_is", NONNEG, ">= 0"),
    ("algo.sapo_tau_pos", _positive, "> 0 (a gate temperature)"),
    ("algo.sapo_tau_neg", _positive, "> 0 (a gate temperature)"),
    ("algo.clip_cov_frac", lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    ("algo.kl_cov_frac", lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    ("algo.kl_cov_coef", NONNEG, ">= 0"),
    ("algo.entropy_coef", NONNEG, ">= 0 (an entropy bonus)"),
    ("algo.top_entropy_frac", lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1] (1: every token)"),
    ("algo.behav_weight_cap", _optional(_positive), "> 0 (or null)"),
    ("algo.max_gen_len", _optional(COUNT), "an integer >= 1 (or null)"),
    ("algo.kl_coef", NONNEG, ">= 0"),
    ("algo.tis_cap", _positive, "> 0"),
    ("algo.mis_low", NONNEG, ">= 0"),
    ("algo.ess_base_ratio", _positive, "> 0"),
    ("algo.passk_k", COUNT, "an integer >= 1"),
    ("algo.tis_floor", _unit, "in [0, 1]"),
    ("algo.rs_threshold", _positive, "> 0"),
    ("algo.is_veto_threshold", _optional(lambda v: _number(v) and 0.0 < v < 1.0), "in (0, 1) (or null)"),
    ("algo.offpolicy_mask_delta", _optional(NONNEG), ">= 0 (or null)"),
    ("algo.gamma", _unit, "in [0, 1]"),
    ("algo.lam", _unit, "in [0, 1]"),
    ("algo.value_clip", _optional(_positive), "> 0 (or null: no value clipping)"),
    ("algo.vf_coef", _positive, "> 0"),
    *OPTIM_RULES,  # shared with the stages (optim/rules.py)
    ("trainer.num_minibatches", COUNT, "an integer >= 1"),
    ("trainer.temperature", _positive, "> 0"),
    ("trainer.micro_batch_tokens", _optional(COUNT), "an integer >= 1 (or null)"),
    ("trainer.pack_tokens", COUNT, "an integer >= 1"),
    ("trainer.logprob_chunk_size", COUNT, "an integer >= 1"),
    ("system.num_threads", COUNT, "an integer >= 1"),
    ("system.async_threads", COUNT, "an integer >= 1"),
    ("system.rollout_workers", COUNT, "an integer >= 1"),
    ("system.rollout_worker_cpus", NONNEG, ">= 0"),
    ("system.rollout_worker_gpus", NONNEG, ">= 0"),
    ("system.rollout_worker_threads", COUNT, "an integer >= 1"),
    ("system.rollout_worker_restarts", NONNEG, "an integer >= 0"),
    ("system.reward_worker_cpus", NONNEG, ">= 0"),
    ("env.max_turns", COUNT, "an integer >= 1"),
    ("env.renderer", lambda v: v in ("plain", "chat"), "plain or chat"),
    ("env.max_episode_tokens", _optional(COUNT), "an integer >= 1 (or null: the model's context)"),
    ("env.step_timeout_s", _positive, "> 0 seconds"),
    ("env.max_concurrent_episodes", _optional(COUNT), "an integer >= 1 (or null)"),
    ("env.num_workers", COUNT, "an integer >= 1"),
    ("env.latency_median_s", NONNEG, ">= 0 seconds (0: no simulated latency)"),
    ("env.latency_sigma", NONNEG, ">= 0"),
    ("curriculum.difficulty.floor", lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1] (0 would never revisit a "
     "solved or hopeless prompt)"),
    ("curriculum.difficulty.decay", _unit, "in [0, 1]"),
    ("curriculum.difficulty.prior", _unit, "in [0, 1]"),
    ("curriculum.difficulty.pass_threshold", _number, "a number"),
    ("rollout.length_growth.window", COUNT, "an integer >= 1"),
    ("rollout.length_growth.quantile", lambda v: _number(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    ("rollout.length_growth.within", _fraction, "in [0, 1)"),
    ("rollout.thinking.eval_budget", _optional(NONNEG), "an integer >= 0 (or null: unlimited)"),
    ("reward.length_bias.patience", COUNT, "an integer >= 1"),
    ("reward.length_bias.factor", _unit, "in [0, 1]"),
    ("harness.max_concurrent_episodes", COUNT, "an integer >= 1"),
    ("harness.episode_timeout_s", _positive, "> 0 seconds"),
    ("harness.serve.max_request_bytes", COUNT, "an integer >= 1"),
    ("harness.serve.max_episodes", _optional(COUNT), "an integer >= 1 (or null)"),
    ("harness.serve.episode_timeout_s", _optional(_positive), "> 0 seconds (or null)"),
    ("harness.serve.max_closed_ids", NONNEG, "an integer >= 0"),
    ("harness.serve.keep_alive_s", _positive, "> 0 seconds"),
]
CRITIC_RULES: list[Rule] = renamed(OPTIM_RULES, "optim.", "critic.optim.")  # algo.advantage=gae's optimizer
MODEL_RULES: list[Rule] = [  # the tiny model built when model.path is not set
    (f"model.{name}", COUNT, "an integer >= 1")
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_position_embeddings")
]


def _check_corrections(cfg: RunConfig) -> None:
    """Advantage and correction knobs that only make sense together (issue 17's estimators and rejections)."""
    a = cfg.algo
    if a.advantage == "pass_at_k" and a.passk_k > cfg.rollout.group_size:
        raise ConfigError(f"algo.passk_k={a.passk_k} must be <= rollout.group_size={cfg.rollout.group_size}: pass@k "
                          "scores the k-subsets of a group")
    if a.tis_floor > a.tis_cap:
        raise ConfigError(f"algo.tis_floor={a.tis_floor} must be <= algo.tis_cap={a.tis_cap}")
    if a.rs_stat == "seq_max_ratio" and a.rs_threshold <= 1:
        raise ConfigError(f"algo.rs_threshold={a.rs_threshold} must be > 1 for algo.rs_stat=seq_max_ratio (a bound "
                          "on the ratio pi_old / pi_behav, e.g. 2.0)")
    rejections = {"rs_stat": a.rs_stat, "is_veto_threshold": a.is_veto_threshold,
                  "offpolicy_mask_delta": a.offpolicy_mask_delta, "is_batch_norm": a.is_batch_norm or None}
    if a.correction == "none":
        for key, value in rejections.items():
            if value is not None:
                raise ConfigError(f"algo.{key}={value} has no effect with algo.correction=none (the trainer applies "
                                  "no correction): use algo.correction=reject, tis or mis")
    if a.correction == "reject" and all(v is None for k, v in rejections.items() if k != "is_batch_norm"):
        raise ConfigError("algo.correction=reject needs a criterion: set algo.rs_stat, algo.is_veto_threshold or "
                          "algo.offpolicy_mask_delta")


def _check_curriculum(cfg: RunConfig) -> None:
    """Length growth, thinking budgets: lists whose entries must be counts, and what they exclude."""
    r = cfg.rollout
    stages = r.length_growth.stages
    if stages:
        if not all(COUNT(s) for s in stages) or any(b <= a for a, b in zip(stages, stages[1:])):
            raise ConfigError(f"rollout.length_growth.stages must be increasing integers >= 1, got {stages!r}")
        if r.length_schedule:
            raise ConfigError("rollout.length_growth.stages and rollout.length_schedule both set the length budget: "
                              "use one (length_growth grows by the length indicator, length_schedule by step)")
    t = r.thinking
    for key, budgets in (("budgets", t.budgets), ("eval_budgets", t.eval_budgets)):
        if not all(NONNEG(b) for b in budgets):
            raise ConfigError(f"rollout.thinking.{key} must be integers >= 0, got {budgets!r}")
    if t.enabled and r.engine != "local":
        raise ConfigError(f"rollout.thinking needs rollout.engine=local (got {r.engine!r}): only the local engine "
                          "forces the close of the thinking section (rollout/thinking.py says what vLLM would need)")


def _check_checkpoint_snapshot(cfg: RunConfig) -> None:
    """``checkpoint_snapshot=deferred`` copies the state after ``save`` returns, which is right only while the
    state changes in optimizer steps alone (``train/async_checkpoint.py``)."""
    if cfg.checkpoint_snapshot not in ("now", "deferred"):
        raise ConfigError(f"checkpoint_snapshot must be now or deferred, got {cfg.checkpoint_snapshot!r}")
    if cfg.checkpoint_snapshot != "deferred":
        return
    if not cfg.async_checkpoint:
        raise ConfigError("checkpoint_snapshot=deferred needs async_checkpoint=true (a synchronous save copies "
                          "nothing to defer)")
    import os

    if cfg.trainer.data_parallel == "elastic" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"checkpoint_snapshot=deferred with trainer.data_parallel={cfg.trainer.data_parallel} "
                          "across processes: a sharded state is gathered (a copy already), and DiLoCo's outer step "
                          "and an elastic replica's heal change parameters outside an optimizer step; use "
                          "checkpoint_snapshot=now")


def _check_vision(cfg: RunConfig) -> None:
    """What a vision-language run (``model.vision``) cannot do yet, refused before any work (docs/vlm.md)."""
    if not cfg.model.vision:
        return
    if cfg.model.path:
        raise ConfigError("model.vision builds the tiny vision-language model; a Qwen2-VL model.path loads as one "
                          "by itself: set one or the other")
    if cfg.model.num_experts:
        raise ConfigError("model.vision with model.num_experts: the tiny vision-language model is dense")
    settings = {"algo.advantage": (cfg.algo.advantage, cfg.algo.advantage in VALUE_ADVANTAGES),
                "trainer.data_parallel": (cfg.trainer.data_parallel, cfg.trainer.data_parallel == "elastic"),
                "system.backend": (cfg.system.backend, cfg.system.backend == "ray"),
                "rollout.speculative.method": (cfg.rollout.speculative.method,
                                               cfg.rollout.speculative.method == "draft_model")}
    for key, (value, refused) in settings.items():
        if refused:
            raise ConfigError(f"{key}={value} with model.vision: not supported for vision-language models yet (the "
                              "critic and a draft model read tokens only; elastic replicas and Ray workers are "
                              "untested with images; docs/vlm.md)")


def validate_run_config(cfg: RunConfig) -> None:
    """Raise a ConfigError naming the first key whose value the run cannot use (see the module docstring)."""
    _check(cfg, RULES)
    if not cfg.model.path:
        _check(cfg, MODEL_RULES)
        m = cfg.model
        if m.hidden_size % m.num_heads or m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be a multiple of model.num_heads "
                              f"({m.num_heads}), and num_heads of model.num_kv_heads ({m.num_kv_heads})")
    _check_vision(cfg)
    r = cfg.rollout
    if r.max_batch_size < r.group_size:
        raise ConfigError(f"rollout.max_batch_size={r.max_batch_size} must be >= rollout.group_size="
                          f"{r.group_size}: a group's samples are decoded together")
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 and NONNEG(p[0]) and COUNT(p[1])
               for p in r.length_schedule):
        raise ConfigError(f"rollout.length_schedule must be [[from_step >= 0, max_new_tokens >= 1], ...], "
                          f"got {r.length_schedule!r}")
    _check_curriculum(cfg)
    _check_checkpoint_snapshot(cfg)
    check_betas(cfg.optim.betas, "optim.betas")
    if not (_number(cfg.algo.clip_cov_high) and _number(cfg.algo.clip_cov_low)
            and cfg.algo.clip_cov_high > cfg.algo.clip_cov_low):
        raise ConfigError(f"algo.clip_cov_high={cfg.algo.clip_cov_high} must be > algo.clip_cov_low="
                          f"{cfg.algo.clip_cov_low}")
    if cfg.algo.mis_high <= cfg.algo.mis_low:
        raise ConfigError(f"algo.mis_high={cfg.algo.mis_high} must be > algo.mis_low={cfg.algo.mis_low}")
    _check_corrections(cfg)
    if cfg.trainer.temperature != r.temperature:
        raise ConfigError(f"trainer.temperature={cfg.trainer.temperature} must equal rollout.temperature="
                          f"{r.temperature}: the importance ratio compares the same distribution")
    _check_speculative(cfg)
    if r.weight_quant != "none" and r.engine != "local":
        raise ConfigError(f"rollout.weight_quant={r.weight_quant} needs rollout.engine=local (got {r.engine!r}): "
                          "vLLM loads block-FP8 weights from a checkpoint written by `tidal quantize` "
                          "(docs/quantization.md)")
    if cfg.env.name is not None and cfg.env.name != "verifiers":
        from tidal.envs import ENVS

        if cfg.env.name not in ENVS:
            raise ConfigError(f"env.name={cfg.env.name!r} is not a registered environment: "
                              f"{', '.join(ENVS.names())}, or verifiers")
    if cfg.env.name == "verifiers" and cfg.harness.reward != "agent":
        raise ConfigError(f"harness.reward={cfg.harness.reward!r} with env.name=verifiers: the environment's rubric "
                          "scores its episodes; leave harness.reward=agent")
    _check_harness(cfg)
    validate_trainer(cfg.trainer)
    _check_device(cfg)
    try:
        cfg.sdc.__post_init__()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_distill(cfg)
    _check_elastic(cfg)
    _check_weights(cfg)
    check_lora(cfg)  # model.lora's keys and the combinations it cannot serve yet
    check_lora_device(cfg.model.lora, resolve_device(cfg.system.device))
    if cfg.algo.advantage in VALUE_ADVANTAGES:
        _check(cfg, CRITIC_RULES)
        check_betas(cfg.critic.optim.betas, "critic.optim.betas")


def _check_speculative(cfg: RunConfig) -> None:
    """``rollout.speculative`` before any work (the engine checks it again when it is built, after the warm
    start): its keys, and a draft model that is a model directory here, not a name the loader reports in its
    own words without the key."""
    spec = cfg.rollout.speculative
    check_speculative(spec)
    if spec.method == "draft_model":
        from pathlib import Path

        if not (Path(spec.draft_model) / "config.json").is_file():
            raise ConfigError(f"rollout.speculative.draft_model={spec.draft_model!r}: no Hugging Face model directory "
                              "there (config.json); a draft model is a local directory with the policy's tokenizer")


def _check_device(cfg: RunConfig) -> None:
    """``system.device`` exists on this machine; the precisions are known names (before the warm start)."""
    device = resolve_device(cfg.system.device)
    resolve_dtype(cfg.trainer.precision, device, "trainer.precision")
    resolve_dtype(cfg.rollout.dtype, device, "rollout.dtype")
    if cfg.rollout.cuda_graphs not in ("auto", "on", "off"):
        raise ConfigError(f"rollout.cuda_graphs must be auto, on or off, got {cfg.rollout.cuda_graphs!r}")
    if cfg.rollout.graph_widths not in GRAPH_WIDTHS:
        raise ConfigError(f"rollout.graph_widths must be {' or '.join(GRAPH_WIDTHS)}, got {cfg.rollout.graph_widths!r}")
    if cfg.rollout.decode_attention not in DECODE_ATTENTION:  # the engine checks it too, after the warm start
        raise ConfigError(f"rollout.decode_attention={cfg.rollout.decode_attention!r}: one of "
                          f"{', '.join(DECODE_ATTENTION)}")
    if device.type != "cpu" and cfg.trainer.data_parallel == "elastic":
        raise ConfigError(f"system.device={cfg.system.device} with trainer.data_parallel=elastic: elastic replicas "
                          "train on the CPU (gloo) for now; use system.device=cpu")
    if device.type != "cpu" and cfg.system.backend == "ray":
        raise ConfigError(f"system.device={cfg.system.device} with system.backend=ray: Ray's rollout workers run "
                          "the local engine on CPU; use system.device=cpu with Ray, or the local backend on a GPU")


def _check_elastic(cfg: RunConfig) -> None:
    """``trainer.data_parallel=elastic`` against what only one process can do (docs/faults.md)."""
    if cfg.trainer.data_parallel != "elastic":
        return
    if cfg.algo.advantage in VALUE_ADVANTAGES:
        raise ConfigError(f"algo.advantage={cfg.algo.advantage} does not support trainer.data_parallel=elastic yet: "
                          "the critic is not synced across replicas; run it in one process")
    changed = [f"sdc.{f.name}={getattr(cfg.sdc, f.name)!r}" for f in dataclasses.fields(SDCConfig)
               if getattr(cfg.sdc, f.name) != getattr(SDCConfig(), f.name)]
    if changed:
        raise ConfigError(f"{', '.join(changed)}: SDC recording and replay run a 1-process trainer, not "
                          "trainer.data_parallel=elastic, whose replicas compare their states every step instead "
                          "(trainer.elastic.check_replicas); leave sdc.* at its defaults")


def _check_weights(cfg: RunConfig) -> None:
    """``trainer.weights=bf16_master`` against what reads the model's parameters and gradients directly
    (``train/precision.py``): there the exact weights and the gradients are the float32 masters."""
    if cfg.trainer.weights != "bf16_master":
        return
    if cfg.trainer.data_parallel == "elastic":
        raise ConfigError("trainer.weights=bf16_master with trainer.data_parallel=elastic: the replicas sum and "
                          "compare the model's parameters and gradients, not the float32 masters; use "
                          "trainer.weights=fp32")
    if cfg.sdc.record:
        raise ConfigError("trainer.weights=bf16_master with sdc.record=true: SDC fingerprints the model's gradients "
                          "and replays steps from its parameters, and under bf16_master those are the float32 "
                          "masters; set sdc.record=false")


def _check_harness(cfg: RunConfig) -> None:
    """``harness.*`` against the keys it must agree with (docs/harness.md)."""
    h = cfg.harness
    if h.reward not in ("agent", "task"):
        raise ConfigError(f"harness.reward={h.reward!r}: use 'agent' (run_episode returns the reward) or 'task' "
                          f"(the task's reward scores the final answer)")
    if not h.enabled:
        return
    if h.function is not None and h.command is not None:
        raise ConfigError("harness.function and harness.command are both set: the agent is one or the other")
    if h.command is not None and (not isinstance(h.command, str) or not h.command.strip()):
        raise ConfigError(f"harness.command must be a command line such as 'python my_agent.py', got {h.command!r}")
    if h.function is not None and (not isinstance(h.function, str) or ":" not in h.function):
        raise ConfigError(f"harness.function must be 'path/to/file.py:function' or 'package.module:function', "
                          f"got {h.function!r}")
    if cfg.env.name is not None:
        raise ConfigError(f"harness.{'function' if h.function is not None else 'command'} and env.name="
                          f"{cfg.env.name!r} are both set: the agent is the episode's "
                          "environment; set env.name=null")
    if h.max_concurrent_episodes < cfg.rollout.group_size:
        raise ConfigError(f"harness.max_concurrent_episodes={h.max_concurrent_episodes} must be >= "
                          f"rollout.group_size={cfg.rollout.group_size}: a group's episodes are admitted together")
    if h.serve.max_episodes is not None and h.serve.max_episodes < h.max_concurrent_episodes:
        raise ConfigError(f"harness.serve.max_episodes={h.serve.max_episodes} must be >= "
                          f"harness.max_concurrent_episodes={h.max_concurrent_episodes} (or null), or agents get 429")


def _check_distill(cfg: RunConfig) -> None:
    """On-policy distillation's keys: a teacher that exists, and settings that keep its signal."""
    d = cfg.distill
    if d.teacher is None:
        return
    from pathlib import Path

    if d.teacher != "quickstart" and not (Path(d.teacher) / "config.json").exists():
        raise ConfigError(f"distill.teacher={d.teacher!r}: no Hugging Face model directory there (config.json); "
                          "use a model directory, or `quickstart` to build the quickstart teacher")
    if not (isinstance(d.micro_batch, int) and d.micro_batch >= 1):
        raise ConfigError(f"distill.micro_batch must be >= 1, got {d.micro_batch}")
    if cfg.algo.guidance != "none":
        raise ConfigError(f"algo.guidance={cfg.algo.guidance} with distill.teacher: a demonstration has no teacher "
                          "scores to learn from; set algo.guidance=none (the on_policy_distill recipe does)")
    if cfg.algo.advantage in VALUE_ADVANTAGES:
        raise ConfigError(f"distill.teacher with algo.advantage={cfg.algo.advantage}: on-policy distillation gives "
                          "per-token advantages itself; use a group estimator (grpo)")
    if cfg.algo.skip_zero_adv_groups:
        raise ConfigError("distill.teacher needs algo.skip_zero_adv_groups=false: a group whose rewards are all equal "
                          "still carries the teacher's per-token signal")
