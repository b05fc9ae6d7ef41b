"""Checkpoint files written past the page cache and hashed as they are written.

Why (issue 55; ``/tmp``-style profile of ``write_checkpoint`` on the 0.5B shapes with 4 decoder layers, 2.35 GB
per checkpoint, on the 2-core Firecracker VM these numbers come from): the writer used 4-6 s of CPU per save,
and ~90% of it was *kernel* time allocating page-cache pages for the new files (0.4 s user, 3.8-5.3 s sys;
a plain ``os.write`` of 2.35 GB into a new file: 5.0 s sys the first time, 0.46 s when the pages of a file
deleted a moment earlier are reused). The VM hands freed guest pages back to its host (free page reporting),
so every checkpoint's 2.35 GB of fresh page cache is faulted in again. None of it is the disk's cost: the same
bytes written with ``O_DIRECT`` from a reused, aligned buffer took 1.2-2.1 s of wall time and 0.3-0.4 s of CPU.

So the two large files are written here instead of through the page cache:

- ``HashingWriter``: a write-only file object that copies what it is given into one reused page-aligned
  buffer (``BUFFER_BYTES``), writes the full buffer with ``O_DIRECT`` and feeds the same bytes to the
  ``hashes.json`` digest (xxh3-128), so the file is not read back to hash it. The last partial block is
  written padded and the file truncated to its length. Where ``O_DIRECT`` is refused (tmpfs, some network and
  FUSE filesystems, macOS has no such flag) it writes through the page cache as before; the bytes are the same.
- ``save_safetensors``: ``safetensors.torch.save_file``'s format, byte for byte (the same header, tensor order
  and padding: ``tests/train/test_checkpoint_io.py`` compares the files), streamed through a ``HashingWriter``
  from the tensors' own memory. ``save_pretrained`` keeps doing everything else (tied weights written once,
  weight conversions reverted, config, generation config): ``direct_save_pretrained`` swaps the one call that
  writes the shard, ``transformers.modeling_utils.safe_save_file``, for the duration of the save.
- ``trainer_state.pt`` is ``torch.save`` into a ``HashingWriter`` (``torch.save`` accepts a file object and
  hands it memoryviews of each storage, no copies), without the zip's CRC-32 of every record (0.22 s of CPU
  per GB here): ``hashes.json``'s digest already covers the file, and ``torch.load`` does not check the CRC.

What stays the disk's: the wall time of the write (measured ~1.1-1.9 GB/s here), which the asynchronous
writer hides; the copy into the aligned buffer and the hash (~0.1 s per GB each).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import xxhash

DIGEST = "xxh3_128"
BLOCK = 4096
"""``O_DIRECT`` wants file offsets, lengths and buffer addresses aligned to the device's logical block size
(512 or 4096 bytes on the disks we know); 4096 covers both."""
BUFFER_BYTES = 32 << 20
"""The aligned staging buffer: large enough that a write call costs little per byte (32 MB: 2.35 GB in
1.2-2.1 s), small enough to keep for the process's life."""

_BUFFER: mmap.mmap | None = None
_BUFFER_LOCK = threading.Lock()


def _staging_buffer() -> tuple[mmap.mmap, bool]:
    """The process's staging buffer (kept: a fresh one would be page-faulted in again every save) and whether
    the caller holds it; a second writer at the same time gets a private one."""
    global _BUFFER
    if _BUFFER_LOCK.acquire(blocking=False):
        if _BUFFER is None:
            _BUFFER = mmap.mmap(-1, BUFFER_BYTES)  # anonymous mappings are page-aligned
        return _BUFFER, True
    return mmap.mmap(-1, BUFFER_BYTES), False


