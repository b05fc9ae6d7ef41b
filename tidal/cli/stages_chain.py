"""``tidal chain``: stages run one after another, each one's model the next one's base.

``--config CHAIN.yaml`` runs a user's chain (``stages/chain.py``: the file's format, placeholders and the
model each stage starts from), every stage's keys and input files checked before the first runs, and prints
each stage's last held-out metrics (also ``OUT/chain.json``). Without it, the chain is the demonstration
below: DAPT -> SFT -> DPO -> RL on a small synthetic domain (``stages/synthetic.py``), tiny model, CPU.

Each stage is the command docs/stages.md shows, run through ``tidal.cli.main``; each takes the previous
stage's ``model/`` as ``model.path``. RL is the ``stages_rl`` recipe (``recipes/stages.py``: the quickstart's
async RL on the domain's questions). Then every stage's model gets the domain's held-out checks
(``stages/evaluate.py``), written to ``OUT/table.json`` and printed as the table docs/stages.md shows.

    tidal chain [--config CHAIN.yaml] --out runs/stages [--set STAGE:key=value ...] [--resume | --overwrite]

(``python -m tidal.cli.stages_chain`` with the same flags is the same command.)

``--set sft:run.steps=2`` appends an override to one stage's command (tests run the chain that way,
short); every stage's keys are checked before the first stage runs. An ``--out`` holding a previous chain
is refused unless ``--overwrite`` (passed to every stage: each deletes only what it wrote) or ``--resume``
(each stage with a checkpoint continues from it, the others start) says what to do with it. The commands
are ``commands(out)``; ``tests/stages/test_chain.py`` checks docs/stages.md shows them.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def commands(out: str, chain=None) -> list[tuple[str, list[str]]]:
    """(stage, argv of ``tidal``) for every stage of ``chain`` (default: the synthetic domain's), in order."""
    from tidal.stages import chain as chains

    chain = chain or chains.builtin(out)
    return [(s.name, chains.argv(chain, i, out)) for i, s in enumerate(chain.stages)]


def rl_with_rm(out: str) -> list[str]:
    """The RL stage scored by the trained reward model instead of the verifier (``reward.name=rm``)."""
    return ["train", "stages_rl", "--set", f"model.path={out}/dpo/model", "--set", f"task.path={out}/domain/rl.jsonl",
            "--set", f"task.eval_path={out}/domain/eval.jsonl", "--set", "reward.name=rm",
            "--set", f"reward.params.path={out}/rm/model", "--set", "system.num_threads=1", "--out", f"{out}/rl_rm"]


def model_dirs(out: str) -> dict[str, Path]:
    from tidal.train.checkpoint import latest_checkpoint

    dirs = {stage: Path(out) / stage / "model" for stage in ("dapt", "sft", "dpo")}
    rl = latest_checkpoint(Path(out) / "rl" / "checkpoints")
    if rl is not None:
        dirs["rl"] = rl
    return dirs


def check(out: str, extra: dict[str, list[str]], chain=None) -> None:
    """Every ``--set STAGE:KEY=VALUE`` names a stage and a key its command takes, and every input file a stage
    names exists: checked for every stage before the first runs (a bad key for RL used to surface after DAPT,
    SFT, DPO and the reward model had trained)."""
    from tidal.cli.common import train_config
    from tidal.cli.stages import stage_config
    from tidal.config import ConfigError
    from tidal.stages import chain as chains

    user_chain = chain is not None
    chain = chain or chains.builtin(out)
    names = [s.name for s in chain.stages]
    for stage in extra:
        if stage not in names:
            raise ConfigError(f"--set {stage}:{extra[stage][0]}: unknown stage {stage!r}; --set takes "
                              f"STAGE:KEY=VALUE, STAGE one of {', '.join(names)}")
    for stage, (name, argv) in zip(chain.stages, commands(out, chain)):
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] + extra.get(name, [])
        try:
            train_config(argv[1], sets) if stage.command == "train" else stage_config(argv[0], None, sets)
        except (ConfigError, KeyError) as e:
            text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise ConfigError(f"stage {name}: {text}") from None
    if user_chain:  # the synthetic domain's files are written by the chain itself
        chains.check_inputs(chain, extra)


