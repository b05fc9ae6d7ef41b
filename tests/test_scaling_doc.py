"""docs/scaling.md: every `tidal train` command in it (plain, under torchrun, or from the vLLM venv)
names a recipe and only config keys that exist, with values of the right type. The commands
themselves run in the backend tests (tests/system/test_ray_backend.py, test_data_parallel.py,
tests/rollout/test_vllm_*.py); this keeps the page from drifting from the config."""

import re
import shlex
from pathlib import Path

from tidal.config import apply_overrides
from tidal.recipes import RECIPES

DOC = Path(__file__).resolve().parent.parent / "docs" / "scaling.md"


def train_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        m = re.search(r"(?:^|[\s/])(?:tidal|-m tidal\.cli) train (.*)$", line)
        if m:
            out.append(shlex.split(m.group(1)))
    return out


def test_every_train_command_in_scaling_md_parses():
    commands = train_commands()
    assert len(commands) >= 11, "the page lost its commands"
    for argv in commands:
        recipe = "quickstart" if argv[0] == "RECIPE" else argv[0]
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        apply_overrides(RECIPES.get(recipe)(), sets)  # raises on an unknown key or a bad value
