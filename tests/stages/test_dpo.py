"""The DPO stage: reference log-probs once, before training, from the starting policy; kept for --resume."""

import json
import math

import pytest
import torch

from tidal.config import ConfigError, apply_overrides
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


def _swapped(src, dst):
    """The same prompts, count and lengths with chosen and rejected swapped: other rows of the same size."""
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    dst.write_text("".join(json.dumps({**r, "chosen": r["rejected"], "rejected": r["chosen"]}) + "\n" for r in rows))
    return dst


def test_resume_checks_the_saved_reference_by_content(domain, tmp_path):
    """Issue 50 item 9: only the row count was checked, so another data file of the same size (or another
    reference model) resumed on the old rows' reference log-probs. Each is one line naming what differs."""
    dpo.train(_cfg(domain["pairs"], **{"run.steps": 2}), str(tmp_path / "r"), log=lambda s: None)
    other = _swapped(domain["pairs"], tmp_path / "swapped.jsonl")
    with pytest.raises(ConfigError, match=r"train rows are not those .*data\.path=.*swapped\.jsonl") as e:
        dpo.train(_cfg(other, **{"run.steps": 3}), str(tmp_path / "r"), resume=True, log=lambda s: None)
    assert "\n" not in str(e.value) and "reference model" not in str(e.value)
    tok = tiny.build_chat_tokenizer()
    ref = tiny.build_model(tiny.ModelConfig(**SMALL, tokenizer="chat", init_seed=7), tok)
    tiny.save(ref, tok, tmp_path / "ref")
    with pytest.raises(ConfigError, match=r"reference model differs .*ref\b") as e:
        dpo.train(_cfg(domain["pairs"], ref_path=tmp_path / "ref", **{"run.steps": 3}), str(tmp_path / "r"),
                  resume=True, log=lambda s: None)
    assert "rows" not in str(e.value).split("reference_logps.pt")[1]
    dpo.train(_cfg(domain["pairs"], **{"run.steps": 3}), str(tmp_path / "r"), resume=True, log=lambda s: None)


def test_lora_dpo_starts_at_the_reference_and_trains_adapters(domain, tmp_path):
    """Issue 50 item 10 for DPO: the reference pass runs on the base, then adapters (B = 0: the base itself) are
    trained, so step 1's loss is log 2 as without LoRA, and the checkpoints hold adapters only."""
    pytest.importorskip("peft")
    from tidal.train.checkpoint import latest_checkpoint

    tok = tiny.build_chat_tokenizer()
    tiny.save(tiny.build_model(tiny.ModelConfig(**SMALL, tokenizer="chat"), tok), tok, tmp_path / "base")
    cfg = _cfg(domain["pairs"], **{"run.steps": 2, "model.path": tmp_path / "base", "model.lora.rank": 2})
    dpo.train(cfg, str(tmp_path / "r"), log=lambda s: None)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[0]["train/loss"] - math.log(2)) < 1e-5 and rows[1]["train/grad_norm"] > 0
    ckpt = latest_checkpoint(tmp_path / "r" / "checkpoints")
    assert (ckpt / "adapter_config.json").exists() and not (ckpt / "model.safetensors").exists()
    assert (tmp_path / "r" / "model" / "model.safetensors").exists()  # merged: a plain model.path


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "simpo"])
def test_every_loss_trains(domain, tmp_path, loss_type):
    last = dpo.train(_cfg(domain["pairs"], loss_type=loss_type, **{"run.steps": 2, "run.eval_every": 2}),
                     str(tmp_path / loss_type), log=lambda s: None)
    assert math.isfinite(last["eval/loss"]) and 0 <= last["eval/pref_acc"] <= 1
    assert (tmp_path / loss_type / "model" / "model.safetensors").exists()
