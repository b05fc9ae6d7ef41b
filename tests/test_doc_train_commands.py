"""docs/agentic.md, docs/harness.md, docs/faults.md, docs/gpu.md and docs/vlm.md: every `tidal train` command in
them names a recipe and only config keys that exist, with values of the right type and a config that validates
(the recipes themselves run in tests/system/test_agentic_run.py and tests/serve/test_harness_run.py and, to their
targets, in the slow tests; the elastic command of faults.md in tests/launch/test_elastic.py)."""

import re
import shlex
from pathlib import Path

import pytest
import torch

from tidal.config import apply_overrides
from tidal.recipes import RECIPES
from tidal.system.validate import validate_run_config

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("page, default_recipe, at_least", [("agentic.md", "agentic_quickstart", 3),
                                                            ("harness.md", "harness_quickstart", 3),
                                                            ("faults.md", "quickstart", 2),
                                                            ("gpu.md", "quickstart", 4),
                                                            ("environments.md", "verifiers_quickstart", 2),
                                                            ("vlm.md", "vlm_quickstart", 1)])
def test_every_train_command_parses(page, default_recipe, at_least, monkeypatch):
    if page == "gpu.md":  # its commands name GPUs: validate them as on a machine with two
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    blocks = re.findall(r"```[a-z]*\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        m = re.search(r"(?:^|\s)tidal train (.*)$", line.split(" #", 1)[0].strip())
        if m:
            commands.append(shlex.split(m.group(1)))
    assert len(commands) >= at_least, "the page lost its commands"
    for argv in commands:
        recipe = default_recipe if argv[0] == "RECIPE" else argv[0]
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        validate_run_config(apply_overrides(RECIPES.get(recipe)(), sets))  # raises on an unknown key or a bad value
