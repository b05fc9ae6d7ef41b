"""docs/moe.md: every `tidal train` command in it runs (shrunk to a tiny MoE), the bench command's keys exist,
and the page's numbers are the committed benchmarks/results/moe.json's."""

import json
import re
import shlex
from pathlib import Path

from tidal import bench
from tidal.cli import main
from tidal.config import apply_overrides
from tidal.recipes import RECIPES

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "moe.md").read_text()
RESULT = json.loads((ROOT / "benchmarks" / "results" / "moe.json").read_text())
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.expert_intermediate_size=16", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=8",
        "max_steps=2", "eval_every=1", "num_eval=8", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "algo.passk_k=2", "log.progress=false", "log.report=false", "log.tensorboard=false", "reward.num_workers=0"]


def commands() -> list[list[str]]:
    text = "\n".join(re.findall(r"```bash\n(.*?)```", DOC, flags=re.S))
    return [shlex.split(line.split(" #", 1)[0]) for line in text.splitlines() if line.strip()]


def test_every_command_runs_or_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmds = commands()
    assert [c[1] for c in cmds].count("train") == 3 and [c[1] for c in cmds].count("bench") == 1
    for argv in cmds:
        verb, rest = argv[1], argv[2:]
        if verb == "bench":
            sets = [rest[i + 1] for i, a in enumerate(rest) if a == "--set"]
            _, others = bench.load("moe")._settings(sets)
            apply_overrides(RECIPES.get("quickstart")(), others)
            continue
        assert main(["train", *rest, *(x for kv in TINY for x in ("--set", kv))]) == 0, argv


def test_the_numbers_on_the_page_are_the_benchmarks():
    table = DOC[DOC.index("## Measured"):DOC.index("## Not supported")]
    assert f"**{RESULT['routing_agreement_off']:.4f}**" in table
    for key in ("mismatch_off_over_r3", "extreme_off_over_r3", "abs_mismatch_off_over_r3"):
        assert f"**{RESULT[key]:.2f}**" in table, key
    for arm, steps in RESULT["steps_to_0.85_by_arm"].items():
        assert " / ".join("-" if s is None else str(s) for s in steps) in table, arm
    assert RESULT["collapsed_runs_by_arm"] == {"off": 0, "r2": 0, "r3": 0, "fp32_engine": 0}  # "0 of 3" each
