"""Data: ``tidal curate`` (curation pipelines), ``tidal score`` (rewards over JSONL rows), ``tidal audit-reward``
(known reward hacks against a reward, on a task's prompts)."""

from __future__ import annotations

import io
import json
import math
import sys
import time

from tidal.cli.common import one_line_errors
from tidal.config import ConfigError, apply_overrides


@one_line_errors
def cmd_curate(args) -> int:
    """Run a curation recipe (docs/curate.md) and print its report's per-block counts."""
    from tidal.data.curate import curate
    from tidal.data.io import refuse_overwrite

    if args.recipe == "compare":
        from tidal.data.proxy import main_compare

        result = main_compare(args.set, args.out, overwrite=args.overwrite)
        for block in result["by_lr"]:
            print(f"lr {block['lr']:g}: " + " < ".join(
                f"{r['dataset']} ({r['mean_loss']:.3f} +- {r['std_loss']:.3f})" for r in block["rows"])
                + f"  [{block['seeds_agreeing_with_ranking']}/{block['seeds']} seeds agree]")
        print(f"report: {args.out}")
        return 0
    if args.recipe == "mixture":
        from tidal.data.mixture_methods import main_mixture

        report = main_mixture(args.set, args.out, progress=sys.stderr.isatty(), overwrite=args.overwrite)
        for name, r in report["methods"].items():
            mix = ", ".join(f"{d} {p:.2f}" for d, p in r["mix"].items())
            extra = (f"  regret {report['regret_by_method'][name]:+.2%}, compute "
                     f"{report['compute_frac_by_method'].get(name, float('nan')):.1%} of the grid's"
                     if "regret_by_method" in report and name != "given" else "")
            print(f"{name:<6} {mix}  held-out loss {r['held_out_loss']:.4f}{extra}")
        print(f"report: {args.out}")
        return 0
    if args.inp is None:
        raise ConfigError(f"tidal curate {args.recipe} needs --in PATH")
    refuse_overwrite(args.out, {"--in": args.inp})
    if args.recipe == "train-classifier":
        from tidal.data.classifier import TrainClassifierConfig, train_classifier

        metrics = train_classifier(args.inp, args.out, apply_overrides(TrainClassifierConfig(), args.set))
        print(f"classifier written to {args.out}: {json.dumps(metrics)}")
        return 0
    report = curate(args.recipe, args.inp, args.out, args.set, progress=sys.stderr.isatty())
    print(f"{report['rows_in']} rows in, {report['malformed_lines']} malformed lines skipped, {report['rows_out']} "
          f"kept ({report['rows_per_s'] or 0:.0f} rows/s, {report['workers']} workers); report: {args.out}.report.json")
    for where in report["malformed_examples"]:
        print(f"  malformed: {where}")
    for b in report["blocks"]:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(b["dropped"].items())) or "none"
        print(f"  {b['name']:<18} seen {b['seen']:>8}  kept {b['kept']:>8}  dropped: {dropped}")
    return 0


SCORE_CHUNK = 256  # rows scored per pool call: output appears progressively and memory stays bounded


def _score_item(n: int, line: str):
    """Parse JSONL line ``n``: (row to write back, (response, Prompt) to score or None, error or None).
    ``prompt``/``question`` become the prompt text, ``answer`` the answer, every other field the meta."""
    from tidal.types import Prompt

    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return {"raw": line.rstrip("\r\n")}, None, f"line {n}: invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(row, dict):
        return {"raw": line.rstrip("\r\n")}, None, f"line {n}: a row must be a JSON object, got {type(row).__name__}"
    if "response" not in row:
        return row, None, f"line {n}: missing field 'response'"
    text_key = "prompt" if "prompt" in row else "question"
    values = {"response": row["response"], text_key: row.get(text_key, ""), "answer": row.get("answer", "")}
    for key, value in values.items():
        if value is None and key == "answer":
            values[key] = ""
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key == "answer":
            values[key] = str(value)
        elif not isinstance(value, str):
            return row, None, f"line {n}: field {key!r} must be a string, got {type(value).__name__}"
    skip = {"response", text_key, "answer", "reward", "details"}
    meta = {k: v for k, v in row.items() if k not in skip}
    prompt = Prompt(uid=f"line-{n}", text=values[text_key], answer=values["answer"], meta=meta)
    return row, (values["response"], prompt), None


