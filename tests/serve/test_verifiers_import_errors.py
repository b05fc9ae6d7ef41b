"""A verifiers environment id whose code cannot be imported is one line naming the file and the cause (issue 50,
item 11): a syntax error, no ``__all__``, an exception at import, and ``sys.exit`` at import (which used to exit
the whole run with its code and no message). The same for ``env.verifiers.demos``."""

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from tidal.config import ConfigError  # noqa: E402
from tidal.envs.verifiers_config import VerifiersConfig  # noqa: E402
from tidal.tasks.config import TaskConfig  # noqa: E402
from tidal.tasks.verifiers_task import VerifiersTask, demo_function  # noqa: E402

BROKEN = {
    "syntax": ("def load(:\n", r"SyntaxError: .*\(t50_syntax\.py, line 1\)"),
    "no_all": ("import verifiers.v1 as vf\n\nclass T(vf.Taskset):\n    pass\n", r"defines no `__all__`"),
    "raises": ("raise RuntimeError('set MY_API_KEY first')\n", r"RuntimeError: set MY_API_KEY first"),
    "exits": ("import sys\n\nsys.exit(3)\n", r"t50_exits\.py\) called sys\.exit\(3\) on import"),
}


@pytest.fixture
def broken_dir(tmp_path, monkeypatch):
    """The broken modules in a fresh folder; ``sys.path`` and ``PYTHONPATH`` (which loading a path id extends)
    are put back after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    for name, (source, _) in BROKEN.items():
        (tmp_path / f"t50_{name}.py").write_text(source)
    yield tmp_path
    for name in BROKEN:
        sys.modules.pop(f"t50_{name}", None)


@pytest.mark.parametrize("name", list(BROKEN))
def test_an_environment_that_cannot_be_imported_is_one_line(name, broken_dir):
    path = broken_dir / f"t50_{name}.py"
    with pytest.raises(ConfigError) as e:
        VerifiersTask(TaskConfig(), VerifiersConfig(id=str(path), num_eval=1))
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    prefix = f"env.verifiers.id={str(path)!r}"
    assert message.startswith(prefix) and str(path) in message[len(prefix):], message  # the file, named again
    assert re.search(BROKEN[name][1], message), message


@pytest.mark.parametrize("name", ["syntax", "raises", "exits"])
def test_demos_that_cannot_be_imported_are_one_line(name, broken_dir):
    spec = f"{broken_dir / f't50_{name}.py'}:demo"
    with pytest.raises(ConfigError) as e:
        demo_function(spec, roots=(Path(broken_dir),))
    assert str(e.value).startswith(f"env.verifiers.demos={spec!r}: ") and len(str(e.value).splitlines()) == 1
    assert re.search(BROKEN[name][1], str(e.value)), str(e.value)
