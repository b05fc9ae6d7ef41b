"""The HTTP overhead of training an agent harness: episodes per second through the OpenAI endpoint
against the built-in environment, on the same task, model and engine.

Both arms run ``harness_quickstart``'s episodes (a 2-digit product, one calculator call in hermes
format, then the answer) from its warm-started base, sampled at the rollout temperature, as RL's
rollouts are:

- ``builtin``: ``EpisodeEngine`` with the ``calculator`` environment (``call_format=hermes``, the
  result as a ``tool`` message through the chat renderer): tokens in, tokens out, in-process.
- ``harness``: ``HarnessEngine`` running ``examples/calculator_agent.py`` on threads; every turn is an
  ``openai`` client request to the uvicorn/FastAPI server, validated, rendered by the chat template,
  queued to the engine thread and recorded.

- ``verifiers`` (``--set verifiers=true``; off by default, as it needs the verifiers extra and its
  tool server's start): ``HarnessEngine`` running the verifiers
  environment ``examples/verifiers_calculator.py`` through ``env.name=verifiers`` (the same kind of
  task: a 2-digit product with a calculator tool): every turn goes through verifiers' chat program
  (in-process), its interception server, and tidal's endpoint; the tool is verifiers' MCP server; the
  rubric scores each episode. Its tasks are the environment's own and its prompt carries the
  environment's system prompt, which the base (warm-started on the agent's conversations) never saw, so
  it succeeds less and its episodes' lengths differ: read the ratio with the tokens per episode beside it. ``verifiers_over_builtin`` is its episodes/s over the built-in arm's.

The arms alternate (``reps`` times each, after one unmeasured warm-up of each) and each generates the
same ``prompts`` x ``group_size`` episodes. ``http_overhead_ratio`` is the built-in arm's episodes/s
over the harness arm's (1.0: no overhead), from the median of each arm's repetitions. Tokens per
episode and success are reported too, so a ratio is never read off episodes of different lengths.
Wall-clock numbers: label them with the machine's load (2 shared cores make them noisy).

    tidal bench harness [--set prompts=32] [--set reps=3] [--set threads=1] [--set verifiers=true]
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.config import apply_overrides
from tidal.envs import ENVS
from tidal.envs.config import EnvConfig
from tidal.models import tiny
from tidal.recipes import RECIPES
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.local import LocalEngine
from tidal.rollout.requests import group_requests
from tidal.system.run import base_model_path, harness_function, model_context
from tidal.tasks import TASKS

DESCRIPTION = "agent episodes/s through the OpenAI endpoint vs the built-in environment (HTTP overhead ratio)"


@dataclass
class Settings:
    """This benchmark's own knobs; every other ``--set`` key goes to the run config."""

    prompts: int = 32
    """Tasks per repetition (each run ``rollout.group_size`` times): one RL step's episodes."""
    reps: int = 3
    """Measured repetitions per arm (alternating), after one warm-up of each."""
    threads: int = 1
    """torch threads for the engine in both arms (the harness arm's HTTP work needs the other core)."""
    verifiers: bool = False
    """Run the ``verifiers`` arm too (needs the verifiers extra)."""


def builtin_engine(cfg, model, tokenizer) -> EpisodeEngine:
    env_cfg = EnvConfig(name="calculator", params={"call_format": "hermes", "result_open": "", "result_close": ""},
                        renderer="chat", max_turns=3)
    cls = ENVS.get("calculator")
    make_env = lambda: cls(**env_cfg.params)  # noqa: E731
    sampling = dataclasses.replace(cfg.rollout, stop=[*cfg.rollout.stop, *make_env().stop])
    return EpisodeEngine(LocalEngine(model, tokenizer, sampling, cfg.seed, 0), tokenizer, make_env, env_cfg,
                         model_context(cfg), cfg.seed, cfg.rollout.max_new_tokens)


