"""Checkpoints: everything needed to continue a run exactly where it stopped.

``checkpoints/step_<k>/`` holds the policy (``save_pretrained``, safetensors, loadable by any HF
tool; with ``model.lora`` its adapters in PEFT's layout, ``adapter_config.json`` +
``adapter_model.safetensors``, which ``PeftModel.from_pretrained`` loads onto the base), the tokenizer,
and ``trainer_state.pt``: optimizer and scheduler state, RNG states, the
policy version, the step and the data position; plus one ``<name>.pt`` per extra trained component
(``critic.pt``: the value model of ``algo.advantage=gae``, its optimizer and scheduler). A checkpoint
is written to a temporary directory (``.tmp_step_<k>``) and renamed into place, and ``latest`` is
updated last, so a crash mid-save leaves the previous checkpoint intact. A save that fails (a full
disk) removes its temporary directory and raises ``CheckpointError``, one line naming the step and the
cause; a ``.tmp_*`` left by a process that died mid-save is never read as a checkpoint and is removed
by the next save. Older checkpoints beyond ``keep`` are removed.

Content hashes: every file a checkpoint restores from (``model.safetensors``, ``trainer_state.pt``, each
``<name>.pt``) has its digest in ``hashes.json``, written inside the same atomic save, and is checked on
load: a file changed on disk since (a flipped bit, a truncated copy) fails with ``CheckpointCorrupted``
naming the file, instead of silently training on corrupted weights. The digest is xxh3-128 (``xxhash``):
it detects corruption, which is all it is for (not tampering), at ~6 GB/s against sha256's ~0.45 GB/s on
this machine, where hashing a 0.5B model's 2.35 GB state with sha256 was 5 s of every save's CPU.
Checkpoints written with sha256 (bare hex digests) are still checked with it; one without ``hashes.json``
(written before hashes existed) loads unchecked. The weights and ``.pt`` files are hashed as they are written
(``checkpoint_io``), not read back; the digest is the same, of the bytes in the file.

The large files are written past the page cache (``checkpoint_io``: ``O_DIRECT``, where the filesystem allows
it): on the 2-core VM this is measured on, faulting in fresh page cache was ~90% of the writer's CPU, 4-6 s per
2.35 GB save, against ~0.45 s now (``tidal bench checkpoint``, ``writer_cpu_s_per_gb``).

Writing is split in two so that it can run in the background: ``capture`` (or ``snapshot.py``'s host copy)
collects what a checkpoint holds, ``write_checkpoint`` writes it. ``save_checkpoint`` does both at once;
``async_checkpoint.py`` snapshots on the training thread and writes on a background one, to the same files.

A model sharded with FSDP (``parallel/fsdp.py``, found by ``data_parallel.root_of``) is saved as full weights and
full optimizer state gathered on rank 0, in the same files and numbering as one process writes, so a run can
resume with a different number of processes; loading one broadcasts it from rank 0 into every rank's shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from tidal.models import lora
from tidal.models.char_tokenizers import save_tokenizer
from tidal.train import checkpoint_io
from tidal.train.data_parallel import root_of
from tidal.utils.seeding import rng_state, set_rng_state


class CheckpointError(OSError):
    """A checkpoint could not be written; the previous one (if any) is intact."""


class CheckpointCorrupted(RuntimeError):
    """A checkpoint file's content no longer matches the sha256 recorded when it was written."""


HASHES = "hashes.json"
HASHED = ("model.safetensors", lora.ADAPTER_WEIGHTS, "trainer_state.pt")
"""Files whose content hash a checkpoint records (plus every ``<component>.pt``)."""


DIGEST = "xxh3_128"
"""The digest ``hashes.json`` records, as ``xxh3_128:<hex>`` (module docstring); a bare hex digest is sha256."""


def file_digest(path: Path, algorithm: str = DIGEST, chunk: int = 1 << 22) -> str:
    """``path``'s digest as ``hashes.json`` records it: ``xxh3_128:<hex>``, or bare hex for ``sha256``."""
    h = xxhash.xxh3_128() if algorithm == DIGEST else hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return f"{DIGEST}:{h.hexdigest()}" if algorithm == DIGEST else h.hexdigest()


def write_hashes(directory: Path, names: list[str], known: dict[str, str] | None = None) -> None:
    """Record the digest of ``names`` (files in ``directory``) in ``directory/hashes.json``. ``known``: digests
    already computed while writing (absolute path -> digest, ``checkpoint_io``); any other file is read back."""
    known = known or {}
    hashes = {n: known.get(os.path.abspath(directory / n)) or file_digest(directory / n)
              for n in names if (directory / n).exists()}
    (directory / HASHES).write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")