def previous(out: str, chain=None) -> list[str]:
    """The stages whose folders under ``out`` hold a run (results, or a checkpoint to resume)."""
    from tidal.stages import chain as chains
    from tidal.stages.common import STAGE_OUTPUTS
    from tidal.system.run_dir import TRAIN
    from tidal.train.checkpoint import latest_checkpoint
    from tidal.utils.outputs import Layout, previous_run

    found = []
    for stage in (chain or chains.builtin(out)).stages:
        d = Path(out) / stage.name
        layout = TRAIN if stage.command == "train" else Layout(stage.command, STAGE_OUTPUTS, ("metrics.jsonl", "model"))
        if d.is_dir() and previous_run(d, layout, latest_checkpoint(d / "checkpoints")):
            found.append(stage.name)
    return found


def run(out: str, extra: dict[str, list[str]] | None = None, overwrite: bool = False, resume: bool = False,
        chain=None) -> dict:
    """Run every stage of ``chain`` (``extra``: more ``--set``s per stage), each right after the one before; then,
    for the synthetic domain's chain (``chain`` None), the held-out checks of every stage's model: the table;
    for a user's chain, each stage's last held-out metrics. ``overwrite`` and ``resume`` are the user's, passed on
    to the stages (``resume``: to those with a checkpoint)."""
    from tidal.stages import chain as chains
    from tidal.utils.outputs import Layout, OutputError, RunDir

    extra = extra or {}
    builtin = chain is None
    check(out, extra, chain)
    chain = chain or chains.builtin(out)
    found = previous(out, chain)
    if found and not (overwrite or resume):
        raise OutputError(f"{out} holds a previous chain's runs ({', '.join(f'{s}/' for s in found)}); pass --resume "
                          "to continue it, --overwrite to replace them, or choose another --out")
    layout = Layout("chain", ("domain", "base", "table.json") if builtin else ("chain.json",), ())
    with RunDir.open(out, layout, resume=resume and Path(out).is_dir(), overwrite=overwrite):
        if builtin:
            _build_domain(out)
        _run_stages(out, chain, extra, overwrite, resume)
        if builtin:
            table = _domain_table(out)
            Path(out, "table.json").write_text(json.dumps(table, indent=2))
        else:
            table = {s.name: last_eval(Path(out) / s.name) for s in chain.stages}
            Path(out, "chain.json").write_text(json.dumps(table, indent=2))
    return table


def _run_stages(out: str, chain, extra: dict[str, list[str]], overwrite: bool, resume: bool) -> None:
    from tidal import cli
    from tidal.stages import chain as chains
    from tidal.train.checkpoint import latest_checkpoint

    for i, stage in enumerate(chain.stages):
        flag = ["--overwrite"] if overwrite else []
        if resume and latest_checkpoint(Path(out) / stage.name / "checkpoints") is not None:
            flag = ["--resume"]
        argv = chains.argv(chain, i, out)  # now: a train stage's model is the checkpoint it has just written
        argv = argv + [x for kv in extra.get(stage.name, []) for x in ("--set", kv)] + flag
        print(f"$ tidal {shlex.join(argv)}", file=sys.stderr, flush=True)
        if cli.main(argv) != 0:
            raise SystemExit(f"stage {stage.name} failed")


def _build_domain(out: str) -> None:
    """The synthetic domain's files and the untrained tiny model (the table's first row)."""
    from tidal.models import tiny
    from tidal.stages import synthetic
    from tidal.stages.chat_data import PLAIN_TEMPLATE

    synthetic.build(f"{out}/domain")
    tok = tiny.build_tokenizer()
    tok.chat_template = PLAIN_TEMPLATE
    tiny.save(tiny.build_model(tiny.ModelConfig(), tok), tok, Path(out) / "base")


