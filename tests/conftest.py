"""Shared fixtures: a tiny random model + tokenizer (no training), built once per session."""

import pytest
import torch

from tidal.models import tiny


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="session")
def small_model(tokenizer):
    cfg = tiny.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128)
    return tiny.build_model(cfg, tokenizer)
