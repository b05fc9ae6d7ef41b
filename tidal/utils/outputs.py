"""What a command writes (a run folder, ``--out DIR``, or one file, ``--out FILE``) and the one rule every
command that writes follows, so that nothing the user had is lost.

``tidal train``, ``sft``/``dpo``/``rm``, the stages chain, ``tidal distill``, ``tidal curate mixture`` and
``compare`` and ``tidal export`` all go through here, so the rule is written once:

1. **Inputs first.** The command reads and checks its inputs (config, model, data) before it opens its
   ``--out``; ``RunDir.open`` then checks the paths: an input that is, holds or lies inside a file tidal
   wrote in ``--out`` (``model.path=OUT/model`` with ``--overwrite``), or that is a name the run writes,
   is one line, and nothing has been deleted.
2. **Only tidal's files.** A run folder records which files under its names (``checkpoints/``, ``model/``,
   ``metrics.jsonl``, ...) tidal wrote and which it found there (``.tidal_outputs.json``): ``open``
   classifies what is present, and ``sweep`` records what tidal wrote since, after every checkpoint and
   when the command ends. ``--overwrite`` deletes tidal's files and nothing else: a user's file inside
   ``model/`` or ``checkpoints/`` survives, and the line that says what was deleted says what was kept.
   A file nobody recorded (a folder written before the manifest existed, a checkpoint renamed into place
   just before a ``kill -9``) is tidal's when its name is one tidal gives (``_tidal_name``), else the
   user's. A file a user adds under tidal's names while a run writes there counts as tidal's at the next
   sweep: the record is only as fine as the sweeps.
3. **Never reused silently.** A folder holding a run's results is continued only by ``--resume`` (and only
   by a command of the kind that wrote it: the manifest records it) or replaced only by ``--overwrite``;
   one file as ``--out`` is replaced only with ``--overwrite``, and never if it is an input or a folder.
4. **One writer.** A process writing a run folder holds an advisory lock (``fcntl.flock`` on
   ``.tidal_lock``, which holds its pid) until the command ends, so a second process on the same
   ``--out`` is one line naming the first instead of a second run mixed into the first.

It lives in ``utils`` (no torch, nothing above layer 0) because every layer that writes uses it: ``data``
(curate), ``models`` (export), ``stages``, ``system``, ``distill`` and ``cli``. What a checkpoint is stays in
``train/checkpoint.py``: callers hand ``open`` a function that finds the latest one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from fnmatch import fnmatch
from pathlib import Path

from tidal.config import ConfigError

MANIFEST = ".tidal_outputs.json"
LOCK = ".tidal_lock"


class OutputError(ConfigError):
    """``--out`` cannot take this command's output (one line on the command line)."""


@dataclass(frozen=True)
class Layout:
    """What one kind of command writes into its folder."""

    kind: str
    """The command (``train``, ``sft``, ...): ``--resume`` continues only a run of the same kind."""
    outputs: tuple[str, ...]
    """Every name it writes at the top of the folder (files and folders); nothing else there is touched."""
    data: tuple[str, ...]
    """Those whose presence (a non-empty file or folder) means the folder holds a run's results."""


# ---- paths ---------------------------------------------------------------------------------------------

def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file or directory (through symlinks, ``..`` and hard links)."""
    a, b = Path(a), Path(b)
    if a.exists() and b.exists():
        return a.samefile(b)
    return a.resolve() == b.resolve()


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


def _within(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies inside it (both real paths)."""
    return path == folder or folder in path.parents


def _exists(text: str) -> bool:
    try:
        return len(text) < 4096 and Path(text).exists()
    except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte: a value, not a path
        return False


