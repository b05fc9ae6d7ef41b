"""``tidal distill traces|logits`` end to end on tiny models (the commands docs/distill.md shows)."""

import json

from tidal.cli import main
from tidal.distill.shards import LogitShards

from ..system.test_controller import TINY_OVERRIDES


def sets(tmp_path, *extra):
    out = []
    for item in [*TINY_OVERRIDES(tmp_path), "student.steps=3", "student.eval_every=2", "student.batch_size=8", *extra]:
        out += ["--set", item]
    return out


def test_traces_then_student(tmp_path, teacher_dir, capsys):
    code = main(["distill", "traces", "--teacher", str(teacher_dir), "--out", str(tmp_path / "tr"),
                 *sets(tmp_path, "traces.num_prompts=12", "traces.samples_per_prompt=2", "traces.min_reward=0")])
    assert code == 0
    head = json.loads(capsys.readouterr().out)
    summary = json.loads((tmp_path / "tr" / "summary.json").read_text())
    assert summary["traces"]["kept"] == 24 and head["traces"] == summary["traces"]
    assert [c["step"] for c in summary["curve"]] == [0, 2, 3]
    assert (tmp_path / "tr" / "student" / "model" / "config.json").exists()


def test_logits_with_full_kl_comparison(tmp_path, teacher_dir, capsys):
    code = main(["distill", "logits", "--teacher", str(teacher_dir), "--top-k", "8", "--compare-full",
                 "--out", str(tmp_path / "lg"), *sets(tmp_path, "logits.num_prompts=12", "logits.report_k=[1,8,54]")])
    assert code == 0
    head = json.loads(capsys.readouterr().out)
    store = LogitShards(tmp_path / "lg" / "logits")
    assert store.k == 8 and len(store) == 12
    assert head["store"]["bytes_per_position"] == 8 * 4 + 4
    lost = head["store"]["info_loss_kl"]
    assert lost["54"] == 0.0  # the whole vocabulary (54 tokens)
    assert lost["1"] > lost["8"] > 0.0  # more ids kept, less lost
    assert head["sparse"]["eval_kl"] > 0 and head["full"]["eval_kl"] > 0
    assert abs(head["rel_loss_gap"] - (head["sparse"]["eval_kl"] / head["full"]["eval_kl"] - 1)) < 1e-9


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["distill", "traces", "--out", str(tmp_path / "x")]) == 2
    assert "needs --teacher DIR" in capsys.readouterr().err
    assert main(["distill", "traces", "--teacher", str(tmp_path / "none"), "--out", str(tmp_path / "x"),
                 *sets(tmp_path)]) == 2
    assert "--teacher" in capsys.readouterr().err
    assert main(["distill", "logits", "--teacher", str(tmp_path), "--set", "student.residual=drop"]) == 2
    assert "student.residual must be one of" in capsys.readouterr().err


def test_a_previous_run_in_out_needs_overwrite_which_keeps_a_users_file(tmp_path, teacher_dir, capsys):
    """Issue 50: ``tidal distill`` wrote into an --out holding a previous run (its traces replaced, its
    shards refused only after the teacher had sampled); --overwrite deletes only what that run wrote."""
    out = tmp_path / "tr"
    argv = ["distill", "traces", "--teacher", str(teacher_dir), "--out", str(out), "--no-train",
            *sets(tmp_path, "traces.num_prompts=4", "traces.samples_per_prompt=1", "traces.min_reward=0")]
    assert main(argv) == 0, capsys.readouterr().err
    (out / "student").mkdir()
    (out / "student" / "notes.txt").write_text("a user's notes\n")
    before = (out / "traces.jsonl").read_bytes()
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out} holds a previous run's traces.jsonl, summary.json; pass --overwrite" in err[0]
    assert (out / "traces.jsonl").read_bytes() == before
    assert main([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    assert (out / "student" / "notes.txt").read_text() == "a user's notes\n"
