"""Rows to prompts: the part every dataset adapter shares (files, HF datasets, reasoning-gym).

An adapter yields ``(row_number, row)`` pairs; this module turns them into ``Prompt`` s through the
field mapping and the optional template, skips and counts bad rows (a missing column, a value of
the wrong type) with one warning that names the first few by row number and key, splits off the
held-out eval set by a stable hash of the prompt text, and serves the endless, seeded training
stream the ``Task`` protocol asks for.

Why hash the prompt *text*: duplicated problems (common in scraped data and in small generated
problem spaces) land on the same side, and training rows whose text equals an eval row's are
dropped, so no eval problem is ever trained on. A fraction split (``eval_fraction``) hashes each
row on its own, so adding rows never moves an existing row across the split.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.tasks.config import FieldMap, TaskConfig
from tidal.types import Prompt
from tidal.utils.seeding import stable_hash

MAX_LISTED = 5  # bad rows named one by one in the warning; the rest are counted


class BadRow(ValueError):
    """A row that cannot become a prompt; ``key`` is the offending column (None: the row itself)."""

    def __init__(self, key: str | None, reason: str):
        super().__init__(f"{key!r}: {reason}" if key else reason)
        self.key = key


_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_]\w*)\}")


def render(template: str, row: dict[str, Any]) -> str:
    """``{name}`` -> the row's column; ``{{``/``}}`` -> literal braces; any other brace stays as written,
    so ``\\boxed{}`` needs no escaping (unlike ``str.format``)."""

    def sub(m: re.Match) -> str:
        if m.group(1) is None:
            return m.group(0)[0]
        return _scalar(row, m.group(1), "template")

    return _PLACEHOLDER.sub(sub, template)


def check_template(template: str | None) -> None:
    """A template must name a column; one without any is the YAML trap: unquoted, ``{question} =``
    parses as a mapping and reaches us as its repr ``{'question': None}``."""
    if template is not None and not any(m.group(1) for m in _PLACEHOLDER.finditer(template)):
        raise ConfigError(f"task.template={template!r} names no {{column}}; on the command line quote it, "
                          "e.g. --set 'task.template=\"{question} =\"' (unquoted, YAML reads braces as a mapping)")


def _scalar(row: dict[str, Any], key: str, role: str) -> str:
    """A string or number column as text; anything else is a BadRow naming ``key``."""
    if key not in row:
        raise BadRow(key, f"missing ({role} column)")
    value = row[key]
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise BadRow(key, f"{role} must be a string or a number, got {type(value).__name__}")


def to_prompt(row: Any, fields: FieldMap, template: str | None) -> Prompt:
    """One row as a Prompt (uid left empty: the task assigns it when the prompt is drawn)."""
    if isinstance(row, BadRow):  # the reader could not parse it (e.g. invalid JSON)
        raise row
    if not isinstance(row, dict):
        raise BadRow(None, f"row must be an object, got {type(row).__name__}")
    text = render(template, row) if template is not None else _scalar(row, fields.prompt, "prompt")
    if not text.strip():
        raise BadRow(None if template is not None else fields.prompt, "empty prompt")
    answer = _scalar(row, fields.answer, "answer") if fields.answer else ""
    used = {fields.answer, fields.id, fields.solution} | ({fields.prompt} if template is None else set())
    keep = fields.meta if fields.meta is not None else [k for k in row if k not in used]
    meta = {k: row[k] for k in keep if k in row}
    if fields.id:
        meta["id"] = _scalar(row, fields.id, "id")
    if fields.solution:
        meta["solution"] = _scalar(row, fields.solution, "solution")
    return Prompt(uid="", text=text, answer=answer, meta=meta)


@dataclass
class Loaded:
    """Parsed prompts plus what was skipped: ``skipped[i] = (row label, reason)``."""

    prompts: list[Prompt]
    skipped: list[tuple[str, str]]


def parse_rows(rows: Iterable[tuple[str, Any]], fields: FieldMap, template: str | None, source: str) -> Loaded:
    """Parse labelled rows; warn once about bad ones; a ConfigError if none is usable."""
    check_template(template)
    prompts, skipped = [], []
    for label, row in rows:
        try:
            prompts.append(to_prompt(row, fields, template))
        except BadRow as e:
            skipped.append((label, str(e)))
    if skipped:
        listed = "; ".join(f"row {label}: {reason}" for label, reason in skipped[:MAX_LISTED])
        more = f"; and {len(skipped) - MAX_LISTED} more" if len(skipped) > MAX_LISTED else ""
        message = f"{source}: skipped {len(skipped)} of {len(skipped) + len(prompts)} rows ({listed}{more})"
        if not prompts:
            raise ConfigError(f"{message}: no usable rows (check task.fields / task.template)")
        warnings.warn(message, stacklevel=3)
    if not prompts:
        raise ConfigError(f"{source}: no rows")
    return Loaded(prompts, skipped)


def split_eval(prompts: list[Prompt], cfg: TaskConfig, source: str) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) by a seeded hash of the text: ``eval_fraction`` of rows, else ``num_eval`` rows."""
    keyed = [(stable_hash(cfg.seed, "eval", p.text), i) for i, p in enumerate(prompts)]
    if cfg.eval_fraction is not None:
        if not 0.0 <= cfg.eval_fraction < 1.0:
            raise ConfigError(f"task.eval_fraction={cfg.eval_fraction} must be in [0, 1)")
        cut = cfg.eval_fraction * 2**63
        eval_idx = sorted(i for h, i in keyed if h < cut)
    else:
        eval_idx = sorted(i for _, i in sorted(keyed)[: cfg.num_eval])
    evals = [prompts[i] for i in eval_idx]
    return drop_overlap(prompts, evals, source, cfg), evals