def config_inputs(cfg, prefix: str = "") -> dict[str, str]:
    """Every value of a config (dataclasses, mappings and lists, nested) that names an existing file or folder,
    by its ``--set`` key: what the command reads from disk (``model.path``, ``data.path``, ``task.path``,
    ``reward.params.path``, ``harness.function``'s file of ``file.py:function``). The working directory and
    its parents are never an input (a value of ``.`` names no data)."""
    if is_dataclass(cfg) and not isinstance(cfg, type):
        items = [(f.name, getattr(cfg, f.name)) for f in fields(cfg)]
    elif isinstance(cfg, Mapping):
        items = [(str(k), v) for k, v in cfg.items()]
    elif isinstance(cfg, (list, tuple)):
        return {k: v for i, item in enumerate(cfg) for k, v in config_inputs(item, f"{prefix}[{i}]").items()}
    elif isinstance(cfg, (str, os.PathLike)) and str(cfg):
        text = str(cfg)
        cwd = Path.cwd()
        for candidate in (text, text.rpartition(":")[0]):
            if candidate and _exists(candidate) and _real(candidate) not in (cwd, *cwd.parents):
                return {prefix: candidate}
        return {}
    else:
        return {}
    found: dict[str, str] = {}
    for key, value in items:
        found.update(config_inputs(value, f"{prefix}.{key}" if prefix else key))
    return found


def check_not_input(out: str | Path, inputs: Mapping[str, str | Path | None]) -> None:
    """One line naming both if ``out`` is one of ``inputs`` (``{"--in": path, ...}``): writing the output
    would replace the data it is computed from."""
    for label, path in inputs.items():
        if path and same_file(out, path):
            raise OutputError(f"--out {out} is the same file as {label} {path}; refusing to overwrite the input "
                              "(choose another --out)")


def check_outside(out: str | Path, inputs: Mapping[str, str | Path | None]) -> None:
    """One line if ``out`` lies inside one of the folders ``inputs`` names (``tidal export RUN --out
    RUN/checkpoints/step_4/x`` would write into the checkpoint it reads, which rotation later deletes)."""
    where = _real(out)
    for label, path in inputs.items():
        if path and Path(path).is_dir() and _within(where, _real(path)):
            raise OutputError(f"--out {out} is inside {label} {path}, which this command reads; choose an --out "
                              "outside it")


def claim_file(out: str | Path, inputs: Mapping[str, str | Path | None], overwrite: bool) -> Path:
    """Check, before any work, that ``out`` can take the one file a command writes: not a folder, none of
    ``inputs``, and not an existing file unless ``overwrite``. Returns it as a Path."""
    out = Path(out)
    if out.is_dir():
        raise OutputError(f"--out {out} is a folder; --out names the file to write")
    check_not_input(out, inputs)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise OutputError(f"--out {out} exists; pass --overwrite to replace it, or choose another --out")
    return out


# ---- the manifest ----------------------------------------------------------------------------------------

_MODEL_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                "pytorch_model*.bin", "adapter_config.json", "adapter_model.safetensors", "tokenizer*",
                "special_tokens_map.json", "chat_template*", "vocab*", "merges.txt", "added_tokens.json")
_STATE_FILES = ("trainer_state.pt", "hashes.json", "*.pt")


def _tidal_name(rel: str, recorded: bool) -> bool:
    """Whether a file under a run's names that nobody recorded is tidal's by its name: a checkpoint's
    (``checkpoints/latest``, a ``step_<k>/``'s model and state files, a failed save's ``.tmp_*``: a run killed
    between a checkpoint's rename and its sweep leaves those); and in a folder an older tidal wrote without a
    manifest (not ``recorded``), also ``model/``'s model files and anything in folders only tidal writes into
    (``tensorboard/``, ``sdc/``, ``logits/``...)."""
    parts = rel.split("/")
    top, name = parts[0], parts[-1]
    if top == "checkpoints":
        if len(parts) == 2:
            return name in ("latest", "latest.tmp") or name.startswith(".tmp_")
        if parts[1].startswith(".tmp_"):
            return True
        return (len(parts) == 3 and re.fullmatch(r"step_\d+", parts[1]) is not None
                and any(fnmatch(name, p) for p in _MODEL_FILES + _STATE_FILES))
    if recorded:
        return False
    if top == "model":
        return len(parts) == 2 and any(fnmatch(name, p) for p in _MODEL_FILES)
    return True


def _files_under(out: Path, names) -> list[str]:
    """The relative paths of every file (and symlink, never followed) under ``out/name`` for each name."""
    found = []
    for name in names:
        path = out / name
        if path.is_symlink() or path.is_file():
            found.append(name)
        elif path.is_dir():
            for root, dirs, files in os.walk(path):
                links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
                found += [Path(root, f).relative_to(out).as_posix() for f in sorted(files + links)]
    return found


