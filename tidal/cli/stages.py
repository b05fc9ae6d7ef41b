"""``tidal sft``, ``tidal dpo``, ``tidal rm``: the stages around RL on the command line.

    tidal sft [CONFIG.yaml] [--set key=value ...] [--out DIR] [--resume | --overwrite]

Each writes ``DIR/config.yaml``, ``DIR/metrics.jsonl``, ``DIR/checkpoints/`` and ``DIR/model`` (the next
stage's, or RL's, ``model.path``) and prints a JSON summary. Bad input is one ``error:`` line and exit 2;
Ctrl-C is one line saying how to resume (before the first checkpoint: how to start again) and exit 130.
``--out`` follows every command's rules (``utils/outputs.py``). Nothing heavy is imported until a stage runs, so
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
        sp.add_argument("--overwrite", action="store_true", help="delete the previous run's files in --out first")
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


def saved_kind(out: Path) -> str | None:
    """The command whose config ``out/config.yaml`` holds, for a run written before runs recorded their kind
    (``utils/outputs.py``): the config class (``tidal train``'s or a stage's) with exactly its keys, else the one
    class that has every key it has (an older version's config lacks newer keys)."""
    import dataclasses

    from tidal.system.config import RunConfig
    from tidal.utils.yaml_file import read_yaml

    try:
        keys = set(read_yaml(out / "config.yaml", mapping=True))
    except (OSError, ValueError):
        return None
    classes = {"train": RunConfig, **{name: getattr(importlib.import_module(module), cls)
                                      for name, (module, cls, _) in STAGES.items()}}
    fields = {kind: {f.name for f in dataclasses.fields(c)} for kind, c in classes.items()}
    exact = [kind for kind, names in fields.items() if keys == names]  # a config saved by this version: every key
    fits = exact or [kind for kind, names in fields.items() if keys and keys <= names]
    return fits[0] if len(fits) == 1 else None


def interrupted(args, out: Path) -> str:
    """The line after Ctrl-C: resume from the last checkpoint or, before the first one (DPO's reference pass,
    the first steps), the same command again with ``--overwrite``: ``--resume`` would find nothing to continue."""
    import shlex

    from tidal.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is not None:
        return f"interrupted; checkpoint saved in {ckpt}; resume with: tidal {args.command} --out {out} --resume"
    argv = [args.command, *([args.config] if args.config else []), *(a for kv in args.set for a in ("--set", kv)),
            "--out", str(out), "--overwrite"]
    return f"interrupted before the first checkpoint; start again with: tidal {shlex.join(argv)}"


def cmd_stage(args) -> int:
    from tidal.stages.chat_data import DataError
    from tidal.utils import outputs

    out = Path(args.out or f"runs/{args.command}")
    try:
        if args.resume:  # before its config.yaml is read as this stage's
            outputs.check_kind(out, args.command, guess=saved_kind)
        cfg = stage_config(args.command, args.config, args.set, out / "config.yaml" if args.resume else None)
        train = importlib.import_module(STAGES[args.command][0]).train
        last = train(cfg, str(out), resume=args.resume, overwrite=args.overwrite,
                     log=lambda line: print(line, file=sys.stderr))
    except KeyboardInterrupt:
        print(interrupted(args, out), file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError, DataError) as e:  # ConfigError, a bad file, an unknown name
        print("error: " + one_line(e), file=sys.stderr)
        return 2
    print(json.dumps({"out": str(out), "model": str(out / "model"), **last}, indent=2))
    return 0
