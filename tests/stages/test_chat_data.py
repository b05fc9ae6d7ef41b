"""Rows -> ids and masks through the chat template; bad rows counted and named; the three file formats."""

import json

import pytest

from tidal.models import tiny
from tidal.stages.chat_data import (
    DataError,
    encode_all,
    encode_pair,
    encode_sft,
    load_examples,
    read_rows,
    summary,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}


def test_assistant_mask_is_the_content_and_its_end_marker(chat_tok):
    ex = encode_sft(chat_tok, CHAT, 100)
    assert chat_tok.decode(ex.ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    marked = [t for t, m in zip(chat_tok.convert_ids_to_tokens(ex.ids), ex.mask) if m]
    assert marked == ["o", "k", "<|im_end|>"]


def test_prompt_completion_is_the_same_chat(chat_tok):
    a = encode_sft(chat_tok, CHAT, 100)
    b = encode_sft(chat_tok, {"prompt": "hi", "completion": "ok"}, 100)
    assert (a.ids, a.mask) == (b.ids, b.mask)


def test_two_assistant_turns_are_both_marked(chat_tok):
    row = {"messages": CHAT["messages"] + [{"role": "user", "content": "x"}, {"role": "assistant", "content": "yz"}]}
    ex = encode_sft(chat_tok, row, 100)
    assert "".join(t for t, m in zip(chat_tok.convert_ids_to_tokens(ex.ids), ex.mask) if m) == \
        "ok<|im_end|>yz<|im_end|>"


def test_pair_completion_follows_the_generation_prompt(chat_tok):
    ex = encode_pair(chat_tok, {"prompt": "hi", "chosen": "ab", "rejected": "c"}, 100)
    toks = chat_tok.convert_ids_to_tokens(ex.chosen_ids)
    assert [t for t, m in zip(toks, ex.chosen_mask) if m] == ["a", "b", "<|im_end|>", "\n"]
    assert sum(ex.rejected_mask) == 3 and ex.chosen_ids[:10] == ex.rejected_ids[:10]


def test_bad_rows_are_counted_and_named(chat_tok, tmp_path):
    rows = [CHAT, {"messages": [{"role": "user", "content": "only a question"}]}, {"question": "no chat"}, CHAT]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{torn\n")
    good, line = load_examples(str(path), encode_sft, chat_tok, 100)
    assert len(good) == 2
    assert line == (f"{path}: 2 rows, 3 skipped: 'no assistant turn' x1 (rows 2); \"needs 'messages', "
                    "'prompt'/'completion' or 'text', has ['question']\" x1 (rows 3); 'not JSON' x1 (rows 5)")


def test_bad_pairs_are_named(chat_tok):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "a"}, {"prompt": "p", "chosen": "", "rejected": "b"},
            {"prompt": "p", "chosen": "a"}, {"prompt": "p", "chosen": "a", "rejected": "b"}]
    good, bad = encode_all(rows, encode_pair, chat_tok, 100)
    assert len(good) == 1
    assert [(b.index, b.reason) for b in bad] == [(1, "chosen == rejected"), (2, "empty chosen"),
                                                 (3, "missing ['rejected']")]
    assert summary("x", 1, bad).startswith("x: 1 rows, 3 skipped: 'chosen == rejected' x1 (rows 1)")


def test_a_template_without_generation_marks_derives_the_same_mask(chat_tok):
    tok = tiny.build_chat_tokenizer()  # ChatML without {% generation %}: the mask comes from the template's turns
    ex, want = encode_sft(tok, CHAT, 100), encode_sft(chat_tok, CHAT, 100)
    assert (ex.ids, ex.mask) == (want.ids, want.mask)


def test_a_template_that_renders_no_assistant_turn_is_named():
    tok = tiny.build_chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                         "{% endfor %}")
    _, bad = encode_all([CHAT], encode_sft, tok, 100)
    assert bad[0].reason == "the chat template renders no assistant tokens"


