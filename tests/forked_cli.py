"""``python -m tidal.cli ...`` as a real process, without paying the interpreter's start-up for each one.

The bad-input tests run the command line as a user runs it: a process of its own, its exit code, its stderr,
every file it touched. Each such process spends ~3 s of CPU importing torch and transformers before it reads
its first argument, and ~90 of them did that in the default suite (a quarter of its time on 2 cores).

Here one server process imports those once, then forks a child per command. The child is a process of its
own as a fresh one would be (its own session, so ``os.killpg(proc.pid, ...)`` reaches it and only it; its
own stdin, stdout and stderr files; its environment and working directory; Python's default SIGINT and
SIGTERM handling) and runs ``tidal.cli``'s ``__main__`` exactly as ``python -m`` does: an uncaught exception
prints its traceback and exits 1, ``sys.exit`` codes pass through, atexit handlers and non-daemon threads
run at exit (then ``os._exit``: a forked child that tears its interpreter down writes to every page it
shares with the server, seconds of copy-on-write under load). What differs from a fresh interpreter: the
modules the server imported are already imported (an import-time warning or failure would not show here:
the tests that run a real ``python -m tidal.cli``, signals and ``kill -9`` among them, still do), and
variables read only at interpreter start-up (``PYTHONWARNINGS``, ``PYTHONHASHSEED``) are applied by hand or
not at all (the warnings filter is).

The server forks only while it has no other thread (it asserts so) and never runs torch itself, so no
thread pool is copied into a child half-held. Usage::

    proc = forked_cli.start(["train", "quickstart", ...], env=..., cwd=..., stdin=b"")
    out, err = proc.communicate(timeout=60)   # bytes; proc.returncode as subprocess gives it
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "safetensors.torch", "tidal.cli", "tidal.api",
           "tidal.cli.run", "tidal.system.run")
"""What every command imports anyway (the bulk of the start-up); imported once, in the server."""

_SERVER = r'''
import atexit, importlib, json, os, runpy, select, signal, sys, threading, traceback
for name in sys.argv[1].split(","):
    importlib.import_module(name)
assert threading.active_count() == 1, "the fork server must hold no thread before it forks"
print(json.dumps({"ready": os.getpid()}), flush=True)
children = set()
buffer = b""
while True:
    readable, _, _ = select.select([0], [], [], 0.05)
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        children.discard(pid)
        print(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}), flush=True)
    if not readable:
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        break
    buffer += chunk
    while b"\n" in buffer:
        line, buffer = buffer.split(b"\n", 1)
        job = json.loads(line)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid:
            os.close(ready_w)
            os.read(ready_r, 1)  # the child is in its own session before anyone may signal its group
            os.close(ready_r)
            children.add(pid)
            print(json.dumps({"started": pid, "id": job["id"]}), flush=True)
            continue
        os.setsid()
        os.close(ready_r)
        os.write(ready_w, b"s")
        os.close(ready_w)
        for fd, (path, mode) in enumerate([(job["stdin"], os.O_RDONLY), (job["stdout"], os.O_WRONLY),
                                            (job["stderr"], os.O_WRONLY)]):
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(job["env"])
        if os.environ.get("PYTHONWARNINGS"):
            import warnings
            for rule in os.environ["PYTHONWARNINGS"].split(","):
                warnings.filterwarnings(rule.split(":")[0])
        os.chdir(job["cwd"])
        sys.argv = ["tidal", *job["argv"]]
        del children, buffer, line, job, readable, chunk, pid, ready_r, ready_w
        code, interrupted = 0, False
        try:
            runpy.run_module("tidal.cli", run_name="__main__", alter_sys=True)
        except SystemExit as e:  # what the interpreter makes of sys.exit's argument
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException as e:  # an uncaught exception: its traceback, exit 1 (Ctrl-C: death by SIGINT)
            traceback.print_exc()
            code, interrupted = 1, isinstance(e, KeyboardInterrupt)
        threading._shutdown()  # the interpreter's own exit: non-daemon threads, then atexit handlers
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)  # not the finalizer: tearing down torch touches every copy-on-write page (7 s under load)
'''


class ForkedProcess:
    """What ``subprocess.Popen`` gives the tests: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``,
    ``communicate`` (bytes, or str with ``text=True``)."""

    def __init__(self, server: _Server, pid: int, args: list[str], files: dict[str, Path], text: bool):
        self._server, self.pid, self.args, self._files, self._text = server, pid, args, files, text
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        self.wait(timeout)
        out, err = (self._files[k].read_bytes() for k in ("stdout", "stderr"))
        for path in self._files.values():
            path.unlink(missing_ok=True)
        return (out.decode(), err.decode()) if self._text else (out, err)


class _Server:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tidal-forked-cli-"))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, ",".join(PRELOAD)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=self.dir)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        assert "ready" in ready, "the forked-cli server did not start"
        self._lock = threading.Condition()
        self._started: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        threading.Thread(target=self._read, daemon=True, name="forked-cli-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            event = json.loads(line)
            with self._lock:
                if "started" in event:
                    self._started[event["id"]] = event["started"]
                elif "exit" in event:
                    self._exits[event["exit"]] = event["code"]
                self._lock.notify_all()

    def start(self, argv: list[str], env: dict, cwd: str | Path, stdin: bytes, text: bool) -> ForkedProcess:
        with self._lock:
            job_id, self._next = self._next, self._next + 1
        files = {k: self.dir / f"{job_id}.{k}" for k in ("stdin", "stdout", "stderr")}
        files["stdin"].write_bytes(stdin)
        for k in ("stdout", "stderr"):
            files[k].touch()
        job = {"id": job_id, "argv": argv, "env": env, "cwd": str(cwd), **{k: str(v) for k, v in files.items()}}
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        with self._lock:
            assert self._lock.wait_for(lambda: job_id in self._started, 60), "the forked-cli server did not fork"
            pid = self._started.pop(job_id)
        return ForkedProcess(self, pid, ["tidal", *argv], files, text)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._lock.wait(left)
            return self._exits[pid]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


_server: _Server | None = None


def start(argv: list[str], env: dict | None = None, cwd: str | Path = ".", stdin: bytes = b"",
          text: bool = False) -> ForkedProcess:
    """Start ``tidal <argv>`` in a child of the (lazily started) server; see the module docstring."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
        atexit.register(_server.close)
    return _server.start(argv, dict(os.environ if env is None else env), cwd, stdin, text)


def run(argv: list[str], env: dict | None = None, cwd: str | Path = ".", stdin: bytes = b"",
        timeout: float = 60, text: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run(["tidal", *argv], capture_output=True)``, forked; a child past ``timeout`` is killed
    (its whole session) and ``subprocess.TimeoutExpired`` raised."""
    proc = start(argv, env, cwd, stdin, text)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
