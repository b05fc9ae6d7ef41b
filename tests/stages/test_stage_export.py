"""``tidal export`` on a stage run trained with LoRA (issue 53): ``--merge`` writes the model the stage's own
``model/`` is, so either can be the next stage's ``model.path``; without it, the adapters and their base."""

import json

import pytest
import torch

from tidal.models import tiny

from .conftest import MODEL, run_cli


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_export_merge_of_a_lora_stage_is_its_model(domain, tmp_path, capsys, stage):
    pytest.importorskip("peft")
    common = ["--set", "run.threads=1", "--set", "data.max_length=40", *MODEL, "--set", "model.tokenizer=chat"]
    base = tmp_path / "base"
    assert run_cli(capsys, "sft", "--set", f"data.path={domain['sft']}", "--set", "run.steps=1", *common,
                   "--out", str(base))[0] == 0
    data = domain["sft"] if stage == "sft" else domain["pairs"]
    run = tmp_path / stage
    code, _, err = run_cli(capsys, stage, "--set", f"model.path={base}/model", "--set", f"data.path={data}",
                           "--set", "run.steps=2", "--set", "model.lora.rank=2", "--set", "optim.lr=1e-2", *common,
                           "--out", str(run))
    assert code == 0, err
    code, out, err = run_cli(capsys, "export", str(run), "--out", str(tmp_path / "merged"), "--merge")
    assert code == 0, err
    assert json.loads(out)["kind"] == "merged"
    ours, exported = tiny.load(run / "model")[0].state_dict(), tiny.load(tmp_path / "merged")[0].state_dict()
    assert set(ours) == set(exported)
    for k in ours:
        torch.testing.assert_close(exported[k], ours[k], rtol=0, atol=1e-6, msg=k)
    moved = [k for k in ours if not torch.equal(ours[k], tiny.load(base / "model")[0].state_dict()[k])]
    assert moved, "the adapters changed nothing: the comparison would hold for any export"
    code, out, err = run_cli(capsys, "export", str(run), "--out", str(tmp_path / "adapters"))
    assert code == 0 and json.loads(out)["kind"] == "adapters", err
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["r"] == 2
    code, _, err = run_cli(capsys, "sft", "--set", f"model.path={tmp_path}/merged", "--set",
                           f"data.path={domain['sft']}", "--set", "run.steps=1", *common,
                           "--out", str(tmp_path / "next"))
    assert code == 0, err  # the export is the next stage's base
