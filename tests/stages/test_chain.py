"""docs/stages.md's chain: the page shows exactly the chain's commands, and every one of them runs (short)."""

import json
import re
import shlex
from pathlib import Path

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
