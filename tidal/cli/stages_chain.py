"""DAPT -> SFT -> DPO -> RL on a small synthetic domain (``stages/synthetic.py``), tiny model, CPU.

Each stage is the command docs/stages.md shows, run through ``tidal.cli.main``; each takes the previous
stage's ``model/`` as ``model.path``. RL is the ``stages_rl`` recipe (``recipes/stages.py``: the quickstart's
async RL on the domain's questions). Then every stage's model gets the domain's held-out checks
(``stages/evaluate.py``), written to ``OUT/table.json`` and printed as the table docs/stages.md shows.

    python -m tidal.cli.stages_chain --out runs/stages [--set STAGE:key=value ...]

``--set sft:run.steps=2`` appends an override to one stage's command (tests run the chain that way,
short). The commands are ``commands(out)``; ``tests/stages/test_chain.py`` checks docs/stages.md shows them.
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
                "--set", f"data.eval_path={d}/pairs_eval.jsonl", "--set", "optim.lr=1e-3", "--set", "run.steps=100",
                "--set", "run.threads=1", "--out", f"{out}/rm"]),
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


def run(out: str, extra: dict[str, list[str]] | None = None) -> dict:
    from tidal import cli
    from tidal.models import tiny
    from tidal.stages import synthetic
    from tidal.stages.chat_data import PLAIN_TEMPLATE
    from tidal.stages.evaluate import held_out_checks

    extra = extra or {}
    synthetic.build(f"{out}/domain")
    base = Path(out) / "base"  # the untrained tiny model: the table's first row
    tok = tiny.build_tokenizer()
    tok.chat_template = PLAIN_TEMPLATE
    tiny.save(tiny.build_model(tiny.ModelConfig(), tok), tok, base)
    for stage, argv in commands(out):
        argv = argv + [x for kv in extra.get(stage, []) for x in ("--set", kv)] + ["--overwrite"]
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


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tidal.cli.stages_chain", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/stages")
    p.add_argument("--set", action="append", default=[], metavar="STAGE:KEY=VALUE")
    args = p.parse_args(argv)
    extra: dict[str, list[str]] = {}
    for item in args.set:
        stage, _, kv = item.partition(":")
        extra.setdefault(stage, []).append(kv)
    print(markdown(run(args.out, extra)))


if __name__ == "__main__":
    main()
