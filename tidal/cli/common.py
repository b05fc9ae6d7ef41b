"""Helpers every command group shares: a recipe's run config, one-line errors, refusing to overwrite a run's data."""

from __future__ import annotations

import sys
from pathlib import Path

from tidal.config import ConfigError, apply_overrides


def recipe_config(name: str, overrides: list[str]):
    from tidal.recipes import RECIPES

    cfg = RECIPES.get(name)()
    return apply_overrides(cfg, overrides)


def train_config(recipe: str, overrides: list[str], saved: Path | None = None):
    """The run config: a recipe by name, or a YAML file (a run's ``config.yaml`` reproduces that run),
    then ``saved`` (the run's own config.yaml, on --resume), then the ``--set`` overrides."""
    from tidal.config import apply_mapping
    from tidal.system.config import RunConfig
    from tidal.utils.yaml_file import read_yaml

    if Path(recipe).is_dir():
        raise ConfigError(f"{recipe} is a directory, not a recipe name or a YAML config (to rerun a run's config: "
                          f"tidal train {Path(recipe) / 'config.yaml'}; to continue it: --out {recipe} --resume)")
    if recipe.endswith((".yaml", ".yml")) or Path(recipe).is_file():
        if not Path(recipe).is_file():
            raise ConfigError(f"{recipe}: no such config file (a recipe name or a YAML config file)")
        cfg = apply_mapping(RunConfig(), read_yaml(recipe, mapping=True))
    else:
        from tidal.recipes import RECIPES

        cfg = RECIPES.get(recipe)()
    if saved is not None:
        apply_mapping(cfg, read_yaml(saved, mapping=True))
    return apply_overrides(cfg, overrides)


def one_line_errors(fn):
    """Bad input to ``fn`` (a ValueError or OSError: a malformed file, a missing or unwritable path) is
    one ``error:`` line on stderr and exit code 2, never a traceback; a failed engine or an evaluation whose every
    episode failed (``EngineFailed``, ``AllFailed``) is one line and 1; Ctrl-C is one line and 130 (the
    outputs are written under temporary names, so an interrupted command leaves them as they were)."""
    import functools

    @functools.wraps(fn)
    def wrapper(args) -> int:
        try:
            return fn(args)
        except (ValueError, OSError) as e:
            print("error: " + " ".join(str(e).split()), file=sys.stderr)
            return 2
        except RuntimeError as e:
            from tidal.api import EngineFailed  # torch: imported by then, never before a command runs

            if not isinstance(e, EngineFailed):
                raise
            print("error: " + " ".join(str(e).split()), file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"error: tidal {args.command} interrupted; its outputs were not replaced", file=sys.stderr)
            return 130

    return wrapper


def refuse_run_data(out: str | None, run_dirs: list[str]) -> None:
    """``--out`` is none of the run files a command reads (``tidal report A B --out A/metrics.jsonl`` used to
    replace A's metrics with HTML): one line naming both."""
    from tidal.data.io import refuse_overwrite
    from tidal.utils.runs import RUN_DATA

    if out is not None:
        for d in run_dirs:
            for name in RUN_DATA:
                refuse_overwrite(out, {"the input": Path(d) / name})
