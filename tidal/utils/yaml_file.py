"""Read a YAML file a user wrote (a curate recipe, a run's config.yaml): a file that is not UTF-8 or
does not parse is one ``ConfigError`` naming ``file:line``, never a parser traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tidal.config import ConfigError, load_yaml


def read_yaml(path: str | Path, mapping: bool = False) -> Any:
    """The parsed document (``{}`` for an empty file); ``mapping``: it must be a mapping of keys."""
    path = Path(path)
    try:
        doc = load_yaml(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start + 1})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    if mapping and not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got a {type(doc).__name__}")
    return doc
