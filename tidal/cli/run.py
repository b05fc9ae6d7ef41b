"""Training runs: ``tidal recipes``, ``tidal train``, ``tidal eval``."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tidal.cli.common import one_line_errors, recipe_config, train_config
from tidal.config import ConfigError, apply_overrides


def cmd_recipes(args) -> int:
    from tidal.recipes import RECIPES

    if args.action is None:
        for name in RECIPES:
            doc = (RECIPES.get(name).__doc__ or "").strip().splitlines()[0]
            print(f"{name:18s} {doc}")
        return 0
    if args.action != "show" or not args.name:
        print("usage: tidal recipes [show NAME]", file=sys.stderr)
        return 2
    print(show_recipe(args.name), end="")
    return 0


def show_recipe(name: str) -> str:
    """The resolved config, one ``key: value`` per line, each key the recipe sets annotated with its source."""
    import dataclasses

    import yaml

    from tidal.recipes import RECIPES
    from tidal.recipes.papers import NOTES, SOURCES

    cfg = RECIPES.get(name)()
    sources = SOURCES.get(name, {})

    def flat(node, prefix=""):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                yield from flat(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value

    doc = (RECIPES.get(name).__doc__ or "").strip()
    lines = [f"# {name}: {doc}"] + [f"# {note}" for note in NOTES.get(name, [])]
    for key, value in flat(cfg):
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        line = f"{key}: {text}"
        lines.append(f"{line:48s} # {sources[key]}" if key in sources else line)
    return "\n".join(lines) + "\n"


def _default_out(recipe: str) -> str:
    path = Path(recipe)
    name = path.stem if path.suffix in (".yaml", ".yml") else recipe
    return f"runs/{name}"


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as the interrupt every part of a run already handles (checkpoint, clean stop)."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def cmd_train(args) -> int:
    """Train a recipe (or a saved config.yaml); bad input is one line, Ctrl-C says how to resume (exit 130)."""
    from tidal.api import EngineFailed
    from tidal.system.run import check_inputs, train
    from tidal.system.run_dir import interrupted_message, open_out_dir
    from tidal.utils import outputs

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: FSDP or DiLoCo (elastic is refused there)
        from tidal.launch.torchrun import train

    out = Path(args.out or _default_out(args.recipe))
    # A scheduler's SIGTERM (preemption, `kill`, the end of a job's time) stops the run as Ctrl-C does:
    # checkpoint, one line saying how to resume; exit 143 (128 + SIGTERM), as if the signal had ended it.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if Path(args.recipe).is_file() and not args.resume:  # with --resume it is the run's own config.yaml
            from tidal.data.io import refuse_overwrite

            refuse_overwrite(out / "config.yaml", {"the config": args.recipe})  # the run writes its config there
        if args.resume:  # before its config.yaml is read as a train config
            from tidal.cli.stages import saved_kind

            outputs.check_kind(out, "train", guess=saved_kind)
        saved = out / "config.yaml" if args.resume and (out / "config.yaml").is_file() else None
        cfg = train_config(args.recipe, args.set, saved)
        task = check_inputs(cfg)  # every input the run reads, before --overwrite deletes anything (every rank)
        if cfg.trainer.data_parallel == "elastic" and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            from tidal.launch.elastic import train  # this process leads replica processes it starts
        run_dir = None
        if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 owns the directory
            run_dir = open_out_dir(out, args.resume, args.overwrite, outputs.config_inputs(cfg),
                                   lambda line: print(line, file=sys.stderr))
        try:
            result = train(cfg, out, resume=args.resume, task=task)
        finally:
            if run_dir is not None:
                run_dir.close()  # what the run wrote goes into its record; the lock is released
    except KeyboardInterrupt as e:
        print(interrupted_message(out, args.recipe), file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except EngineFailed as e:  # checkpointed like Ctrl-C: one line naming the failure and how to go on
        stopped = interrupted_message(out, args.recipe).replace("interrupted", "stopped", 1)
        print("error: " + " ".join(str(e).split()) + "; " + stopped, file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # a bad value met late, an output that could not be written: one line
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    if result is None:  # a data-parallel rank other than 0: rank 0 reports
        return 0
    summary = {
        "out": str(out),
        "steps": result.steps,
        "base_accuracy": result.base_accuracy,
        "final_accuracy": result.final_accuracy,
        "best_accuracy": result.best_accuracy,
        "stopped_because": result.stopped_because,
        "report": str(out / "report.html"),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _quant_method(model_dir: Path) -> str:
    """``config.json``'s ``quantization_config.quant_method`` (what loading the model needs), or "?"."""
    try:
        return json.loads((model_dir / "config.json").read_text())["quantization_config"]["quant_method"]
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


