"""Agent environments: what answers a policy's turn in a multi-turn episode (docs/agentic.md).

``ENVS`` maps a name to a class built as ``cls(**env.params)``, one instance per episode. The
protocol (``tidal.api.Environment``) is small: ``reset(prompt)`` and ``step(turn_text) -> EnvStep``.
"""

from tidal.registry import Registry

ENVS: Registry = Registry("environment")

from tidal.envs import calculator as _calculator  # noqa: E402,F401  (registers environments)
from tidal.envs import guess_number as _guess_number  # noqa: E402,F401
from tidal.envs import python_tool as _python_tool  # noqa: E402,F401
from tidal.envs import zoom as _zoom  # noqa: E402,F401