def verify_hashes(directory: str | Path) -> int:
    """Check every file listed in ``hashes.json`` against its recorded digest (xxh3-128, or sha256 for a
    bare hex digest); returns how many were checked (0: no hashes recorded). Raises ``CheckpointCorrupted``
    naming the first bad or missing file."""
    directory = Path(directory)
    if not (directory / HASHES).exists():
        return 0
    hashes = json.loads((directory / HASHES).read_text())
    for name, want in sorted(hashes.items()):
        if not (directory / name).exists():
            raise CheckpointCorrupted(f"checkpoint {directory}: {name} is missing (hashes.json lists it)")
        got = file_digest(directory / name, DIGEST if want.startswith(f"{DIGEST}:") else "sha256")
        if got != want:
            raise CheckpointCorrupted(f"checkpoint {directory}: {name} is corrupted (digest {got[:25]}..., "
                                      f"written as {want[:25]}...); roll back to an earlier checkpoint")
    return len(hashes)


@dataclass
class TrainingState:
    """Counters that locate a run in its data and in policy-version space."""

    step: int  # training steps completed
    version: int  # policy version of the saved weights
    next_group: int  # index of the first group (prompt) not yet trained on
    extra: dict[str, Any]


@dataclass
class CheckpointContents:
    """What one checkpoint writes, apart from the tokenizer and the model's config: the weights (None: the
    model's own, read while writing), the optimizer, scheduler and RNG states, the counters and each extra
    component's state dict. ``capture`` fills it with the live objects (a synchronous save writes them at
    once); ``snapshot.py`` with host copies, which a background writer may read while training goes on."""

    model_state: dict[str, Any] | None
    optimizer: dict
    scheduler: dict
    rng: dict
    state: dict
    components: dict[str, dict]


def capture(model, optimizer, scheduler, state: TrainingState, components: dict[str, Any] | None = None,
            model_state: dict | None = None, optimizer_state: dict | None = None) -> CheckpointContents:
    """The live state a checkpoint holds (no copies: write it before the next training step)."""
    return CheckpointContents(
        model_state=model_state,
        optimizer=optimizer.state_dict() if optimizer_state is None else optimizer_state,
        scheduler=scheduler.state_dict(),
        rng=rng_state(),
        state=state.__dict__,
        components={name: component.state_dict() for name, component in (components or {}).items()},
    )


def save_checkpoint(
    root: str | Path, model, tokenizer, optimizer, scheduler, state: TrainingState, keep: int = 2,
    components: dict[str, Any] | None = None,
) -> Path | None:
    """Write ``step_<k>/`` now (the step waits for the disk; ``async_checkpoint.py`` writes in the background).
    A sharded model: every rank takes part in the gather and rank 0 writes (the others get None).
    ``components``: name -> an object with ``state_dict()``, each written to ``<name>.pt`` inside the same
    atomic save."""
    model_state_dict = optimizer_state = None
    if (sharded := root_of(model)) is not None:
        model_state_dict, optimizer_state = sharded.gather_full_state(optimizer)
        if torch.distributed.get_rank() != 0:
            return None
    contents = capture(model, optimizer, scheduler, state, components, model_state_dict, optimizer_state)
    return write_checkpoint(root, model, tokenizer, contents, keep)


WRITE_HOLD_ENV = "TIDAL_TEST_HOLD_CHECKPOINT_WRITE"
"""Tests only: ``<step>:<marker path>`` makes the write of ``step_<step>`` stop after the weights (before the
trainer state, the hashes and the rename), create the marker file and wait there until the process is killed:
a deterministic "killed mid-write" (``tests/train/test_async_checkpoint_kill.py``)."""


def write_checkpoint(root: str | Path, model, tokenizer, contents: CheckpointContents, keep: int = 2) -> Path:
    """Write ``contents`` as ``root/step_<k>/``: into ``.tmp_step_<k>``, hashed, renamed into place, ``latest``
    updated, then checkpoints beyond the newest ``keep`` removed (never the one just written, so the newest
    complete checkpoint always survives). ``model`` and ``tokenizer`` give the file layout, the config and
    the vocabulary (read only); with ``contents.model_state`` the weights come from there."""
    with _ONE_WRITE_AT_A_TIME:
        return _write(Path(root), model, tokenizer, contents, keep)


_ONE_WRITE_AT_A_TIME = threading.Lock()
"""Two writes in one process take turns: each begins by removing ``.tmp_*`` leftovers, so two at once (an
interrupt's checkpoint beside a background write still running) would delete each other's files."""


