"""``tidal curate RECIPE --in PATH --out PATH [--set key=value ...]``: run a curation recipe.

A recipe is an ordered list of block names plus their settings (``CurateConfig``); the built-in
ones are in ``RECIPES``, and a YAML file with the same keys is a recipe too. The kept rows are
written unchanged to ``--out`` and ``OUT.report.json`` lands beside it: rows in and out, and per
block what it saw, kept and dropped by reason (each block sees what the previous one kept, so the
counts add up), its throughput, and examples of dropped rows (every one for decontamination).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tidal.config import ConfigError, apply_overrides
from tidal.data.classifier import ClassifierConfig, QualityClassifier
from tidal.data.decontam import DecontamConfig, Decontaminate
from tidal.data.dedup import ExactDedup, NearDedup, NearDedupConfig
from tidal.data.difficulty import Difficulty, DifficultyConfig, difficulty_stages
from tidal.data.io import BadRows, input_kind, output_kind, read_numbered, refuse_overwrite, write_rows
from tidal.data.pipeline import Block, Pipeline
from tidal.data.quality import (
    C4Filter,
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    GopherRepetitionConfig,
    LanguageConfig,
    LanguageFilter,
)
from tidal.data.rephrase import Rephrase, RephraseConfig
from tidal.data.verify import Verifiable
from tidal.utils.progress import progress_bar
from tidal.utils.yaml_file import read_yaml


@dataclass
class CurateConfig:
    blocks: list[str] = field(default_factory=list)
    """The chain, in order (names of ``BLOCKS``)."""
    text_key: str = "text"
    """The field the text blocks read (``prompt`` for problem sets)."""
    eval: list[str] | str = field(default_factory=list)
    """Evaluation sets for ``decontaminate`` (paths: JSONL, Parquet, or HF dataset directories)."""
    workers: int = 0
    """Processes for the per-row work; 0: every core."""
    executor: str = "local"
    """``local`` (a process pool) or ``ray`` (Ray tasks on a cluster: ``ray start --head`` first, or a
    local instance is started)."""
    ray_address: str | None = None
    """``executor=ray``: the cluster to join (e.g. ``auto`` or ``10.0.0.1:6379``); None starts one."""
    chunk_size: int = 1024
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    c4_min_sentences: int = 3
    language: LanguageConfig = field(default_factory=LanguageConfig)
    decontaminate: DecontamConfig = field(default_factory=DecontamConfig)
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)
    difficulty: DifficultyConfig = field(default_factory=DifficultyConfig)
    rephrase: RephraseConfig = field(default_factory=RephraseConfig)


BLOCKS = {
    "exact_dedup": lambda c: ExactDedup(c.text_key),
    "near_dedup": lambda c: NearDedup(c.near_dedup, c.text_key),
    "gopher_quality": lambda c: GopherQuality(c.gopher_quality, c.text_key),
    "gopher_repetition": lambda c: GopherRepetition(c.gopher_repetition, c.text_key),
    "c4": lambda c: C4Filter(c.c4_min_sentences, c.text_key),
    "language": lambda c: LanguageFilter(c.language, c.text_key),
    "decontaminate": lambda c: Decontaminate(c.decontaminate, [c.eval] if isinstance(c.eval, str) else c.eval),
    "verifiable": lambda c: Verifiable(c.text_key),
    "quality_classifier": lambda c: QualityClassifier(c.classifier, c.text_key),
    "difficulty": None,  # one block per model: build_blocks
    "rephrase": lambda c: Rephrase(c.rephrase, c.text_key),
}

RECIPES = {
    "dedup": dict(blocks=["exact_dedup", "near_dedup"]),
    "quality": dict(blocks=["gopher_quality", "gopher_repetition", "c4", "language"]),
    "decontaminate": dict(blocks=["decontaminate"]),
    "rl-problems": dict(blocks=["verifiable", "exact_dedup"], text_key="prompt"),
    # verifiable problems in the pass-rate band of difficulty.model (one or two stages)
    "rl-difficulty": dict(blocks=["verifiable", "exact_dedup", "difficulty"], text_key="prompt"),
    "rephrase": dict(blocks=["rephrase"]),  # needs rephrase.model=DIR
}


def load_recipe(recipe: str, overrides: list[str]) -> CurateConfig:
    """A built-in recipe by name, or a YAML file with ``CurateConfig``'s keys; then the overrides."""
    if recipe in RECIPES:
        base = RECIPES[recipe]
    elif recipe.endswith((".yaml", ".yml")) and Path(recipe).is_file():
        base = read_yaml(recipe)
        if not isinstance(base, dict):
            raise ConfigError(f"{recipe}: a recipe file is a mapping of CurateConfig keys")
    else:
        raise ConfigError(f"unknown recipe {recipe!r}; built in: {', '.join(RECIPES)} (or a .yaml file)")
    cfg = CurateConfig()
    flat = [f"{k}={json.dumps(v)}" for k, v in _flatten(base).items()]
    apply_overrides(cfg, flat + list(overrides))
    unknown = [b for b in cfg.blocks if b not in BLOCKS]
    if unknown or not cfg.blocks:
        raise ConfigError(f"blocks {unknown or '[]'}: choose from {', '.join(BLOCKS)}")
    _check(cfg)
    return cfg


