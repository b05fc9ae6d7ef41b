"""One verifying TLS context per trust store for every httpx client in the process.

Building an ``ssl.SSLContext`` that verifies certificates parses the whole CA bundle: ~20-25 ms of CPU
each time on this machine. httpx (and ``httpx2``, which MCP's client uses) builds a fresh one for every
client made without ``verify=<context>``, and a verifiers episode makes three or four such clients
(verifiers' relay to the model, the chat program's OpenAI client, its MCP client; all on loopback, so
the context is never even used): ~100 ms of CPU per episode, 42% of a ``verifiers_quickstart`` warm
start's samples under py-spy. A context is built to be shared by many connections (``ssl`` docs), so
``share_verified_contexts`` makes each library's ``create_ssl_context`` return one cached context per
(trust store, environment) for the verifying defaults (``verify=True`` or a CA-bundle path, no client
certificate); anything else (``verify=False``, a caller's own context, a client certificate) goes to the
library's own function unchanged, so no client ever gets weaker verification than it asked for.

What it changes: clients made after it share the context object. httpx and httpcore only set the ALPN
protocols on it before each handshake (the same list for every HTTP/1.1 client); code that reaches into
a client's pool and edits its context would now edit everyone's. tidal installs it only where verifiers
episodes run (``serve/verifiers_bridge.py``).
"""

from __future__ import annotations

import functools
import importlib
import os
import threading

_LIBRARIES = ("httpx._transports.default", "httpx2._transports.default")
"""Modules whose ``create_ssl_context`` (imported by name) builds every client transport's context."""
_lock = threading.Lock()


def _sharing(original):
    cache: dict[tuple, object] = {}

    @functools.wraps(original)
    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if cert or not (verify is True or isinstance(verify, str)):
            return original(verify=verify, cert=cert, trust_env=trust_env)
        key = (verify, trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        with _lock:
            if key not in cache:
                cache[key] = original(verify=verify, cert=cert, trust_env=trust_env)
            return cache[key]

    create_ssl_context.tidal_shared = True
    return create_ssl_context


def share_verified_contexts() -> list[str]:
    """Install the sharing ``create_ssl_context`` in every library above that is importable (idempotent);
    the modules patched."""
    patched = []
    with _lock:
        for name in _LIBRARIES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            current = getattr(module, "create_ssl_context", None)
            if current is None:
                continue
            if not getattr(current, "tidal_shared", False):
                module.create_ssl_context = _sharing(current)
            patched.append(name)
    return patched