def _score_chunk(pool, chunk: list, out) -> tuple[float, int]:
    """Score one chunk, write its rows in input order; returns (sum of rewards, malformed rows)."""
    scored = iter(pool.score([item for _, item, _ in chunk if item is not None]))
    total, malformed = 0.0, 0
    for row, item, error in chunk:
        if item is None:
            reward, details = 0.0, {"error": error}
            malformed += 1
        else:
            reward, details = next(scored)
        total += reward
        out.write(json.dumps({**row, "reward": reward, "details": details}, default=str) + "\n")
    out.flush()
    return total, malformed


def cmd_score(args) -> int:
    """Score JSONL rows from stdin with a reward; see docs/score.md."""
    from tidal.config import apply_overrides
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardConfig, RewardPool

    params = apply_overrides({}, args.set)
    cfg = RewardConfig(name=args.reward, params=params, num_workers=args.workers, timeout_s=args.timeout)
    if cfg.num_workers < 0 or not 0 < cfg.timeout_s < math.inf:  # argparse's float() takes "nan" and "inf"
        raise ConfigError(f"--workers must be >= 0 and --timeout a finite number > 0 (got {cfg.num_workers}, "
                          f"{cfg.timeout_s})")
    pool = RewardPool(build_reward(cfg.name, cfg.params), cfg)
    # Undecodable bytes become U+FFFD instead of ending the stream; output is ASCII JSON (any locale).
    source = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace") if hasattr(
        sys.stdin, "buffer") else sys.stdin
    out = sys.stdout
    start, rows, total, malformed, chunk = time.perf_counter(), 0, 0.0, 0, []
    try:
        for n, line in enumerate(source, start=1):
            if line.strip():
                chunk.append(_score_item(n, line))
            if len(chunk) == SCORE_CHUNK:
                t, m = _score_chunk(pool, chunk, out)
                rows, total, malformed, chunk = rows + len(chunk), total + t, malformed + m, []
        if chunk:
            t, m = _score_chunk(pool, chunk, out)
            rows, total, malformed = rows + len(chunk), total + t, malformed + m
    finally:
        pool.close()
        elapsed = time.perf_counter() - start
        print(f"score: {rows} rows, mean reward {total / max(rows, 1):.4f}, {malformed} malformed, "
              f"{pool.num_errors} reward errors, {pool.num_timeouts} timeouts, {rows / elapsed:.1f} rows/s",
              file=sys.stderr)
    return 0


@one_line_errors
def cmd_audit_reward(args) -> int:
    """Run the library of known reward hacks (``rewards/audit.py``) against a reward on a recipe's task prompts;
    exit 1 when a hack scores above the threshold or no control scores at all. See docs/rewards.md."""
    from tidal.recipes import RECIPES
    from tidal.rewards import build_reward
    from tidal.rewards.audit import format_table, run_audit
    from tidal.rewards.pool import RewardConfig, RewardPool
    from tidal.system.curriculum import build_task, run_reward
    from tidal.utils.files import replace_text

    if args.num_prompts < 1 or args.workers < 0 or not 0 < args.timeout < math.inf:
        raise ConfigError(f"--num-prompts must be >= 1, --workers >= 0 and --timeout a finite number > 0 (got "
                          f"{args.num_prompts}, {args.workers}, {args.timeout})")
    cfg = RECIPES.get(args.recipe)()
    if args.reward is not None:  # the recipe's params belong to the recipe's reward
        cfg.reward.name, cfg.reward.params = args.reward, {}
    apply_overrides(cfg, args.set)
    prompts = build_task(cfg).eval_prompts()[: args.num_prompts]
    name, params = run_reward(cfg)
    pool = RewardPool(build_reward(name, params), RewardConfig(name=name, params=params, num_workers=args.workers,
                                                                timeout_s=args.timeout))
    try:
        report = run_audit(pool.score, prompts, args.threshold)
    finally:
        pool.close()
    report = {"reward": name, "params": params, "recipe": args.recipe, "task": cfg.task.name, **report,
              "reward_errors": pool.num_errors, "reward_timeouts": pool.num_timeouts}
    print(f"audit of reward {name} {json.dumps(params)} on {len(prompts)} prompts of task {cfg.task.name} "
          f"(recipe {args.recipe})")
    print(format_table(report))
    if args.out:
        replace_text(args.out, json.dumps(report, indent=2, default=str) + "\n")
        print(f"report: {args.out}")
    return 0 if report["passed"] else 1


