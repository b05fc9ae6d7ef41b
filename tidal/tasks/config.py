"""The task section of a run config: which task, and for dataset adapters where its rows come from.

One flat dataclass serves every task (``name`` picks the ``TASKS`` entry), so ``--set task.x=y``
works the same for all of them and a typo is an error naming the closest key. Fields a task does
not use are ignored by it. The synthetic tasks' fields (``max_operand`` ...) keep their names and
defaults; the adapters (``jsonl``, ``parquet``, ``hf_disk``, ``reasoning_gym``) add the data
source, the field mapping, a prompt template and the eval split. See docs/tasks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FieldMap:
    """Which column of a row holds what. Columns not named here go into ``Prompt.meta``."""

    prompt: str = "prompt"
    """Column with the prompt text (unused when ``task.template`` is set: the template builds it)."""
    answer: str | None = "answer"
    """Column with the reference answer (a string or a number). null: rows have no answer (e.g. code
    tasks scored by ``tests`` in meta); ``Prompt.answer`` is then empty."""
    id: str | None = None
    """Column with a row id, kept as ``Prompt.meta['id']`` (uids stay ``train-N`` / ``eval-N``, unique
    per draw, because the controller keys in-flight groups by uid)."""
    solution: str | None = None
    """Column with a reference response for the supervised warm start (``sft_example``). Without one,
    a recipe that warm-starts raises; point ``model.path`` at an existing model instead."""
    meta: list[str] | None = None
    """Columns to keep in ``Prompt.meta`` (null: every column not mapped above)."""
    images: str | None = "images"
    """Column with the row's images (one, or a list): paths (relative ones from the data file's folder), bytes,
    data URLs, ``datasets`` Image values or ``image_url`` parts, anything ``utils/images.load_image`` reads.
    Each is decoded once at load to check it and kept in ``Prompt.meta['images']`` as a data URL. A row
    without the column (or with null) is a text-only row; a bad image makes the row a skipped, counted bad
    row. The default names the column ``Prompt.images`` reads, so such a column is always checked rather
    than passed on raw; a column named explicitly that no row has is an error (a typo, not a text dataset)."""


@dataclass
class TaskConfig:
    """Which task to train on and how its data is drawn."""

    name: str = "addition"
    """Registered task name (``tidal.tasks.TASKS``): ``addition``, ``repeat``, ``jsonl``, ``parquet``,
    ``hf_disk``, ``reasoning_gym``."""
    max_operand: int = 99
    """addition: operands are drawn from [0, max_operand] (99 -> 2-digit addition)."""
    fixed_width: bool = True
    """addition: zero-pad operands and answer to fixed widths ("07+45=" -> "052"). Digits then sit
    at fixed offsets, which a small transformer aligns far more easily (Lee et al. 2023,
    "Teaching Arithmetic to Small Transformers", arXiv 2307.03381, on data formatting). Measured
    here (1M model, batch 64, lr 1e-3): fixed width reaches 0.34 greedy accuracy after 300 steps and
    0.67 after 400; the natural format needs ~750 steps for 0.42."""
    max_terms: int = 5
    """sum_chain: the most terms in a sum (at least 2). k is drawn geometric, P(k) ~ 2^-(k-2), but
    two-term sums run out of distinct problems, so the task's problems are ~20% / 40% / 20% / 20%
    for k = 2..5 (``tasks/arithmetic.py``): episode lengths of 1-5 turns, with a tail."""
    max_repeat: int = 48
    """repeat: the longest response (the tail of the length distribution)."""
    num_eval: int = 500
    """Held-out problems for greedy-accuracy evaluation (adapters: rows held out by a stable hash of
    the prompt text; ignored when ``eval_fraction`` or ``eval_path``/``eval_split`` is set)."""
    seed: int = 0
    """Seed of the train/eval split and of the training stream."""
    path: str | None = None
    """jsonl / parquet / hf_disk: a local file, a directory of such files, or a glob. hf_disk also
    takes a ``save_to_disk`` directory. Never a hub name: tidal does not download datasets."""
    eval_path: str | None = None
    """A separate held-out file (same format as ``path``); training rows with the same prompt text
    are dropped so eval problems are never trained on."""
    eval_fraction: float | None = None
    """Hold out this fraction of rows (by a stable hash, so a row's side never depends on the others)
    instead of ``num_eval`` rows."""
    split: str = "train"
    """hf_disk: the split of a DatasetDict (or of ``load_dataset(builder, data_files=...)``) to train on."""
    eval_split: str | None = None
    """hf_disk: a split of the same DatasetDict to evaluate on (e.g. ``test``)."""
    fields: FieldMap = field(default_factory=FieldMap)
    """Column mapping: ``--set task.fields.prompt=question``."""
    template: str | None = None
    """Prompt template over the row's columns, e.g. ``"{question}\\nPut the final answer in \\boxed{}."``:
    ``{name}`` is a column, ``{}`` and other braces stay literal, ``{{``/``}}`` are literal braces."""
    max_images: int = 8
    """jsonl / parquet / hf_disk: the most images one row may show (its image column plus the image parts
    of a content-part prompt); a row with more is a skipped, counted bad row. It bounds the prompt's image
    tokens and the memory of one group's pictures; 8 covers multi-image benchmarks without letting a broken
    row (a whole album in one cell) through."""
    params: dict[str, Any] = field(default_factory=dict)
    """Adapter-specific settings. reasoning_gym: ``dataset`` (required), ``size`` (training problems,
    default 1000), ``seed`` and the dataset's own config keys. hf_disk: ``builder`` (json, parquet,
    csv, arrow, text; inferred from the file name) and ``cache_dir``."""
