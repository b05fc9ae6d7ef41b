"""Chat and preference rows -> token ids and loss masks, through the tokenizer's own chat template.

Rows come from JSONL, Parquet or a Hugging Face dataset saved with ``save_to_disk`` (``read_rows``).

SFT rows: ``messages`` (a chat) or ``prompt``/``completion`` (strings, wrapped as one user turn and one
assistant turn, or message lists, concatenated), or ``text`` (domain-adaptive pre-training: BOS + text + EOS,
every token in the loss, as TRL's language-modeling rows). The loss mask marks the assistant's tokens, found
one of two ways (``assistant_mask``; pieces are never tokenized separately and glued, the template decides where
a turn starts and ends):

- a template with ``{% generation %}`` blocks marks them itself: ``apply_chat_template(...,
  return_assistant_tokens_mask=True)``, the same call TRL's ``assistant_only_loss`` makes (``sft_trainer.py``,
  tokenize_fn), so a tagged template's author decides;
- most shipped templates (SmolLM2's, Qwen2.5's, Llama 3's) have none, and their mask is derived from the
  template itself (``derived_mask``): assistant turn i is what ``messages[:i+1]`` renders past ``messages[:i]``
  rendered with the generation prompt, i.e. exactly what the model writes after being prompted at inference:
  its content and the end-of-turn marker it must learn to stop with (``<|im_end|>``, ``<|eot_id|>``, EOS), not
  the whitespace the template writes after that marker (ChatML's newline: generation stops at the marker, so
  the model never writes it). On tidal's tagged templates this equals the tags' mask token for token.

Preference rows (DPO, reward model): ``prompt``, ``chosen``, ``rejected`` (strings or message lists). The
completion is what follows the prompt rendered with ``add_generation_prompt=True``, the longest common
prefix of the prompt's and the prompt+completion's ids, as TRL's DPO collator counts it (``dpo_trainer.py``).

Bad rows are skipped, counted and named (``BadRow``): no assistant turn, a template whose assistant tokens
cannot be told apart (``derived_mask`` names the turn), a template that raises, empty ``chosen``,
``chosen == rejected``, a message whose content is not text (``messages[1].content`` null or a number: a
template would render it as ``None`` or ``5`` and train on that), a row longer than
``max_length`` after truncation leaves nothing to learn from. Never a traceback: the stage prints ``summary``
(one part per reason, counted) and trains on the rest. Rows are numbered from 1, a JSONL file's by its line
numbers (blank lines keep theirs), as RL's task files number them. A file that is not text at all (a model,
an archive) is one ``DataError``, not one bad row per line.

A row is never tokenized whole: only the first ``max_length`` tokens are kept, and a token spans at most as
many characters as the tokenizer's longest token (K), so the content is cut at ``2 * max_length * K``
characters before the template renders it (``char_budget``). A 5 MB row used to take 2.6 GB and 23 s of
tokenizing before its error; now it costs what a row of that budget costs. The ids are those of the whole
row cut to ``max_length``: the cut lies ``max_length`` tokens past the kept ones (a tokenizer that maps a
long unknown run to one token, which breaks the bound, is caught by the count and tokenized whole).
"""

from __future__ import annotations

import json
import re
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
    """The row's number, from 1 (a JSONL file's line number)."""
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


BINARY_PROBE = 8192
"""Bytes read from the start of a JSONL file to tell text from binary data."""


def _binary(head: bytes) -> str | None:
    """Why ``head`` is not the start of a text file (a NUL byte, or bytes that are mostly not UTF-8), or None."""
    nul = head.find(b"\0")
    if nul >= 0:
        return f"a NUL byte at offset {nul}"
    bad = head.decode("utf-8", "replace").count("\ufffd")
    return f"{bad} of its first {len(head)} bytes are not UTF-8" if bad > len(head) // 20 else None