def add_parsers(sub) -> None:
    """This group's subcommands: their options and handlers."""
    sp = sub.add_parser("curate", help="curate a dataset: dedup, quality, decontaminate, rl-problems, rl-difficulty, "
                        "rephrase, train-classifier, compare, mixture (docs/curate.md)")
    sp.add_argument("recipe", help="dedup | quality | decontaminate | rl-problems | rl-difficulty (verifiable "
                    "problems a policy solves sometimes: --set difficulty.model=DIR) | rephrase (a model rewrites "
                    "each row: --set rephrase.model=DIR) | a recipe .yaml | "
                    "train-classifier (labeled rows in, a quality model directory out) | "
                    "compare (proxy models rank datasets: --set proxy.datasets=[A, B] --set proxy.eval=PATH) | "
                    "mixture (choose domain proportions: --set mixture.domains=[A, B] --set mixture.eval=PATH "
                    "--set mixture.method=grid|merge|aioli|bayes|all)")
    sp.add_argument("--in", dest="inp", default=None, help="input: .jsonl(.gz), .parquet or a HF dataset directory")
    sp.add_argument("--out", required=True, help="output for the kept rows (same formats; never the --in file: "
                    "written whole or not at all); OUT.report.json beside it")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="eval=PATH, workers=N, near_dedup.threshold=0.8, ... (CurateConfig keys)")
    sp.add_argument("--overwrite", action="store_true", help="compare, mixture: replace an existing --out report "
                    "(refused without it)")
    sp.set_defaults(fn=cmd_curate)

    sp = sub.add_parser("score", help="score JSONL rows from stdin with a reward; write them back with reward/details")
    sp.add_argument("--reward", required=True, help="registered reward name (e.g. exact_match, math, reasoning_gym) "
                    "or an import path (my_pkg.mod:fn, file.py:fn)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a reward parameter (YAML value)")
    sp.add_argument("--workers", type=int, default=1, help="reward worker processes (0: score inline)")
    sp.add_argument("--timeout", type=float, default=10.0, help="per-row limit in seconds (reward 0, counted)")
    sp.set_defaults(fn=cmd_score)

    sp = sub.add_parser("audit-reward", help="run known reward hacks (restated question, candidate lists, empty "
                        "tags, filler, ...) against a reward on a task's prompts; exit 1 if any scores")
    sp.add_argument("--reward", default=None, help="a registered reward or an import path (my_pkg.mod:fn, file.py:fn); "
                    "default: the recipe's reward")
    sp.add_argument("--recipe", default="quickstart", help="recipe whose task (and default reward) to use "
                    "(default quickstart)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config key: reward.params.mode=lenient, task.name=..., task.path=...")
    sp.add_argument("--num-prompts", type=int, default=20, help="held-out task prompts to probe (default 20)")
    sp.add_argument("--threshold", type=float, default=0.0, help="a hack fails when a sample scores above this "
                    "(default 0; e.g. 0.1 under a format bonus that wrong answers get too)")
    sp.add_argument("--out", default=None, help="also write the report as JSON here")
    sp.add_argument("--workers", type=int, default=1, help="reward worker processes (0: score inline)")
    sp.add_argument("--timeout", type=float, default=10.0, help="per-response limit in seconds (reward 0, counted)")
    sp.set_defaults(fn=cmd_audit_reward)