def _read_manifest(out: Path) -> dict | None:
    try:
        data = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("wrote"), list):
        return None
    return data


def _write_manifest(out: Path, kind: str, outputs, wrote, kept) -> None:
    tmp = out / f"{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp"  # a writer of its own: never torn
    tmp.write_text(json.dumps({"kind": kind, "outputs": list(outputs), "wrote": sorted(set(wrote)),
                               "kept": sorted(set(kept))}, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)


def run_kind(out: str | Path) -> str | None:
    """The kind of command that wrote the run in ``out`` (its manifest's), None if unknown."""
    manifest = _read_manifest(Path(out))
    return manifest.get("kind") if manifest else None


def wrong_kind(out: Path, found: str, kind: str) -> str:
    """The line for ``--resume`` of a run another command wrote, with the command that continues it."""
    again = f"tidal train {out / 'config.yaml'} --out {out} --resume" if found == "train" else \
        f"tidal {found} --out {out} --resume"
    return f"--resume: {out} is a tidal {found} run, not a tidal {kind} run; continue it with: {again}"


def check_kind(out: str | Path, kind: str, guess: Callable[[Path], str | None] | None = None) -> None:
    """Before a command reads ``out``'s saved config on ``--resume``: the run there is one it wrote (the
    manifest says; for a run without one, ``guess(out)`` may tell from its config), else one line naming the
    command that wrote it (a dpo config read into an sft run failed on the first key the two do not share)."""
    out = Path(out)
    found = run_kind(out) or (guess(out) if guess is not None and out.is_dir() else None)
    if found not in (None, kind):
        raise OutputError(wrong_kind(out, found, kind))


def _classify(out: Path, manifest: dict | None, names) -> tuple[list[str], list[str]]:
    """(tidal's files, the others) among the files now under ``names``. A file at one of the names itself
    (``metrics.jsonl``) is tidal's: the run writes it whatever was there. Inside a folder (``model/``,
    ``checkpoints/``) a file is tidal's as the manifest records it; one nobody recorded by its name
    (``_tidal_name``), if the folder holds a run at all: without a manifest or a file of a run, a folder is
    the user's and so is everything in it."""
    wrote = set(manifest["wrote"]) if manifest else set()
    kept = set(manifest.get("kept", [])) if manifest else set()
    by_name = manifest is not None or any((out / n).is_file() for n in names) or (out / "checkpoints").is_dir()
    ours, theirs = [], []
    for rel in _files_under(out, names):
        mine = "/" not in rel or rel in wrote or (rel not in kept and by_name and _tidal_name(rel, bool(manifest)))
        (ours if mine else theirs).append(rel)
    return ours, theirs


_SWEEP_LOCK = threading.Lock()  # a background checkpoint writer sweeps too


def sweep(out: str | Path) -> None:
    """Record in ``out``'s manifest every file now under the run's names that is not one it found there: what
    tidal wrote since the last sweep. Files that are gone (checkpoints rotated away) drop out of it. Without a
    manifest (a run started from the Python API, not through ``RunDir.open``) there is nothing to record."""
    out = Path(out)
    with _SWEEP_LOCK:
        manifest = _read_manifest(out)
        if manifest is None:
            return
        kept = set(manifest.get("kept", []))
        present = _files_under(out, manifest.get("outputs", []))
        wrote, still_kept = [p for p in present if p not in kept], [p for p in present if p in kept]
        if sorted(set(wrote)) != manifest["wrote"] or sorted(still_kept) != manifest.get("kept"):
            _write_manifest(out, manifest.get("kind", ""), manifest.get("outputs", []), wrote, still_kept)


def previous_run(out: Path, layout: Layout, checkpoint: Path | None, ours: list[str] | None = None) -> list[str]:
    """The results of a previous run in ``out``, as the user would name them: a non-empty file among
    ``layout.data``, a folder among them holding files (of tidal's, if ``ours`` lists them), a checkpoint."""
    found = []
    for name in layout.data:
        path = out / name
        if path.is_file() and path.stat().st_size > 0:
            found.append(name)
        elif path.is_dir() and (any(r.startswith(f"{name}/") for r in ours) if ours is not None
                                else any(path.iterdir())):
            found.append(f"{name}/")
    return found + ([f"checkpoints/{checkpoint.name}"] if checkpoint is not None else [])


def install(tmp: Path, dest: Path, run_folder: Path) -> None:
    """Put the folder ``tmp`` (written complete, flat) at ``dest`` in ``run_folder``, replacing what tidal
    wrote there before: a stage's ``model/``. Files tidal did not write (a user's file inside ``model/``,
    found there by ``RunDir.open``) stay where they are."""
    rel = dest.relative_to(run_folder).as_posix()
    theirs = set(_classify(run_folder, _read_manifest(run_folder), [rel])[1])
    if not theirs:
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return
    for f in dest.iterdir():
        if f.relative_to(run_folder).as_posix() not in theirs and (f.is_symlink() or not f.is_dir()):
            f.unlink()
    for f in tmp.iterdir():
        os.replace(f, dest / f.name)
    tmp.rmdir()


# ---- the lock --------------------------------------------------------------------------------------------

def _lock(out: Path) -> int:
    """An exclusive ``flock`` on ``out/.tidal_lock`` (holding this pid), or one line naming the holder's pid."""
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks: go on unlocked
            return fd
        try:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        raise OutputError(f"{out} is being written by another tidal process (pid {pid}); wait for it to end (or "
                          "stop it), or choose another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _usable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise OutputError(f"--out {out}: cannot write a run there ({e.strerror or e})") from None


# ---- the run folder --------------------------------------------------------------------------------------

class RunDir:
    """A run folder a command writes. ``open`` checks it and locks it; ``begin`` (once the command has read
    and checked its inputs) deletes the previous run's files with ``--overwrite`` and records what is there;
    ``sweep`` records what the command wrote since; ``close`` (or the end of a ``with`` block) sweeps and
    releases the lock. A folder ``open`` created for a command that fails before ``begin`` is removed again."""

    def __init__(self, path: Path, layout: Layout, fd: int | None, created: bool) -> None:
        self.path, self.layout, self._fd, self._created = path, layout, fd, created
        self._pending: tuple | None = None
        self._begun = False

    @classmethod
    def open(cls, out: str | Path, layout: Layout, *, resume: bool = False, overwrite: bool = False,
             inputs: Mapping[str, str | Path | None] | None = None,
             checkpoint: Callable[[Path], Path | None] | None = None,
             log: Callable[[str], None] = print, begin: bool = True) -> RunDir:
        """Check that ``out`` can take this command's run and lock it; with ``begin`` also ``begin`` it.
        ``inputs``: ``{key: path}`` of everything the command reads (``config_inputs``). ``checkpoint(out)``:
        the latest checkpoint, which ``resume`` needs (None: ``resume`` needs none). ``log`` gets the line
        saying what ``--overwrite`` deleted and what it kept."""
        out = Path(out)
        inputs = {k: Path(v) for k, v in (inputs or {}).items() if v}
        if resume and overwrite:
            raise OutputError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
        if out.exists() and not out.is_dir():
            raise OutputError(f"--out {out} is a file, not a directory")
        if resume and not out.exists():
            raise OutputError(f"--resume: {out} does not exist, so there is no run to continue")
        kind = run_kind(out)
        if resume and kind not in (None, layout.kind):
            raise OutputError(wrong_kind(out, kind, layout.kind))
        created = not out.exists()
        _usable(out)
        run = cls(out, layout, _lock(out), created)
        try:
            run._check(resume, overwrite, inputs, checkpoint, log)
            if begin:
                run.begin()
        except BaseException:
            run.close()
            raise
        return run

    def _names(self, manifest: dict | None) -> list[str]:
        """The names to look under: this run's, and those of the run it replaces."""
        return list(dict.fromkeys([*self.layout.outputs, *(manifest.get("outputs", []) if manifest else [])]))

    def _check(self, resume: bool, overwrite: bool, inputs: dict[str, Path], checkpoint, log) -> None:
        out, layout = self.path, self.layout
        manifest = _read_manifest(out)
        ours, _ = _classify(out, manifest, self._names(manifest))
        self._check_inputs(inputs, ours, overwrite)
        ckpt = checkpoint(out) if checkpoint is not None else None
        if resume:
            if checkpoint is not None and ckpt is None:
                raise OutputError(f"--resume: {out} holds no checkpoint to continue from; start again with --overwrite")
        else:
            found = previous_run(out, layout, ckpt, ours)
            if found and not overwrite:
                if checkpoint is None:  # a command that cannot resume (tidal distill)
                    raise OutputError(f"{out} holds a previous run's {', '.join(found)}; pass --overwrite to replace "
                                      "it (only the files that run wrote), or choose another --out")
                if ckpt is not None:
                    raise OutputError(f"{out} already holds a run ({', '.join(found)}); pass --resume to continue "
                                      "it, --overwrite to delete it and start again, or choose another --out")
                raise OutputError(f"{out} holds a previous run's {', '.join(found)} but no checkpoint to resume; "
                                  "pass --overwrite to delete it and start again, or choose another --out")
        self._pending = (overwrite, log)

    def begin(self) -> None:
        """With ``--overwrite``, delete the previous run's files (tidal's only: the line logged says what went
        and what stayed); record what is in the folder now. Call it once the inputs are read and checked."""
        if self._pending is None:
            return
        (overwrite, log), self._pending, self._begun = self._pending, None, True
        out = self.path
        manifest = _read_manifest(out)
        names = self._names(manifest)
        ours, _ = _classify(out, manifest, names)
        if overwrite:
            note = self._delete(ours, names)
            if note:
                log(note)
            ours = []
        present = set(_files_under(out, names))
        ours = [p for p in ours if p in present]
        _write_manifest(out, self.layout.kind, self.layout.outputs, ours, present - set(ours))

    def _check_inputs(self, inputs: dict[str, Path], ours: list[str], overwrite: bool) -> None:
        """No input is a name this run writes, nor is, holds or lies in a file tidal wrote here (which
        ``--overwrite`` would delete, or the run would rewrite)."""
        out = self.path
        written = [(rel, _real(out / rel)) for rel in ours]
        for key, path in inputs.items():
            where = _real(path)
            if where in _real(out).parents:  # a folder around the run (a cache the run lives in) is read, not held
                continue
            clash = next((rel for rel, f in written if _within(f, where)), None)
            if clash is None and any(where == _real(out / name) for name in self.layout.outputs):
                clash = where.name
            if clash is None:
                continue
            what = "the previous run's" if overwrite else "the run's"
            does = "--overwrite would delete" if overwrite else "this run writes"
            raise OutputError(f"{key}={path} is (or holds) {what} {clash} in --out {out}, which {does}; copy it "
                              "out of --out first, or choose another --out")

    def _delete(self, ours: list[str], names: list[str]) -> str | None:
        """Delete tidal's files (and the folders they leave empty); the line saying what went and what stayed."""
        out = self.path
        leftovers = list((out / "checkpoints").glob(".tmp_*")) if "checkpoints" in names else []
        tops = {rel.split("/")[0] for rel in ours} | ({"checkpoints"} if leftovers else set())
        folders = {t for t in tops if (out / t).is_dir() and not (out / t).is_symlink()}
        for rel in ours:
            (out / rel).unlink(missing_ok=True)
        for leftover in leftovers:  # a failed save's temporary folder, empty or not: tidal's
            shutil.rmtree(leftover, ignore_errors=True)
        for folder in sorted({(out / rel).parent for rel in ours} | {out / t for t in folders},
                             key=lambda p: len(p.parts), reverse=True):
            while folder != out and _within(folder, out) and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
                folder = folder.parent
        if not tops:
            return None
        shown = [f"{t}/" if t in folders else t for t in names if t in tops]
        note = f"--overwrite: deleted the previous run's {', '.join(shown)} from {out}"
        kept = [rel for rel in _files_under(out, sorted(folders))]
        if kept:
            more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
            note += f"; kept {len(kept)} file(s) tidal did not write: {', '.join(kept[:3])}{more}"
        return note

    def sweep(self) -> None:
        sweep(self.path)

    def close(self) -> None:
        """Record what the command wrote and release the lock (also when it failed or was interrupted); a
        folder this command created and never began to write is removed."""
        if self._fd is None:
            return
        try:
            if self._begun:
                sweep(self.path)
            elif self._created:
                (self.path / LOCK).unlink(missing_ok=True)
                if not any(self.path.iterdir()):
                    self.path.rmdir()
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
