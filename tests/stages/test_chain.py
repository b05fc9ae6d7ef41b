"""docs/stages.md's chain: the page shows exactly the chain's commands, and every one of them runs (short)."""

import json
import re
import shlex
from pathlib import Path

import pytest

from tidal import cli
from tidal.cli import stages_chain

DOC = Path(__file__).resolve().parents[2] / "docs" / "stages.md"
SHORT = {"dapt": ["run.steps=2"], "sft": ["run.steps=2"], "dpo": ["run.steps=2"], "rm": ["run.steps=2"],
         "rl": ["max_steps=1", "num_eval=8", "rollout.prompts_per_step=4"]}


def _doc_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_page_shows_the_chain():
    want = ["python -m tidal.stages.synthetic --out runs/stages/domain"]
    want += ["tidal " + shlex.join(argv) for _, argv in stages_chain.commands("runs/stages")]
    want += ["tidal " + shlex.join(stages_chain.rl_with_rm("runs/stages"))]
    assert _doc_commands() == want


def test_every_command_runs(tmp_path, capsys):
    """The chain with each stage shortened, then RL scored by the reward model; the table has every stage."""
    out = str(tmp_path / "stages")
    table = stages_chain.run(out, SHORT)
    assert list(table) == ["base", "dapt", "sft", "dpo", "rl", "rm"]
    for stage in ("base", "dapt", "sft", "dpo", "rl"):
        m = table[stage]
        assert 0 <= m["accuracy"] <= 1 and 0 <= m["pref_acc"] <= 1 and m["corpus_nll"] > 0, (stage, m)
    assert table["dapt"]["corpus_nll"] < table["base"]["corpus_nll"]  # even 2 steps at lr 1e-3 move it
    assert json.loads((tmp_path / "stages" / "table.json").read_text()) == table
    capsys.readouterr()
    argv = stages_chain.rl_with_rm(out) + [x for kv in SHORT["rl"] for x in ("--set", kv)]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 1
    metrics = [json.loads(line) for line in (tmp_path / "stages" / "rl_rm" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/mean" in m for m in metrics)


@pytest.mark.parametrize("sets,message", [
    (["--set", "bogus"], "error: --set bogus: expected STAGE:KEY=VALUE"),
    (["--set", "sfy:run.steps=2"], "error: --set sfy:run.steps=2: unknown stage 'sfy'"),
    (["--set", "dpo:run.steps=2", "--set", "rl:nope=1"], "error: stage rl: unknown config key 'nope'"),
], ids=["no-stage", "unknown-stage", "later-stage-key"])
def test_every_stage_key_is_checked_before_the_first_stage_runs(tmp_path, capsys, sets, message):
    """Issue 50 item 13: the chain ignored ``--set bogus``, and a later stage's bad key surfaced only after the
    stages before it had trained."""
    out = tmp_path / "stages"
    assert cli.main(["chain", "--out", str(out), *sets]) == 2  # `tidal chain`
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    with pytest.raises(SystemExit) as e:  # the module's own spelling, the same command
        stages_chain.main(["--out", str(out), *sets])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == err
    assert not out.exists(), "something ran before the keys were checked"


def test_the_chain_passes_the_users_flags_and_keeps_a_previous_chain(tmp_path, monkeypatch, capsys):
    """Issue 50 item 3: the chain added --overwrite to every stage itself, deleting an earlier run in its --out."""
    calls = []

    def fake_main(argv):  # every stage "runs" but rl, which stops the chain
        calls.append(argv)
        return 1 if argv[0] == "train" else 0

    monkeypatch.setattr(cli, "main", fake_main)
    out = tmp_path / "stages"
    with pytest.raises(SystemExit, match="stage rl failed"):
        stages_chain.run(str(out))
    assert len(calls) == 5 and not any("--overwrite" in argv or "--resume" in argv for argv in calls)

    (out / "sft" / "checkpoints" / "step_2").mkdir(parents=True)  # a previous chain's sft run
    (out / "sft" / "checkpoints" / "step_2" / "trainer_state.pt").write_text("state")
    (out / "sft" / "metrics.jsonl").write_text('{"step": 2}\n')
    with pytest.raises(ValueError, match=r"holds a previous chain's runs \(sft/\); pass --resume .* --overwrite"):
        stages_chain.run(str(out))
    assert (out / "sft" / "metrics.jsonl").read_text() == '{"step": 2}\n'

    calls.clear()
    with pytest.raises(SystemExit, match="stage rl failed"):
        stages_chain.run(str(out), resume=True)
    assert [argv[-1] for argv in calls] == [f"{out}/dapt", "--resume", f"{out}/dpo", f"{out}/rm", f"{out}/rl"]
    calls.clear()
    with pytest.raises(SystemExit, match="stage rl failed"):
        stages_chain.run(str(out), overwrite=True)
    assert all(argv[-1] == "--overwrite" for argv in calls) and len(calls) == 5
