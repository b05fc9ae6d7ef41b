"""Tasks: prompt sources with a seeded training stream and a fixed held-out eval set."""

from tidal.registry import Registry

TASKS: Registry = Registry("task")

from tidal.tasks import arithmetic as _arithmetic  # noqa: E402,F401  (registers tasks)
from tidal.tasks import files as _files  # noqa: E402,F401
from tidal.tasks import reasoning_gym as _reasoning_gym  # noqa: E402,F401
from tidal.tasks import think as _think  # noqa: E402,F401
from tidal.tasks import visual as _visual  # noqa: E402,F401
