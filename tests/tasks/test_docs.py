"""The shell blocks of docs/tasks.md and docs/score.md run as written (training shrunk to a tiny model)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=8", "max_steps=1",
        "eval_every=1",
        "num_eval=8", "rollout.prompts_per_step=2", "rollout.group_size=2", "algo.passk_k=2", "log.progress=false",
        "log.report=false", "log.tensorboard=false"]


def script(doc: str) -> str:
    """The doc's ```bash blocks as one script; ``tidal train``/``tidal bench`` lines get shrinking flags."""
    blocks = re.findall(r"```bash\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)
    lines = []
    for line in "".join(blocks).splitlines():
        if line.startswith("tidal train"):
            line += "".join(f" --set {kv}" for kv in TINY)
        elif line.startswith("tidal bench rewards"):
            line += " --set math_samples=8 --set code_samples=4 --set workers=[1]"
        lines.append(line)
    return "\n".join(lines)


def _run(doc: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script(doc)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{doc}: {proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_tasks_doc_commands_run(tmp_path):
    assert script("tasks.md").count("tidal train") == 6
    _run("tasks.md", tmp_path)
    assert (tmp_path / "runs/rg/config.yaml").exists() and (tmp_path / "add_dd/dataset_dict.json").exists()


def test_score_doc_commands_run_and_show_real_output(tmp_path):
    (tmp_path / "benchmarks").symlink_to(DOCS.parent / "benchmarks")
    out = _run("score.md", tmp_path).stdout
    documented = re.search(r"```\n(\{.*?)```", (DOCS / "score.md").read_text(), flags=re.S).group(1)
    assert documented.strip() in out  # the exact_match example's output, as the doc shows it
    assert '"reward": 1.0' in out and "math" in out
