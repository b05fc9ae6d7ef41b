"""``utils/outputs.py``: what a command may delete or replace in its ``--out``, checked on small folders.

Issue 50's "nothing the user had is lost": ``--overwrite`` deletes the files tidal wrote and nothing else (a
user's file inside ``model/`` or ``checkpoints/`` survives, and the line says it was kept); an input inside
``--out`` is one line before anything is deleted; a second process on the same ``--out`` is one line naming
the first's pid; one file as ``--out`` is never replaced without ``--overwrite``.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from tidal.utils import outputs
from tidal.utils.outputs import Layout, OutputError, RunDir

STAGE = Layout("sft", ("config.yaml", "metrics.jsonl", "checkpoints", "model"), ("metrics.jsonl", "model"))


def _checkpoint(out):
    step = out / "checkpoints" / "step_2"
    return step if (step / "trainer_state.pt").exists() else None


def _a_run(out, with_manifest=True):
    """What a finished stage leaves, written through RunDir (so recorded) or by hand (an older tidal)."""
    def write():
        (out / "config.yaml").write_text("run: {}\n")
        (out / "metrics.jsonl").write_text('{"step": 2}\n')
        (out / "checkpoints" / "step_2").mkdir(parents=True)
        for name in ("model.safetensors", "trainer_state.pt", "hashes.json", "config.json"):
            (out / "checkpoints" / "step_2" / name).write_text("w")
        (out / "checkpoints" / "latest").write_text("step_2")
        (out / "model").mkdir()
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            (out / "model" / name).write_text("w")

    if not with_manifest:
        out.mkdir(parents=True)
        write()
        return
    with RunDir.open(out, STAGE, log=lambda line: None):
        write()


def _files(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not p.name.startswith(".tidal"))


@pytest.mark.parametrize("with_manifest", [True, False], ids=["recorded", "older-tidal"])
def test_overwrite_deletes_only_what_tidal_wrote_and_says_what_it_kept(tmp_path, with_manifest):
    """Issue 50 item 2: --overwrite used to delete the whole model/ and checkpoints/ folders."""
    out = tmp_path / "run"
    _a_run(out, with_manifest)
    (out / "model" / "my_data.jsonl").write_text("a user's rows\n")
    (out / "checkpoints" / "notes.txt").write_text("a user's notes\n")
    (out / "README.md").write_text("not under a name tidal writes\n")
    lines = []
    with RunDir.open(out, STAGE, overwrite=True, checkpoint=_checkpoint, log=lines.append):
        pass
    assert _files(out) == ["README.md", "checkpoints/notes.txt", "model/my_data.jsonl"]
    assert lines == [f"--overwrite: deleted the previous run's config.yaml, metrics.jsonl, checkpoints/, model/ "
                     f"from {out}; kept 2 file(s) tidal did not write: checkpoints/notes.txt, model/my_data.jsonl"]


def test_the_manifest_keeps_a_users_file_even_with_a_name_tidal_gives(tmp_path):
    """A file found under tidal's names when the run started stays the user's, whatever it is called."""
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("the user's own")
    with RunDir.open(out, STAGE, log=print):
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        (out / "model" / "model.safetensors").write_text("w")
    manifest = json.loads((out / outputs.MANIFEST).read_text())
    assert manifest["kind"] == "sft" and manifest["kept"] == ["model/config.json"]
    assert manifest["wrote"] == ["metrics.jsonl", "model/model.safetensors"]
    with RunDir.open(out, STAGE, overwrite=True, log=lambda line: None):
        pass
    assert _files(out) == ["model/config.json"]


@pytest.mark.parametrize("key,where", [("model.path", "model"), ("model.path", "checkpoints/step_2"),
                                       ("data.path", "metrics.jsonl"), ("data.path", ".")])
def test_an_input_the_overwrite_would_delete_is_one_line_and_nothing_is_deleted(tmp_path, key, where):
    """Issue 50 item 1: ``--set model.path=OUT/model --overwrite`` deleted the model, then failed to load it."""
    out = tmp_path / "run"
    _a_run(out)
    before = _files(out)
    with pytest.raises(OutputError, match=rf"^{key}=.* in --out {out}, which --overwrite would delete"):
        RunDir.open(out, STAGE, overwrite=True, inputs={key: out / where}, checkpoint=_checkpoint)
    assert _files(out) == before


def test_a_users_file_inside_model_is_an_input_that_survives(tmp_path):
    out = tmp_path / "run"
    _a_run(out)
    (out / "model" / "rows.jsonl").write_text("{}\n")
    with RunDir.open(out, STAGE, overwrite=True, inputs={"data.path": out / "model" / "rows.jsonl"},
                     log=lambda line: None):
        pass
    assert (out / "model" / "rows.jsonl").read_text() == "{}\n"


def test_install_replaces_tidals_model_files_and_keeps_the_users(tmp_path):
    out = tmp_path / "run"
    _a_run(out)
    (out / "model" / "rows.jsonl").write_text("{}\n")
    with RunDir.open(out, STAGE, overwrite=True, log=lambda line: None):
        tmp = out / "model.tmp"
        tmp.mkdir()
        (tmp / "config.json").write_text("new")
        outputs.install(tmp, out / "model", out)
        assert sorted(p.name for p in (out / "model").iterdir()) == ["config.json", "rows.jsonl"]
    assert (out / "model" / "config.json").read_text() == "new" and not tmp.exists()
    assert json.loads((out / outputs.MANIFEST).read_text())["wrote"] == ["model/config.json"]


def test_a_previous_run_is_refused_without_a_flag_and_resume_needs_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    _a_run(out)
    with pytest.raises(OutputError, match="already holds a run .*checkpoints/step_2.*--resume"):
        RunDir.open(out, STAGE, checkpoint=_checkpoint)
    (out / "checkpoints" / "step_2" / "trainer_state.pt").unlink()
    with pytest.raises(OutputError, match="holds no checkpoint to continue from"):
        RunDir.open(out, STAGE, resume=True, checkpoint=_checkpoint)


def test_resume_of_a_run_of_another_kind_names_it(tmp_path):
    """Issue 50 item 12: ``tidal dpo --out SFT_RUN --resume`` said "unknown config key 'seed'"."""
    out = tmp_path / "run"
    _a_run(out)
    with pytest.raises(OutputError, match=rf"{out} is a tidal sft run, not a tidal dpo run; continue it with: "
                                          rf"tidal sft --out {out} --resume"):
        RunDir.open(out, Layout("dpo", STAGE.outputs, STAGE.data), resume=True, checkpoint=_checkpoint)


def test_a_second_process_on_the_same_out_is_one_line_naming_the_first(tmp_path):
    """Issue 50 item 5: a second --resume while the first still wrote used to write into the same folder."""
    out = tmp_path / "run"
    with RunDir.open(out, STAGE):
        with pytest.raises(OutputError, match=rf"{out} is being written by another tidal process \(pid "
                                              rf"{os.getpid()}\)"):
            RunDir.open(out, STAGE, resume=True)  # another open file: flock refuses it, in this process too
        code = ("import sys; from tidal.utils.outputs import Layout, RunDir\n"
                "try:\n    RunDir.open(sys.argv[1], Layout('sft', ('model',), ()), resume=True)\n"
                "except ValueError as e:\n    print(e)\n")
        proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60)
        assert f"(pid {os.getpid()})" in proc.stdout, proc.stdout + proc.stderr
    with RunDir.open(out, STAGE, resume=True):  # released at the end of the first
        pass


def test_claim_file_refuses_a_folder_an_input_and_an_existing_file_without_overwrite(tmp_path):
    """Issue 50 item 4: ``tidal curate mixture --out FILE`` replaced a user's file."""
    (tmp_path / "mine.jsonl").write_text("rows\n")
    (tmp_path / "a_folder").mkdir()
    with pytest.raises(OutputError, match="is a folder"):
        outputs.claim_file(tmp_path / "a_folder", {}, overwrite=True)
    with pytest.raises(OutputError, match="same file as mixture.eval"):
        outputs.claim_file(tmp_path / "mine.jsonl", {"mixture.eval": tmp_path / "mine.jsonl"}, overwrite=True)
    with pytest.raises(OutputError, match="exists; pass --overwrite to replace it"):
        outputs.claim_file(tmp_path / "mine.jsonl", {}, overwrite=False)
    assert outputs.claim_file(tmp_path / "mine.jsonl", {}, overwrite=True) == tmp_path / "mine.jsonl"
    assert (tmp_path / "mine.jsonl").read_text() == "rows\n"


def test_config_inputs_are_the_values_that_name_existing_paths(tmp_path):
    (tmp_path / "rows.jsonl").write_text("{}\n")
    (tmp_path / "agent.py").write_text("")

    @dataclass
    class Data:
        path: str = str(tmp_path / "rows.jsonl")
        eval_path: str = ""
        files: list = field(default_factory=lambda: ["nope.jsonl", str(tmp_path)])

    @dataclass
    class Cfg:
        data: Data = field(default_factory=Data)
        function: str = f"{tmp_path / 'agent.py'}:run"
        name: str = "."
        params: dict = field(default_factory=lambda: {"path": str(tmp_path / "rows.jsonl")})

    assert outputs.config_inputs(Cfg()) == {
        "data.path": str(tmp_path / "rows.jsonl"), "data.files[1]": str(tmp_path),
        "function": str(tmp_path / "agent.py"), "params.path": str(tmp_path / "rows.jsonl")}
