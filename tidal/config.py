"""Config base: nested dataclasses, ``--set a.b=c`` overrides, YAML round-trip.

Each component owns a small dataclass next to its code (``RolloutConfig`` in ``rollout/``,
``AlgoConfig`` in ``algo/`` ...); a run config nests them. Overrides are parsed with YAML (so
``0.2`` is a float, ``[a, b]`` a list, ``null`` None) and then checked against the field's type. Only
``true``/``false`` are booleans (YAML 1.2): YAML 1.1 also reads ``on``/``off``/``yes``/``no`` as booleans, which
turned ``--set rollout.cuda_graphs=off`` into the string "False"; a boolean key still takes those words.
An unknown key is an error naming the key and its closest matches. Every number set this way (from
``--set`` or a YAML config, inside lists and mappings too) must be finite: NaN passes every range
check (each comparison with it is false) and then silently poisons whatever reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A bad key or value in a config or an override."""


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true/false (any case), so ``off`` stays a string."""


_BOOL = "tag:yaml.org,2002:bool"
ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_BOOL_WORDS = {"on": True, "yes": True, "off": False, "no": False}


def load_yaml(text: str) -> Any:
    """A config document (a file or one override's value) parsed with ``ConfigLoader``."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)


def _all_keys(cfg: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(_all_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _coerce(key: str, raw: Any, hint: Any) -> Any:
    """Check/convert a YAML-parsed value against a (simple) type hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if raw is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, raw, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {raw!r}")
    if origin in (list, tuple):
        if not isinstance(raw, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {raw!r}")
        (inner, *_) = typing.get_args(hint) or (Any,)
        items = [_coerce(key, x, inner) for x in raw]
        return tuple(items) if origin is tuple else items
    if origin is typing.Literal:
        if raw not in typing.get_args(hint):
            raise ConfigError(f"{key}: {raw!r} is not one of {typing.get_args(hint)}")
        return raw
    if hint is Any or hint is object:
        return raw
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _BOOL_WORDS:  # YAML 1.1's words for booleans
            return _BOOL_WORDS[raw.lower()]
        raise ConfigError(f"{key}: expected true/false, got {raw!r}")
    if hint is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        try:  # YAML 1.1 reads "5e-4" (no dot) as a string
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {raw!r}") from None
    if hint is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ConfigError(f"{key}: expected an integer, got {raw!r}")
    if hint is str:
        return str(raw)
    if origin is dict or hint is dict:
        if not isinstance(raw, dict):
            raise ConfigError(f"{key}: expected a mapping, got {raw!r}")
        return raw
    return raw


def _check_finite(key: str, value: Any) -> None:
    """A ConfigError naming the first nan or +-inf in ``value`` by its path (``a.b[1].weight``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(f"{key}[{i}]", v)


def set_key(cfg: Any, key: str, raw_value: Any) -> None:
    """Set ``cfg.a.b = value`` for ``key='a.b'``, checking the key exists and the value's type."""
    parts = key.split(".")
    node = cfg
    for i, part in enumerate(parts):
        if isinstance(node, dict):  # a free-form mapping field (e.g. ``reward.params``): any sub-key
            *inner, last = parts[i:]
            for name in inner:
                node = node.setdefault(name, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{key!r}: {name!r} is not a mapping")
            _check_finite(key, raw_value)
            node[last] = raw_value
            return
        names = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in names:
            close = difflib.get_close_matches(key, _all_keys(cfg), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        if i == len(parts) - 1:
            hints = typing.get_type_hints(type(node))
            value = getattr(node, part)
            if dataclasses.is_dataclass(value):
                raise ConfigError(f"{key!r} is a section; set one of its keys, e.g. {key}.{_all_keys(value)[0]}")
            value = _coerce(key, raw_value, hints[part])
            _check_finite(key, value)
            setattr(node, part, value)
        else:
            node = getattr(node, part)


def apply_overrides(cfg: C, overrides: list[str]) -> C:
    """Apply ``["a.b=1", "c=[x, y]"]`` in order; returns ``cfg`` (mutated) for chaining."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, _, text = item.partition("=")
        try:
            value = load_yaml(text) if text.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: cannot parse value: {e}") from None
        set_key(cfg, key.strip(), value)
    return cfg


def apply_mapping(cfg: C, mapping: dict[str, Any], prefix: str = "") -> C:
    """Apply a nested mapping (e.g. a loaded config.yaml) onto a config."""
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and dataclasses.is_dataclass(_walk(cfg, full)):
            apply_mapping(cfg, value, f"{full}.")
        else:
            set_key(cfg, full, value)
    return cfg


def _walk(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_yaml(cfg: Any, path: str | Path) -> None:
    """Write the config under a temporary name, then rename it: a full disk never leaves a torn file (on
    --resume the file is the run's own config)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"could not write {path}: {e.strerror}") from e


def load_yaml_into(cfg: C, path: str | Path) -> C:
    return apply_mapping(cfg, load_yaml(Path(path).read_text()) or {})
