"""Chat SFT: the packed loss equals the padded one, resume replays the same run, the export loads."""

import json

import pytest
import torch

from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.stages import sft, synthetic
from tidal.stages.chat_data import encode_sft
from tidal.stages.common import StageDirError

from .conftest import SMALL


def test_packed_loss_equals_padded_loss(chat_tok):
    model = tiny.build_model(tiny.ModelConfig(**SMALL), chat_tok).eval()
    rows = [{"prompt": "what is 1+2?", "completion": "3"}, {"prompt": "hi", "completion": "hello there"},
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}, {"role": "assistant", "content": "dd"}]}]
    examples = [encode_sft(chat_tok, r, 128) for r in rows]
    with torch.no_grad():
        total, count = sft.nll_sum(model, examples, pack_length=64, attention="dense")
        ids, lengths = sft.padded([e.ids for e in examples])
        attn = (torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
        token_logp = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        mask = sft.masks(examples, ids.shape[1])[:, 1:]
    assert count == int(mask.sum()) == 2 + 12 + 2 + 3  # "3"+end, "hello there"+end, "b"+end, "dd"+end
    assert abs(float(total) - float(-(token_logp * mask).sum())) < 1e-4


def _cfg(data, **extra):
    sets = [f"data.path={data}", "run.steps=4", "run.save_every=2", "run.eval_every=2", "run.batch_size=8",
            "optim.lr=1e-3", "run.threads=1", "data.max_length=40", "pack_length=80"]
    sets += [f"model.{k}={v}" for k, v in SMALL.items()] + ["model.tokenizer=chat"]
    sets += [f"{k}={v}" for k, v in extra.items()]
    return apply_overrides(sft.SFTStageConfig(), sets)


@pytest.fixture(scope="module")
def domain(tmp_path_factory):
    return synthetic.build(tmp_path_factory.mktemp("dom"), num_sft=120, num_pairs=120, num_eval=20)


def test_resume_continues_the_same_run(domain, tmp_path):
    straight = sft.train(_cfg(domain["sft"]), str(tmp_path / "a"), log=lambda s: None)
    with pytest.raises(RuntimeError, match="stop"):  # a crash after step 3 (step 2's checkpoint is the last)
        sft.train(_cfg(domain["sft"], **{"run.steps": 3, "run.save_every": 2}), str(tmp_path / "b"),
                  log=lambda s: (_ for _ in ()).throw(RuntimeError("stop")) if "step 3" in s else None)
    resumed = sft.train(_cfg(domain["sft"]), str(tmp_path / "b"), resume=True, log=lambda s: None)
    for key in ("perf/tokens_per_s", "perf/wall_s", "perf/train_s"):
        del resumed[key], straight[key]
    assert resumed == pytest.approx(straight, rel=1e-5), (resumed, straight)
    a, _ = tiny.load(tmp_path / "a" / "model")
    b, _ = tiny.load(tmp_path / "b" / "model")
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_export_is_a_model_path_with_its_template(domain, tmp_path):
    sft.train(_cfg(domain["sft"], **{"run.steps": 1}), str(tmp_path / "r"), log=lambda s: None)
    model, tok = tiny.load(tmp_path / "r" / "model")
    assert "{% generation %}" in tok.chat_template
    with pytest.raises(StageDirError, match="--resume"):
        sft.train(_cfg(domain["sft"], **{"run.steps": 1}), str(tmp_path / "r"), log=lambda s: None)
    # the next stage starts from it
    sft.train(_cfg(domain["sft"], **{"run.steps": 1, "model.path": str(tmp_path / "r" / "model")}),
              str(tmp_path / "next"), log=lambda s: None)