def test_no_usable_row_is_one_error(chat_tok, tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(DataError, match="no usable rows"):
        load_examples(str(path), encode_sft, chat_tok, 100)


def test_jsonl_parquet_and_saved_dataset_read_the_same(tmp_path):
    import datasets

    rows = [CHAT, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "r.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    want = read_rows(tmp_path / "r.jsonl")
    assert read_rows(tmp_path / "r.parquet") == want
    assert read_rows(tmp_path / "saved") == want
    assert read_rows(tmp_path / "dict", split="train") == want
    with pytest.raises(DataError, match="not 'test'"):
        read_rows(tmp_path / "dict", split="test")


def test_plain_template_prompts_the_model_as_rl_does():
    from tidal.rollout.requests import prompt_ids
    from tidal.stages.chat_data import PLAIN_TEMPLATE
    from tidal.types import Prompt

    tok = tiny.build_tokenizer()
    tok.chat_template = PLAIN_TEMPLATE
    ex = encode_sft(tok, {"prompt": "what is 2+3?", "completion": "5"}, 100)
    rl_prompt = list(prompt_ids(tok, Prompt("u", "what is 2+3?", "5")))
    assert ex.ids == rl_prompt + [tok.convert_tokens_to_ids("5"), tok.eos_token_id]
    assert ex.mask == [0] * len(rl_prompt) + [1, 1]
    pair = encode_pair(tok, {"prompt": "what is 2+3?", "chosen": "5", "rejected": "6"}, 100)
    assert pair.chosen_ids[: len(rl_prompt)] == rl_prompt and sum(pair.chosen_mask) == 2


def test_text_rows_train_on_every_token():
    tok = tiny.build_tokenizer()
    ex = encode_sft(tok, {"text": "1+2=3"}, 100)
    assert ex.ids[0] == tok.bos_token_id and ex.ids[-1] == tok.eos_token_id and len(ex.ids) == 7
    assert ex.mask == [1] * 7


def test_bad_lines_are_grouped_by_reason_and_numbered_by_line(chat_tok, tmp_path):
    """Issue 50: every reason used to carry its line number ("line 5 is not JSON"), so no two grouped, while the
    rows beside them were numbered from 0. One reason per kind, counted; rows numbered by line, from 1 (a
    blank line keeps its number)."""
    path = tmp_path / "x.jsonl"
    lines = [json.dumps(CHAT), "{torn", "", "[1, 2]", "not json", json.dumps(CHAT), "{also torn", "[3]"]
    path.write_text("\n".join(lines) + "\n")
    good, line = load_examples(str(path), encode_sft, chat_tok, 100)
    assert len(good) == 2
    assert line == f"{path}: 2 rows, 5 skipped: 'not JSON' x3 (rows 2, 5, 7); 'not a JSON object' x2 (rows 4, 8)"


def test_many_reasons_are_counted_past_the_first_five(chat_tok):
    rows = [CHAT] + [{f"only{i}": 1} for i in range(8)]  # eight reasons, each once
    _, bad = encode_all(rows, encode_sft, chat_tok, 100)
    line = summary("x", 1, bad)
    assert line.count("x1 (rows") == 5 and line.endswith("; 3 other reasons x3"), line


def test_a_binary_file_is_one_error(chat_tok, tmp_path):
    """A binary file named .jsonl (here: random bytes with NULs) used to give a reason per "line" of it (152 on
    a small model file); it is one DataError saying what it is."""
    import random

    path = tmp_path / "model.jsonl"
    rng = random.Random(0)
    path.write_bytes(bytes(rng.randrange(256) for _ in range(20_000)))
    with pytest.raises(DataError, match=r"model\.jsonl: this is not a JSONL text file \(a NUL byte at offset \d+\)"):
        load_examples(str(path), encode_sft, chat_tok, 100)
    path.write_bytes(b"\x9c\xf0" * 4000 + b"\n")  # no NUL, but not UTF-8 either
    with pytest.raises(DataError, match="this is not a JSONL text file"):
        load_examples(str(path), encode_sft, chat_tok, 100)


def test_a_message_whose_content_is_not_text_is_refused_by_row_and_key(chat_tok):
    """Issue 50: numeric user content and a null assistant turn rendered as "5" and "None" and trained on."""
    rows = [CHAT,
            {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": None}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
            {"prompt": 7, "completion": "x"},
            {"prompt": "p", "completion": [{"role": "assistant"}]},
            {"messages": [{"content": "hi"}, {"role": "assistant", "content": "ok"}]},
            {"messages": ["hi", {"role": "assistant", "content": "ok"}]},
            {"prompt": "p", "chosen": 3, "rejected": "b"}]
    _, bad = encode_all(rows, encode_sft, chat_tok, 100)
    assert [(b.index, b.reason) for b in bad][:6] == [
        (2, "messages[0].content must be a string, got a number"),
        (3, "messages[1].content must be a string, got null"),
        (4, "prompt must be a string or a list of messages, got a number"),
        (5, "completion[0].content must be a string, got null"),
        (6, "messages[0].role must be a string, got null"),
        (7, "messages[0] must be a message (an object with role and content), got a string")]
    _, bad = encode_all(rows[-1:], encode_pair, chat_tok, 100)
    assert bad[0].reason == "chosen must be a string or a list of messages, got a number"
    calls = {"messages": [{"role": "user", "content": "2*3?"},
                          {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                              "name": "calc", "arguments": "{}"}}]},
                          {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]}
    assert encode_all([calls], encode_sft, chat_tok, 200)[1] == []  # null content beside tool calls is a turn


def test_a_huge_row_is_cut_by_characters_before_tokenizing(chat_tok, monkeypatch):
    """Issue 50: a 5 MB row was tokenized whole (2.6 GB, 23 s) before the cut to max_length. Now at most
    ``char_budget`` characters of content are tokenized, and the ids and mask are the whole row's, cut."""

    def char_budget(tok, max_length):  # chat_data.char_budget's rule: 2 x max_length x the longest token
        return 2 * max_length * max(len(t) for t in tok.get_vocab())

    long_answer = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab " * 5_000}]}
    whole = chat_tok.apply_chat_template(long_answer["messages"], tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
    budget = char_budget(chat_tok, 100)
    assert budget < 10_000
    seen = []  # the length of every text a tokenizer is given (apply_chat_template calls it too)
    real_call = type(chat_tok).__call__

    def call(this, text, *a, **k):
        seen.append(len(text))
        return real_call(this, text, *a, **k)

    monkeypatch.setattr(type(chat_tok), "__call__", call)
    huge_prompt = {"messages": [{"role": "user", "content": "x" * 5_000_000}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(ValueError, match="no assistant token within max_length=100"):
        encode_sft(chat_tok, huge_prompt, 100)
    ex = encode_sft(chat_tok, long_answer, 100)
    assert (ex.ids, ex.mask) == (list(whole["input_ids"])[:100], list(whole["assistant_masks"])[:100])
    with pytest.raises(ValueError, match="no completion token within max_length=100"):
        encode_pair(chat_tok, {"prompt": "y" * 5_000_000, "chosen": "a", "rejected": "b"}, 100)
    assert seen and max(seen) <= budget + 200, max(seen)  # the content's budget, plus the template's markers
    tok, seen[:] = tiny.build_tokenizer(), []
    text = encode_sft(tok, {"text": "1+2=3 " * 1_000_000}, 100)
    assert text.ids == [tok.bos_token_id] + tok("1+2=3 " * 20, add_special_tokens=False).input_ids[:99]
    assert max(seen) <= char_budget(tok, 100), max(seen)
