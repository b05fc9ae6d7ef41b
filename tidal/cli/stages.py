"""``tidal sft``, ``tidal dpo``, ``tidal rm``: the stages around RL on the command line.

    tidal sft [CONFIG.yaml] [--set key=value ...] [--out DIR] [--resume | --overwrite]

Each writes ``DIR/config.yaml``, ``DIR/metrics.jsonl``, ``DIR/checkpoints/`` and ``DIR/model`` (the next
stage's, or RL's, ``model.path``) and prints a JSON summary. Bad input is one ``error:`` line and exit 2;
Ctrl-C is one line saying how to resume and exit 130. Nothing heavy is imported until a stage runs, so
``tidal score`` does not pay for it.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

STAGES = {
    "sft": ("tidal.stages.sft", "SFTStageConfig", "chat SFT on assistant tokens (messages or prompt/completion rows)"),
    "dpo": ("tidal.stages.dpo", "DPOStageConfig", "preference optimization: sigmoid (DPO), ipo, hinge, simpo"),
    "rm": ("tidal.stages.reward_model", "RMStageConfig", "a Bradley-Terry reward model for reward.name=rm"),
}


def add_parsers(sub) -> None:
    """Add the stage commands to ``tidal``'s sub-parsers."""
    for name, (_, _, help_text) in STAGES.items():
        sp = sub.add_parser(name, help=f"{help_text} (docs/stages.md)")
        sp.add_argument("config", nargs="?", help="a YAML config (e.g. a previous run's config.yaml)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        sp.add_argument("--out", help=f"run directory (default runs/{name})")
        sp.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
        sp.add_argument("--overwrite", action="store_true", help="delete the previous run in --out first")
        sp.set_defaults(fn=cmd_stage)


def stage_config(name: str, config: str | None, sets: list[str], saved: Path | None = None):
    """The stage's config: defaults, then ``config`` (or the run's own ``saved`` one), then ``sets``."""
    from tidal.config import apply_overrides, load_yaml_into

    module, cls, _ = STAGES[name]
    cfg = getattr(importlib.import_module(module), cls)()
    source = config or (str(saved) if saved is not None and saved.is_file() else None)
    if source:
        load_yaml_into(cfg, source)
    return apply_overrides(cfg, sets)


def one_line(e: BaseException) -> str:
    """The error's message on one line. A KeyError's ``str`` is the repr of its message (quoted): its message
    itself, not ``str(e)`` with quotes stripped from both ends, which also took the closing quote off a message
    ending in a quoted name (``unknown config key 'bogus'``)."""
    text = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    return " ".join(text.split())


def cmd_stage(args) -> int:
    from tidal.stages.chat_data import DataError

    out = Path(args.out or f"runs/{args.command}")
    try:
        cfg = stage_config(args.command, args.config, args.set, out / "config.yaml" if args.resume else None)
        train = importlib.import_module(STAGES[args.command][0]).train
        last = train(cfg, str(out), resume=args.resume, overwrite=args.overwrite,
                     log=lambda line: print(line, file=sys.stderr))
    except KeyboardInterrupt:
        print(f"interrupted; resume with: tidal {args.command} --out {out} --resume", file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError, DataError) as e:  # ConfigError, a bad file, an unknown name
        print("error: " + one_line(e), file=sys.stderr)
        return 2
    print(json.dumps({"out": str(out), "model": str(out / "model"), **last}, indent=2))
    return 0
