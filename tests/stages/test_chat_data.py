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
    assert line == (f"{path}: 2 rows, 3 skipped: 'no assistant turn' x1 (rows 1); \"needs 'messages', "
                    "'prompt'/'completion' or 'text', has ['question']\" x1 (rows 2); 'line 5 is not JSON' x1 (rows 4)")


def test_bad_pairs_are_named(chat_tok):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "a"}, {"prompt": "p", "chosen": "", "rejected": "b"},
            {"prompt": "p", "chosen": "a"}, {"prompt": "p", "chosen": "a", "rejected": "b"}]
    good, bad = encode_all(rows, encode_pair, chat_tok, 100)
    assert len(good) == 1
    assert [(b.index, b.reason) for b in bad] == [(0, "chosen == rejected"), (1, "empty chosen"),
                                                 (2, "missing ['rejected']")]
    assert summary("x", 1, bad).startswith("x: 1 rows, 3 skipped: 'chosen == rejected' x1 (rows 0)")


def test_a_template_without_generation_marks_is_named():
    tok = tiny.build_chat_tokenizer()  # ChatML without {% generation %}
    _, bad = encode_all([CHAT], encode_sft, tok, 100)
    assert "marks no assistant tokens" in bad[0].reason


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