def _jsonl_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) per non-blank line, decoded line by line: a stray byte costs its line, while a binary
    file (a model, an archive named ``.jsonl``) is one error, not a reason per line."""
    with open(path, "rb") as f:
        why = _binary(f.read(BINARY_PROBE))
        if why is not None:
            raise DataError(f"{path}: this is not a JSONL text file ({why})")
        f.seek(0)
        rows = []
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                row = {"__bad__": "not UTF-8 text"}
            except ValueError:
                row = {"__bad__": "not JSON"}
            rows.append((n, row if isinstance(row, dict) else {"__bad__": "not a JSON object"}))
    return rows


def read_numbered(path: str | Path, split: str = "train") -> list[tuple[int, dict[str, Any]]]:
    """(row number, row) of a ``.jsonl`` file (numbered by line; a line that is not a JSON object becomes
    ``{"__bad__": reason}``, named later), a ``.parquet`` file, or a ``save_to_disk`` directory (a
    DatasetDict: its ``split``), numbered from 1."""
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
        return list(enumerate(ds, 1))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_rows(path)
    raise DataError(f"{path}: expected .jsonl, .parquet or a save_to_disk directory")


def read_rows(path: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """The rows of ``read_numbered``, without their numbers."""
    return [row for _, row in read_numbered(path, split)]


def _kind(value: Any) -> str:
    """A JSON value's kind, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _check_message(m: Any, key: str) -> None:
    """A chat message a template can render as text: an object with a string ``role`` and string (or
    content-parts list) ``content``; null content only beside ``tool_calls``."""
    if not isinstance(m, dict):
        raise ValueError(f"{key} must be a message (an object with role and content), got {_kind(m)}")
    if not isinstance(m.get("role"), str):
        raise ValueError(f"{key}.role must be a string, got {_kind(m.get('role'))}")
    content = m.get("content")
    if isinstance(content, (str, list)) or (content is None and m.get("tool_calls")):
        return
    raise ValueError(f"{key}.content must be a string, got {_kind(content)}")


def _as_messages(value: Any, role: str, key: str) -> list[dict[str, Any]]:
    """A string becomes one ``role`` turn; a message list is checked (``_check_message``) and used as it is.
    ``key`` names the row's field in the reason."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        for i, m in enumerate(value):
            _check_message(m, f"{key}[{i}]")
        return value
    raise ValueError(f"{key} must be a string or a list of messages, got {_kind(value)}")


def sft_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in row:
        return _as_messages(row["messages"], "user", "messages")
    if "prompt" in row and "completion" in row:
        return _as_messages(row["prompt"], "user", "prompt") + \
            _as_messages(row["completion"], "assistant", "completion")
    raise ValueError(f"needs 'messages', 'prompt'/'completion' or 'text', has {sorted(row)}")


def char_budget(tokenizer, max_length: int) -> int:
    """Characters of content that hold at least ``2 * max_length`` tokens: a token spans at most K characters,
    K the length of the tokenizer's longest token (a byte-level token's string has one character per byte, so
    it counts at least the characters it stands for). Worked out once per tokenizer."""
    longest = getattr(tokenizer, "_tidal_longest_token", None)
    if longest is None:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        tokenizer._tidal_longest_token = longest
    return 2 * max_length * max(longest, 1)


def _cut(messages: list[dict[str, Any]], budget: int) -> tuple[list[dict[str, Any]], bool]:
    """(the messages with their string contents cut to ``budget`` characters in all, in order; whether any was)."""
    out, cut = [], False
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            if len(content) > budget:
                m, cut = {**m, "content": content[:budget]}, True
            budget -= len(m["content"])
        out.append(m)
    return out, cut


def _template(tokenizer, messages, **kwargs) -> dict[str, list[int]]:
    """The template's ids (and masks); a template that raises (``raise_exception``: roles that do not alternate, a
    system turn it refuses) is the row's error, not a traceback."""
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except TemplateError as e:
        raise ValueError(f"the chat template fails: {e}") from None
    return {k: list(v) for k, v in out.items()}