class HashingWriter:
    """A new file at ``path``, written through ``write(bytes-like)`` and finished by ``close()``, after which
    ``digest`` is its ``hashes.json`` entry (``xxh3_128:<hex>``) and ``direct`` says whether it bypassed the
    page cache. Errors are ``OSError``; the partly written file is the caller's to remove."""

    def __init__(self, path: str | Path, direct: bool = True) -> None:
        self.path = Path(path)
        self.direct = direct and hasattr(os, "O_DIRECT")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # a filesystem without O_DIRECT (tmpfs)
        if self._fd < 0:
            self._fd = os.open(self.path, flags, 0o644)
        self._buffer, self._owned = _staging_buffer()
        self._view = memoryview(self._buffer)
        self._array = np.frombuffer(self._buffer, dtype=np.uint8)
        self._filled = 0
        self._size = 0  # bytes given to write()
        self._written = 0  # bytes written to the file, padding included
        self._hash = xxhash.xxh3_128()
        self.digest: str | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n, done = view.nbytes, 0
        if n == 0:
            return 0
        # numpy's copy releases the GIL (a memoryview slice assignment holds it for the whole copy, ~10 ms per
        # 32 MB here, and the training thread then waits that long for the GIL at each of its Python steps: it
        # slowed the step beside a background write by more than the write's own CPU); xxhash and os.write
        # release it too
        source = np.frombuffer(view, dtype=np.uint8)
        while done < n:
            k = min(n - done, BUFFER_BYTES - self._filled)
            np.copyto(self._array[self._filled:self._filled + k], source[done:done + k])
            self._filled += k
            done += k
            if self._filled == BUFFER_BYTES:
                self._flush(BUFFER_BYTES)
        self._size += n
        return n

    def flush(self) -> None:
        """Nothing to do before ``close``: a partial block cannot be written with ``O_DIRECT`` (``torch.save``
        calls this once, at its end)."""

    def _flush(self, length: int) -> None:
        """Write the buffer's first ``length`` bytes (a multiple of ``BLOCK`` unless it is the end) and hash them."""
        chunk = self._view[:length]
        self._hash.update(chunk)
        padded = -(-length // BLOCK) * BLOCK if self.direct else length
        if padded != length:
            self._view[length:padded] = bytes(padded - length)
        done = 0
        while done < padded:
            try:
                done += os.write(self._fd, self._view[done:padded])
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL and self._written == 0 and done == 0):
                    raise
                # the filesystem took O_DIRECT at open but refuses its writes: the page cache, from the start
                self._reopen_buffered()
                padded = length
        self._written += padded
        self._filled = 0

    def _reopen_buffered(self) -> None:
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o644)
        self.direct = False

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._filled or self._size == 0:
                self._flush(self._filled)
            if self.direct:
                os.ftruncate(self._fd, self._size)  # the zeros that padded the last block
        finally:
            os.close(self._fd)
            self._fd = -1
            del self._array
            self._view.release()
            if self._owned:
                _BUFFER_LOCK.release()
        self.digest = f"{DIGEST}:{self._hash.hexdigest()}"

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16",
          "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
"""safetensors' ``Dtype`` enum order: a file lists its tensors by dtype, this order reversed, then by name (so
every tensor's offset is aligned to its element size)."""


def save_safetensors(tensors: dict[str, torch.Tensor], filename: str | Path, metadata: dict[str, str] | None = None,
                     digests: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file(tensors, filename, metadata)``, written by a ``HashingWriter``; the file's
    digest goes to ``digests[str(filename)]``. A dtype this does not know, or a big-endian host, is handed to
    ``save_file`` itself (and hashed by the caller, reading the file back)."""
    from safetensors.torch import save_file

    if sys.byteorder != "little" or any(t.dtype not in _DTYPES for t in tensors.values()):
        save_file(tensors, filename, metadata=metadata)
        return
    areas = []
    for name, t in tensors.items():  # save_file's own checks, with its messages' gist
        if t.layout != torch.strided:
            raise ValueError(f"You are trying to save a sparse tensor: `{name}` which safetensors does not support.")
        if not t.is_contiguous():
            raise ValueError(f"You are trying to save a non contiguous tensor: `{name}` which is not allowed.")
        if t.numel():
            areas.append((str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name))
    areas.sort()
    for (device, _, end, first), (device2, start, _, name) in zip(areas, areas[1:]):
        # disjoint slices of one storage are fine (an MoE's per-expert views of its fused tensor), overlaps not
        if device == device2 and start < end:
            raise RuntimeError(f"Some tensors share memory: [{first!r}, {name!r}]; safetensors writes each once "
                               "(save_pretrained removes tied weights first)")
    names = sorted(tensors, key=lambda n: (-_ORDER.index(_DTYPES[tensors[n].dtype]), n))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with HashingWriter(filename) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            t = tensors[name].detach()
            if t.numel():
                f.write(t.cpu().reshape(-1).view(torch.uint8).numpy())
    if digests is not None:
        digests[os.path.abspath(filename)] = f.digest


@contextlib.contextmanager
def direct_save_pretrained(digests: dict[str, str]) -> Iterator[None]:
    """While inside, ``PreTrainedModel.save_pretrained`` writes its safetensors shards with ``save_safetensors``
    (their digests land in ``digests``, by absolute file name). transformers looks the function up in its module at
    call time; a transformers without it keeps its own writer (the caller hashes by reading back). Callers hold
    ``checkpoint._ONE_WRITE_AT_A_TIME``, so saves do not swap it concurrently; another thread's
    ``save_pretrained`` meanwhile writes the same bytes."""
    try:
        from transformers import modeling_utils
    except ImportError:  # pragma: no cover
        yield
        return
    original = getattr(modeling_utils, "safe_save_file", None)
    if original is None:
        yield
        return

    def write(tensors, filename, metadata=None):
        save_safetensors(tensors, filename, metadata, digests)

    modeling_utils.safe_save_file = write
    try:
        yield
    finally:
        modeling_utils.safe_save_file = original


def torch_save(obj, path: str | Path) -> str:
    """``torch.save(obj, path)`` through a ``HashingWriter``, without the zip's per-record CRC-32 (module
    docstring); returns the file's digest."""
    from torch import serialization

    crc = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        with HashingWriter(path) as f:
            torch.save(obj, f)
    finally:
        serialization.set_crc32_options(crc)
    return f.digest
