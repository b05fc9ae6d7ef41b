"""A chain of stages from one config: each stage a ``tidal`` command, each one's model the next one's base.

Why one config: DAPT -> SFT -> DPO -> RL is four commands whose ``model.path`` each name the previous stage's
output, and a key mistyped in the last one used to surface only after the first three had trained. A chain file
says it once, and every stage's keys and input files are checked before the first stage runs::

    model: smollm2-135m-instruct        # the first stage's model.path (a catalog name, a folder, a .gguf)
    stages:
      - name: sft                       # its folder: OUT/sft
        command: sft                    # sft | dpo | rm | train
        set: {data.path: chat.jsonl, run.steps: 200, optim.lr: 2e-5}
      - name: dpo                       # model.path: OUT/sft/model (the previous stage's policy)
        command: dpo
        set: {data.path: pairs.jsonl}
      - name: rm                        # a reward model from the SFT policy, not from DPO's
        command: rm
        model_from: sft
        set: {data.path: pairs.jsonl}
      - name: rl                        # RL from DPO's policy (a reward model is never a policy)
        command: train
        recipe: smollm2_quickstart
        set: {reward.name: rm, reward.params.path: "{rm}"}

``set`` takes each command's own ``--set`` keys (a mapping, or a list of ``key=value``). A value may name a
stage's model, ``{<stage>}`` (``OUT/<stage>/model``; a ``train`` stage's latest checkpoint), or ``{out}``.
A stage's ``model.path`` is, unless its ``set`` gives one: ``model_from``'s model; else the previous stage's
whose output is a policy (not ``rm``'s classifier); else the chain's ``model`` (none: the command's default,
the tiny model). ``tidal chain --config FILE --out OUT`` runs it (``cli/stages_chain.py``); without
``--config`` the chain is the synthetic domain's (``builtin``).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import ConfigError

COMMANDS = ("sft", "dpo", "rm", "train")
"""What a stage can run: ``tidal sft|dpo|rm`` or ``tidal train RECIPE``."""

INPUT_KEYS = ("data.path", "data.eval_path", "task.path", "task.eval_path")
"""Keys naming a user's input file: checked to exist before the first stage runs (unless a placeholder)."""


@dataclass
class Stage:
    name: str
    command: str
    sets: list[str] = field(default_factory=list)
    """``key=value`` overrides, placeholders not yet filled."""
    recipe: str = ""
    """``train`` stages: the recipe (a name or a YAML file)."""
    model_from: str = ""
    """The stage whose model this one starts from; empty: the rule in the module docstring."""


@dataclass
class Chain:
    stages: list[Stage]
    model: str = ""
    """The first stage's ``model.path``; empty: the command's default."""

    def base_of(self, index: int) -> str | None:
        """The stage ``stages[index]`` starts from: a stage's name, ``""`` for the chain's ``model``, or None when
        its own ``set`` names ``model.path``."""
        stage = self.stages[index]
        if any(kv.startswith("model.path=") for kv in stage.sets):
            return None
        if stage.model_from:
            return stage.model_from
        policies = [s.name for s in self.stages[:index] if s.command != "rm"]
        return policies[-1] if policies else ""


def model_dir(out: str | Path, stage: Stage) -> Path:
    """Where ``stage``'s model lands under the chain's ``out``: a stage's ``model/``, a run's latest checkpoint
    (``train``; ``OUT/<name>/checkpoints`` until it exists, so a check before the run has a path to show)."""
    from tidal.train.checkpoint import latest_checkpoint

    if stage.command == "train":
        root = Path(out) / stage.name / "checkpoints"
        return latest_checkpoint(root) or root
    return Path(out) / stage.name / "model"


def argv(chain: Chain, index: int, out: str) -> list[str]:
    """The ``tidal`` argv of ``chain.stages[index]`` under ``out``, placeholders filled."""
    stage = chain.stages[index]
    values = {"out": out, **{s.name: str(model_dir(out, s)) for s in chain.stages}}
    sets = [_fill(kv, values, stage.name) for kv in stage.sets]
    base = chain.base_of(index)
    if base:
        sets.insert(0, f"model.path={values[base]}")
    elif base == "" and chain.model:
        sets.insert(0, f"model.path={chain.model}")
    head = [stage.command, stage.recipe] if stage.command == "train" else [stage.command]
    return head + [x for kv in sets for x in ("--set", kv)] + ["--out", f"{out}/{stage.name}"]


def _fill(kv: str, values: dict[str, str], stage: str) -> str:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(kv) if name is not None]
    except ValueError as e:
        raise ConfigError(f"stage {stage}: {kv}: {e} (a literal brace is written {{{{ or }}}})") from None
    for name in names:
        if name not in values:
            raise ConfigError(f"stage {stage}: {kv}: unknown placeholder {{{name}}}; one of "
                              f"{', '.join('{' + n + '}' for n in values)}")
    return kv.format_map(values)


