"""docs/agentic.md: every `tidal train` command in it names a recipe and only config keys that exist,
with values of the right type (the recipes themselves run in tests/system/test_agentic_run.py and,
to their targets, in the slow tests)."""

import re
import shlex
from pathlib import Path

from tidal.config import apply_overrides
from tidal.recipes import RECIPES

DOC = Path(__file__).resolve().parent.parent / "docs" / "agentic.md"


def test_every_train_command_in_agentic_md_parses():
    blocks = re.findall(r"```[a-z]*\n(.*?)```", DOC.read_text(), flags=re.S)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        m = re.search(r"(?:^|\s)tidal train (.*)$", line.split(" #", 1)[0].strip())
        if m:
            commands.append(shlex.split(m.group(1)))
    assert len(commands) >= 3, "the page lost its commands"
    for argv in commands:
        recipe = "agentic_quickstart" if argv[0] == "RECIPE" else argv[0]
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        apply_overrides(RECIPES.get(recipe)(), sets)  # raises on an unknown key or a bad value
