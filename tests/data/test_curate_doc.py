"""The `tidal curate` commands in docs/curate.md's first block run as written, on small synthetic
inputs created under the names they use (rl-difficulty and rephrase need a model: their own tests
run them through the CLI, tests/data/test_difficulty.py and test_rephrase.py)."""

import json
import re
import shlex
from pathlib import Path

from tests.data.corpus import corpus_with_duplicates
from tidal.cli import main
from tidal.data.io import write_rows

DOC = Path(__file__).resolve().parents[2] / "docs" / "curate.md"
NEEDS_A_MODEL = ("rl-difficulty", "rephrase")


def doc_commands() -> list[list[str]]:
    first = re.search(r"```\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
    lines = [line.split(" #", 1)[0].strip() for line in first.splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("tidal curate ")]


def test_the_docs_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows, _, _ = corpus_with_duplicates(seed=0, originals=30, exact=3, near=3)
    for name in ("raw.jsonl", "raw.jsonl.gz", "train.jsonl"):
        write_rows(tmp_path / name, rows)
    write_rows(tmp_path / "math500.jsonl", [{"problem": rows[0]["text"][:200]}])
    write_rows(tmp_path / "problems.jsonl", [{"prompt": "2+2?", "answer": "4"}, {"prompt": "x?", "answer": ""}])
    (tmp_path / "my_recipe.yaml").write_text("blocks: [exact_dedup, c4, language]\n")
    commands = doc_commands()
    assert len(commands) >= 6, "docs/curate.md lost its commands"
    ran = 0
    for argv in commands:
        if argv[0] in NEEDS_A_MODEL:
            continue
        assert main(["curate", *argv]) == 0, argv
        out = argv[argv.index("--out") + 1]
        report = json.loads(Path(out + ".report.json").read_text())
        assert report["rows_out"] <= report["rows_in"]
        ran += 1
    assert ran >= 5