def load(path: str | Path) -> Chain:
    """The chain in a YAML file; every mistake is one ``ConfigError`` naming the stage and the key."""
    from tidal.utils.yaml_file import read_yaml

    if not Path(path).is_file():
        raise ConfigError(f"--config {path}: no such file")
    doc = read_yaml(path, mapping=True)
    unknown = sorted(set(doc) - {"model", "stages"})
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (a chain has model and stages)")
    if not isinstance(doc.get("stages"), list) or not doc["stages"]:
        raise ConfigError(f"{path}: stages must be a non-empty list of stages (name, command, set, ...)")
    stages = [_stage(item, i, path) for i, item in enumerate(doc["stages"], start=1)]
    chain = Chain(stages, model=str(doc.get("model") or ""))
    check_structure(chain, str(path))
    return chain


def _stage(item, number: int, path) -> Stage:
    where = f"{path}: stage {number}"
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a mapping (name, command, set, ...), got {type(item).__name__}")
    unknown = sorted(set(item) - {"name", "command", "set", "recipe", "model_from"})
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (a stage has name, command, recipe, model_from, set)")
    name = str(item.get("name") or "")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"{where}: name {name!r}: a stage needs a name of letters, digits, - and _ (its folder)")
    sets = item.get("set") or {}
    if isinstance(sets, dict):
        sets = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sets.items()]
    elif not (isinstance(sets, list) and all(isinstance(kv, str) and "=" in kv for kv in sets)):
        raise ConfigError(f"stage {name}: set must be a mapping of keys or a list of key=value")
    return Stage(name, str(item.get("command") or ""), list(sets), str(item.get("recipe") or ""),
                 str(item.get("model_from") or ""))


def check_structure(chain: Chain, where: str = "chain") -> None:
    """Names unique, commands known, ``train`` stages with a recipe, ``model_from`` naming an earlier policy."""
    seen: dict[str, Stage] = {}
    for stage in chain.stages:
        if stage.name in seen:
            raise ConfigError(f"{where}: two stages are named {stage.name!r} (each is a folder under --out)")
        if stage.command not in COMMANDS:
            raise ConfigError(f"stage {stage.name}: command {stage.command!r}; one of {', '.join(COMMANDS)}")
        if stage.command == "train" and not stage.recipe:
            raise ConfigError(f"stage {stage.name}: command train needs a recipe (a recipe name or a YAML config)")
        if stage.command != "train" and stage.recipe:
            raise ConfigError(f"stage {stage.name}: recipe is for command train only")
        if stage.model_from:
            source = seen.get(stage.model_from)
            if source is None:
                raise ConfigError(f"stage {stage.name}: model_from {stage.model_from!r} names no earlier stage")
            if source.command == "rm":
                raise ConfigError(f"stage {stage.name}: model_from {stage.model_from!r} is a reward model, not a "
                                  "policy (name a reward model with reward.params.path: \"{" + source.name + "}\")")
        seen[stage.name] = stage


def check_inputs(chain: Chain, extra: dict[str, list[str]]) -> None:
    """Every input file a stage names (``INPUT_KEYS``, no placeholder) exists: before anything trains."""
    for stage in chain.stages:
        for kv in stage.sets + extra.get(stage.name, []):
            key, _, value = kv.partition("=")
            if key in INPUT_KEYS and value and "{" not in value and not Path(value).exists():
                raise ConfigError(f"stage {stage.name}: {key}={value}: no such file or directory")


def builtin(out: str) -> Chain:
    """The synthetic domain's chain (``stages/synthetic.py``, the tiny model, CPU): docs/stages.md's commands."""
    d = f"{out}/domain"
    return Chain([
        Stage("dapt", "sft", [f"data.path={d}/corpus.jsonl", "optim.lr=1e-3", "run.steps=150", "run.threads=1"]),
        Stage("sft", "sft", [f"data.path={d}/sft.jsonl", "optim.lr=1e-3", "run.batch_size=64", "run.steps=1000",
                             "run.threads=1"]),
        Stage("dpo", "dpo", [f"data.path={d}/pairs.jsonl", "optim.lr=1e-4", "beta=0.1", "run.batch_size=16",
                             "run.steps=200", "run.threads=1"]),
        Stage("rm", "rm", [f"data.path={d}/pairs.jsonl", f"data.eval_path={d}/pairs_eval.jsonl", "optim.lr=1e-4",
                           "run.batch_size=16", "run.steps=700", "run.threads=1"], model_from="sft"),
        Stage("rl", "train", [f"task.path={d}/rl.jsonl", f"task.eval_path={d}/eval.jsonl", "system.num_threads=1"],
              recipe="stages_rl"),
    ])
