"""Tiny teachers and run configs for the distillation tests (seconds on CPU)."""

import pytest

from tidal.models import tiny
from tidal.models.tiny import ModelConfig

from ..system.test_controller import tiny_cfg


@pytest.fixture
def teacher_dir(tmp_path):
    """A tiny model with the student's tokenizer but its own (random) weights: a teacher that disagrees."""
    tok = tiny.build_tokenizer()
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64, init_seed=7)
    path = tmp_path / "teacher"
    tiny.save(tiny.build_model(cfg, tok), tok, path)
    return path


@pytest.fixture
def cfg_for(tmp_path):
    return lambda *extra: tiny_cfg(tmp_path, *extra)