def drop_overlap(train: list[Prompt], evals: list[Prompt], source: str, cfg: TaskConfig) -> list[Prompt]:
    """Training prompts whose text is not an eval prompt's text; an error if none is left."""
    eval_texts = {p.text for p in evals}
    kept = [p for p in train if p.text not in eval_texts]
    if not kept:
        raise ConfigError(f"{source}: holding out {len(evals)} eval rows leaves no training rows "
                          f"(of {len(train)}); lower task.num_eval (now {cfg.num_eval}) or set task.eval_fraction")
    return kept


class RowTask:
    """A Task over a fixed list of training and eval prompts (see the module docstring).

    Epoch 0 of the training stream is a seeded shuffle; each later epoch is reshuffled by hash, so
    ``train_prompt(i)`` is a pure function of ``i`` (resume-safe) and the controller's uids
    ``train-i`` stay unique across epochs.
    """

    name = "rows"

    def __init__(self, cfg: TaskConfig, train: list[Prompt], evals: list[Prompt], skipped: int = 0):
        self.cfg = cfg
        self._train = list(train)
        random.Random(cfg.seed).shuffle(self._train)
        self._eval = evals
        self.num_skipped = skipped
        self._cached_epoch: tuple[int, list[Prompt]] = (-1, [])

    @property
    def num_train(self) -> int:
        return len(self._train)

    def train_prompt(self, index: int) -> Prompt:
        epoch, pos = divmod(index, len(self._train))
        return _with_uid(self._epoch_order(epoch)[pos], f"train-{index}")

    def _epoch_order(self, epoch: int) -> list[Prompt]:
        if epoch == 0:
            return self._train
        if self._cached_epoch[0] != epoch:
            keyed = sorted(range(len(self._train)), key=lambda i: stable_hash(self.cfg.seed, epoch, i))
            self._cached_epoch = (epoch, [self._train[i] for i in keyed])
        return self._cached_epoch[1]

    def eval_prompts(self) -> list[Prompt]:
        return [_with_uid(p, f"eval-{i}") for i, p in enumerate(self._eval)]

    def sft_example(self, prompt: Prompt) -> str:
        if "solution" not in prompt.meta or self.cfg.fields.solution is None:
            raise ConfigError(
                f"task {self.name}: the supervised warm start needs a reference response, but no solution "
                "column is mapped; set task.fields.solution=COLUMN (e.g. the answer column) or point "
                "model.path at an existing model to skip the warm start")
        return prompt.meta["solution"]


def _with_uid(prompt: Prompt, uid: str) -> Prompt:
    return Prompt(uid=uid, text=prompt.text, answer=prompt.answer, meta=prompt.meta)


def numbered(rows: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Label rows ``prefix`` + 1-based row number (the labels bad-row messages use)."""
    for i, row in enumerate(rows, start=1):
        yield f"{prefix}{i}", row