def harness_engine(cfg, model, tokenizer):
    from tidal.serve.engine import HarnessEngine

    return HarnessEngine(LocalEngine(model, tokenizer, cfg.rollout, cfg.seed, 0), tokenizer, harness_function(cfg),
                         cfg.harness, model_context(cfg), cfg.rollout.max_new_tokens)


def verifiers_arm(cfg, model, tokenizer):
    """(engine, task) of the verifiers arm: the example environment through ``env.name=verifiers``."""
    from tidal.envs.verifiers_config import VerifiersConfig
    from tidal.serve.engine import HarnessEngine
    from tidal.serve.verifiers_bridge import VerifiersEpisodes
    from tidal.tasks.verifiers_task import VerifiersTask

    task = VerifiersTask(cfg.task, VerifiersConfig(id="examples/verifiers_calculator.py"))
    engine = HarnessEngine(LocalEngine(model, tokenizer, cfg.rollout, cfg.seed, 0), tokenizer,
                           VerifiersEpisodes(task.tasks, cfg.harness.serve.model_name).run_episode, cfg.harness,
                           model_context(cfg), cfg.rollout.max_new_tokens)
    return engine, task


def measure(engine, tokenizer, prompts, group_size: int) -> dict:
    requests = group_requests(tokenizer, prompts, group_size)
    start = time.perf_counter()
    trajs = engine.generate(requests)
    seconds = time.perf_counter() - start
    ok = [t for t in trajs if not t.infra_failed]
    return {"episodes": len(trajs), "seconds": seconds, "episodes_per_s": len(trajs) / seconds,
            "sampled_tokens_per_episode": statistics.mean(t.num_sampled_tokens for t in ok) if ok else 0.0,
            "tokens_per_episode": statistics.mean(len(t.prompt_ids) + t.num_tokens for t in ok) if ok else 0.0,
            "success": sum(t.reward >= 1.0 for t in trajs) / len(trajs), "failed": len(trajs) - len(ok)}


def run(overrides: list[str], out_dir: Path) -> dict:
    own = {f.name for f in dataclasses.fields(Settings)}
    mine = [o for o in overrides if o.partition("=")[0].strip() in own]
    s = apply_overrides(Settings(), mine)
    cfg = apply_overrides(RECIPES.get("harness_quickstart")(),
                          ["log.progress=false", *(o for o in overrides if o not in mine)])
    task = TASKS.get(cfg.task.name)(cfg.task)
    model, tokenizer = tiny.load(base_model_path(cfg, task, progress=False))  # the warm start, outside the timing
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    engines = {"builtin": builtin_engine(cfg, model, tokenizer), "harness": harness_engine(cfg, model, tokenizer)}
    tasks = {"builtin": task, "harness": task}
    if s.verifiers:
        engines["verifiers"], tasks["verifiers"] = verifiers_arm(cfg, model, tokenizer)
    table = []
    try:
        for rep in range(s.reps + 1):  # rep 0 warms both arms up (server start, first allocations)
            for arm, engine in engines.items():
                prompts = [tasks[arm].train_prompt(rep * s.prompts + i) for i in range(s.prompts)]
                row = {"arm": arm, "rep": rep, **measure(engine, tokenizer, prompts, cfg.rollout.group_size)}
                if rep > 0:
                    table.append(row)
    finally:
        for arm in ("harness", "verifiers"):
            if arm in engines:
                engines[arm].close()
        torch.set_num_threads(threads)
    rate = {arm: statistics.median(r["episodes_per_s"] for r in table if r["arm"] == arm) for arm in engines}
    extra = {}
    if s.verifiers:
        extra = {"verifiers_over_builtin": rate["verifiers"] / rate["builtin"],
                 "verifiers_episodes_per_s": rate["verifiers"]}
    return {"benchmark": "harness", "description": DESCRIPTION, "table": table, **extra,
            "http_overhead_ratio": rate["builtin"] / rate["harness"],
            "builtin_episodes_per_s": rate["builtin"], "harness_episodes_per_s": rate["harness"],
            "episodes_per_rep": s.prompts * cfg.rollout.group_size, "reps": s.reps, "threads": s.threads,
            "overrides": overrides}
