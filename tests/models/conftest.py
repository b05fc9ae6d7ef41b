"""The tiny character-level model (fp32, training mode) and a small left-padded batch for it."""

import pytest
import torch

from tidal.models import tiny


@pytest.fixture(autouse=True)
def _one_thread():
    """These shapes are tiny: a second thread buys nothing and, on a shared machine, oversubscription
    makes a step up to 20x slower (FACTS.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = tiny.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128)
    return tiny.build_model(cfg, tokenizer).train()


@pytest.fixture(scope="module")
def batch(tokenizer):
    """Three rows of 20 random tokens; row 0 is left-padded by 5, as the engines' batches are."""
    ids = torch.randint(3, len(tokenizer), (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return ids, mask

