"""``tidal sft|dpo|rm``: a summary on success, one ``error:`` line and exit 2 on bad input, --resume."""

import json

import pytest

from .conftest import MODEL, run_cli


@pytest.mark.parametrize("stage, data", [("sft", "sft"), ("dpo", "pairs"), ("rm", "pairs")])
def test_stage_runs_and_resumes(stage, data, domain, tmp_path, capsys):
    args = [stage, "--set", f"data.path={domain[data]}", "--set", "run.steps=1", "--set", "run.threads=1",
            "--out", str(tmp_path / stage), *MODEL]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["step"] == 1 and summary["model"] == str(tmp_path / stage / "model")
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and err.startswith("error: ") and "--resume" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys, *[a if a != "run.steps=1" else "run.steps=2" for a in args], "--resume")
    assert code == 0 and json.loads(out)["step"] == 2, err


@pytest.mark.parametrize("argv, message", [
    (["sft", "--set", "data.path=/nonexistent.jsonl"], "error: no data at /nonexistent.jsonl"),
    (["dpo", "--set", "loss_type=dpoo", "--set", "data.path=x.jsonl"], "error: unknown preference loss 'dpoo'"),
    (["rm", "--set", "data.pth=x"], "error: unknown config key 'data.pth'"),
    (["sft"], "error: data.path is required"),
])
def test_bad_input_is_one_line(argv, message, tmp_path, capsys):
    code, out, err = run_cli(capsys, *argv, "--out", str(tmp_path / "r"))
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err
