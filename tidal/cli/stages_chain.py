"""DAPT -> SFT -> DPO -> RL on a small synthetic domain (``stages/synthetic.py``), tiny model, CPU.

Each stage is the command docs/stages.md shows, run through ``tidal.cli.main``; each takes the previous
stage's ``model/`` as ``model.path``. RL is the ``stages_rl`` recipe (``recipes/stages.py``: the quickstart's
async RL on the domain's questions). Then every stage's model gets the domain's held-out checks
(``stages/evaluate.py``), written to ``OUT/table.json`` and printed as the table docs/stages.md shows.

    tidal chain --out runs/stages [--set STAGE:key=value ...] [--resume | --overwrite]

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


def commands(out: str) -> list[tuple[str, list[str]]]:
    """(stage, argv of ``tidal``) for every stage, in order."""
    d = f"{out}/domain"
    return [
        ("dapt", ["sft", "--set", f"data.path={d}/corpus.jsonl", "--set", "optim.lr=1e-3", "--set", "run.steps=150",
                  "--set", "run.threads=1", "--out", f"{out}/dapt"]),
        ("sft", ["sft", "--set", f"model.path={out}/dapt/model", "--set", f"data.path={d}/sft.jsonl",
                 "--set", "optim.lr=1e-3", "--set", "run.batch_size=64", "--set", "run.steps=1000",
                 "--set", "run.threads=1", "--out", f"{out}/sft"]),
        ("dpo", ["dpo", "--set", f"model.path={out}/sft/model", "--set", f"data.path={d}/pairs.jsonl",
                 "--set", "optim.lr=1e-4", "--set", "beta=0.1", "--set", "run.batch_size=16",
                 "--set", "run.steps=200", "--set", "run.threads=1", "--out", f"{out}/dpo"]),
        ("rm", ["rm", "--set", f"model.path={out}/sft/model", "--set", f"data.path={d}/pairs.jsonl",
                "--set", f"data.eval_path={d}/pairs_eval.jsonl", "--set", "optim.lr=1e-4", "--set", "run.batch_size=16",
                "--set", "run.steps=700", "--set", "run.threads=1", "--out", f"{out}/rm"]),
        ("rl", ["train", "stages_rl", "--set", f"model.path={out}/dpo/model", "--set", f"task.path={d}/rl.jsonl",
                "--set", f"task.eval_path={d}/eval.jsonl", "--set", "system.num_threads=1", "--out", f"{out}/rl"]),
    ]


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


KINDS = {"dapt": "sft", "sft": "sft", "dpo": "dpo", "rm": "rm", "rl": "train"}
"""The command each stage runs (``--resume`` of a stage is that command's)."""


def check(out: str, extra: dict[str, list[str]]) -> None:
    """Every ``--set STAGE:KEY=VALUE`` names a stage and a key its command takes: checked for every stage before
    the first runs (a bad key for RL used to surface after DAPT, SFT, DPO and the reward model had trained)."""
    from tidal.cli.common import train_config
    from tidal.cli.stages import stage_config
    from tidal.config import ConfigError

    for stage in extra:
        if stage not in KINDS:
            raise ConfigError(f"--set {stage}:{extra[stage][0]}: unknown stage {stage!r}; --set takes "
                              f"STAGE:KEY=VALUE, STAGE one of {', '.join(KINDS)}")
    for stage, argv in commands(out):
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] + extra.get(stage, [])
        try:
            train_config(argv[1], sets) if KINDS[stage] == "train" else stage_config(argv[0], None, sets)
        except (ConfigError, KeyError) as e:
            text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise ConfigError(f"stage {stage}: {text}") from None


def previous(out: str) -> list[str]:
    """The stages whose folders under ``out`` hold a run (results, or a checkpoint to resume)."""
    from tidal.stages.common import STAGE_OUTPUTS
    from tidal.system.run_dir import TRAIN
    from tidal.train.checkpoint import latest_checkpoint
    from tidal.utils.outputs import Layout, previous_run

    found = []
    for stage in KINDS:
        d = Path(out) / stage
        layout = TRAIN if KINDS[stage] == "train" else Layout(KINDS[stage], STAGE_OUTPUTS, ("metrics.jsonl", "model"))
        if d.is_dir() and previous_run(d, layout, latest_checkpoint(d / "checkpoints")):
            found.append(stage)
    return found


