"""The sandbox supervisor: run as ``python -I -S -B sandbox_init.py CONFIG`` by ``sandbox.run_python``.

It is a separate script (stdlib only, never imported by tidal) because it must do, in a fresh
process, what a library call cannot do to its caller: enter new namespaces, fork the program's
pid-1 and wait for it. It does the same system calls as util-linux ``unshare(1)``, plus what
``unshare`` cannot (a recursive read-only remount, a private size-limited /tmp, hiding home
directories, dropping capabilities), and it stays in control so that killing and *waiting* for
the whole sandbox is synchronous: when the supervisor exits, every process of the sandbox is gone.

Process tree and who kills whom:

    caller (pool worker) --Popen--> supervisor (new session, dies with the caller: PDEATHSIG)
        |  unshare(mount, pid, net, ipc, uts [, user when not root])
        +--fork--> pid 1 of the new pid namespace (dies with the supervisor: PDEATHSIG)
                     mounts, rlimits, drop privileges; waits for the program, reports its status
              +--fork--> the program: runs main.py in this interpreter

When pid 1 exits or is killed the kernel kills every other process of its pid namespace (daemons
that called setsid included) before pid 1 can be reaped, so the supervisor's ``wait4`` returning
means the sandbox is empty. SIGTERM to the supervisor SIGKILLs pid 1 (signals sent from the parent
namespace are forced for SIGKILL only). The result goes back as text lines on ``status_fd``:
``setup_error MESSAGE`` if the sandbox could not be built, else ``exit N`` or ``signal N``, then
``cpu SECONDS``.

The config keys are written by ``sandbox._supervisor_config``; see docs/sandbox.md for the threat
model.
"""

from __future__ import annotations

import _signal as signal  # the `signal` module imports enum: ~8 ms of start-up we pay per program
import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH = 1, os.O_CLOEXEC, 4
MOUNT_ATTR_RDONLY = 1
# The "new mount API" syscalls have one number on every architecture we run on (x86_64, arm64).
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 28, 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# NOROOT(+locked): uid 0 gains no capabilities at exec; KEEP_CAPS_LOCKED; NO_CAP_AMBIENT_RAISE(+locked).
SECUREBITS_NO_ROOT = 0x01 | 0x02 | 0x20 | 0x40 | 0x80
SETUP_FAILED = 111

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """The sandbox could not be built as configured: reported, the program never runs."""


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")
    return ret


