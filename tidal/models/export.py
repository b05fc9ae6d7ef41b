"""``tidal export``: a trained policy as a directory other tools load.

From a checkpoint directory (``tidal export RUN`` picks the run's latest):

- LoRA adapters (``model.lora``), without ``merge``: the adapters in PEFT's layout plus the tokenizer;
  ``PeftModel.from_pretrained(base, DIR)`` loads them, and ``adapter_config.json`` names the base.
- LoRA adapters with ``merge``: the base with W0 + (alpha / r) B A written into every adapted layer,
  saved as a plain Hugging Face model directory (``AutoModelForCausalLM.from_pretrained`` loads it, and
  ``model.path`` accepts it for a next stage), with the tokenizer.
- Full weights: the model and tokenizer as they are (``merge`` changes nothing).

The directory is written under a temporary name and renamed into place, so a failed export leaves
nothing half-written; an existing non-empty ``out`` is refused rather than mixed with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tidal.models import lora

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
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info: dict[str, object] = {"out": str(out), "from": str(src), "kind": kind,
                               "bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file())}
    if adapters:
        info["base"] = str(lora.base_of(src))
    return info