def _template_cut(tokenizer, messages, max_length: int, **kwargs) -> tuple[dict[str, list[int]], list[dict]]:
    """(``_template`` of ``messages`` whose first ``max_length`` ids and mask are the whole chat's, tokenizing at
    most ``char_budget`` characters of content (module docstring); the messages it rendered, cut or whole)."""
    short, cut = _cut(messages, char_budget(tokenizer, max_length))
    out = _template(tokenizer, short, **kwargs)
    if cut and len(out["input_ids"]) < 2 * max_length:  # tokens longer than K characters (an unknown run)
        return _template(tokenizer, messages, **kwargs), messages
    return out, short


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""``{% generation %}`` and its whitespace-trimming forms (TRL's ``has_generation_markers`` pattern)."""


def has_generation_tags(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant tokens itself (its ``default`` one, when it ships
    named templates, as ``apply_chat_template`` picks)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default", "")
    return isinstance(template, str) and _GENERATION_TAG.search(template) is not None


def assistant_mask(tokenizer) -> str:
    """``template_tags`` when the chat template has ``{% generation %}`` blocks (its author's mask wins, as in
    TRL), else ``derived`` (``derived_mask``). Both agree on tidal's tagged templates, so no setting chooses."""
    return "template_tags" if has_generation_tags(tokenizer) else "derived"


def _shared(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _blank(tokenizer, ids: list[int]) -> bool:
    """Whether ``ids`` decode to whitespace only (or nothing)."""
    return not tokenizer.decode(ids).strip()


def _past_seam(tokenizer, seam: str, ids: list[int], start: int) -> int:
    """The first token of ``ids`` from ``start`` that is not wholly inside ``seam``, the generation prompt's
    trailing whitespace that the whole conversation tokenizes differently (Llama 3's ``\n\n`` is one token
    alone, two before the answer): those tokens are the prompt's, a token that straddles into the turn is the
    turn's (as the tags' character offsets count it)."""
    while seam and start < len(ids):
        piece = tokenizer.decode(ids[start: start + 1])
        if not piece or not seam.startswith(piece):
            break
        seam, start = seam[len(piece):], start + 1
    return start


def derived_mask(tokenizer, messages: list[dict[str, Any]], ids: list[int], limit: int) -> list[int]:
    """The assistant mask of ``ids`` (the template's ids of ``messages``), from the template alone, for templates
    without ``{% generation %}`` blocks. Assistant turn i starts where the ids of ``messages[:i]`` rendered with
    the generation prompt end (the prompt the model answers at inference) and ends where the ids of
    ``messages[:i+1]`` stop agreeing with ``ids``, less the whitespace the template writes after the turn's last
    visible token (ChatML's newline after ``<|im_end|>``: generation stops at the marker). Boundaries are found
    by comparing token ids, so tokenization is the whole conversation's. A turn is skipped once it starts past
    ``limit`` tokens. Two renders per assistant turn (one for a last one), of the turns up to it.

    A template whose rendering of the turns so far is not what the whole conversation renders has no such
    boundary, and the turn is named (``ValueError``) rather than guessed: templates that drop earlier turns'
    reasoning (Qwen3, DeepSeek-R1), or whose generation prompt opens a block the turn does not repeat. Two
    seams are allowed. At the start, whitespace the whole conversation tokenizes differently from the prompt
    alone (``_past_seam``). At the end, tokens the template writes after the last message only, special ones
    (Phi-3's EOS) or whitespace: the last turn keeps them, as TRL's tagged Phi-3 template marks its EOS."""
    mask = [0] * len(ids)
    special: set[int] | None = None
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        where = f"messages[{i}] (assistant)"
        head = _template(tokenizer, messages[:i], add_generation_prompt=True)["input_ids"]
        start = _shared(head, ids)
        if start >= limit:
            break
        if not _blank(tokenizer, head[start:]):
            raise ValueError(f"{where}: the chat template renders the conversation before it, with the generation "
                             "prompt, differently from the whole conversation, so its tokens cannot be told apart "
                             "(give data.chat_template a template with {% generation %} blocks)")
        start = _past_seam(tokenizer, tokenizer.decode(head[start:]), ids, start)
        turn = ids if i + 1 == len(messages) else _template(tokenizer, messages[: i + 1])["input_ids"]
        end = _shared(turn, ids)
        rest = turn[end:]
        if rest:
            special = special if special is not None else \
                set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
            if end < start or not all(t in special or _blank(tokenizer, [t]) for t in rest):
                raise ValueError(f"{where}: the chat template renders this turn differently once later turns "
                                 "follow it (it drops reasoning from earlier turns, say), so its tokens cannot be "
                                 "told apart (give data.chat_template a template with {% generation %} blocks)")
        while end > start and _blank(tokenizer, ids[end - 1: end]):  # the template's whitespace after the turn
            end -= 1
        mask[start:end] = [1] * (end - start)
    return mask


def encode_sft(tokenizer, row: dict[str, Any], max_length: int) -> SFTExample:
    """Ids and assistant mask of one SFT row (``ValueError`` with the reason for a bad row)."""
    if "__bad__" in row:
        raise ValueError(row["__bad__"])
    if isinstance(row.get("text"), str) and "messages" not in row:  # raw text (DAPT): every token counts
        text, budget = row["text"], char_budget(tokenizer, max_length)
        ids = tokenizer(text[:budget], add_special_tokens=False).input_ids
        if len(text) > budget and len(ids) < 2 * max_length:  # tokens longer than K characters: the whole text
            ids = tokenizer(text, add_special_tokens=False).input_ids
        ids = [tokenizer.bos_token_id] * (tokenizer.bos_token_id is not None) + ids + [tokenizer.eos_token_id]
        if len(ids) < 2:
            raise ValueError("empty text")
        return SFTExample(ids[:max_length], [1] * min(len(ids), max_length))
    messages = sft_messages(row)
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("no assistant turn")
    if assistant_mask(tokenizer) == "template_tags":
        out, _ = _template_cut(tokenizer, messages, max_length, return_assistant_tokens_mask=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        if 1 not in mask:
            raise ValueError("the chat template's {% generation %} blocks mark no assistant tokens")
    else:
        out, rendered = _template_cut(tokenizer, messages, max_length)
        ids = out["input_ids"]
        mask = derived_mask(tokenizer, rendered, ids, max_length)
        if 1 not in mask and len(ids) <= max_length:  # else: the turns may start past max_length (below)
            raise ValueError("the chat template renders no assistant tokens")
    ids, mask = ids[:max_length], mask[:max_length]
    if 1 not in mask[1:]:  # token 0 is never predicted
        raise ValueError(f"no assistant token within max_length={max_length}")
    return SFTExample(ids, mask)


def _completion(tokenizer, prompt, completion, max_length: int) -> tuple[list[int], list[int]]:
    chat, cut = _cut(prompt + completion, char_budget(tokenizer, max_length))
    ids = _template(tokenizer, chat)["input_ids"]
    if cut and len(ids) < 2 * max_length:  # tokens longer than K characters (module docstring): the whole chat
        chat = prompt + completion
        ids = _template(tokenizer, chat)["input_ids"]
    prompt_ids = _template(tokenizer, chat[: len(prompt)], add_generation_prompt=True)["input_ids"]
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
    prompt = _as_messages(row["prompt"], "user", "prompt")
    answers = {key: _as_messages(row[key], "assistant", key) for key in ("chosen", "rejected")}
    for key, messages in answers.items():
        if not any(m.get("content") for m in messages):
            raise ValueError(f"empty {key}")
    if row["chosen"] == row["rejected"]:
        raise ValueError("chosen == rejected")
    chosen = _completion(tokenizer, prompt, answers["chosen"], max_length)
    rejected = _completion(tokenizer, prompt, answers["rejected"], max_length)
    return PairExample(*chosen, *rejected)


def encode_all(rows: list[dict[str, Any]], encode, tokenizer, max_length: int,
               numbers: list[int] | None = None) -> tuple[list, list[BadRow]]:
    """(the good rows' examples, the bad rows with their reasons and row numbers: ``numbers``, else 1, 2, ...);
    a bad row's error never escapes."""
    good, bad = [], []
    for n, row in zip(numbers or range(1, len(rows) + 1), rows):
        try:
            good.append(encode(tokenizer, row, max_length))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            bad.append(BadRow(n, str(e).splitlines()[0] if str(e) else type(e).__name__))
    return good, bad


def summary(name: str, num_good: int, bad: list[BadRow], shown: int = 3, reasons: int = 5) -> str:
    """One part per reason, the most common first, counted, with its first row numbers:
    ``train: 98 rows, 2 skipped: 'no assistant turn' x2 (rows 4, 17)``; past ``reasons`` reasons, one part
    counts the rest."""
    if not bad:
        return f"{name}: {num_good} rows"
    groups = Counter(b.reason for b in bad).most_common()
    parts = []
    for reason, count in groups[:reasons]:
        rows = [b.index for b in bad if b.reason == reason]
        more = f", ... {len(rows) - shown} more" if len(rows) > shown else ""
        parts.append(f"{reason!r} x{count} (rows {', '.join(map(str, rows[:shown]))}{more})")
    if len(groups) > reasons:
        parts.append(f"{len(groups) - reasons} other reasons x{sum(c for _, c in groups[reasons:])}")
    return f"{name}: {num_good} rows, {len(bad)} skipped: " + "; ".join(parts)


def load_examples(path: str, encode, tokenizer, max_length: int, split: str = "train") -> tuple[list, str]:
    """Read and encode ``path``; (examples, summary line). No usable row at all is a ``DataError``."""
    numbered = read_numbered(path, split)
    good, bad = encode_all([r for _, r in numbered], encode, tokenizer, max_length, [n for n, _ in numbered])
    line = summary(str(path), len(good), bad)
    if not good:
        raise DataError(f"no usable rows in {line}")
    return good, line
