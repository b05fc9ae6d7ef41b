"""Chat SFT: the packed loss equals the padded one, resume replays the same run, the export loads."""

import json

import pytest
import torch

from tidal.config import ConfigError, apply_overrides
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


def test_resume_on_other_rows_of_the_same_size_is_refused(domain, tmp_path):
    """Issue 50's rule: a resume checks the data it continues on by content. Step k of a resumed run is the k-th
    slice of the run's own rows; on another file of the same size it would train on rows the run never had."""
    sft.train(_cfg(domain["sft"], **{"run.steps": 2}), str(tmp_path / "r"), log=lambda s: None)
    rows = [json.loads(line) for line in domain["sft"].read_text().splitlines()]
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(rows[(i + 1) % len(rows)]) + "\n" for i in range(len(rows))))
    with pytest.raises(StageDirError, match=r"training rows .*other\.jsonl.* are not the rows") as e:
        sft.train(_cfg(other), str(tmp_path / "r"), resume=True, log=lambda s: None)
    assert "\n" not in str(e.value)
    assert f"path: {domain['sft']}" in (tmp_path / "r" / "config.yaml").read_text()  # the run's config, kept


def test_lora_trains_adapters_on_the_frozen_base_and_exports_them_merged(domain, tmp_path):
    """Issue 50 item 10: model.lora.rank=2 was accepted and ignored (every weight trained, the saved config said
    LoRA). Now RL's LoRA code trains rank-2 adapters on the frozen base: checkpoints hold the adapters (PEFT's
    layout), model/ is the base plus a rank-2 delta on each adapted layer and nothing else moved, and a resume
    continues the adapters."""
    pytest.importorskip("peft")
    from tidal.train.checkpoint import latest_checkpoint

    sft.train(_cfg(domain["sft"], **{"run.steps": 1}), str(tmp_path / "base"), log=lambda s: None)
    base_path = tmp_path / "base" / "model"
    lora = {"model.path": base_path, "model.lora.rank": 2, "optim.lr": 1e-2}
    lines = []
    sft.train(_cfg(domain["sft"], **lora, **{"run.steps": 2}), str(tmp_path / "r"), log=lines.append)
    assert any("LoRA rank 2" in line for line in lines), lines
    ckpt = latest_checkpoint(tmp_path / "r" / "checkpoints")
    assert not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / "adapter_config.json").read_text())["r"] == 2
    base, merged = tiny.load(base_path)[0].state_dict(), tiny.load(tmp_path / "r" / "model")[0].state_dict()
    assert set(base) == set(merged)
    adapted = [k for k in base if k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))]
    assert adapted
    for k in base:
        if k in adapted:
            sv = torch.linalg.svdvals(merged[k] - base[k])
            assert sv[0] > 1e-6 and sv[2] < 1e-4 * sv[0], (k, sv[:4])  # moved, by a rank-2 delta
        elif not k.endswith(("proj.weight",)):
            assert torch.equal(merged[k], base[k]), k  # embeddings, norms, biases: frozen
    sft.train(_cfg(domain["sft"], **lora, **{"run.steps": 3}), str(tmp_path / "r"), resume=True, log=lambda s: None)
    with pytest.raises(ConfigError, match=r"model\.lora\.rank=2 \(this run: 4\)"):
        sft.train(_cfg(domain["sft"], **{**lora, "model.lora.rank": 4}, **{"run.steps": 4}), str(tmp_path / "r"),
                  resume=True, log=lambda s: None)


def test_lora_without_a_base_is_one_line(domain, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.lora\.rank=2 needs model\.path") as e:
        sft.train(_cfg(domain["sft"], **{"model.lora.rank": 2}), str(tmp_path / "r"), log=lambda s: None)
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()


def test_export_is_a_model_path_with_its_template(domain, tmp_path):
    sft.train(_cfg(domain["sft"], **{"run.steps": 1}), str(tmp_path / "r"), log=lambda s: None)
    model, tok = tiny.load(tmp_path / "r" / "model")
    assert "{% generation %}" in tok.chat_template
    with pytest.raises(StageDirError, match="--resume"):
        sft.train(_cfg(domain["sft"], **{"run.steps": 1}), str(tmp_path / "r"), log=lambda s: None)
    # the next stage starts from it
    sft.train(_cfg(domain["sft"], **{"run.steps": 1, "model.path": str(tmp_path / "r" / "model")}),
              str(tmp_path / "next"), log=lambda s: None)