def _domain_table(out: str) -> dict:
    from tidal.stages.evaluate import held_out_checks

    table = {"base": held_out_checks(Path(out) / "base", f"{out}/domain")}
    for stage, path in model_dirs(out).items():
        table[stage] = held_out_checks(path, f"{out}/domain")
    rm_metrics = [json.loads(line) for line in (Path(out) / "rm" / "metrics.jsonl").read_text().splitlines()]
    table["rm"] = {"eval_accuracy": [m for m in rm_metrics if "eval/accuracy" in m][-1]["eval/accuracy"]}
    return table


def last_eval(run: Path) -> dict:
    """A stage's last ``eval/*`` values and its step (from its ``metrics.jsonl``); {} when it logged none."""
    from tidal.utils.metrics import logged_rows

    last: dict = {}
    for row in logged_rows(run / "metrics.jsonl", through_step=2**62):
        evals = {k: v for k, v in row.items() if k.startswith("eval/")}
        if evals:
            last = {"step": row.get("step"), **evals}
    return last


def markdown(table: dict) -> str:
    """The synthetic domain's table (``_domain_table``) as docs/stages.md shows it."""
    lines = ["| stage | held-out accuracy | preference accuracy | corpus NLL |", "|---|---|---|---|"]
    for stage, m in table.items():
        if stage == "rm":
            lines.append(f"| rm (reward model) | held-out pair accuracy {m['eval_accuracy']:.3f} | | |")
            continue
        lines.append(f"| {stage} | {m['accuracy']:.3f} | {m['pref_acc']:.3f} | {m['corpus_nll']:.3f} |")
    return "\n".join(lines)


def eval_markdown(table: dict) -> str:
    """A user's chain: each stage's last held-out metrics, one row per stage."""
    lines = ["| stage | step | held-out metrics |", "|---|---|---|"]
    for stage, m in table.items():
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items() if k != "step")
        lines.append(f"| {stage} | {m.get('step', '')} | {shown or 'none logged'} |")
    return "\n".join(lines)


def add_parsers(sub) -> None:
    """``tidal chain`` among ``tidal``'s sub-parsers."""
    sp = sub.add_parser("chain", help="stages run one after another, each stage's model the next one's base: a "
                        "chain file's (--config), or DAPT -> SFT -> DPO (and a reward model) -> RL on the synthetic "
                        "domain with its held-out table (docs/stages.md)")
    add_arguments(sp)
    sp.set_defaults(fn=cmd_chain)


def add_arguments(p) -> None:
    """The chain's flags, for ``tidal chain`` and ``python -m tidal.cli.stages_chain``."""
    p.add_argument("--config", default=None, metavar="CHAIN.yaml",
                   help="a chain file (tidal/stages/chain.py: model, stages with name, command, recipe, set); "
                   "default: the synthetic domain's chain")
    p.add_argument("--out", default="runs/stages")
    p.add_argument("--set", action="append", default=[], metavar="STAGE:KEY=VALUE",
                   help="one more override for one stage's command, e.g. sft:run.steps=2")
    p.add_argument("--resume", action="store_true", help="continue the stages that have a checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a previous chain in --out (each stage "
                   "deletes only what it wrote)")


def cmd_chain(args) -> int:
    """``tidal chain``: every stage, then the table (printed); a bad ``--set`` or an ``--out`` holding a previous
    chain is one line and exit 2, with nothing run."""
    from tidal.config import ConfigError
    from tidal.stages import chain as chains

    extra: dict[str, list[str]] = {}
    try:
        chain = chains.load(args.config) if args.config else None
        names = [s.name for s in (chain or chains.builtin(args.out)).stages]
        for item in args.set:
            stage, colon, kv = item.partition(":")
            if not colon:
                raise ConfigError(f"--set {item}: expected STAGE:KEY=VALUE, STAGE one of {', '.join(names)}")
            extra.setdefault(stage, []).append(kv)
        table = run(args.out, extra, overwrite=args.overwrite, resume=args.resume, chain=chain)
        print(markdown(table) if chain is None else eval_markdown(table))
    except ConfigError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m tidal.cli.stages_chain``: the same as ``tidal chain``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tidal.cli.stages_chain", description=__doc__.splitlines()[0])
    add_arguments(p)
    code = cmd_chain(p.parse_args(argv))
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
