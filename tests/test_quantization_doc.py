"""docs/quantization.md: its `tidal train` / `tidal bench quant` overrides are real config keys, its
`tidal quantize` commands run (on a tiny model standing in for the run directory), and its tables
carry the numbers of the committed benchmarks/results/quant.json."""

import json
import re
import shlex
from pathlib import Path

import pytest

from tidal.cli import build_parser, main
from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.recipes import RECIPES

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "quantization.md").read_text()
RESULT = ROOT / "benchmarks" / "results" / "quant.json"


def _commands(verb: str) -> list[list[str]]:
    text = "\n".join(re.findall(r"```bash\n(.*?)```", DOC, flags=re.S))
    return [shlex.split(line.split(" #", 1)[0])[2:] for line in text.splitlines() if line.startswith(f"tidal {verb}")]


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_train_and_bench_overrides_exist():
    trains, benches = _commands("train"), _commands("bench")
    assert trains and benches
    for argv in trains:
        apply_overrides(RECIPES.get(argv[0])(), _sets(argv))
    for argv in benches:
        assert argv[0] == "quant"
        apply_overrides(RECIPES.get("quickstart_grpo")(), _sets(argv))


def test_quantize_commands_run(tmp_path, tokenizer):
    commands = _commands("quantize")
    assert len(commands) == 2
    cfg = tiny.ModelConfig(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=4, intermediate_size=256)
    src = tmp_path / "model"
    tiny.save(tiny.build_model(cfg, tokenizer), tokenizer, src)
    for argv in commands:
        build_parser().parse_args(["quantize", *argv])  # the options exist
        out = tmp_path / argv[1].replace("/", "_")
        assert main(["quantize", str(src), str(out), *argv[2:]]) == 0
        assert (out / "model.safetensors").exists()


@pytest.mark.skipif(not RESULT.exists(), reason="run `tidal bench quant` first")
def test_rotation_table_matches_the_benchmark():
    errors = json.loads(RESULT.read_text())["relative_error"]
    rows = {"quickstart model": "quickstart linear weights",
            "random 512 x 512": "random 512x512, 4 outlier channels x20"}
    for label, key in rows.items():
        line = next(x for x in DOC.splitlines() if x.startswith(f"| {label}"))
        cells = [float(c) for c in line.strip("|").split("|")[1:]]
        expected = [errors[key][k] for k in ("fp8_block", "fp8_block+hadamard", "int4_block", "int4_block+hadamard")]
        assert cells == pytest.approx(expected, rel=5e-3), label


@pytest.mark.skipif(not RESULT.exists(), reason="run `tidal bench quant` first")
def test_training_table_matches_the_benchmark():
    result = json.loads(RESULT.read_text())
    for arm, label in (("none", "| float32 (none) |"), ("fp8_block", "| fp8_block |")):
        cells = [c.strip() for c in next(x for x in DOC.splitlines() if x.startswith(label)).strip("|").split("|")]
        assert float(cells[3]) == round(result["mean_over_seeds"][arm]["final_accuracy"], 3), arm
        assert int(cells[5].replace(",", "")) == result["mean_over_seeds"][arm]["sync_bytes"], arm
        for seed, column in ((0, 1), (1, 2)):
            row = next(r for r in result["table"] if r["rollout_weights"] == arm and r["seed"] == seed)
            assert [float(x) for x in cells[column].split(",")] == pytest.approx(row["accuracy_by_eval"], abs=0.006)
