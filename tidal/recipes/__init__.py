"""Named, complete run configurations (``tidal recipes`` lists them; ``tidal train NAME`` runs one).

Each recipe is a function returning a fresh RunConfig; its docstring is the one-line description
``tidal recipes`` prints.
"""

from __future__ import annotations

from tidal.registry import Registry

RECIPES: Registry = Registry("recipe")

from tidal.recipes import agentic as _agentic  # noqa: E402,F401
from tidal.recipes import harness as _harness  # noqa: E402,F401
from tidal.recipes import papers as _papers  # noqa: E402,F401  (registers recipes)
from tidal.recipes import quickstart as _quickstart  # noqa: E402,F401
from tidal.recipes import real as _real  # noqa: E402,F401
from tidal.recipes import stages as _stages  # noqa: E402,F401
from tidal.recipes import verifiers as _verifiers  # noqa: E402,F401
from tidal.recipes import vision as _vision  # noqa: E402,F401