def _prctl(option: int, arg: int = 0) -> int:
    return _check(libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {fstype or ''} {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def _read_only_everywhere() -> None:
    """Every mount (recursively) read-only in this mount namespace: Linux >= 5.12 mount_setattr(2)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
        ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
    )  # fmt: skip
    _check(ret, "mount_setattr(/, read-only, recursive) [needs Linux >= 5.12]")


def _hide(hide: list[str], keep: list[str]) -> None:
    """Cover each ``hide`` directory with an empty tmpfs (made read-only with everything else), except
    the ``keep`` trees below it (the Python installation may live in /root or /home), which are
    cloned first and moved back in."""
    hide = [h for h in hide if os.path.isdir(h) and not os.path.islink(h)]
    kept = []
    for k in keep:
        if any(k.startswith(h.rstrip("/") + "/") for h in hide) and os.path.isdir(k):
            fd = libc.syscall(
                ctypes.c_long(SYS_OPEN_TREE), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(k.encode()),
                ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE),
            )  # fmt: skip
            kept.append((k, _check(fd, f"open_tree {k}")))
    for h in hide:
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
    for k, fd in kept:
        os.makedirs(k, exist_ok=True)
        ret = libc.syscall(
            ctypes.c_long(SYS_MOVE_MOUNT), ctypes.c_int(fd), ctypes.c_char_p(b""), ctypes.c_int(AT_FDCWD),
            ctypes.c_char_p(k.encode()), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH),
        )  # fmt: skip
        _check(ret, f"move_mount {k}")
        os.close(fd)


def _drop_bounding_set() -> None:
    """No capability can ever be gained again, whatever is executed."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
        cap += 1


def _drop_capabilities() -> None:
    """Drop every capability for good (bounding set, ambient set, capset to zero; uid 0 regains none at exec)."""
    _drop_bounding_set()
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")  # _LINUX_CAPABILITY_VERSION_3


def _set_limits(cfg: dict) -> None:
    mb = 1 << 20
    limits = {
        resource.RLIMIT_CPU: (cfg["cpu_s"], cfg["cpu_s"] + 1),  # soft: SIGXCPU, hard: SIGKILL
        resource.RLIMIT_AS: (cfg["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (cfg["file_size_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (cfg["max_processes"],) * 2,
        resource.RLIMIT_NOFILE: (cfg["max_open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, (soft, hard) in limits.items():
        resource.setrlimit(which, (soft, hard))


def _enter_namespaces() -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if uid != 0:
        flags |= CLONE_NEWUSER
    _check(libc.unshare(flags), "unshare(mount, pid, net, ipc, uts" + (", user)" if uid != 0 else ")"))
    if uid != 0:  # what `unshare --map-root-user` writes
        for path, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
    # Nothing we mount may propagate back to the host's mount namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def kill_marked(token: str) -> int:
    """SIGKILL every process whose environment carries ``TIDAL_SANDBOX=token``, until none is left.

    Without a pid namespace this is how a run's escaped processes (setsid daemons) are found; a
    process that replaced its environment by exec'ing with a new one is not (docs/sandbox.md)."""
    needle = f"TIDAL_SANDBOX={token}".encode()
    killed = 0
    for _ in range(100):  # a process may fork while we scan: rescan until a pass finds nothing
        found = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():  # the supervisor carries the marker too
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        os.kill(int(pid), signal.SIGKILL)
                        found += 1
            except OSError:
                continue
        if not found:
            break
        killed += found
    return killed


def _unisolated_workdir(cfg: dict) -> str:
    """Without a mount namespace the program works in a fresh directory we create and remove."""
    path = os.path.join(cfg["tmp_root"], f"tidal-sandbox-{os.urandom(6).hex()}")
    os.mkdir(path, 0o700)
    if cfg["uid"] is not None:
        os.chown(path, cfg["uid"], cfg["uid"])
    os.environ["HOME"] = os.environ["TMPDIR"] = path
    return path


def _setup(cfg: dict, source: bytes, alive_r: int) -> None:
    """In pid 1 of the sandbox: build its world and give up every privilege."""
    workdir = cfg["workdir"] or "/tmp"
    with open("/proc/self/oom_score_adj", "w") as f:  # if memory runs out, the OOM killer takes us first
        f.write("1000")
    if cfg["isolate"]:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except SetupError:
            pass  # e.g. a container masks parts of /proc; the host's /proc stays visible (documented)
        _hide(cfg["hide_paths"], cfg["keep_paths"])
        _read_only_everywhere()
        tmpfs = f"size={cfg['tmpfs_mb']}m,nr_inodes=4096,mode=1777"
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
        if os.path.isdir("/dev/shm"):
            _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    with open(os.path.join(workdir, "main.py"), "wb") as f:  # for tracebacks; the program runs from memory
        f.write(source)
    os.chmod(os.path.join(workdir, "main.py"), 0o644)  # whatever the caller's umask: the new uid reads it
    os.chdir(workdir)
    if not cfg["isolate"]:
        os.setpgid(0, 0)  # no pid namespace: the supervisor kills this process group
    _set_limits(cfg)
    if cfg["uid"] is not None:  # we are real root: become a throwaway uid (root ignores RLIMIT_NPROC)
        _drop_bounding_set()
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])  # clears every remaining capability
    elif cfg["isolate"]:  # root of our own user namespace: keep the uid, lose the powers
        _prctl(PR_SET_SECUREBITS, SECUREBITS_NO_ROOT)
        _drop_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary or file capability can raise privileges again
    # Die with the supervisor. Armed only now: changing the uid clears it.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.set_blocking(alive_r, False)
    try:
        os.read(alive_r, 1)  # EOF: the supervisor died before we armed it
        raise SetupError("supervisor died")
    except BlockingIOError:
        os.close(alive_r)


def _run_program(cfg: dict, source: bytes) -> None:
    """Become ``python -I -S main.py`` without a second interpreter start-up (~30 ms saved per run).

    This interpreter was started with the same flags; the program gets a fresh ``__main__`` and
    the default SIGTERM action, and an uncaught exception prints a traceback of the program's own
    frames and exits 1, as the interpreter would.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cfg["site_packages"]:
        import site

        site.main()
    else:  # -S skips site, which defines exit() and quit(); programs (competitive ones above all) use them
        import builtins

        builtins.exit = builtins.quit = sys.exit
    main = type(sys)("__main__")
    main.__file__ = os.path.abspath("main.py")
    sys.modules["__main__"], sys.argv = main, ["main.py"]
    try:
        code = compile(source, "main.py", "exec")
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


def _init(program: int, report) -> None:
    """pid 1 stays a bare init and the program runs as its child: the kernel drops default-action
    signals sent to a namespace's pid 1 (SIGXCPU from RLIMIT_CPU would be lost), and pid 1 exiting
    is what kills every leftover process of the sandbox."""
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # same uid as the program, which must not ptrace us to forge a status
    _, wstatus = os.waitpid(program, 0)
    if os.WIFSIGNALED(wstatus):
        report(f"signal {os.WTERMSIG(wstatus)}")
    else:
        report(f"exit {os.WEXITSTATUS(wstatus)}")
    os._exit(0)


def _clean_up(cfg: dict, child: int | None) -> None:
    """Without namespaces nothing dies or disappears by itself: kill what is left, remove the directory."""
    if cfg["isolate"]:
        return
    if child is not None:
        try:
            os.killpg(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kill_marked(os.environ["TIDAL_SANDBOX"])
    if cfg.get("workdir"):
        import shutil

        shutil.rmtree(cfg["workdir"], ignore_errors=True)


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    status = cfg["status_fd"]
    report = lambda line: os.write(status, (line.replace("\n", " ") + "\n").encode())
    child = None

    def on_term(signum, frame):
        if child is None:
            os._exit(SETUP_FAILED)
        # SIGKILL from the parent pid namespace always reaches pid 1; without one, kill its group.
        try:
            (os.kill if cfg["isolate"] else os.killpg)(child, signal.SIGKILL)
        except ProcessLookupError:  # its group does not exist yet
            os.kill(child, signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_term)
    try:
        # SIGTERM when the caller dies: on_term kills the sandbox, then we clean up as after a timeout.
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != cfg["parent_pid"]:  # the caller died before PDEATHSIG was armed
            os._exit(SETUP_FAILED)
        with os.fdopen(cfg["program_fd"], "rb") as f:
            source = f.read()
        cfg["workdir"] = None if cfg["isolate"] else _unisolated_workdir(cfg)
        if cfg["isolate"]:
            _enter_namespaces()
        alive_r, alive_w = os.pipe()
        child = os.fork()
    except (SetupError, OSError) as e:
        report(f"setup_error {e}")
        _clean_up(cfg, None)
        os._exit(SETUP_FAILED)
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(alive_w)
        try:
            _setup(cfg, source, alive_r)
            init_pid = os.getpid()
            program = os.fork()
        except (SetupError, OSError) as e:
            report(f"setup_error {e}")
            os._exit(SETUP_FAILED)
        if program == 0:
            os.close(status)  # the program must not be able to forge a status
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # matters without a pid namespace only
            if os.getppid() != init_pid:
                os._exit(SETUP_FAILED)
            _run_program(cfg, source)
            return
        _init(program, report)
    _, wstatus, usage = os.wait4(child, 0)
    _clean_up(cfg, child)
    if os.WIFSIGNALED(wstatus):  # pid 1 was killed (timeout): the program went with it
        report(f"signal {os.WTERMSIG(wstatus)}")
    report(f"cpu {usage.ru_utime + usage.ru_stime:.3f}")


if __name__ == "__main__":
    main()
