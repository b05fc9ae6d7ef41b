"""Chat and preference rows -> token ids and loss masks, through the tokenizer's own chat template.

Rows come from JSONL, Parquet or a Hugging Face dataset saved with ``save_to_disk`` (``read_rows``).

SFT rows: ``messages`` (a chat) or ``prompt``/``completion`` (strings, wrapped as one user turn and one
assistant turn, or message lists, concatenated), or ``text`` (domain-adaptive pre-training: BOS + text + EOS,
every token in the loss, as TRL's language-modeling rows). The loss mask is the template's own assistant mask:
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks the tokens its ``{% generation %}``
blocks render, the same call TRL's ``assistant_only_loss`` makes (``sft_trainer.py``, tokenize_fn). Pieces
are never tokenized separately and glued: the template decides where a turn starts and ends.

Preference rows (DPO, reward model): ``prompt``, ``chosen``, ``rejected`` (strings or message lists). The
completion is what follows the prompt rendered with ``add_generation_prompt=True``, the longest common
prefix of the prompt's and the prompt+completion's ids, as TRL's DPO collator counts it (``dpo_trainer.py``).

Bad rows are skipped, counted and named (``BadRow``): no assistant turn, a template that marks no assistant
tokens, empty ``chosen``, ``chosen == rejected``, a row longer than ``max_length`` after truncation leaves
nothing to learn from. Never a traceback: the stage prints ``summary`` and trains on the rest.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ChatML (Qwen2.5's markers) with the assistant turn inside ``{% generation %}``: the content and its
# ``<|im_end|>`` are what the model must learn to write (the turn's end is how it stops), the newline after
# it and the role header are the template's. The tiny chat tokenizer (``models/tiny.py``) has every marker.
GENERATION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# The plain rendering single-turn RL uses (``rollout/requests.prompt_ids``: BOS + the prompt's text; the model
# answers and ends with EOS), as a chat template: a model trained with it is prompted by RL exactly as it
# was trained. For base models and the tiny model's character tokenizer (no chat markers).
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")


class DataError(ValueError):
    """A data file that cannot be read at all (missing, wrong format, no usable rows); one line."""


@dataclass
class BadRow:
    index: int
    reason: str


@dataclass
class SFTExample:
    ids: list[int]
    mask: list[int]
    """1 where token t is an assistant token the model must predict (the loss counts it)."""


@dataclass
class PairExample:
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]


def read_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` file (a line that is not a JSON object becomes ``{"__bad__": reason}``,
    named later), a ``.parquet`` file, or a ``save_to_disk`` directory (a DatasetDict: its ``split``)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"no data at {path}")
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"{path} is not a dataset saved with save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{path} has splits {sorted(ds)}, not {split!r}")
            ds = ds[split]
        return list(ds)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    row = {"__bad__": f"line {n} is not JSON"}
                rows.append(row if isinstance(row, dict) else {"__bad__": f"line {n} is not a JSON object"})
        return rows
    raise DataError(f"{path}: expected .jsonl, .parquet or a save_to_disk directory")


def _as_messages(value: Any, role: str) -> list[dict[str, Any]]:
    """A string becomes one ``role`` turn; a message list is used as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return value
    raise ValueError(f"expected a string or a list of messages, got {type(value).__name__}")


def sft_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in row:
        return _as_messages(row["messages"], "user")
    if "prompt" in row and "completion" in row:
        return _as_messages(row["prompt"], "user") + _as_messages(row["completion"], "assistant")
    raise ValueError(f"needs 'messages', 'prompt'/'completion' or 'text', has {sorted(row)}")


