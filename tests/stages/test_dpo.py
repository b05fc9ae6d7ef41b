"""The DPO stage: reference log-probs once, before training, from the starting policy; kept for --resume."""

import json
import math

import pytest
import torch

from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.stages import dpo, synthetic
from tidal.stages.chat_data import encode_pair

from .conftest import SMALL


@pytest.fixture(scope="module")
def domain(tmp_path_factory):
    return synthetic.build(tmp_path_factory.mktemp("dom"), num_sft=50, num_pairs=80, num_eval=20)


def _cfg(data, **extra):
    sets = [f"data.path={data}", "run.steps=3", "run.save_every=2", "run.eval_every=3", "run.batch_size=8",
            "optim.lr=1e-3", "run.threads=1", "data.max_length=40", "ref_batch_size=16"]
    sets += [f"model.{k}={v}" for k, v in SMALL.items()] + ["model.tokenizer=chat"]
    sets += [f"{k}={v}" for k, v in extra.items()]
    return apply_overrides(dpo.DPOStageConfig(), sets)


def test_first_step_loss_is_log_2_and_reference_is_the_start(domain, tmp_path):
    """Policy == reference at step 1, so h = 0 for every pair: the sigmoid loss is log 2 exactly (up to
    the packing of the reference pass in other batches)."""
    dpo.train(_cfg(domain["pairs"]), str(tmp_path / "r"), log=lambda s: None)
    first = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["train/loss"] - math.log(2)) < 1e-5, first
    saved = torch.load(tmp_path / "r" / "reference_logps.pt")
    cfg = _cfg(domain["pairs"])
    start = tiny.build_model(tiny.ModelConfig(**SMALL, tokenizer="chat"), tiny.build_chat_tokenizer())
    _, tok = tiny.load(tmp_path / "r" / "model")
    rows = [json.loads(line) for line in domain["pairs"].read_text().splitlines()]
    pairs = [encode_pair(tok, r, cfg.data.max_length) for r in rows]
    direct = dpo.reference_logps(start, pairs, 64, 40)
    found = {tuple(map(float, r)) for r in saved["train"]} | {tuple(map(float, r)) for r in saved["held"]}
    assert len(found) == len(pairs) > 0
    assert all(min(max(abs(a - float(x)), abs(b - float(y))) for a, b in found) < 1e-4 for x, y in direct)


def test_resume_reads_the_saved_reference(domain, tmp_path):
    cfg = _cfg(domain["pairs"], **{"run.steps": 2})
    dpo.train(cfg, str(tmp_path / "r"), log=lambda s: None)
    before = torch.load(tmp_path / "r" / "reference_logps.pt")
    lines = []
    dpo.train(_cfg(domain["pairs"], **{"run.steps": 3}), str(tmp_path / "r"), resume=True, log=lines.append)
    after = torch.load(tmp_path / "r" / "reference_logps.pt")
    assert torch.equal(before["train"], after["train"]) and not any("reference log-probs" in s for s in lines)


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "simpo"])
def test_every_loss_trains(domain, tmp_path, loss_type):
    last = dpo.train(_cfg(domain["pairs"], loss_type=loss_type, **{"run.steps": 2, "run.eval_every": 2}),
                     str(tmp_path / loss_type), log=lambda s: None)
    assert math.isfinite(last["eval/loss"]) and 0 <= last["eval/pref_acc"] <= 1
    assert (tmp_path / loss_type / "model" / "model.safetensors").exists()
