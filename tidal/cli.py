"""The ``tidal`` command line: train, eval, recipes, bench, report.

    tidal recipes
    tidal train quickstart [--set key=value ...] [--out DIR] [--resume]
    tidal eval DIR_OR_MODEL [--recipe NAME] [--set ...]
    tidal bench async [--set ...]
    tidal report DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tidal.config import ConfigError, apply_overrides, load_yaml_into
from tidal.registry import UnknownNameError


def _recipe_config(name: str, overrides: list[str]):
    from tidal.recipes import RECIPES

    cfg = RECIPES.get(name)()
    return apply_overrides(cfg, overrides)


def cmd_recipes(args) -> int:
    from tidal.recipes import RECIPES

    for name in RECIPES:
        doc = (RECIPES.get(name).__doc__ or "").strip().splitlines()[0]
        print(f"{name:18s} {doc}")
    return 0


def cmd_train(args) -> int:
    from tidal.system.run import train

    out = Path(args.out or f"runs/{args.recipe}")
    if args.resume and (out / "config.yaml").exists():
        from tidal.recipes import RECIPES

        cfg = apply_overrides(load_yaml_into(RECIPES.get(args.recipe)(), out / "config.yaml"), args.set)
    else:
        if not args.resume and (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
            print(f"error: {out} already holds a run; pass --resume to continue it or choose another --out",
                  file=sys.stderr)
            return 2
        cfg = _recipe_config(args.recipe, args.set)
    result = train(cfg, out, resume=args.resume)
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


def cmd_eval(args) -> int:
    """Greedy held-out accuracy of a run's latest checkpoint or of a model directory."""
    from tidal.models import tiny
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardPool
    from tidal.rollout import ENGINES
    from tidal.system.evaluate import greedy_accuracy
    from tidal.tasks import TASKS
    from tidal.train.checkpoint import latest_checkpoint

    target = Path(args.path)
    cfg = _recipe_config(args.recipe, [])
    if (target / "config.yaml").exists():
        load_yaml_into(cfg, target / "config.yaml")
    apply_overrides(cfg, args.set)
    model_dir = target
    if (target / "checkpoints").exists():
        model_dir = latest_checkpoint(target / "checkpoints") or target
    model, tokenizer = tiny.load(model_dir)
    task = TASKS.get(cfg.task.name)(cfg.task)
    engine = ENGINES.get(cfg.rollout.engine)(model, tokenizer, cfg.rollout, cfg.seed, 0)
    pool = RewardPool(build_reward(cfg.reward.name, cfg.reward.params), cfg.reward)
    try:
        result = greedy_accuracy(engine, tokenizer, task.eval_prompts()[: cfg.num_eval], pool)
    finally:
        pool.close()
    print(json.dumps({"model": str(model_dir), "task": cfg.task.name, **result}, indent=2))
    return 0


def cmd_bench(args) -> int:
    from tidal.bench import run_benchmark

    return run_benchmark(args.name, args.set, args.out)


def cmd_report(args) -> int:
    from tidal.utils.report import write_report

    print(write_report(args.run_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="Asynchronous RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("recipes", help="list the named recipes")
    sp.set_defaults(fn=cmd_recipes)

    sp = sub.add_parser("train", help="train a recipe")
    sp.add_argument("recipe")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    sp.add_argument("--out", help="run directory (default runs/RECIPE)")
    sp.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("eval", help="greedy held-out accuracy of a run or model directory")
    sp.add_argument("path")
    sp.add_argument("--recipe", default="quickstart", help="recipe whose task/reward to use (default quickstart)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.set_defaults(fn=cmd_eval)

    sp = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    sp.add_argument("name")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    sp.set_defaults(fn=cmd_bench)

    sp = sub.add_parser("report", help="(re)write report.html for a run directory")
    sp.add_argument("run_dir")
    sp.set_defaults(fn=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard save/load bars drown the run's own progress bar
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, UnknownNameError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
