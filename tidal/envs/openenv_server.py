"""An OpenEnv environment served on loopback from this process, for ``env.name=verifiers env.verifiers.id=openenv``.

Meta's OpenEnv (``openenv-core``) environments are ``Environment`` subclasses (``reset``/``step`` with
pydantic ``Action``/``Observation`` types) that clients reach over HTTP and WebSocket; OpenEnv's own
providers start them as ``uv`` processes or Docker containers. verifiers 0.4 ships a taskset that plays
an OpenEnv environment (``verifiers.v1.tasksets.openenv``: each observation is the next user turn, the
model's reply is parsed as the action, the steps' rewards are summed into ``openenv_reward``) and can
connect to a server that is already running (``base_url``). ``serve_openenv`` is that server for an
environment class in this process: OpenEnv's own app (``openenv.core.env_server.create_app``) under
uvicorn on 127.0.0.1 with a free port, on a daemon thread. tidal then trains it like any verifiers
environment. Containers (``use_docker``) are not available here; an environment OpenEnv would start
with ``uv`` can be started by hand and named by ``base_url`` instead.

A missing ``openenv-core`` is one line naming the extra: ``pip install 'tidal[openenv]'``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from tidal.config import ConfigError

MISSING = "OpenEnv environments need the openenv extra: pip install 'tidal[openenv]'"


@contextlib.contextmanager
def serve_openenv(make_env: Callable[[], object], action_cls: type, observation_cls: type,
                  max_concurrent_envs: int = 256, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``make_env`` environments on loopback; yields the base URL (``http://127.0.0.1:PORT``)."""
    try:
        import uvicorn
        from openenv.core.env_server.http_server import create_app
    except ImportError as e:
        raise ConfigError(f"{MISSING} ({e})") from None
    app = create_app(make_env, action_cls, observation_cls, max_concurrent_envs=max_concurrent_envs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="tidal-openenv", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the OpenEnv server did not start on 127.0.0.1")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
