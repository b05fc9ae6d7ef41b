"""docs/models.md's shell commands run as written: the catalog, the import, an evaluation by name (shrunk to 8
prompts), and the two-part transfer of SmolLM2's GGUF to a borrowed GPU machine (split here, joined there)."""

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.models import catalog

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "models.md"


def doc_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


SHRINK = {  # a two-step run of the recipe (evaluated at steps 0 and 2), 4 evaluation prompts of 8 new tokens: the
    # command as written, at test size (the eval command's 8 prompts of the recipe's 48 tokens were 6 s of SmolLM2)
    "train": ["max_steps=2", "eval_every=2", "num_eval=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
              "rollout.max_new_tokens=8", "log.progress=false", "log.report=false"],
    "eval": ["num_eval=4", "rollout.max_new_tokens=8"],
}


STAGES = ("tidal sft ", "tidal dpo ")
"""docs/models.md's SFT and DPO on SmolLM2: run by ``test_stage_commands`` on a shrunk domain."""


def test_tidal_commands(smollm2_dir, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TIDAL_CACHE", str(smollm2_dir.parent.parent))
    commands = [c for c in doc_commands() if c.startswith("tidal ") and not c.startswith(STAGES)]
    assert any(c.startswith("tidal model import") for c in commands)
    assert any(c.startswith("tidal eval") for c in commands)
    for command in commands:
        argv = shlex.split(command)[1:]
        extra = [x for kv in SHRINK.get(argv[0], []) for x in ("--set", kv)]
        if "--out" in argv:
            argv[argv.index("--out") + 1] = str(tmp_path / argv[argv.index("--out") + 1])
        assert main(argv + extra) == 0, f"`{command}` failed: {capsys.readouterr().err}"
    out = capsys.readouterr().out
    assert '"gguf_sha256": "b179c952' in out and '"eval/accuracy"' in out
    assert (tmp_path / "runs" / "smollm2" / "metrics.jsonl").exists()


def test_device_parts_split_and_join(tmp_path, smollm2_dir):
    """Split here (parts under the 64 MiB a command may carry), join on a machine that has only the parts."""
    commands = [c for c in doc_commands() if c.startswith("bash scripts/device_model_parts.sh")]
    assert commands == ["bash scripts/device_model_parts.sh split"]
    here, there = tmp_path / "here", tmp_path / "there"
    for repo in (here, there):
        shutil.copytree(ROOT / "scripts", repo / "scripts")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
           "TIDAL_CACHE": str(smollm2_dir.parent.parent)}
    subprocess.run(shlex.split(commands[0]), cwd=here, env=env, check=True, capture_output=True)
    parts = sorted((here / ".tidal_cache" / "device").glob("smollm2.gguf.part*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 50 * 2**20 for p in parts)
    (there / ".tidal_cache" / "device").mkdir(parents=True)
    for p in parts:
        shutil.copy(p, there / ".tidal_cache" / "device")
    subprocess.run(["bash", "scripts/device_model_parts.sh", "join"], cwd=there, check=True, capture_output=True)
    joined = there / ".tidal_cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    digest = hashlib.sha256(joined.read_bytes()).hexdigest()
    assert digest == catalog.CATALOG["smollm2-135m-instruct"].sha256
    gguf, origin = catalog.catalog_gguf("smollm2-135m-instruct", there / ".tidal_cache", download=False)
    assert origin["from"] in ("installed", "cache")  # here the wheel is installed; there only the joined file


@pytest.mark.slow  # ~25 s: SmolLM2 loaded four times
def test_stage_commands(smollm2_dir, monkeypatch, capsys, tmp_path):
    """SFT then DPO on SmolLM2 as the page shows them, on a domain of 16 chats and 8 pairs, one step each, then the
    page's held-out checks of the DPO model: the commands run as written (their numbers are the page's)."""
    import json

    from tidal.stages import evaluate, synthetic

    monkeypatch.setenv("TIDAL_CACHE", str(smollm2_dir.parent.parent))
    monkeypatch.chdir(tmp_path)
    commands = [c for c in doc_commands() if c.startswith(("python -m tidal.stages.",) + STAGES)]
    assert [c.split()[:3] for c in commands] == [["python", "-m", "tidal.stages.synthetic"], ["tidal", "sft", "--set"],
                                                ["tidal", "dpo", "--set"], ["python", "-m", "tidal.stages.evaluate"]]
    shrink = {"synthetic": ["--num-sft", "16", "--num-pairs", "8", "--num-eval", "4"],
              "sft": ["run.steps=1", "run.eval_every=1", "data.eval_fraction=0.25", "run.threads=2"],
              "dpo": ["run.steps=1", "run.eval_every=1", "run.threads=2"]}
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "python":
            module = {"tidal.stages.synthetic": synthetic, "tidal.stages.evaluate": evaluate}[argv[2]]
            module.main(argv[3:] + shrink.get(argv[2].rsplit(".", 1)[1], []))
            continue
        extra = [x for kv in shrink[argv[1]] for x in ("--set", kv)]
        assert main(argv[1:] + extra) == 0, f"`{command}` failed: {capsys.readouterr().err}"
    out = capsys.readouterr().out
    checks = json.loads(out[out.rfind("{\n"):])  # the evaluation's object, printed last
    assert set(checks) == {"accuracy", "pref_acc", "corpus_nll"}
