"""The tiny model's save/load round trip: what comes back tokenizes exactly as what was saved."""

from __future__ import annotations

from tidal.models import tiny


def test_saved_tokenizer_loads_with_its_own_pretokenizer(tmp_path, tokenizer, model):
    # transformers 5's AutoTokenizer maps a qwen2 checkpoint to Qwen2Tokenizer and rebuilds the
    # pre-tokenizer in code: spaces and newlines vanished from every prompt of a loaded tiny model.
    tiny.save(model, tokenizer, tmp_path)
    _, loaded = tiny.load(tmp_path)
    text = "calculate 4 + 1.\nq: (a, b)?"
    want = tokenizer(text, add_special_tokens=False).input_ids
    assert loaded(text, add_special_tokens=False).input_ids == want
    assert len(want) == len(text)  # one token per character, spaces included
    assert loaded.decode(want) == text
    assert loaded.padding_side == "left"
