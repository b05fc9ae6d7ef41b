"""The ``tidal`` command line: train, eval, recipes, bench, report.

    tidal recipes
    tidal train RECIPE|CONFIG.yaml [--set key=value ...] [--out DIR] [--resume | --overwrite]
    tidal eval DIR_OR_MODEL [--recipe NAME] [--set ...]
    tidal bench async [--set ...]
    tidal report DIR [DIR ...] [--out FILE]
    tidal inspect DIR [DIR ...] [--out FILE] [--serve [--port N]]
    tidal quantize MODEL_OR_RUN_DIR OUT_DIR [--layout compressed-tensors|fp8]
    tidal export RUN_OR_CHECKPOINT --out DIR [--merge]
    tidal score --reward NAME [--set key=value ...] [--workers N] [--timeout S] < rows.jsonl
    tidal curate RECIPE --in PATH --out PATH [--set key=value ...]
    tidal simulate [--set preset=cpu|areal] [--set key=value ...] [--out DIR] [--plot eta|devices|none]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from tidal.config import ConfigError, apply_overrides
from tidal.registry import UnknownNameError


def _recipe_config(name: str, overrides: list[str]):
    from tidal.recipes import RECIPES

    cfg = RECIPES.get(name)()
    return apply_overrides(cfg, overrides)


def cmd_recipes(args) -> int:
    from tidal.recipes import RECIPES

    if args.action is None:
        for name in RECIPES:
            doc = (RECIPES.get(name).__doc__ or "").strip().splitlines()[0]
            print(f"{name:18s} {doc}")
        return 0
    if args.action != "show" or not args.name:
        print("usage: tidal recipes [show NAME]", file=sys.stderr)
        return 2
    print(show_recipe(args.name), end="")
    return 0


def show_recipe(name: str) -> str:
    """The resolved config, one ``key: value`` per line, each key the recipe sets annotated with its source."""
    import dataclasses

    import yaml

    from tidal.recipes import RECIPES
    from tidal.recipes.papers import NOTES, SOURCES

    cfg = RECIPES.get(name)()
    sources = SOURCES.get(name, {})

    def flat(node, prefix=""):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                yield from flat(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value

    doc = (RECIPES.get(name).__doc__ or "").strip()
    lines = [f"# {name}: {doc}"] + [f"# {note}" for note in NOTES.get(name, [])]
    for key, value in flat(cfg):
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        line = f"{key}: {text}"
        lines.append(f"{line:48s} # {sources[key]}" if key in sources else line)
    return "\n".join(lines) + "\n"


def _train_config(recipe: str, overrides: list[str], saved: Path | None = None):
    """The run config: a recipe by name, or a YAML file (a run's ``config.yaml`` reproduces that run),
    then ``saved`` (the run's own config.yaml, on --resume), then the ``--set`` overrides."""
    from tidal.config import apply_mapping
    from tidal.system.config import RunConfig
    from tidal.utils.yaml_file import read_yaml

    if Path(recipe).is_dir():
        raise ConfigError(f"{recipe} is a directory, not a recipe name or a YAML config (to rerun a run's config: "
                          f"tidal train {Path(recipe) / 'config.yaml'}; to continue it: --out {recipe} --resume)")
    if recipe.endswith((".yaml", ".yml")) or Path(recipe).is_file():
        if not Path(recipe).is_file():
            raise ConfigError(f"{recipe}: no such config file (a recipe name or a YAML config file)")
        cfg = apply_mapping(RunConfig(), read_yaml(recipe, mapping=True))
    else:
        from tidal.recipes import RECIPES

        cfg = RECIPES.get(recipe)()
    if saved is not None:
        apply_mapping(cfg, read_yaml(saved, mapping=True))
    return apply_overrides(cfg, overrides)


def _refuse_run_data(out: str | None, run_dirs: list[str]) -> None:
    """``--out`` is none of the run files a command reads (``tidal report A B --out A/metrics.jsonl`` used to
    replace A's metrics with HTML): one line naming both."""
    from tidal.data.io import refuse_overwrite
    from tidal.utils.runs import RUN_DATA

    if out is not None:
        for d in run_dirs:
            for name in RUN_DATA:
                refuse_overwrite(out, {"the input": Path(d) / name})


def _default_out(recipe: str) -> str:
    path = Path(recipe)
    name = path.stem if path.suffix in (".yaml", ".yml") else recipe
    return f"runs/{name}"


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as the interrupt every part of a run already handles (checkpoint, clean stop)."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def cmd_train(args) -> int:
    """Train a recipe (or a saved config.yaml); bad input is one line, Ctrl-C says how to resume (exit 130)."""
    from tidal.api import EngineFailed
    from tidal.system.run import check_inputs, train
    from tidal.system.run_dir import interrupted_message, prepare_out_dir

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: FSDP or DiLoCo (elastic is refused there)
        from tidal.system.data_parallel import train

    out = Path(args.out or _default_out(args.recipe))
    # A scheduler's SIGTERM (preemption, `kill`, the end of a job's time) stops the run as Ctrl-C does:
    # checkpoint, one line saying how to resume; exit 143 (128 + SIGTERM), as if the signal had ended it.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if Path(args.recipe).is_file() and not args.resume:  # with --resume it is the run's own config.yaml
            from tidal.data.io import refuse_overwrite

            refuse_overwrite(out / "config.yaml", {"the config": args.recipe})  # the run writes its config there
        saved = out / "config.yaml" if args.resume and (out / "config.yaml").is_file() else None
        cfg = _train_config(args.recipe, args.set, saved)
        task = check_inputs(cfg)  # every input the run reads, before --overwrite deletes anything (every rank)
        if cfg.trainer.data_parallel == "elastic" and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            from tidal.system.elastic_run import train  # this process leads replica processes it starts
        if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 owns the directory
            note = prepare_out_dir(out, args.resume, args.overwrite)
            if note:
                print(note, file=sys.stderr)
        result = train(cfg, out, resume=args.resume, task=task)
    except KeyboardInterrupt as e:
        print(interrupted_message(out, args.recipe), file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except EngineFailed as e:  # checkpointed like Ctrl-C: one line naming the failure and how to go on
        stopped = interrupted_message(out, args.recipe).replace("interrupted", "stopped", 1)
        print("error: " + " ".join(str(e).split()) + "; " + stopped, file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # a bad value met late, an output that could not be written: one line
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    if result is None:  # a data-parallel rank other than 0: rank 0 reports
        return 0
    summary = {
        "out": str(out),
        "steps": result.steps,
        "base_accuracy": result.base_accuracy,
        "final_accuracy": result.final_accuracy,
        "best_accuracy": result.best_accuracy,
        "stopped_because": result.stopped_because,
        "report": str(out / "report.html"),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _one_line_errors(fn):
    """Bad input to ``fn`` (a ValueError or OSError: a malformed file, a missing or unwritable path) is
    one ``error:`` line on stderr and exit code 2, never a traceback; Ctrl-C is one line and 130 (the
    outputs are written under temporary names, so an interrupted command leaves them as they were)."""
    import functools

    @functools.wraps(fn)
    def wrapper(args) -> int:
        try:
            return fn(args)
        except (ValueError, OSError) as e:
            print("error: " + " ".join(str(e).split()), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"error: tidal {args.command} interrupted; its outputs were not replaced", file=sys.stderr)
            return 130

    return wrapper


def _quant_method(model_dir: Path) -> str:
    """``config.json``'s ``quantization_config.quant_method`` (what loading the model needs), or "?"."""
    try:
        return json.loads((model_dir / "config.json").read_text())["quantization_config"]["quant_method"]
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


@_one_line_errors
def cmd_eval(args) -> int:
    """Greedy held-out accuracy of a run's latest checkpoint or of a model directory."""
    from tidal.config import apply_mapping
    from tidal.models import tiny
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardPool
    from tidal.rollout import ENGINES
    from tidal.rollout.thinking import close_ids
    from tidal.system.curriculum import build_task, run_reward
    from tidal.system.evaluate import accuracy_by_budget, greedy_accuracy
    from tidal.system.validate import validate_run_config
    from tidal.train.checkpoint import latest_checkpoint
    from tidal.utils.yaml_file import read_yaml

    target = Path(args.path)
    cfg = _recipe_config(args.recipe, [])
    if (target / "config.yaml").exists():
        apply_mapping(cfg, read_yaml(target / "config.yaml", mapping=True))  # broken: one line naming file:line
    apply_overrides(cfg, args.set)
    model_dir = target
    if (target / "checkpoints").exists():
        model_dir = latest_checkpoint(target / "checkpoints") or target
    try:
        model, tokenizer = tiny.load(model_dir)
    except ImportError as e:  # transformers' quantizers (compressed-tensors, fp8) need optional packages
        raise ConfigError(f"{model_dir}: loading this quantized checkpoint (quant_method {_quant_method(model_dir)}) "
                          f"needs packages that are not installed; pip install 'tidal[quant]' ({e})") from None
    validate_run_config(cfg)
    task = build_task(cfg)
    try:
        engine = ENGINES.get(cfg.rollout.engine)(model, tokenizer, cfg.rollout, cfg.seed, 0)
    except ImportError as e:  # an optional engine (vllm): its message says what to install
        raise ConfigError(f"rollout.engine={cfg.rollout.engine}: {e}") from None
    pool = RewardPool(build_reward(*run_reward(cfg)), cfg.reward)
    prompts = task.eval_prompts()[: cfg.num_eval]
    thinking, close = cfg.rollout.thinking, close_ids(tokenizer, cfg.rollout.thinking)
    try:
        budget = thinking.eval_budget
        result = greedy_accuracy(engine, tokenizer, prompts, pool, None if budget is None else (budget, close))
        if thinking.eval_budgets:  # the accuracy-vs-thinking-budget curve (budget forcing, rollout/thinking.py)
            result["accuracy_by_thinking_budget"] = accuracy_by_budget(engine, tokenizer, prompts, pool,
                                                                       thinking.eval_budgets, close)
    finally:
        pool.close()
    print(json.dumps({"model": str(model_dir), "task": task.name if cfg.curriculum.mixture else cfg.task.name,
                      **result}, indent=2))
    return 0


def cmd_bench(args) -> int:
    from tidal.bench import run_benchmark

    return run_benchmark(args.name, args.set, args.out)


@_one_line_errors
def cmd_curate(args) -> int:
    """Run a curation recipe (docs/curate.md) and print its report's per-block counts."""
    from tidal.data.curate import curate
    from tidal.data.io import refuse_overwrite

    if args.recipe == "compare":
        from tidal.data.proxy import main_compare

        result = main_compare(args.set, args.out)
        for block in result["by_lr"]:
            print(f"lr {block['lr']:g}: " + " < ".join(
                f"{r['dataset']} ({r['mean_loss']:.3f} +- {r['std_loss']:.3f})" for r in block["rows"])
                + f"  [{block['seeds_agreeing_with_ranking']}/{block['seeds']} seeds agree]")
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


@_one_line_errors
def cmd_simulate(args) -> int:
    """Predict sync / periodic / async throughput with the discrete-event simulator (docs/simulate.md)."""
    from tidal.sim.report import main as simulate_main

    simulate_main(args.set, args.out, args.plot)
    return 0


@_one_line_errors
def cmd_quantize(args) -> int:
    """Write a block-FP8 copy of a model directory (or a run's latest checkpoint) that vLLM loads."""
    from tidal.models.quant_checkpoint import quantize_checkpoint
    from tidal.train.checkpoint import latest_checkpoint

    src = Path(args.src)
    if (src / "checkpoints").exists():
        src = latest_checkpoint(src / "checkpoints") or src
    info = quantize_checkpoint(src, args.dst, args.layout)
    print(f"{args.dst}: {info['num_quantized']} linear weights to FP8 (128x128 blocks, {args.layout} layout), "
          f"{info['bytes_before']:,} -> {info['bytes_after']:,} bytes")
    return 0


@_one_line_errors
def cmd_export(args) -> int:
    """A run's latest checkpoint (or a checkpoint) as LoRA adapters, a merged model, or full weights."""
    from tidal.models.export import export
    from tidal.train.checkpoint import latest_checkpoint

    src = Path(args.run)
    if (src / "checkpoints").exists():
        src = latest_checkpoint(src / "checkpoints") or src
    print(json.dumps(export(src, args.out, merge=args.merge)))
    return 0


@_one_line_errors
def cmd_report(args) -> int:
    """One run: (re)write its report.html. Several: one comparison report (their panels overlaid, config diff)."""
    from tidal.utils.report import write_report
    from tidal.utils.report_compare import write_comparison

    _refuse_run_data(args.out, args.run_dirs)
    if len(args.run_dirs) == 1 and args.out is None:
        print(write_report(args.run_dirs[0]))
    else:
        print(write_comparison(args.run_dirs, args.out))
    return 0


@_one_line_errors
def cmd_inspect(args) -> int:
    """Write the rollout inspector of one or more runs (docs/inspect.md); with --serve, serve it on loopback."""
    from tidal.inspector.page import write_inspector

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0-65535 (0: any free port), got {args.port}")
    _refuse_run_data(args.out, args.run_dirs)
    out = write_inspector(args.run_dirs, args.out)
    print(out)
    if not args.serve:
        return 0
    from tidal.inspector.serve import make_server

    server = make_server(out, args.port)
    host, port = server.server_address[:2]
    print(f"serving http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
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


@_one_line_errors
def cmd_distill(args) -> int:
    """Teacher to student: ``teacher`` (build or find the quickstart teacher), ``traces`` or ``logits``
    (``distill/pipeline.py``); prints the summary's headline numbers, writes OUT/summary.json."""
    from tidal.distill import pipeline
    from tidal.system.run import teacher_path

    cfg, sections = pipeline.resolve(_train_config(args.recipe, []), args.set)
    if args.mode == "teacher" or args.teacher == "quickstart":
        cfg.distill.teacher = "quickstart"
        teacher = str(teacher_path(cfg, progress=True, teacher=sections["teacher"]))
        if args.mode == "teacher":
            print(json.dumps({"teacher": teacher}))
            return 0
    elif args.teacher is None:
        raise ConfigError(f"tidal distill {args.mode} needs --teacher DIR (a model directory, or quickstart)")
    else:
        teacher = args.teacher
    out = Path(args.out or f"runs/distill_{args.mode}")
    common = dict(overrides=args.set, student=args.student, progress=True, train=not args.no_train)
    if args.mode == "traces":
        s = pipeline.distill_traces(teacher, out, _train_config(args.recipe, []), **common)
        head = {"traces": s["traces"], "student": s.get("student")}
    else:
        s = pipeline.distill_logits(teacher, out, _train_config(args.recipe, []), top_k=args.top_k,
                                    traces=args.traces, compare_full=args.compare_full, **common)
        head = {"store": {k: s["store"][k] for k in ("k", "num_positions", "bytes_per_position", "info_loss_kl")},
                "sparse": s.get("sparse"), "full": s.get("full"), "rel_loss_gap": s.get("rel_loss_gap")}
    for key in ("student", "sparse", "full"):
        if head.get(key):
            head[key] = {k: head[key][k] for k in ("start_accuracy", "final_accuracy", "eval_kl", "student_out")
                         if k in head[key]}
    print(json.dumps({"out": str(out), "teacher_accuracy": s["teacher_accuracy"], **head}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="Asynchronous RL post-training for language models.")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("recipes", help="list the named recipes; `recipes show NAME` prints one with its sources")
    sp.add_argument("action", nargs="?", choices=["show"])
    sp.add_argument("name", nargs="?")
    sp.set_defaults(fn=cmd_recipes)

    sp = sub.add_parser("train", help="train a recipe")
    sp.add_argument("recipe", help="a recipe name (`tidal recipes`) or a YAML config, e.g. a run's config.yaml")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    sp.add_argument("--out", help="run directory (default runs/RECIPE, or runs/NAME for NAME.yaml)")
    sp.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    sp.add_argument("--overwrite", action="store_true", help="delete the previous run's files in --out first")
    sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("eval", help="greedy held-out accuracy of a run or model directory")
    sp.add_argument("path")
    sp.add_argument("--recipe", default="quickstart", help="recipe whose task/reward to use (default quickstart)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.set_defaults(fn=cmd_eval)

    sp = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    sp.add_argument("name")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    sp.set_defaults(fn=cmd_bench)

    sp = sub.add_parser("distill", help="teacher -> student: traces (SFT on verified teacher samples), logits "
                        "(k-sparse teacher distributions, forward KL), teacher (build the quickstart teacher); "
                        "docs/distill.md")
    sp.add_argument("mode", choices=["traces", "logits", "teacher"])
    sp.add_argument("--teacher", help="teacher model directory, or quickstart (built once, cached)")
    sp.add_argument("--student", help="student model directory to start from (default: the recipe's warm-started base)")
    sp.add_argument("--recipe", default="quickstart", help="recipe whose task, reward and base to use")
    sp.add_argument("--out", help="output directory (default runs/distill_MODE)")
    sp.add_argument("--top-k", type=int, default=None, help="logits: token ids kept per position (default 32)")
    sp.add_argument("--traces", help="logits: store the teacher's distributions on these traces (a traces.jsonl)")
    sp.add_argument("--compare-full", action="store_true",
                    help="logits: also train a student with full-vocabulary KL on the fly, from the same start")
    sp.add_argument("--no-train", action="store_true", help="write the teacher data only")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="traces.*, logits.*, student.* (docs/distill.md) or a run-config key")
    sp.set_defaults(fn=cmd_distill)

    sp = sub.add_parser("curate", help="curate a dataset: dedup, quality, decontaminate, rl-problems, rl-difficulty, "
                        "rephrase, train-classifier, compare (docs/curate.md)")
    sp.add_argument("recipe", help="dedup | quality | decontaminate | rl-problems | rl-difficulty (verifiable "
                    "problems a policy solves sometimes: --set difficulty.model=DIR) | rephrase (a model rewrites "
                    "each row: --set rephrase.model=DIR) | a recipe .yaml | "
                    "train-classifier (labeled rows in, a quality model directory out) | "
                    "compare (proxy models rank datasets: --set proxy.datasets=[A, B] --set proxy.eval=PATH)")
    sp.add_argument("--in", dest="inp", default=None, help="input: .jsonl(.gz), .parquet or a HF dataset directory")
    sp.add_argument("--out", required=True, help="output for the kept rows (same formats; never the --in file: "
                    "written whole or not at all); OUT.report.json beside it")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="eval=PATH, workers=N, near_dedup.threshold=0.8, ... (CurateConfig keys)")
    sp.set_defaults(fn=cmd_curate)

    sp = sub.add_parser("simulate", help="simulate sync/periodic/async RL throughput at any scale (docs/simulate.md)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="preset=cpu|areal, or a simulator key (costs.*, layout.*, workload.*, steps, ...)")
    sp.add_argument("--out", default="runs/simulate", help="where result.json and simulate.png go")
    sp.add_argument("--plot", choices=["eta", "devices", "none"], default="eta", help="PNG: throughput vs this")
    sp.set_defaults(fn=cmd_simulate)

    sp = sub.add_parser("quantize", help="write a block-FP8 checkpoint vLLM loads (docs/quantization.md)")
    sp.add_argument("src", help="a model directory, or a run directory (its latest checkpoint)")
    sp.add_argument("dst", help="output model directory")
    sp.add_argument("--layout", choices=["compressed-tensors", "fp8"], default="compressed-tensors",
                    help="compressed-tensors (weight_scale) or DeepSeek-V3's native fp8 (weight_scale_inv)")
    sp.set_defaults(fn=cmd_quantize)

    sp = sub.add_parser("export", help="write a run's policy: LoRA adapters (PEFT layout) or, with --merge, a merged "
                        "Hugging Face model directory (docs/lora.md)")
    sp.add_argument("run", help="a run directory (its latest checkpoint) or a checkpoint directory")
    sp.add_argument("--out", required=True, help="output directory (new or empty)")
    sp.add_argument("--merge", action="store_true", help="merge the adapters into the base (a plain HF model)")
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("report", help="(re)write report.html for a run directory; several: compare them")
    sp.add_argument("run_dirs", nargs="+", metavar="run_dir")
    sp.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html for one run, "
                    "compare.html here for several)")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("inspect", help="write inspect.html: recorded rollouts, metric curves and config diff of "
                        "one or more runs (docs/inspect.md)")
    sp.add_argument("run_dirs", nargs="+", metavar="run_dir")
    sp.add_argument("--out", default=None, help="output file (default: RUN_DIR/inspect.html for one run, "
                    "inspect.html here for several)")
    sp.add_argument("--serve", action="store_true", help="then serve the page on 127.0.0.1 until Ctrl-C")
    sp.add_argument("--port", type=int, default=8000, help="port for --serve (0: any free port)")
    sp.set_defaults(fn=cmd_inspect)

    sp = sub.add_parser("score", help="score JSONL rows from stdin with a reward; write them back with reward/details")
    sp.add_argument("--reward", required=True, help="registered reward name (e.g. exact_match, math, reasoning_gym)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a reward parameter (YAML value)")
    sp.add_argument("--workers", type=int, default=1, help="reward worker processes (0: score inline)")
    sp.add_argument("--timeout", type=float, default=10.0, help="per-row limit in seconds (reward 0, counted)")
    sp.set_defaults(fn=cmd_score)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    if args.command != "score":  # score never loads a model: skip transformers' ~1 s import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard save/load bars drown the run's own progress bar
    try:
        return args.fn(args)
    except (ConfigError, UnknownNameError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