def _check(cfg: CurateConfig) -> None:
    """A ConfigError naming the key for a setting no block can run with (not an assertion inside it)."""
    nd, diff = cfg.near_dedup, cfg.difficulty
    rules = [
        ("chunk_size", cfg.chunk_size >= 1, ">= 1"),
        ("workers", cfg.workers >= 0, ">= 0 (0: every core)"),
        ("executor", cfg.executor in ("local", "ray"), "local or ray"),
        ("near_dedup.threshold", 0 < nd.threshold <= 1, "in (0, 1]"),
        ("near_dedup.ngram", nd.ngram >= 1, ">= 1"),
        ("near_dedup.bands", nd.bands >= 1, ">= 1"),
        ("near_dedup.rows", nd.rows >= 1, ">= 1"),
        ("decontaminate.ngram", cfg.decontaminate.ngram >= 1, ">= 1"),
        ("difficulty.samples", diff.samples >= 1, ">= 1"),
        ("difficulty.min_pass_rate", 0 <= diff.min_pass_rate <= diff.max_pass_rate <= 1,
         f"0 <= min_pass_rate <= max_pass_rate (= {diff.max_pass_rate}) <= 1"),
    ]
    for key, ok, rule in rules:
        if not ok:
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            raise ConfigError(f"{key}={node!r}: must be {rule}")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in ("gopher_repetition.top_ngram_char_frac",
                                               "gopher_repetition.dup_ngram_char_frac"):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def build_blocks(cfg: CurateConfig) -> list[Block]:
    blocks = []
    for name in cfg.blocks:
        if name == "difficulty":  # one block per stage (model)
            blocks += difficulty_stages(cfg.difficulty, cfg.text_key)
        else:
            blocks.append(BLOCKS[name](cfg))
    return blocks


def curate(recipe: str, in_path: str | Path, out_path: str | Path, overrides: list[str] = (),
           progress: bool = True) -> dict:
    """Run ``recipe`` on ``in_path``; write the kept rows to ``out_path`` and the report beside it."""
    cfg = load_recipe(recipe, list(overrides))
    evals = [cfg.eval] if isinstance(cfg.eval, str) else cfg.eval
    refuse_overwrite(out_path, {"--in": in_path, **{f"eval={e}": e for e in evals if "decontaminate" in cfg.blocks}})
    refuse_overwrite(str(out_path) + ".report.json", {"--in": in_path})
    input_kind(Path(in_path))  # a missing input, an unknown format: errors before any work
    output_kind(Path(out_path))
    pipeline = Pipeline(build_blocks(cfg), workers=cfg.workers or os.cpu_count() or 1, chunk_size=cfg.chunk_size,
                        executor=cfg.executor, ray_address=cfg.ray_address)
    bad = BadRows()
    rows = progress_bar(progress, iterable=read_numbered(in_path, bad), desc=f"curate {recipe}", unit=" rows")
    kept = _nonempty(pipeline.run_numbered(rows), pipeline, bad, in_path)
    if cfg.difficulty.curriculum:
        last = [b for b in pipeline.blocks if isinstance(b, Difficulty)]
        if not last:
            raise ConfigError("difficulty.curriculum=true needs the difficulty block in the recipe")
        kept = sorted(kept, key=lambda row: -last[-1].pass_rates[id(row)])  # easiest first (stable)
    written = write_rows(out_path, kept)  # a failure above leaves --out as it was
    assert written == pipeline.rows_out
    report = {"recipe": recipe, "input": str(in_path), "output": str(out_path),
              "malformed_lines": bad.count, "malformed_examples": bad.examples, **pipeline.report(),
              "config": asdict(cfg)}
    report_path = Path(str(out_path) + ".report.json")
    tmp = report_path.with_name(report_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(report_path)
    return report


def _nonempty(kept, pipeline: Pipeline, bad: BadRows, in_path):
    """``kept``, but an error (before anything is written) if the input held no valid row at all: an
    empty or binary file is a wrong ``--in``, not an empty dataset."""
    yield from kept
    if pipeline.rows_in == 0:
        first = f"; first: {bad.examples[0]}" if bad.examples else ""
        raise ValueError(f"{in_path}: no valid rows ({bad.count} malformed lines{first})")
