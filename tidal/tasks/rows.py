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

Images (issue 54). A row's images come from its image column (``task.fields.images``, one image or a
list) and, when the prompt column holds a user turn's OpenAI-style content parts instead of a string,
from its ``image_url`` / ``image`` parts (in order; a bare ``{"type": "image"}`` part takes the next of
the column's images), the text parts joined by newlines becoming the prompt text: the model sees the
images first, then the text (``models/vlm.user_message``). Each image is decoded once here, so a bad one
(unreadable, missing file, zero-size, remote URL) is a bad row named by row and key instead of an error
deep in the engine, and kept as a data URL (``utils/images.as_data_url``): JSON-safe for the endpoint,
the inspector and reward workers. Relative paths resolve against the data file's folder. A row showing
the same text with different pictures ("how many squares?") is a different problem, so for rows with
images the split hashes the images' bytes with the text; a text-only row's hash is exactly what it was,
so existing splits do not move.
"""

from __future__ import annotations

import hashlib
import random
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config import ConfigError
from tidal.tasks.config import FieldMap, TaskConfig
from tidal.types import Prompt
from tidal.utils.images import ImageError, as_data_url
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


def to_prompt(row: Any, fields: FieldMap, template: str | None, *, folder: Path | None = None,
              max_images: int = 8) -> Prompt:
    """One row as a Prompt (uid left empty: the task assigns it when the prompt is drawn). Relative image
    paths resolve against ``folder`` (the data file's); more than ``max_images`` images is a BadRow."""
    if isinstance(row, BadRow):  # the reader could not parse it (e.g. invalid JSON)
        raise row
    if not isinstance(row, dict):
        raise BadRow(None, f"row must be an object, got {type(row).__name__}")
    parts: list[tuple[int, dict]] = []
    if template is not None:
        text = render(template, row)
    elif _is_parts(row.get(fields.prompt)):
        text, parts = _content_parts(row[fields.prompt], fields.prompt)
    else:
        text = _scalar(row, fields.prompt, "prompt")
    if not text.strip():
        raise BadRow(None if template is not None else fields.prompt, "empty prompt")
    answer = _scalar(row, fields.answer, "answer") if fields.answer else ""
    sources = _image_sources(row, fields, parts, max_images)  # counted before any is decoded
    used = {fields.answer, fields.id, fields.solution, fields.images} | ({fields.prompt} if template is None else set())
    keep = fields.meta if fields.meta is not None else [k for k in row if k not in used]
    meta = {k: row[k] for k in keep if k in row}
    if fields.id:
        meta["id"] = _scalar(row, fields.id, "id")
    if fields.solution:
        meta["solution"] = _scalar(row, fields.solution, "solution")
    if sources:
        meta["images"] = [_data_url(key, where, value, folder) for key, where, value in sources]
    return Prompt(uid="", text=text, answer=answer, meta=meta)


_IMAGE_PARTS = ("image_url", "image")


def _is_parts(value: Any) -> bool:
    """A non-empty list of objects: content parts (a list of anything else stays a wrong-type prompt)."""
    return isinstance(value, list) and bool(value) and all(isinstance(part, dict) for part in value)


def _content_parts(parts: list, key: str) -> tuple[str, list[tuple[int, dict]]]:
    """A user turn's content parts: (the text parts joined by newlines, [(index, image part)] in order)."""
    texts, images = [], []
    for i, part in enumerate(parts):
        if "role" in part:
            raise BadRow(key, "a list of chat messages; give the user turn's content parts instead, e.g. "
                              "[{'type': 'text', 'text': ...}, {'type': 'image_url', 'image_url': {'url': ...}}]")
        # Parquet and datasets give every part every struct field, the absent ones None: go by the values.
        kind = part.get("type") or next((k for k in ("text", *_IMAGE_PARTS) if part.get(k) is not None), None)
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise BadRow(key, f"content[{i}]: a text part's 'text' must be a string")
            texts.append(part["text"])
        elif kind in _IMAGE_PARTS:
            images.append((i, part))
        else:
            raise BadRow(key, f"content[{i}]: unsupported content part type {kind!r} (text, image_url, image)")
    return "\n".join(texts), images


def _image_sources(row: dict, fields: FieldMap, parts: list[tuple[int, dict]],
                   max_images: int) -> list[tuple[str, str, Any]]:
    """(key, where, value) of each of the row's images, in order: the content parts' images (a bare
    ``{"type": "image"}`` part takes the next of the column's), then the rest of the image column."""
    column = row.get(fields.images) if fields.images else None
    listed = isinstance(column, (list, tuple))
    spare = list(column) if listed else [] if column is None else [column]
    spare_at = [f"{fields.images!r}[{i}]" if listed else repr(fields.images) for i in range(len(spare))]
    count = len(parts) + len(spare) - sum(_is_bare(part) for _, part in parts)
    if count > max_images:
        raise BadRow(fields.images if spare else fields.prompt,
                     f"{count} images, more than task.max_images={max_images}")
    sources = []
    for i, part in parts:
        if not _is_bare(part):
            sources.append((fields.prompt, f"{fields.prompt!r} content[{i}]", part))
        elif spare:
            sources.append((fields.images, spare_at.pop(0), spare.pop(0)))
        else:
            raise BadRow(fields.prompt, f"content[{i}]: an image part with no image, and no image left in the "
                                        f"image column ({fields.images!r}) to fill it")
    return sources + [(fields.images, at, value) for at, value in zip(spare_at, spare)]


def _is_bare(part: dict) -> bool:
    return all(part.get(k) is None for k in _IMAGE_PARTS)


def _data_url(key: str, where: str, value: Any, folder: Path | None) -> str:
    """One image checked and stored (``as_data_url``); a bad one is a BadRow naming ``key``."""
    try:
        return as_data_url(_resolved(value, folder), where)
    except ImageError as e:
        bad = BadRow(None, str(e))  # the message already opens with the key (``where``)
        bad.key = key
        raise bad from None


def _resolved(value: Any, folder: Path | None) -> Any:
    """A relative path (also inside a part or a ``{"bytes", "path"}`` dict) joined to ``folder``."""
    if isinstance(value, dict):
        inner = value.get("image_url") if value.get("image_url") is not None else value.get("image")
        if isinstance(inner, dict):
            inner = inner.get("url")
        if inner is None and value.get("bytes") is None:
            inner = value.get("path")
        return value if inner is None else _resolved(inner, folder)
    if folder is None or not isinstance(value, (str, Path)) or str(value).startswith("data:") or "://" in str(value):
        return value
    path = Path(value).expanduser()
    return path if path.is_absolute() else folder / path


@dataclass
class Loaded:
    """Parsed prompts plus what was skipped: ``skipped[i] = (row label, reason)``."""

    prompts: list[Prompt]
    skipped: list[tuple[str, str]]


def parse_rows(rows: Iterable[tuple[Any, ...]], fields: FieldMap, template: str | None, source: str, *,
               max_images: int = 8, folder: Path | None = None) -> Loaded:
    """Parse labelled rows; warn once about bad ones; a ConfigError if none is usable.

    ``rows`` yields ``(label, row)``, or ``(label, row, folder)`` where a row's relative image paths resolve
    against its own file's folder (``folder`` is the default for pairs)."""
    check_template(template)
    if max_images < 0:
        raise ConfigError(f"task.max_images={max_images} must be >= 0")
    prompts, skipped, has_image_column = [], [], False
    for label, row, *own in rows:
        has_image_column = has_image_column or (isinstance(row, dict) and fields.images in row)
        try:
            prompts.append(to_prompt(row, fields, template, folder=own[0] if own else folder, max_images=max_images))
        except BadRow as e:
            skipped.append((label, str(e)))
    if fields.images not in (None, FieldMap.images) and not has_image_column:
        raise ConfigError(f"{source}: task.fields.images={fields.images!r} names a column no row has")
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
    """(train, eval) by a seeded hash of the text (and of the images' bytes, for a row that has images):
    ``eval_fraction`` of rows, else ``num_eval`` rows."""
    keyed = [(stable_hash(cfg.seed, "eval", *_problem(p)), i) for i, p in enumerate(prompts)]
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
    """Training prompts that are not an eval prompt (same text, and same images); an error if none is left."""
    eval_problems = {_problem(p) for p in evals}
    kept = [p for p in train if _problem(p) not in eval_problems]
    if not kept:
        raise ConfigError(f"{source}: holding out {len(evals)} eval rows leaves no training rows "
                          f"(of {len(train)}); lower task.num_eval (now {cfg.num_eval}) or set task.eval_fraction")
    return kept


def _problem(prompt: Prompt) -> tuple[str, ...]:
    """What makes two rows the same problem: the text, plus a digest of the images' bytes when there are
    some (``(text,)`` alone for a text row, so its split hash is the one it always had)."""
    if not prompt.images:
        return (prompt.text,)
    digest = hashlib.blake2b(digest_size=16)
    for image in prompt.images:
        data = _image_bytes(image)
        digest.update(len(data).to_bytes(8, "little") + data)
    return prompt.text, digest.hexdigest()


def _image_bytes(image: Any) -> bytes:
    """The bytes that identify an image in ``meta["images"]``: a data URL's (or path's) text, raw bytes, or
    a PIL image's pixels; row adapters store data URLs, the rest is for prompts built by hand."""
    if isinstance(image, str):
        return image.encode()
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if hasattr(image, "tobytes"):
        return repr((image.mode, image.size)).encode() + image.tobytes()
    return repr(image).encode()


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
