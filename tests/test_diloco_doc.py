"""docs/diloco.md: every `tidal.stages.pretrain` and `tidal bench diloco` command in it uses only config keys
that exist, with values of the right type and in range. The commands run for real (smaller) in
tests/stages/test_pretrain.py and the benchmark's own run."""

import re
import shlex
from pathlib import Path

from tidal.bench import load
from tidal.config import apply_overrides
from tidal.stages.pretrain import PretrainConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "diloco.md"


def _commands(pattern: str) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    lines = [line.split(" #", 1)[0].strip().rstrip("&").strip() for line in "\n".join(blocks).splitlines()]
    return [shlex.split(m.group(1)) for line in lines if (m := re.search(pattern + r"(.*)$", line))]


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_every_pretrain_command_parses_and_validates():
    commands = _commands(r"-m tidal\.stages\.pretrain")
    assert len(commands) >= 6, "the page lost its commands"
    for argv in commands:
        cfg = apply_overrides(PretrainConfig(), _sets(argv))  # raises on an unknown key or a bad value
        for part in (cfg, cfg.diloco, cfg.adaptive_batch):
            part.__post_init__()


def test_every_bench_command_parses():
    commands = _commands(r"tidal bench diloco")
    assert len(commands) >= 2
    settings = load("diloco").Settings
    for argv in commands:
        apply_overrides(settings(), _sets(argv))
