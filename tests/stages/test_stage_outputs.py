"""``tidal sft|dpo|rm --out`` keeps what the user had (issue 50): an input inside the run that ``--overwrite``
would delete is one line before anything is deleted, a user's file inside ``model/`` or ``checkpoints/``
survives ``--overwrite`` and the run itself, ``--resume`` of another command's run names it, Ctrl-C before
the first checkpoint suggests a command that works, and a second process on the same ``--out`` is refused."""

import json
import os
import shlex
import shutil

import pytest

from .conftest import MODEL, run_cli


def _sft(domain, out, *extra):
    return ["sft", "--set", f"data.path={domain['sft']}", "--set", "run.steps=1", "--set", "run.threads=1",
            "--out", str(out), *MODEL, *extra]


@pytest.fixture
def sft_run(domain, tmp_path, capsys):
    out = tmp_path / "sft"
    code, _, err = run_cli(capsys, *_sft(domain, out))
    assert code == 0, err
    return out


def _files(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("where", ["model", "checkpoints/step_1"])
def test_starting_from_the_runs_own_model_with_overwrite_deletes_nothing(sft_run, domain, where, capsys):
    """Issue 50 item 1: this deleted the previous run, model included, and only then failed: "no Hugging Face
    model at OUT/model"."""
    before = _files(sft_run)
    code, _, err = run_cli(capsys, *_sft(domain, sft_run, "--set", f"model.path={sft_run / where}", "--overwrite"))
    assert code == 2
    line = _one_error_line(err)
    assert line.startswith(f"error: model.path={sft_run / where} is (or holds) the previous run's "), line
    assert "--overwrite would delete" in line
    assert _files(sft_run) == before


def test_a_users_files_inside_model_and_checkpoints_survive_overwrite_and_the_run(sft_run, domain, capsys):
    """Issue 50 item 2: --overwrite deleted the whole model/ and checkpoints/, a data file the same command
    was told to read included, and one run then trained and exited 0 with the file gone."""
    rows = sft_run / "model" / "my_rows.jsonl"
    shutil.copy(domain["sft"], rows)
    (sft_run / "checkpoints" / "notes.txt").write_text("a user's notes\n")
    code, out, err = run_cli(capsys, *[a if a != f"data.path={domain['sft']}" else f"data.path={rows}"
                                    for a in _sft(domain, sft_run)], "--overwrite")
    assert code == 0, err
    assert (f"--overwrite: deleted the previous run's config.yaml, metrics.jsonl, checkpoints/, model/ from {sft_run}; "
            "kept 2 file(s) tidal did not write: checkpoints/notes.txt, model/my_rows.jsonl") in err
    assert rows.read_bytes() == domain["sft"].read_bytes(), "the run's own model/ export replaced the user's file"
    assert (sft_run / "checkpoints" / "notes.txt").read_text() == "a user's notes\n"
    assert (sft_run / "model" / "config.json").exists() and json.loads(out)["step"] == 1
    manifest = json.loads((sft_run / ".tidal_outputs.json").read_text())
    assert manifest["kind"] == "sft" and "model/my_rows.jsonl" in manifest["kept"]
    assert "model/config.json" in manifest["wrote"] and "metrics.jsonl" in manifest["wrote"]


@pytest.mark.parametrize("recorded", [True, False], ids=["manifest", "older-run"])
def test_resume_of_a_run_of_another_kind_names_it(sft_run, domain, recorded, capsys):
    """Issue 50 item 12: ``tidal dpo --out SFT_RUN --resume`` failed on a config key the two do not share."""
    if not recorded:
        (sft_run / ".tidal_outputs.json").unlink(missing_ok=True)  # an older run: its kind read from config.yaml
    code, _, err = run_cli(capsys, "dpo", "--set", f"data.path={domain['pairs']}", "--out", str(sft_run), "--resume")
    assert code == 2
    assert _one_error_line(err) == (f"error: --resume: {sft_run} is a tidal sft run, not a tidal dpo run; continue "
                                    f"it with: tidal sft --out {sft_run} --resume")
    code, _, err = run_cli(capsys, "train", "quickstart", "--out", str(sft_run), "--resume")
    assert code == 2 and "is a tidal sft run, not a tidal train run" in _one_error_line(err)


def test_ctrl_c_in_dpo_reference_pass_suggests_a_command_that_works(domain, tmp_path, monkeypatch, capsys):
    """Issue 50 item 12: Ctrl-C before the first checkpoint said "resume with ... --resume", which then said
    there was no checkpoint."""
    from tidal.stages import dpo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "dpo"
    argv = ["dpo", "--set", f"data.path={domain['pairs']}", "--set", "run.steps=1", "--set", "run.threads=1",
            "--out", str(out), *MODEL]
    with monkeypatch.context() as m:
        m.setattr(dpo, "reference_logps", interrupted)
        code, _, err = run_cli(capsys, *argv)
    assert code == 130
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("interrupted before the first checkpoint; start again with: tidal dpo "), err
    command = shlex.split(line.split("start again with: ")[1])
    assert command[0] == "tidal" and "--resume" not in command
    code, out_, err = run_cli(capsys, *command[1:])
    assert code == 0, err
    assert json.loads(out_)["step"] == 1


def test_a_second_process_on_the_same_out_is_one_line_naming_the_first(sft_run, domain, capsys):
    """Issue 50 item 5: a second --resume while the first still wrote used to write into the same run."""
    from tidal.utils.outputs import Layout, RunDir

    before = _files(sft_run)
    with RunDir.open(sft_run, Layout("sft", ("model",), ()), resume=True):  # the first process, still writing
        code, _, err = run_cli(capsys, *_sft(domain, sft_run), "--resume")
    assert code == 2
    assert f"is being written by another tidal process (pid {os.getpid()})" in _one_error_line(err)
    assert {k: v for k, v in _files(sft_run).items() if not k.startswith(".tidal")} == \
        {k: v for k, v in before.items() if not k.startswith(".tidal")}
