"""docs/lora.md: every `tidal train` and `tidal export` command in it runs in order (shrunk to a tiny model),
the torchrun, QLoRA and `tidal bench lora` commands name real keys (the torchrun run itself is
tests/system/test_lora_data_parallel.py, QLoRA tests/gpu/test_lora_gpu.py), the benchmark's memory part runs
on a small stand-in, and the page's numbers are the committed benchmarks/results/lora.json's."""

import json
import re
import shlex
from pathlib import Path

import pytest

from tidal import bench
from tidal.cli import main
from tidal.config import apply_overrides
from tidal.recipes import RECIPES

pytest.importorskip("peft", reason="needs peft: pip install 'tidal[lora]'")
ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "lora.md").read_text()
RESULT = ROOT / "benchmarks" / "results" / "lora.json"
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=8", "max_steps=2",
        "eval_every=1", "num_eval=8", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "algo.passk_k=2", "log.progress=false", "log.report=false", "log.tensorboard=false", "reward.num_workers=0"]


def commands() -> list[list[str]]:
    text = "\n".join(re.findall(r"```bash\n(.*?)```", DOC, flags=re.S))
    return [shlex.split(line.split(" #", 1)[0]) for line in text.splitlines() if line.strip()]


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_every_command_runs_or_parses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    cmds = commands()
    verbs = [c[1] if c[0] == "tidal" else c[0] for c in cmds]
    assert verbs.count("train") >= 5 and verbs.count("export") == 2 and verbs.count("bench") == 3
    assert "torchrun" in verbs
    lora_bench = bench.load("lora")
    for argv in cmds:
        if argv[0] == "torchrun":
            train = argv[argv.index("train") + 1:]
            apply_overrides(RECIPES.get(train[0])(), _sets(train))
            continue
        assert argv[0] == "tidal", argv
        verb, rest = argv[1], argv[2:]
        if verb == "train" and "system.device=cuda" in rest:  # QLoRA: the keys exist (the run needs a GPU)
            apply_overrides(RECIPES.get(rest[0])(), _sets(rest))
            continue
        if verb == "bench":
            settings, others = lora_bench._settings(_sets(rest))
            apply_overrides(RECIPES.get("quickstart")(), others)
            continue
        extra = [x for kv in TINY for x in ("--set", kv)] if verb == "train" else []
        code = main(argv[1:] + extra)
        assert code == 0, f"`{' '.join(argv)}` failed: {capsys.readouterr().err}"
    assert (tmp_path / "exports" / "lora_adapters" / "adapter_config.json").exists()
    assert (tmp_path / "exports" / "lora_merged" / "config.json").exists()
    assert (tmp_path / "runs" / "next_stage" / "checkpoints").exists()


def test_the_memory_part_runs_on_a_small_stand_in(tmp_path):
    lora_bench = bench.load("lora")
    result = lora_bench.run(["parts=[memory]", "memory_model=stand-in", "memory_rows=2", "memory_response_len=8"],
                            tmp_path / "lora")
    m = result["memory"]
    assert m["lora"]["optimizer_state_bytes"] < m["full"]["optimizer_state_bytes"] / 5
    assert result["sync_bytes_ratio"] == m["lora"]["weight_sync_bytes"] / m["full"]["weight_sync_bytes"] < 0.1
    assert m["full"]["trainable_params"] == m["full"]["params"] > m["lora"]["trainable_params"]


def test_pick_best_prefers_fewest_steps_then_the_final_accuracy():
    pick = bench.load("lora").pick_best
    runs = [{"lr": 1, "steps_to_0.85": None, "final": 0.99}, {"lr": 2, "steps_to_0.85": 40, "final": 0.86},
            {"lr": 3, "steps_to_0.85": 40, "final": 0.9}, {"lr": 4, "steps_to_0.85": 50, "final": 0.95}]
    assert pick(runs)["lr"] == 3
    assert pick([runs[0], {"lr": 5, "steps_to_0.85": None, "final": 0.5}])["lr"] == 1
    median = bench.load("lora").median_steps
    assert median([30, None, 50]) == 50 and median([None, None, 5]) is None


@pytest.mark.skipif(not RESULT.exists(), reason="run `tidal bench lora` first")
def test_the_numbers_are_the_committed_results():
    r = json.loads(RESULT.read_text())
    m = r["memory"]
    for key in ("peak_bytes", "optimizer_state_bytes", "weight_sync_bytes"):
        for arm in ("full", "lora"):
            assert f"{m[arm][key] / 1e9:.3f} GB" in DOC or f"{m[arm][key] / 1e6:.1f} MB" in DOC, (arm, key)
    assert f"{r['peak_mem_ratio']:.3f}" in DOC and f"{r['sync_bytes_ratio']:.4f}" in DOC
    for rank, steps in r["median_steps_to_0.85_by_rank"].items():
        assert f"| rank {rank} |" in DOC and (f"| {steps:g} |" if steps is not None else "| - |") in DOC


def test_a_run_already_measured_under_the_same_settings_is_reused(tmp_path):
    lora_bench = bench.load("lora")
    s = lora_bench.Settings(steps=5)
    row = {"arm": "r1", "lr": 1e-3, "seed": 0, "steps": 5, "eval_every": 10, "overrides": [], "steps_to_0.85": 3}
    (tmp_path / "runs.jsonl").write_text(json.dumps({**row, "steps": 6}) + "\n" + json.dumps(row) + "\n")
    assert lora_bench._quickstart_run(None, s, [], 0, 1, 1e-3, tmp_path / "r1") == row  # None: nothing is run
