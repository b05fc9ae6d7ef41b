"""Run an untrusted Python program with hard limits, no network, and nothing left behind.

Model-written code is hostile input: it may loop, fork-bomb, allocate without bound, print
gigabytes, read secrets from the environment, write or delete files, open connections, or leave a
daemon behind. ``run_python(source, stdin, limits)`` runs it in a sandbox built from Linux
namespaces and rlimits (no extra tools needed; the supervisor in ``sandbox_init.py`` does what
util-linux ``unshare`` does, and more) and returns what it printed and how it ended:

- a new pid namespace: when the program's process (pid 1 there) ends, the kernel kills every
  process it started, daemons included; a new network namespace (no interfaces up: no network),
  new ipc and uts namespaces, and a new mount namespace in which every mount is read-only, /tmp
  and /dev/shm are fresh size-limited tmpfs (the program's working directory and HOME; gone with
  the namespace), and /root, /home, /run are hidden (except the Python installation);
- rlimits: CPU seconds, address space, file size, open files, processes; as root the program runs
  as a throwaway uid (the kernel does not apply RLIMIT_NPROC to root), otherwise as root of its
  own user namespace with every capability dropped;
- a minimal environment (PATH, LANG, HOME, TMPDIR, PYTHONIOENCODING and the run's random marker,
  nothing inherited) and the interpreter in isolated mode without site (``python -I -S``);
- a wall-clock deadline and a cap on captured output (the program is killed when either is hit),
  read without ever holding more than the cap in memory.

Where namespaces are not available (an unprivileged user on a kernel or container that forbids
user namespaces) running fails closed with ``SandboxUnavailable``, unless ``allow_unisolated`` is
set; then only the rlimits, the process group and a scan of /proc for the run's marker contain it.
docs/sandbox.md states exactly what is and is not isolated in each mode.
"""

from __future__ import annotations

import functools
import marshal
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tidal.rewards.sandbox_init import kill_marked

_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_init.py")
# Real root runs programs as a uid from this range, one per run, so that RLIMIT_NPROC (counted per
# uid) is per sandbox rather than shared by all concurrent sandboxes; with namespaces no file outside
# the sandbox's own tmpfs can be written, so a reused uid inherits nothing.
_UID_BASE, _UID_SPAN = 200_000_000, 1_000_000
_GRACE_S = 2.0  # how long a killed sandbox may take to be torn down before its supervisor is SIGKILLed


class SandboxUnavailable(RuntimeError):
    """Namespaces cannot be created here and unisolated running was not allowed."""


class SandboxError(RuntimeError):
    """The sandbox could not be built (a setup step failed); the program did not run."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one program run. Defaults suit short test programs (HumanEval, stdin/stdout tasks)."""

    timeout_s: float = 3.0
    """Wall-clock limit, counted from the sandbox's start (its ~30-60 ms start-up included)."""
    cpu_s: int | None = None
    """CPU-seconds per process (RLIMIT_CPU); default: the wall limit rounded up."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS). A sandbox's total is bounded only by memory_mb * max_processes
    (+ the tmpfs): there is no cgroup; sandbox processes are the OOM killer's first choice instead."""
    max_processes: int = 8
    """Processes and threads (RLIMIT_NPROC), counted per sandbox."""
    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    tmpfs_mb: int = 64
    """Size of the private /tmp (the working directory) and of /dev/shm, each."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 1 << 20
    """stdout and stderr are each captured up to this many bytes; one more and the program is killed."""
    hide_paths: tuple[str, ...] = ("/root", "/home", "/run")
    """Directories replaced by an empty tmpfs inside the sandbox (secrets live there), except the Python
    installation if it lies under one of them."""
    site_packages: bool = False
    """True lets programs import the interpreter's installed packages (runs ``site``; 20+ ms slower per run)."""
    python: str = sys.executable
    """Interpreter (Python >= 3.10) that runs the supervisor and, in a forked child of it, the program."""
    allow_unisolated: bool = False
    """Run with rlimits only where namespaces are unavailable (no network, file or process-escape isolation)."""


@dataclass
class RunResult:
    """How a program ended and what it printed (decoded as UTF-8, invalid bytes replaced)."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The exit status, or None when a signal ended it."""
    signal: int | None
    timed_out: bool
    output_exceeded: bool
    wall_s: float
    cpu_s: float
    isolated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_exceeded

    def reason(self) -> str:
        """One line saying why the run did not succeed ("" when it did)."""
        if self.timed_out:
            return f"timeout after {self.wall_s:.1f}s"
        if self.output_exceeded:
            return "output limit exceeded"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.valid_signals() else str(self.signal)
            hint = {"SIGXCPU": " (cpu time limit)", "SIGKILL": " (killed; cpu or memory limit)"}.get(name, "")
            return f"killed by {name}{hint}"
        if self.exit_code:
            last = [line for line in self.stderr.strip().splitlines() if line.strip()]
            return f"exit code {self.exit_code}" + (f": {last[-1].strip()[:200]}" if last else "")
        return ""


