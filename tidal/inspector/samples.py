"""``RUN_DIR/samples.jsonl``: the rollouts the inspector shows, one JSON object (a *record*) per line.

A record is one prompt and its samples at one step::

    {"step": 10, "kind": "train", "group": 3, "prompt": {"uid", "text", "answer", "ids", "task"},
     "samples": [{"text", "ids", "tokens", "behav_logp", "trainer_logp", ...}, ...]}

A prompt with images adds ``prompt.tokens`` and ``prompt.images`` (PNG data URLs, stored once per record:
``record.py``); an agent episode whose observations showed pictures adds its sample's ``images`` (those
pictures, once per sample).

``kind`` is ``train`` (a group of the batch trained at that step, with what the trainer saw: its
log-probs, advantages and loss mask; ``record.py`` lists every field), ``eval`` (one held-out prompt's
greedy answer at an evaluation; step 0 is the base model) or ``capped`` (written once, when the file
reached ``log.samples.max_mb`` and recording stopped).

Why JSONL, as ``metrics.jsonl``: one writer appends a line at a time, so a crash tears at most the
last line (the reader skips and counts it), and a resume drops the lines past the checkpoint
(``keep_steps_through``) so that no sample is recorded twice. Parquet would be smaller but cannot be
appended to without rewriting it. Numbers are rounded to 4 decimals, which is what the inspector shows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.utils.files import read_jsonl
from tidal.utils.metrics import keep_steps_through

FILE_NAME = "samples.jsonl"
KINDS = ("train", "eval", "capped")


@dataclass
class SampleLogConfig:
    """What ``samples.jsonl`` records (``log.samples.*``). On by default at a low rate: reading samples is
    how format bugs and reward hacking are found, and a recording costs a few hundred microseconds
    per recorded step (docs/inspect.md has the measured overhead)."""

    every: int = 10
    """Record training groups at every N-th step (0: none)."""
    groups: int = 2
    """Groups (every sample of each) recorded at such a step, spread evenly over the step's batch."""
    eval_prompts: int = 16
    """Held-out prompts whose greedy answers are recorded at every evaluation (the same first N each time,
    so one prompt's answers can be followed across steps; 0: none)."""
    max_mb: float = 100.0
    """Stop recording once ``samples.jsonl`` would exceed this many megabytes (a ``capped`` line says
    so). 16 samples of 4k tokens take about 3 MB."""


def clean(value: Any, digits: int | None = 4) -> Any:
    """``value`` as strict JSON: non-finite floats become None (browsers reject NaN), floats are rounded to
    ``digits`` decimals (None: kept), tuples become lists and anything else unknown its ``str``."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return (value if digits is None else round(value, digits)) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v, digits) for v in value]
    return str(value)


class SampleLog:
    """Appends records to ``path``, at most ``max_mb`` of them. ``resume_after_step``: keep the records up
    to that step (the checkpoint resumed from); None starts the file afresh."""

    def __init__(self, path: str | Path, max_mb: float, resume_after_step: int | None = None):
        self.path = Path(path)
        self.max_bytes = int(max_mb * 1e6)
        if resume_after_step is not None and self.path.exists():
            keep_steps_through(self.path, resume_after_step)
        elif resume_after_step is None:
            self.path.unlink(missing_ok=True)
        self.size = self.path.stat().st_size if self.path.exists() else 0
        self.capped = self.size >= self.max_bytes or _ends_capped(self.path)  # a resume keeps a cap reached before

    def write(self, step: int, records: list[dict]) -> bool:
        """Append ``records`` (already JSON-clean) as one write; False if the cap refused them."""
        if self.capped or not records:
            return False
        text = "".join(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n" for r in records)
        data = text.encode("utf-8")
        if self.size + len(data) > self.max_bytes:
            self.capped = True
            data = (json.dumps({"step": step, "kind": "capped", "max_mb": self.max_bytes / 1e6}) + "\n").encode()
        try:
            with open(self.path, "ab") as f:  # opened per write: every N steps, and nothing to close
                f.write(data)
        except OSError as e:  # a full disk: say which file
            raise OSError(e.errno, f"could not write {self.path}: {e.strerror}") from e
        self.size += len(data)
        return not self.capped


def _ends_capped(path: Path) -> bool:
    """Whether the file's last line is the ``capped`` record (the cap writes it last, and nothing after)."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        last = f.read().decode("utf-8", errors="replace").rstrip("\n").rsplit("\n", 1)[-1]
    try:
        return json.loads(last).get("kind") == "capped"
    except (ValueError, AttributeError):
        return False


def _entries_ok(images: Any) -> bool:
    """``images`` (a prompt's or a sample's): a list of ``{"url": "data:image/...", ...}`` or ``{"error"}`` entries
    (the page fetches nothing, so no other URL is drawn)."""
    return isinstance(images, list) and all(
        isinstance(i, dict) and (isinstance(i.get("error"), str)
                                 or (isinstance(i.get("url"), str) and i["url"].startswith("data:image/")))
        for i in images)


def _tokens_ok(sample: Any) -> bool:
    """A sample the inspector can draw: text, per-token arrays (the optional ones may be null) that all
    have one entry per token, and its observations' pictures, if any, as ``_entries_ok`` wants them."""
    if not (isinstance(sample, dict) and isinstance(sample.get("text"), str) and isinstance(sample.get("ids"), list)):
        return False
    n = len(sample["ids"])
    required, optional = ("tokens", "behav_logp", "versions"), ("trainer_logp", "loss_mask", "policy_mask")
    return (all(isinstance(sample.get(k), list) and len(sample[k]) == n for k in required)
            and all(sample.get(k) is None or (isinstance(sample[k], list) and len(sample[k]) == n) for k in optional)
            and (sample.get("images") is None or _entries_ok(sample["images"])))


def _images_ok(prompt: dict) -> bool:
    """A prompt's optional image fields: ``images`` as ``_entries_ok`` wants them, ``tokens`` one text per id."""
    images, tokens = prompt.get("images"), prompt.get("tokens")
    if images is not None and not _entries_ok(images):
        return False
    return tokens is None or (isinstance(tokens, list) and isinstance(prompt.get("ids"), list)
                              and len(tokens) == len(prompt["ids"]) and all(isinstance(t, str) for t in tokens))


def valid_record(record: Any) -> bool:
    """Whether one parsed line is a record the inspector can show (else it is skipped and counted)."""
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return False
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return False
    if record["kind"] == "capped":
        return True
    prompt, samples = record.get("prompt"), record.get("samples")
    return (isinstance(prompt, dict) and isinstance(prompt.get("text"), str) and _images_ok(prompt)
            and isinstance(samples, list) and bool(samples) and all(_tokens_ok(s) for s in samples))


def read_samples(path: str | Path) -> tuple[list[dict], int]:
    """The records of a ``samples.jsonl`` and how many lines were skipped: not JSON (a line torn by a
    crash), or not a record the inspector can draw. Blank lines are ignored."""
    return read_jsonl(path, valid_record)