def _write(root: Path, model, tokenizer, contents: CheckpointContents, keep: int) -> Path:
    step = contents.state["step"]
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp_*"):  # a save that died before its rename
            _remove(leftover)
        tmp.mkdir()
        save_tokenizer(tokenizer, tmp)  # a vision-language model's processor with it
        # save_pretrained pops the tensors it writes out of the dict it is given: hand it a shallow copy
        weights = dict(contents.model_state) if contents.model_state is not None else None
        # The large files bypass the page cache and are hashed as they are written (checkpoint_io's docstring:
        # on the 2-core VM, fresh page cache was ~90% of the writer's CPU)
        digests: dict[str, str] = {}
        if lora.is_peft(model):
            lora.save_adapters(model, tmp, weights)
        else:
            with checkpoint_io.direct_save_pretrained(digests):
                model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
            if contents.model_state is not None:
                _config_names_the_weights_dtype(tmp, contents.model_state)
        _hold_if_asked(step)
        trainer_state = {"optimizer": contents.optimizer, "scheduler": contents.scheduler, "rng": contents.rng,
                         "state": contents.state}
        digests[os.path.abspath(tmp / "trainer_state.pt")] = checkpoint_io.torch_save(trainer_state,
                                                                                      tmp / "trainer_state.pt")
        for name, component_state in contents.components.items():
            digests[os.path.abspath(tmp / f"{name}.pt")] = checkpoint_io.torch_save(component_state,
                                                                                    tmp / f"{name}.pt")
        write_hashes(tmp, [*HASHED, *(f"{name}.pt" for name in contents.components)], digests)
        if final.exists():  # the same step saved again (a resumed run): move the old one aside first
            final.rename(root / f".tmp_old_step_{step}")
        tmp.rename(final)
        (root / "latest.tmp").write_text(final.name)
        (root / "latest.tmp").replace(root / "latest")
    except Exception as e:  # OSError, safetensors' SafetensorError, torch's RuntimeError: all a failed write
        _remove(tmp)
        if (root / f".tmp_old_step_{step}").exists() and not final.exists():
            (root / f".tmp_old_step_{step}").rename(final)
        previous = latest_checkpoint(root)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write checkpoint {final} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())}); {kept}") from e
    _remove(root / f".tmp_old_step_{step}")
    for old in sorted(_steps(root))[:-keep] if keep > 0 else []:
        if old != step:
            shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    return final


def _config_names_the_weights_dtype(directory: Path, weights: dict) -> None:
    """``save_pretrained`` writes ``config.json``'s ``dtype`` from the live model, which can differ from the
    weights it was handed: under ``trainer.weights=bf16_master`` the file holds the fp32 masters while the model
    (read on the background writer's thread, after the step) is bf16, and ``from_pretrained(dir)`` would load
    the masters rounded. The dtype of the floating tensors written is the one to name."""
    dtype = next((t.dtype for t in weights.values() if torch.is_floating_point(t)), None)
    path = directory / "config.json"
    if dtype is None or not path.is_file():
        return
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    if config.get("dtype", name) != name:
        config["dtype"] = name
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _hold_if_asked(step: int) -> None:
    hold = os.environ.get(WRITE_HOLD_ENV)
    if hold and int(hold.split(":", 1)[0]) == step:
        Path(hold.split(":", 1)[1]).write_text(f"holding the write of step_{step}\n")
        while True:
            time.sleep(1.0)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _steps(root: Path) -> list[int]:
    return [int(p.name.split("_", 1)[1]) for p in root.glob("step_*") if p.name.split("_", 1)[1].isdigit()]


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    pointer = root / "latest"
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if (path / "trainer_state.pt").exists():
            return path
    steps = [k for k in sorted(_steps(root)) if (root / f"step_{k}" / "trainer_state.pt").exists()]
    return root / f"step_{steps[-1]}" if steps else None