@one_line_errors
def cmd_eval(args) -> int:
    """Greedy held-out accuracy of a run's latest checkpoint or of a model directory."""
    from tidal.config import apply_mapping
    from tidal.models import prompts, tiny
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardPool
    from tidal.rollout import ENGINES
    from tidal.rollout.evaluate import accuracy_by_budget, greedy_accuracy
    from tidal.rollout.thinking import close_ids
    from tidal.system.curriculum import build_task, run_reward
    from tidal.system.validate import validate_run_config
    from tidal.train.checkpoint import latest_checkpoint
    from tidal.utils.yaml_file import read_yaml

    target = Path(args.path)
    cfg = recipe_config(args.recipe, [])
    if (target / "config.yaml").exists():
        apply_mapping(cfg, read_yaml(target / "config.yaml", mapping=True))  # broken: one line naming file:line
    apply_overrides(cfg, args.set)
    model_dir = target
    if (target / "checkpoints").exists():
        model_dir = latest_checkpoint(target / "checkpoints") or target
    try:
        model, tokenizer = tiny.load(model_dir)
    except ImportError as e:  # transformers' quantizers (compressed-tensors, fp8) need optional packages
        raise ConfigError(f"{model_dir}: loading this quantized checkpoint (quant_method {_quant_method(model_dir)}) "
                          f"needs packages that are not installed; pip install 'tidal[quant]' ({e})") from None
    validate_run_config(cfg)
    prompts.attach(tokenizer, cfg.model.prompts())
    task = build_task(cfg)
    try:
        engine = ENGINES.get(cfg.rollout.engine)(model, tokenizer, cfg.rollout, cfg.seed, 0)
    except ImportError as e:  # an optional engine (vllm): its message says what to install
        raise ConfigError(f"rollout.engine={cfg.rollout.engine}: {e}") from None
    pool = RewardPool(build_reward(*run_reward(cfg)), cfg.reward)
    eval_prompts = task.eval_prompts()[: cfg.num_eval]
    thinking, close = cfg.rollout.thinking, close_ids(tokenizer, cfg.rollout.thinking)
    try:
        budget = thinking.eval_budget
        result = greedy_accuracy(engine, tokenizer, eval_prompts, pool, None if budget is None else (budget, close))
        if thinking.eval_budgets:  # the accuracy-vs-thinking-budget curve (budget forcing, rollout/thinking.py)
            result["accuracy_by_thinking_budget"] = accuracy_by_budget(engine, tokenizer, eval_prompts, pool,
                                                                       thinking.eval_budgets, close)
    finally:
        pool.close()
    print(json.dumps({"model": str(model_dir), "task": task.name if cfg.curriculum.mixture else cfg.task.name,
                      **result}, indent=2))
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands: their options and handlers."""
    sp = sub.add_parser("recipes", help="list the named recipes; `recipes show NAME` prints one with its sources")
    sp.add_argument("action", nargs="?", choices=["show"])
    sp.add_argument("name", nargs="?")
    sp.set_defaults(fn=cmd_recipes)

    sp = sub.add_parser("train", help="train a recipe")
    sp.add_argument("recipe", help="a recipe name (`tidal recipes`) or a YAML config, e.g. a run's config.yaml")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    sp.add_argument("--out", help="run directory (default runs/RECIPE, or runs/NAME for NAME.yaml)")
    sp.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    sp.add_argument("--overwrite", action="store_true", help="delete the previous run's files in --out first")
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("eval", help="greedy held-out accuracy of a run or model directory")
    sp.add_argument("path")
    sp.add_argument("--recipe", default="quickstart", help="recipe whose task/reward to use (default quickstart)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.set_defaults(fn=cmd_eval)
