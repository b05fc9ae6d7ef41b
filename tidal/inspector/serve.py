"""``tidal inspect --serve``: the inspector page over HTTP on this machine only (127.0.0.1).

The page works from disk without a server; the server is for a browser that cannot read the file (a
remote machine reached through an SSH tunnel: ``ssh -L 8000:127.0.0.1:8000 host``). It binds the
loopback interface and serves that one page, read again on every request (so a later ``tidal
inspect`` shows at once), and nothing else: not the run directory, whose checkpoints are not for the
network.
"""

from __future__ import annotations

from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOST = "127.0.0.1"


class _PageHandler(BaseHTTPRequestHandler):
    def __init__(self, *args, page: Path, **kwargs):
        self.page = page
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        if self.path.split("?", 1)[0] not in ("/", "/" + self.page.name):
            self.send_error(404, f"only / ({self.page.name}) is served")
            return
        try:
            body = self.page.read_bytes()
        except OSError as e:
            self.send_error(500, f"cannot read {self.page}: {e.strerror}")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002  (quiet: one line per request is noise)
        pass


def make_server(page: str | Path, port: int = 8000) -> ThreadingHTTPServer:
    """A server for ``page`` on 127.0.0.1:``port`` (0: any free port; ``server.server_address`` says
    which). The caller runs ``serve_forever`` and ``server_close``."""
    page = Path(page).resolve()
    if not page.is_file():
        raise FileNotFoundError(f"{page}: no such page to serve")
    try:
        return ThreadingHTTPServer((HOST, port), partial(_PageHandler, page=page))
    except OSError as e:  # the port is taken
        raise OSError(e.errno, f"cannot serve on {HOST}:{port}: {e.strerror} (choose another --port)") from None