def load_checkpoint(path: str | Path, model, optimizer, scheduler,
                    components: dict[str, Any] | None = None) -> TrainingState:
    """Load weights, optimizer, scheduler and RNG state in place; return the counters. A sharded model:
    every rank calls it, rank 0 reads the files. ``components``: name -> an object with
    ``load_state_dict``, restored from ``<name>.pt`` (a checkpoint without it is an error)."""
    if lora.is_peft(model):  # another rank or alpha: one line here (sharded too), not PEFT's size-mismatch traceback
        lora.check_adapters(model, path)
    if (sharded := root_of(model)) is not None:
        assert not components, "extra components are not supported with a sharded model"
        return sharded.load_full_checkpoint(path, optimizer, scheduler)
    for name in components or {}:
        if not (Path(path) / f"{name}.pt").exists():
            raise RuntimeError(f"checkpoint {path} has no {name}.pt: it was saved by a run without a {name} "
                               "(a run with algo.advantage=gae cannot resume from it)")
    adapters = (Path(path) / lora.ADAPTER_WEIGHTS).exists()
    if adapters != lora.is_peft(model):
        runs = "trains LoRA adapters" if lora.is_peft(model) else "trains the whole model"
        raise lora.AdapterMismatch(f"checkpoint {path} holds {'LoRA adapters' if adapters else 'full weights'} but "
                                   f"the run {runs}: resume with the model.lora settings it was written with")
    if adapters:
        verify_hashes(path)
        lora.load_adapters(model, path)
        blob = torch.load(Path(path) / "trainer_state.pt", weights_only=False, map_location="cpu")
    else:
        weights, blob = read_checkpoint(path)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # Tied embeddings are saved once; anything else missing means a different architecture.
        missing = [k for k in missing if k not in ("lm_head.weight",)]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing}, "
                               f"unexpected {unexpected}")
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"])
    for name, component in (components or {}).items():
        component.load_state_dict(torch.load(Path(path) / f"{name}.pt", weights_only=False, map_location="cpu"))
    return TrainingState(**blob["state"])


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, trainer state blob) of a checkpoint directory, its content hashes checked first (a LoRA
    checkpoint's weights: its adapters only)."""
    from safetensors.torch import load_file

    path = Path(path)
    verify_hashes(path)
    if (path / lora.ADAPTER_WEIGHTS).exists():  # a LoRA run's: the adapters, under the PEFT model's names
        return lora.read_adapters(path), torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
    # On the host: a checkpoint saved on a GPU resumes on any device (``load_state_dict`` moves each tensor,
    # optimizer state included, to its parameter's device).
    weights = in_model_layout(path, load_file(path / "model.safetensors"))
    return weights, torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")


def in_model_layout(path: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights under the names and shapes the model has in memory. transformers 5 holds some
    architectures in another layout than their files, and ``save_pretrained`` writes the Hub's layout back (its
    "weight conversions"): MoE experts fused into one [E, ...] tensor per projection in memory, per-expert
    tensors on disk; Qwen2-VL's ``model.visual.*`` / ``model.language_model.*`` in memory, ``visual.*`` /
    ``model.*`` on disk. Checkpoints keep the Hub's layout, which vLLM, ``from_pretrained`` and other tools read;
    for those architectures the weights are read back through transformers' own loader, which applies the
    conversions (the model is built on the host, as the plain read already holds every tensor there).

    Which conversions apply is transformers' own rule (``get_model_conversion_mapping``: for the model and every
    sub-model, by class name first, then ``model_type``), asked of the class that wrote the checkpoint: the one
    ``save_pretrained`` names in ``config.json``'s ``architectures``. Looking up the ``model_type`` alone misses
    conversions keyed by class (Qwen2-VL's), and a loader chosen by task (``AutoModelForCausalLM``) has no class
    for a vision-language model: every key then reads as missing. A checkpoint without the field (written by
    hand) falls back to the causal-LM class of its ``model_type``."""
    config_file = path / "config.json"
    if not config_file.exists():
        return weights
    model_class, config = _writer_class(path)
    if model_class is None or not _converted_on_load(model_class, config):
        return weights
    dtype = next(iter(weights.values())).dtype if weights else torch.float32
    del weights
    model = model_class.from_pretrained(path, local_files_only=True, dtype=dtype)
    return {name: t.detach() for name, t in model.state_dict().items()}


def _writer_class(path: Path):
    """(the transformers class that wrote the checkpoint at ``path``, its config); (None, config) for a class
    transformers does not have (remote code: no built-in conversions to apply)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    for name in config.architectures or []:
        if isinstance(model_class := getattr(transformers, name, None), type):
            return model_class, config
    return AutoModelForCausalLM._model_mapping.get(type(config)), config


def _converted_on_load(model_class, config) -> bool:
    """Whether ``from_pretrained`` of ``model_class`` renames or reshapes a ``save_pretrained`` file's tensors.
    Asked of an empty copy on the meta device (no memory, no initialization); transformers' "legacy" renames
    (``gamma``/``beta`` of old files) are left out, as files written by ``save_pretrained`` never need them."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    with torch.device("meta"):
        skeleton = model_class._from_config(config)
    return bool(get_model_conversion_mapping(skeleton, add_legacy=False))
