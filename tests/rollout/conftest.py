"""Fixtures of the episode tests: the tiny model and a BPE tokenizer with its own model."""

import pytest

from tidal.models import tiny

from .bpe_fixture import build_bpe_tokenizer
from .episode_support import TINY


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny.build_model(TINY, tokenizer)


@pytest.fixture(scope="module")
def bpe():
    tok = build_bpe_tokenizer(vocab_size=240)
    return tok, tiny.build_model(TINY, tok)
