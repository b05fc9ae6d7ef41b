"""``tidal export``: a trained policy as a directory other tools load.

From a checkpoint directory (``tidal export RUN`` picks the run's latest):

- LoRA adapters (``model.lora``), without ``merge``: the adapters in PEFT's layout plus the tokenizer;
  ``PeftModel.from_pretrained(base, DIR)`` loads them, and ``adapter_config.json`` names the base as
  something that outlives tidal's cache (``portable_base``): a catalog model by its catalog name, a base
  imported from a ``.gguf`` or ``.whl`` by that file, any other base by the path it was trained from (a
  checkpoint names the imported folder under ``.tidal_cache/``, which clearing the cache removes).
- LoRA adapters with ``merge``: the base with W0 + (alpha / r) B A written into every adapted layer,
  saved as a plain Hugging Face model directory (``AutoModelForCausalLM.from_pretrained`` loads it, and
  ``model.path`` accepts it for a next stage), with the tokenizer.
- Full weights: the model and tokenizer as they are (``merge`` changes nothing).

The directory is written under a temporary name and renamed into place, so a failed export leaves
nothing half-written; an existing non-empty ``out`` is refused rather than mixed with, and so is an ``out``
inside the run or checkpoint it reads (checkpoint rotation would delete it: ``utils/outputs.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tidal.models import catalog, lora
from tidal.utils import outputs

_MODEL_FILES = (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, "config.json", "generation_config.json")
_MODEL_PREFIXES = ("model", "tokenizer", "special_tokens", "chat_template", "vocab", "merges", "added_tokens")


def _is_model_file(name: str) -> bool:
    """The model, adapters and tokenizer files of a checkpoint, not its run state (``trainer_state.pt``,
    ``hashes.json``, ``sdc.json``, ``critic.pt``, ...)."""
    return name in _MODEL_FILES or name.startswith(_MODEL_PREFIXES)


def export(checkpoint: str | Path, out: str | Path, merge: bool = False) -> dict[str, object]:
    """Write ``checkpoint``'s policy to ``out`` (see the module docstring); returns what was written."""
    from tidal.models import tiny

    src, out = Path(checkpoint), Path(out)
    adapters = lora.is_adapter_dir(src)
    if not adapters and not (src / "config.json").exists():
        raise FileNotFoundError(f"{src}: neither a model directory (config.json) nor LoRA adapters "
                                f"({lora.ADAPTER_CONFIG})")
    outputs.check_outside(out, {"the checkpoint": src})
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not empty; choose a new directory")
    tmp = out.with_name(f".tmp_{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapters and merge:
            model, tokenizer = tiny.load(src)  # the base with the adapters merged (models/tiny.py)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            kind = "merged"
        else:
            for f in src.iterdir():
                if f.is_file() and _is_model_file(f.name):
                    shutil.copy2(f, tmp / f.name)
            kind = "adapters" if adapters else "full"
            if adapters:
                config = json.loads((tmp / lora.ADAPTER_CONFIG).read_text())
                base, base_from = portable_base(str(lora.base_of(src)))
                (tmp / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": base},
                                                                  indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info: dict[str, object] = {"out": str(out), "from": str(src), "kind": kind,
                               "bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file())}
    if adapters:
        info["base"], info["base_from"] = portable_base(str(lora.base_of(src)))
    return info


def portable_base(base: str) -> tuple[str, str]:
    """(how exported adapters name their base, which kind of name it is): ``catalog`` (a catalog model's name,
    ``tidal model import NAME`` rebuilds it), ``file``/``wheel`` (the ``.gguf`` or ``.whl`` it was imported from)
    for a base imported into the cache, read from its ``tidal_source.json``; else ``path``: the base as given."""
    source = Path(base) / catalog.SOURCE_FILE
    try:
        record = json.loads(source.read_text()) if source.is_file() else {}
    except (OSError, ValueError):
        record = {}
    if record.get("name") in catalog.CATALOG:
        return record["name"], "catalog"
    for key in ("file", "wheel"):
        if record.get(key):
            return str(record[key]), key
    return base, "path"