def _template(tokenizer, messages, **kwargs) -> dict[str, list[int]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return {k: list(v) for k, v in out.items()}


def encode_sft(tokenizer, row: dict[str, Any], max_length: int) -> SFTExample:
    """Ids and assistant mask of one SFT row (``ValueError`` with the reason for a bad row)."""
    if "__bad__" in row:
        raise ValueError(row["__bad__"])
    if isinstance(row.get("text"), str) and "messages" not in row:  # raw text (DAPT): every token counts
        ids = tokenizer(row["text"], add_special_tokens=False).input_ids
        ids = [tokenizer.bos_token_id] * (tokenizer.bos_token_id is not None) + ids + [tokenizer.eos_token_id]
        if len(ids) < 2:
            raise ValueError("empty text")
        return SFTExample(ids[:max_length], [1] * min(len(ids), max_length))
    messages = sft_messages(row)
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("no assistant turn")
    out = _template(tokenizer, messages, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    if 1 not in mask:
        raise ValueError("the chat template marks no assistant tokens (it needs {% generation %} blocks)")
    ids, mask = ids[:max_length], mask[:max_length]
    if 1 not in mask[1:]:  # token 0 is never predicted
        raise ValueError(f"no assistant token within max_length={max_length}")
    return SFTExample(ids, mask)


def _completion(tokenizer, prompt, completion, max_length: int) -> tuple[list[int], list[int]]:
    prompt_ids = _template(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
    ids = _template(tokenizer, prompt + completion)["input_ids"]
    start = 0
    while start < min(len(prompt_ids), len(ids)) and prompt_ids[start] == ids[start]:
        start += 1
    mask = [0] * start + [1] * (len(ids) - start)
    ids, mask = ids[:max_length], mask[:max_length]
    if 1 not in mask[1:]:
        raise ValueError(f"no completion token within max_length={max_length}")
    return ids, mask


def encode_pair(tokenizer, row: dict[str, Any], max_length: int) -> PairExample:
    """Ids and completion masks of the chosen and rejected conversations of one preference row."""
    if "__bad__" in row:
        raise ValueError(row["__bad__"])
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise ValueError(f"missing {missing}")
    for key in ("chosen", "rejected"):
        value = row[key]
        if not value or (isinstance(value, list) and not any(m.get("content") for m in value)):
            raise ValueError(f"empty {key}")
    if row["chosen"] == row["rejected"]:
        raise ValueError("chosen == rejected")
    prompt = _as_messages(row["prompt"], "user")
    chosen = _completion(tokenizer, prompt, _as_messages(row["chosen"], "assistant"), max_length)
    rejected = _completion(tokenizer, prompt, _as_messages(row["rejected"], "assistant"), max_length)
    return PairExample(*chosen, *rejected)


def encode_all(rows: list[dict[str, Any]], encode, tokenizer, max_length: int) -> tuple[list, list[BadRow]]:
    """(the good rows' examples, the bad rows with their reasons); a bad row's error never escapes."""
    good, bad = [], []
    for i, row in enumerate(rows):
        try:
            good.append(encode(tokenizer, row, max_length))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            bad.append(BadRow(i, str(e).splitlines()[0] if str(e) else type(e).__name__))
    return good, bad


def summary(name: str, num_good: int, bad: list[BadRow], shown: int = 3) -> str:
    """One line per reason: ``train: 98 rows, 2 skipped: 'no assistant turn' x2 (rows 4, 17)``."""
    if not bad:
        return f"{name}: {num_good} rows"
    by_reason = Counter(b.reason for b in bad)
    parts = []
    for reason, count in by_reason.most_common():
        rows = [b.index for b in bad if b.reason == reason]
        more = f", ... {len(rows) - shown} more" if len(rows) > shown else ""
        parts.append(f"{reason!r} x{count} (rows {', '.join(map(str, rows[:shown]))}{more})")
    return f"{name}: {num_good} rows, {len(bad)} skipped: " + "; ".join(parts)


def load_examples(path: str, encode, tokenizer, max_length: int, split: str = "train") -> tuple[list, str]:
    """Read and encode ``path``; (examples, summary line). No usable row at all is a ``DataError``."""
    good, bad = encode_all(read_rows(path, split), encode, tokenizer, max_length)
    line = summary(str(path), len(good), bad)
    if not good:
        raise DataError(f"no usable rows in {line}")
    return good, line