def _keep_paths(python: str) -> list[str]:
    """The directories the interpreter needs; hidden directories are re-exposed for these only."""
    paths = {os.path.dirname(os.path.dirname(p)) for p in (python, os.path.realpath(python))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    real = sorted({os.path.realpath(p) for p in paths} | paths)
    return [p for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


def _env(token: str) -> dict[str, str]:
    # TIDAL_SANDBOX marks the run's processes, so escaped ones can be found in /proc (unisolated mode,
    # where the supervisor points HOME and TMPDIR at the temporary directory it creates instead).
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "TIDAL_SANDBOX": token}  # fmt: skip


def _tasks_of_this_user() -> int:
    """Threads now running under our uid: without a user namespace RLIMIT_NPROC counts all of them."""
    count, uid = 0, os.getuid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def _launch(source: str, stdin: str, limits: SandboxLimits, isolate: bool):
    """Start the supervisor; returns (process, status read fd, the run's marker token)."""
    token = os.urandom(8).hex()
    uid = _UID_BASE + random.randrange(_UID_SPAN) if os.geteuid() == 0 else None
    shared_nproc = 0
    if not isolate and uid is None:  # the count is shared with all our processes: allow that many more
        shared_nproc = _tasks_of_this_user()
    with tempfile.TemporaryFile() as program, tempfile.TemporaryFile() as stdin_file:
        program.write(source.encode("utf-8", "surrogatepass"))
        program.seek(0)
        stdin_file.write(stdin.encode("utf-8", "surrogatepass"))
        stdin_file.seek(0)
        status_r, status_w = os.pipe()
        cfg = {
            "isolate": isolate, "status_fd": status_w, "program_fd": program.fileno(), "parent_pid": os.getpid(),
            "uid": uid, "tmp_root": tempfile.gettempdir(),
            "site_packages": limits.site_packages,
            "hide_paths": list(limits.hide_paths), "keep_paths": _keep_paths(limits.python),
            "cpu_s": limits.cpu_s or max(1, int(-(-limits.timeout_s // 1))), "memory_mb": limits.memory_mb,
            "file_size_mb": limits.file_size_mb, "max_processes": limits.max_processes + shared_nproc,
            "max_open_files": limits.max_open_files, "tmpfs_mb": limits.tmpfs_mb,
        }  # fmt: skip
        try:
            proc = subprocess.Popen(
                [limits.python, "-I", "-S", "-B", _SUPERVISOR, marshal.dumps(cfg).hex()],
                stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                env=_env(token), pass_fds=(status_w, program.fileno()), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
    return proc, status_r, token


def _run(source: str, stdin: str, limits: SandboxLimits, isolate: bool) -> tuple[RunResult, dict]:
    start = time.monotonic()
    proc, status_r, token = _launch(source, stdin, limits, isolate)
    out, err, status = bytearray(), bytearray(), bytearray()
    buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
    timed_out = exceeded = killed = False
    sel = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    try:
        deadline = start + limits.timeout_s
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                if killed:  # the supervisor did not finish tearing down: take it out, pid 1 follows it
                    proc.kill()
                    break
                timed_out = not exceeded
                proc.send_signal(signal.SIGTERM)
                killed, deadline = True, now + _GRACE_S
            for key, _ in sel.select(timeout=max(0.0, deadline - now)):
                buf = buffers[key.fd]
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                elif buf is status:
                    buf += chunk
                else:  # keep at most max_output_bytes + 1 (to know it overflowed); drain the rest
                    buf += chunk[: max(0, limits.max_output_bytes + 1 - len(buf))]
                    if len(buf) > limits.max_output_bytes and not killed:
                        exceeded = True
                        proc.send_signal(signal.SIGTERM)
                        killed, deadline = True, time.monotonic() + _GRACE_S
        proc.wait()
    finally:
        sel.close()
        os.close(status_r)
        proc.stdout.close()
        proc.stderr.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if not isolate:  # the supervisor had no chance to clean up (its temp dir may be left)
                kill_marked(token)
    report: dict = {}
    for line in bytes(status).decode(errors="replace").splitlines():  # written by sandbox_init.main
        kind, _, rest = line.partition(" ")
        if kind == "setup_error":  # the first failure is the cause; later lines are its consequences
            report.setdefault("setup_error", rest)
        elif kind in ("exit", "signal") and "exit" not in report and "signal" not in report:
            report[kind] = int(rest)
        elif kind == "cpu":
            report["cpu_s"] = float(rest)
    max_out = limits.max_output_bytes
    result = RunResult(
        stdout=bytes(out[:max_out]).decode(errors="replace"), stderr=bytes(err[:max_out]).decode(errors="replace"),
        exit_code=report.get("exit"), signal=report.get("signal", signal.SIGKILL if killed else None),
        timed_out=timed_out, output_exceeded=exceeded, wall_s=round(time.monotonic() - start, 3),
        cpu_s=report.get("cpu_s", 0.0), isolated=isolate,
    )  # fmt: skip
    return result, report


@functools.cache
def isolation_status(python: str = sys.executable) -> tuple[bool, str]:
    """(True, "") when namespaces work here, else (False, why); probed once per process and interpreter."""
    try:
        result, report = _run("", "", SandboxLimits(timeout_s=10.0, python=python), isolate=True)
    except OSError as e:
        return False, f"cannot start the sandbox supervisor: {e}"
    if report.get("setup_error"):
        return False, report["setup_error"]
    if not result.ok:
        return False, f"an empty program failed in the sandbox: {result.reason()} {result.stderr[-300:]}"
    return True, ""


def run_python(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``source`` as ``main.py`` with ``stdin`` in a fresh sandbox; see the module docstring.

    Raises SandboxUnavailable when namespaces cannot be created (unless ``limits.allow_unisolated``)
    and SandboxError when a setup step fails; never raises for anything the program does.
    """
    isolate, why = isolation_status(limits.python)
    if not isolate and not limits.allow_unisolated:
        raise SandboxUnavailable(
            f"cannot isolate untrusted code here ({why}); run as root, enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0), "
            "or set allow_unisolated=True to run with rlimits only"
        )
    result, report = _run(source, stdin, limits, isolate)
    if report.get("setup_error"):
        raise SandboxError(f"sandbox setup failed: {report['setup_error']}")
    return result
