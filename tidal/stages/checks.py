"""Every key of a stage (``tidal sft|dpo|rm``) checked before any work: one ``ConfigError`` naming the key.

``--set`` and a loaded ``config.yaml`` write fields directly (no dataclass check runs), so before these
rules ``pack_length=-1`` or ``packed_attention=maybe`` surfaced (or not) only once the model was loaded
and the data tokenized, and ``optim.grad_clip=-1`` trained uphill in silence. The optimizer keys are
RL's own rules (``optim/rules.py``): a value ``tidal train`` refuses is refused here in the same words,
and the stages build RL's optimizers (``tidal.optim``), so an unknown ``optim.name`` and Muon with LoRA are
refused here as RL refuses them, before any work.
A rule whose key a stage lacks (``ref_batch_size`` outside DPO) is skipped.
"""

from __future__ import annotations

from typing import Any

from tidal.config import ConfigError
from tidal.optim import OPTIMIZERS
from tidal.optim.rules import check_optim
from tidal.train.packing import PACKED_ATTENTION
from tidal.utils.rules import COUNT, NONNEG, Rule, check, number, one_of, positive

STAGE_RULES: list[Rule] = [
    ("run.steps", COUNT, "an integer >= 1"),
    ("run.batch_size", COUNT, "an integer >= 1"),
    ("run.eval_every", COUNT, "an integer >= 1"),
    ("run.save_every", COUNT, "an integer >= 1"),
    ("run.keep", NONNEG, "an integer >= 0 (0 keeps every checkpoint)"),
    ("run.threads", NONNEG, "an integer >= 0 (0: torch's default)"),
    ("data.max_length", COUNT, "an integer >= 1"),
    ("pack_length", NONNEG, "an integer >= 0 (0: data.max_length)"),
    ("packed_attention", *one_of(PACKED_ATTENTION)),
    ("ref_batch_size", COUNT, "an integer >= 1"),
    ("beta", positive, "> 0"),
    ("gamma", number, "a number"),
    ("center", NONNEG, ">= 0"),
]


def validate_stage(cfg: Any) -> None:
    """Raise a ConfigError naming the first key of ``cfg`` (a stage config) the stage cannot use."""
    data = cfg.data
    if not data.path:
        raise ConfigError("data.path is required (a .jsonl, .parquet or save_to_disk directory)")
    if not data.eval_path and not (number(data.eval_fraction) and 0 < data.eval_fraction < 1):
        raise ConfigError(f"data.eval_fraction must be in (0, 1), got {data.eval_fraction}")
    check(cfg, STAGE_RULES, missing_ok=True)
    check_optim(cfg.optim)
    if cfg.optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.optim.name!r} is not an optimizer; one of {', '.join(OPTIMIZERS.names())}")
    if cfg.optim.name == "muon" and cfg.model.lora.rank:  # RL's rule (models/lora.py), in its words
        raise ConfigError("model.lora with optim.name=muon: Muon orthogonalizes whole hidden matrices, and LoRA's A "
                          "and B are rank-r factors; use optim.name=adamw or ademamix")
