"""Tasks: prompt sources with a seeded training stream and a fixed held-out eval set."""

from tidal.registry import Registry

TASKS: Registry = Registry("task")

from tidal.tasks import arithmetic as _arithmetic  # noqa: E402,F401  (registers tasks)
