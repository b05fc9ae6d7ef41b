"""The commands of docs/inspect.md run as written (training shrunk to the tiny model). ``--serve`` blocks
until Ctrl-C, so its line only has to parse; the server itself is tested in test_page.py."""

import re
import shlex
from pathlib import Path

from tidal.cli import build_parser, main

from ..test_readme import TINY

DOC = Path(__file__).resolve().parents[2] / "docs" / "inspect.md"


def commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("tidal ")]


def test_inspect_doc_commands_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ran = []
    for argv in commands():
        if "--serve" in argv:
            assert build_parser().parse_args(argv).serve
            continue
        extra = [x for kv in TINY for x in ("--set", kv)] if argv[0] == "train" else []
        assert main(argv + extra) == 0, f"`tidal {' '.join(argv)}` failed: {capsys.readouterr().err}"
        ran.append(argv[0])
    assert ran.count("inspect") == 2 and ran.count("report") == 1
    assert (tmp_path / "runs/base/inspect.html").is_file() and (tmp_path / "inspect.html").is_file()
    assert (tmp_path / "compare.html").is_file()
    dense = [line for line in (tmp_path / "runs/dense/samples.jsonl").read_text().splitlines() if '"train"' in line]
    assert len(dense) == 2 * 2  # every step (max_steps=2), all 2 groups of a step (prompts_per_step=2)