def run(out: str, extra: dict[str, list[str]] | None = None, overwrite: bool = False, resume: bool = False) -> dict:
    """Run every stage (``extra``: more ``--set``s per stage), then the held-out checks; the table. ``overwrite``
    and ``resume`` are the user's, passed on to the stages (``resume``: to those with a checkpoint)."""
    from tidal import cli
    from tidal.models import tiny
    from tidal.stages import synthetic
    from tidal.stages.chat_data import PLAIN_TEMPLATE
    from tidal.stages.evaluate import held_out_checks
    from tidal.train.checkpoint import latest_checkpoint
    from tidal.utils.outputs import Layout, OutputError, RunDir

    extra = extra or {}
    check(out, extra)
    found = previous(out)
    if found and not (overwrite or resume):
        raise OutputError(f"{out} holds a previous chain's runs ({', '.join(f'{s}/' for s in found)}); pass --resume "
                          "to continue it, --overwrite to replace them, or choose another --out")
    layout = Layout("chain", ("domain", "base", "table.json"), ())
    with RunDir.open(out, layout, resume=resume and Path(out).is_dir(), overwrite=overwrite):
        synthetic.build(f"{out}/domain")
        base = Path(out) / "base"  # the untrained tiny model: the table's first row
        tok = tiny.build_tokenizer()
        tok.chat_template = PLAIN_TEMPLATE
        tiny.save(tiny.build_model(tiny.ModelConfig(), tok), tok, base)
        for stage, argv in commands(out):
            flag = ["--overwrite"] if overwrite else []
            if resume and latest_checkpoint(Path(out) / stage / "checkpoints") is not None:
                flag = ["--resume"]
            argv = argv + [x for kv in extra.get(stage, []) for x in ("--set", kv)] + flag
            print(f"$ tidal {shlex.join(argv)}", file=sys.stderr, flush=True)
            if cli.main(argv) != 0:
                raise SystemExit(f"stage {stage} failed")
        table = {"base": held_out_checks(base, f"{out}/domain")}
        for stage, path in model_dirs(out).items():
            table[stage] = held_out_checks(path, f"{out}/domain")
        rm_metrics = [json.loads(line) for line in (Path(out) / "rm" / "metrics.jsonl").read_text().splitlines()]
        table["rm"] = {"eval_accuracy": [m for m in rm_metrics if "eval/accuracy" in m][-1]["eval/accuracy"]}
        Path(out, "table.json").write_text(json.dumps(table, indent=2))
    return table


def markdown(table: dict) -> str:
    lines = ["| stage | held-out accuracy | preference accuracy | corpus NLL |", "|---|---|---|---|"]
    for stage, m in table.items():
        if stage == "rm":
            lines.append(f"| rm (reward model) | held-out pair accuracy {m['eval_accuracy']:.3f} | | |")
            continue
        lines.append(f"| {stage} | {m['accuracy']:.3f} | {m['pref_acc']:.3f} | {m['corpus_nll']:.3f} |")
    return "\n".join(lines)


def add_parsers(sub) -> None:
    """``tidal chain`` among ``tidal``'s sub-parsers."""
    sp = sub.add_parser("chain", help="DAPT -> SFT -> DPO (and a reward model) -> RL on the synthetic domain, each "
                        "stage's model the next one's base, then every stage's held-out table (docs/stages.md)")
    add_arguments(sp)
    sp.set_defaults(fn=cmd_chain)


def add_arguments(p) -> None:
    """The chain's flags, for ``tidal chain`` and ``python -m tidal.cli.stages_chain``."""
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

    extra: dict[str, list[str]] = {}
    try:
        for item in args.set:
            stage, colon, kv = item.partition(":")
            if not colon:
                raise ConfigError(f"--set {item}: expected STAGE:KEY=VALUE, STAGE one of {', '.join(KINDS)}")
            extra.setdefault(stage, []).append(kv)
        print(markdown(run(args.out, extra, overwrite=args.overwrite, resume=args.resume)))
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
