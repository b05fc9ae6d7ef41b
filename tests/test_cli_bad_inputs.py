"""Bad inputs to the command line, run as a user runs them (a subprocess with a time limit).

Every row of the table is a command over a bad input: an empty, binary or non-UTF-8 file, a huge
line, a wrong type, a missing file, a directory where a file belongs, an output that is the input,
a value the program cannot use. Each must end in one of two ways:

- an error: a non-zero exit code, exactly one line on stderr that starts with ``error:`` and names
  the offending row, file or key, no traceback, and every file that was there before unchanged;
- skipped and counted (a malformed row among good ones): exit code 0, the count in the output, and
  again no file that was there before changed.

No row may hang (each runs under a timeout). Inputs are tiny, so the module runs in well under a minute.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked_cli
from tidal.models import tiny
from tidal.models.quant_checkpoint import quantize_checkpoint

TIMEOUT_S = 60
BINARY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8  # 11 lines, the first not UTF-8
GOOD = [{"text": f"Row {i}: the council met on Tuesday and agreed the library opens longer hours."} for i in range(3)]


def _lines(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokenizer):
    """The bad (and a few good) inputs, plus an earlier output each command must leave alone."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "good.jsonl").write_bytes(_lines(GOOD))
    (d / "empty.jsonl").write_bytes(b"")
    (d / "binary.jsonl").write_bytes(BINARY)
    (d / "huge_line.jsonl").write_bytes(b'{"text": "' + b"x" * 2_000_000 + b"\n")  # 2 MB, unterminated
    (d / "mixed.jsonl").write_bytes(_lines(GOOD[:1]) + b'{"text": "caf\xe9"}\n' + b"[1, 2]\n\n" + b"x" * 100_000
                                    + b"\n" + _lines(GOOD[1:]))  # lines 2, 3 and 5 are malformed
    (d / "wrong_type.jsonl").write_bytes(_lines([{"text": 12}, {"text": None}, {"prompt": ["a"]}]))
    (d / "bad.parquet").write_bytes(b"PAR1 but not really parquet")
    (d / "bad.jsonl.gz").write_bytes(b"\x1f\x8b" + b"not gzip" * 4)
    (d / "bad_syntax.yaml").write_text("blocks: [exact_dedup\ntext_key: text\n")
    (d / "a_list.yaml").write_text("- exact_dedup\n- c4\n")
    (d / "a_dir").mkdir()
    (d / "a_dir" / "notes.txt").write_text("a user's file, not a dataset")
    (d / "earlier_out.jsonl").write_bytes(_lines(GOOD[:1]))
    (d / "lengths_bad.txt").write_text("12\n13\nabc\n")
    cfg = tiny.ModelConfig(hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=4, intermediate_size=256)
    tiny.save(tiny.build_model(cfg, tokenizer), tokenizer, d / "model")
    quantize_checkpoint(d / "model", d / "model_fp8")
    small = tiny.ModelConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4, intermediate_size=128)
    tiny.save(tiny.build_model(small, tokenizer), tokenizer, d / "model_64")  # q_proj: half a 128-row tile
    (d / "run_bad_yaml").mkdir()
    (d / "run_bad_yaml" / "config.yaml").write_text("optim:\n  lr: [0.1\n")
    (d / "junk_model").mkdir()
    (d / "junk_model" / "config.json").write_text("{not json")
    for name in ("run_a", "run_b"):  # a run's data: what report and inspect read
        (d / name).mkdir()
        (d / name / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
        (d / name / "config.yaml").write_text("max_steps: 1\n")
        (d / name / "samples.jsonl").write_text("")
    (d / "my_config").mkdir()
    (d / "my_config" / "config.yaml").write_text("# my settings, commented\nmax_steps: 1\n")
    return d


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


NO_CT = importlib.util.find_spec("compressed_tensors") is None
C, IN, OUT = "curate", "{d}/good.jsonl", "{o}/x.jsonl"
# (id, argv with {d}: the inputs, {o}: a fresh output directory; stdin; what must be printed).
# "error: ..." rows must fail with that text in their one stderr line; others must exit 0 and print it.
ERRORS = [
    ("curate-same-file", [C, "dedup", "--in", IN, "--out", "{d}/./good.jsonl"], "is the same file as --in"),
    ("curate-same-file-yaml", [C, "{d}/bad_syntax.yaml", "--in", IN, "--out", IN],
     "is the same file as --in"),
    ("curate-same-file-classifier", [C, "train-classifier", "--in", IN, "--out", IN],
     "is the same file as --in"),
    ("curate-missing", [C, "dedup", "--in", "{d}/nope.jsonl", "--out", OUT], "nope.jsonl: no such file"),
    ("curate-empty", [C, "dedup", "--in", "{d}/empty.jsonl", "--out", OUT], "empty.jsonl: no valid rows"),
    ("curate-binary", [C, "quality", "--in", "{d}/binary.jsonl", "--out", OUT],
     "binary.jsonl: no valid rows (11 malformed lines; first: {d}/binary.jsonl:1: not UTF-8 (byte 0x89"),
    ("curate-huge-line", [C, "dedup", "--in", "{d}/huge_line.jsonl", "--out", OUT],
     "huge_line.jsonl: no valid rows (1 malformed lines; first: {d}/huge_line.jsonl:1: invalid JSON"),
    ("curate-bad-parquet", [C, "dedup", "--in", "{d}/bad.parquet", "--out", OUT],
     "bad.parquet: not a readable Parquet file"),
    ("curate-bad-gzip", [C, "dedup", "--in", "{d}/bad.jsonl.gz", "--out", OUT],
     "bad.jsonl.gz: not a readable gzip file"),
    ("curate-dir-as-input", [C, "dedup", "--in", "{d}/a_dir", "--out", OUT],
     "a_dir: not a Hugging Face dataset directory"),
    ("curate-dir-as-output", [C, "dedup", "--in", IN, "--out", "{d}/a_dir"],
     "not a Hugging Face dataset directory; refusing to replace it"),
    ("curate-unknown-format", [C, "dedup", "--in", "{d}/lengths_bad.txt", "--out", OUT],
     "lengths_bad.txt: unknown format"),
    ("curate-yaml-syntax", [C, "{d}/bad_syntax.yaml", "--in", IN, "--out", OUT],
     "bad_syntax.yaml:2: YAML syntax error"),
    ("curate-yaml-list", [C, "{d}/a_list.yaml", "--in", IN, "--out", OUT],
     "a recipe file is a mapping"),
    ("curate-unknown-recipe", [C, "dedupe", "--in", IN, "--out", OUT], "unknown recipe 'dedupe'"),
    ("curate-unknown-key", [C, "dedup", "--in", IN, "--out", OUT, "--set", "near_dedup.treshold=1"],
     "near_dedup.treshold"),
    ("curate-wrong-type", [C, "dedup", "--in", IN, "--out", OUT, "--set", "workers=many"],
     "workers"),
    ("curate-no-eval", [C, "decontaminate", "--in", IN, "--out", OUT], "needs evaluation sets"),
    ("curate-eval-binary", [C, "decontaminate", "--in", IN, "--out", OUT, "--set",
                            "eval={d}/binary.jsonl"], "binary.jsonl:1: not UTF-8"),
    ("curate-out-is-eval", [C, "decontaminate", "--in", IN, "--out", "{d}/earlier_out.jsonl", "--set",
                            "eval={d}/earlier_out.jsonl"], "is the same file as eval="),
    ("curate-no-model", [C, "rl-difficulty", "--in", IN, "--out", OUT], "difficulty.model"),
    ("score-unknown-param", ["score", "--reward", "math", "--set", "foo=1"], "valid: mode, formats"),
    ("score-unknown-reward", ["score", "--reward", "maths"], "did you mean 'math'"),
    ("score-bad-workers", ["score", "--reward", "math", "--workers", "-1"], "--workers must be >= 0"),
    ("score-nan-timeout", ["score", "--reward", "math", "--timeout", "nan"], "--timeout a finite number > 0"),
    ("score-nan-param", ["score", "--reward", "compose", "--set", "floor=.nan"], "floor: nan is not a finite number"),
    ("distill-nan-temperature", ["distill", "traces", "--set", "traces.temperature=nan", "--out", "{o}/d"],
     "traces.temperature: nan is not a finite number"),  # was accepted, and NaN written into the JSON
    ("simulate-steps-0", ["simulate", "--set", "steps=0", "--plot", "none", "--out", "{o}/s"], "steps=0"),
    ("simulate-devices-0", ["simulate", "--set", "layout.devices=0", "--plot", "none", "--out", "{o}/s"],
     "layout.devices=0"),
    ("simulate-lengths", ["simulate", "--set", "workload.lengths=lognormal:abc", "--plot", "none", "--out", "{o}/s"],
     "workload.lengths='lognormal:abc'"),
    ("simulate-lengths-file", ["simulate", "--set", "workload.lengths=empirical:{d}/lengths_bad.txt", "--plot", "none",
                               "--out", "{o}/s"], "lengths_bad.txt: line 3"),
    ("simulate-out-is-a-file", ["simulate", "--set", "steps=2", "--plot", "none", "--out", "{d}/earlier_out.jsonl"],
     "earlier_out.jsonl"),
    ("quantize-into-source", ["quantize", "{d}/model", "{d}/model"], "is the source model directory"),
    ("quantize-into-a-file", ["quantize", "{d}/model", "{d}/earlier_out.jsonl"], "is a file"),
    ("quantize-missing", ["quantize", "{d}/nope", "{o}/q"], "no Hugging Face model at"),
    ("quantize-untileable", ["quantize", "{d}/model_64", "{o}/q"], "q_proj.weight has 64 output rows"),
    pytest.param(["eval", "{d}/model_fp8"], "pip install 'tidal[quant]'",
                 marks=pytest.mark.skipif(not NO_CT, reason="compressed-tensors is installed: the checkpoint loads"),
                 id="eval-quantized-no-extra"),
    ("eval-junk-config", ["eval", "{d}/junk_model"], "config.json"),
    ("eval-missing", ["eval", "{d}/nope"], "no Hugging Face model at"),
    ("eval-run-config-syntax", ["eval", "{d}/run_bad_yaml"], "run_bad_yaml/config.yaml:3: YAML syntax error"),
    pytest.param(["eval", "{d}/model", "--set", "rollout.engine=vllm"], "pip install 'tidal[vllm]'",
                 marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed"),
                 id="eval-vllm-not-installed"),
    ("report-out-is-metrics", ["report", "{d}/run_a", "{d}/run_b", "--out", "{d}/run_a/metrics.jsonl"],
     "--out {d}/run_a/metrics.jsonl is the same file as the input {d}/run_a/metrics.jsonl"),  # was replaced by HTML
    ("report-out-is-config", ["report", "{d}/run_a", "--out", "{d}/run_a/./config.yaml"],
     "is the same file as the input {d}/run_a/config.yaml"),
    ("inspect-out-is-samples", ["inspect", "{d}/run_a", "--out", "{d}/run_a/samples.jsonl"],
     "is the same file as the input {d}/run_a/samples.jsonl"),
    ("inspect-port-too-high", ["inspect", "{d}/run_a", "--serve", "--port", "70000", "--out", "{o}/i.html"],
     "--port must be in 0-65535 (0: any free port), got 70000"),  # was an OverflowError traceback
    ("inspect-port-negative", ["inspect", "{d}/run_a", "--serve", "--port", "-1", "--out", "{o}/i.html"],
     "--port must be in 0-65535"),
    ("train-out-holds-its-config", ["train", "{d}/my_config/config.yaml", "--out", "{d}/my_config"],
     "--out {d}/my_config/config.yaml is the same file as the config {d}/my_config/config.yaml"),
    ("train-out-holds-its-config-overwrite", ["train", "{d}/my_config/config.yaml", "--out", "{d}/my_config",
                                              "--overwrite"], "is the same file as the config"),
    ("train-unknown-key", ["train", "quickstart", "--set", "rollout.max_stalenes=2", "--out", "{o}/t"],
     "rollout.max_staleness"),
    ("train-wrong-type", ["train", "quickstart", "--set", "optim.lr=abc", "--out", "{o}/t"], "optim.lr"),
    ("train-nan-mixture-weight", ["train", "quickstart", "--out", "{o}/t", "--set", "curriculum.mixture=[{name: a, "
                                  "task: {name: addition}, weight: .nan}, {name: b, task: {name: addition}}]"],
     "curriculum.mixture[0].weight: nan is not a finite number"),  # routed every draw to one task
]
SKIPPED_AND_COUNTED = [
    ("curate-malformed-among-good", [C, "dedup", "--in", "{d}/mixed.jsonl", "--out", OUT], None,
     "3 rows in, 3 malformed lines skipped, 3 kept"),
    ("curate-wrong-type-rows", [C, "dedup", "--in", "{d}/wrong_type.jsonl", "--out", OUT], None,
     "dropped: no_text 3"),
    ("score-binary-stdin", ["score", "--reward", "exact_match", "--workers", "0"], b"\x89PNG\r\n\x1a\n\x00\xff\xfe\n",
     "3 rows, mean reward 0.0000, 3 malformed"),
    ("score-wrong-types", ["score", "--reward", "exact_match", "--workers", "0"],
     b'{"response": 5}\n{"response": "1", "answer": [1]}\n{"response": "1", "answer": "1"}\n',
     "3 rows, mean reward 0.3333, 2 malformed"),
]


def _run(argv, stdin, d: Path, o: Path, fresh: bool = False) -> subprocess.CompletedProcess:
    """The command as its own process: forked from one that imported torch once (``forked_cli``), or with
    ``fresh`` a new interpreter, start-up and all."""
    argv = [a.replace("{d}", str(d)).replace("{o}", str(o)) for a in argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if fresh:
        return subprocess.run([sys.executable, "-m", "tidal.cli", *argv], input=stdin or b"", capture_output=True,
                              timeout=TIMEOUT_S, env=env, cwd=o)
    return forked_cli.run(argv, env=env, cwd=o, stdin=stdin or b"", timeout=TIMEOUT_S)


def _params(rows):
    return [r if hasattr(r, "marks") else pytest.param(*r[1:], id=r[0]) for r in rows]  # a pytest.param as is


@pytest.mark.parametrize("argv,message", _params(ERRORS))
def test_bad_input_is_one_error_line_and_changes_nothing(inputs, tmp_path, argv, message):
    _check_one_error_line(inputs, tmp_path, argv, message, fresh=False)


@pytest.mark.parametrize("argv,message", _params([r for r in ERRORS if r[0] in ("curate-missing", "eval-junk-config")]))
def test_a_fresh_interpreter_gives_the_same_one_line(inputs, tmp_path, argv, message):
    """The rows above run forked from a process that imported torch and transformers already; whatever the
    imports themselves print would not show there, and shows here."""
    _check_one_error_line(inputs, tmp_path, argv, message, fresh=True)


def _check_one_error_line(inputs, tmp_path, argv, message, fresh: bool) -> None:
    before = _snapshot(inputs)
    proc = _run(argv, None, inputs, tmp_path, fresh)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode != 0, (proc.stdout[-500:], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert message.replace("{d}", str(inputs)) in lines[0], lines[0]
    assert _snapshot(inputs) == before, "an input or an earlier output was modified"
    assert not list(tmp_path.rglob("*")), f"an error left files behind: {list(tmp_path.rglob('*'))}"


@pytest.mark.parametrize("argv,stdin,message", _params(SKIPPED_AND_COUNTED))
def test_malformed_rows_among_good_ones_are_skipped_and_counted(inputs, tmp_path, argv, stdin, message):
    before = _snapshot(inputs)
    proc = _run(argv, stdin, inputs, tmp_path)
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert message in out + err, (out[-2000:], err[-2000:])
    assert _snapshot(inputs) == before
    assert not list(tmp_path.rglob("*.tmp"))
