"""Every `tidal ...` command in the README runs (shrunk to a tiny model with extra --set flags)."""

import re
import shlex
from pathlib import Path

import pytest

from tidal.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
MODELS_DOC = README.parent / "docs" / "models.md"
TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null",
        "sft.batch_size=8", "max_steps=2", "eval_every=1",
        "num_eval=8", "rollout.prompts_per_step=2", "rollout.group_size=2", "algo.passk_k=2", "log.progress=false"]


def readme_commands(path: Path = README) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("tidal ")]


def _without_out(argv: list[str]) -> tuple[str, ...]:
    i = argv.index("--out") if "--out" in argv else len(argv)
    return tuple(argv[:i] + argv[i + 2:])


def run_by_the_models_doc_test() -> set[tuple[str, ...]]:
    """README commands that docs/models.md also shows: tests/models/test_models_doc.py runs them on the real
    model (~35 s of SmolLM2 each), so this test does not run them twice."""
    return {_without_out(c) for c in readme_commands(MODELS_DOC)
            if c[0] in ("train", "eval")} & {_without_out(c) for c in readme_commands()}


def test_the_skipped_commands_are_the_models_docs():
    skipped = run_by_the_models_doc_test()
    assert ("train", "smollm2_quickstart") in skipped, skipped  # the README and the doc still agree
    assert all(c[0] in ("train", "eval") and any("smollm2" in x for x in c) for c in skipped), skipped


def test_readme_has_the_two_setup_commands():
    text = README.read_text()
    assert "make run" in text and "make test" in text


SLOW_BENCHES = ("real", "agentic")
"""README benchmarks whose toy run takes most of this test's time (43 s and 28 s of ~110 s on 2 cores): they run in
``test_readme_slow_bench_commands_run`` (``make test-slow``; ``bench real`` also has tests/test_bench_real.py)."""


def _slow(argv: list[str]) -> bool:
    return argv[0] == "bench" and argv[1] in SLOW_BENCHES


def test_readme_commands_run(tmp_path, monkeypatch, capsys, smollm2_dir):
    commands = [c for c in readme_commands() if not _slow(c)]
    assert any(c[0] == "train" for c in commands), "README lost its train example"
    run_commands(commands, tmp_path, monkeypatch, capsys, smollm2_dir)


@pytest.mark.slow
def test_readme_slow_bench_commands_run(tmp_path, monkeypatch, capsys, smollm2_dir):
    commands = [c for c in readme_commands() if _slow(c)]
    assert len(commands) == len(SLOW_BENCHES), "README lost a benchmark command"
    run_commands(commands, tmp_path, monkeypatch, capsys, smollm2_dir)


def run_commands(commands: list[list[str]], tmp_path, monkeypatch, capsys, smollm2_dir) -> None:
    monkeypatch.setenv("TIDAL_CACHE", str(smollm2_dir.parent.parent.absolute()))  # the imported SmolLM2, reused
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").symlink_to(README.parent / "benchmarks")
    skipped = run_by_the_models_doc_test()
    # recipes whose every eval and step is an agent's episodes through the endpoint (verifiers' own rollout: ~2 s an
    # eval) or a picture task: one RL step (evals at steps 0 and 1) still runs the warm start, an RL step, the evals,
    # the checkpoint and the report through the recipe's own engine
    train_knobs = {
        "verifiers_quickstart": ["max_steps=1", "num_eval=4", "env.verifiers.num_eval=8"],
        "harness_quickstart": ["max_steps=1", "num_eval=4", "task.num_eval=8"],
        "agentic_quickstart": ["max_steps=1", "num_eval=4"],
        "vlm_quickstart": ["max_steps=1", "num_eval=4", "task.num_eval=8"],
    }
    bench_knobs = {  # added to the run-config benchmarks' TINY settings
        "async": ["task.max_repeat=8", "rollout.max_new_tokens=12"],  # 56-token responses: a long tail for timing
        "ablations": ["num_eval=4"],  # eight arms, each evaluated at steps 0 and 1
    }
    for argv in commands:
        if _without_out(argv) in skipped:
            continue
        extra = []
        if argv[0] in ("train", "bench"):
            extra = [x for kv in TINY for x in ("--set", kv)]
            if argv[0] == "train":
                extra += [x for kv in train_knobs.get(argv[1], []) for x in ("--set", kv)]
            if argv[0] == "bench":
                extra += ["--set", "max_steps=1", "--set", "task.num_eval=8", "--out", str(tmp_path / "bench")]
                extra += [x for kv in bench_knobs.get(argv[1], []) for x in ("--set", kv)]
        own_knobs = {  # benchmarks with their own settings rather than a run config
            "rewards": ["math_samples=8", "code_samples=2", "workers=[1]"],
            "packing": ["num_sequences=16", "max_len=32", "steps=1", "micro_batch_tokens=64", "pack_tokens=32",
                    "row_tokens=128", "row_repeats=1"],  # the 1k-token row alone was 80 s of this test
            "optimizers": ["steps=2", "eval_every=2", "batch_size=2", "seq_len=16", "eval_windows=2",
                           "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64"],
            "quickstart": [*TINY, "task.num_eval=8", "seeds=[0,1]", "steps=2"],  # 2 seeds, not 10 runs
            # 2 tasks x group_size 2 episodes per arm, one warm-up and one measured repetition (not 4 x 32 x 2 x 2)
            "harness": [*TINY, "task.num_eval=8", "prompts=2", "reps=1"],
            "real": ["frameworks=[tidal]", "lora_ranks=[]", "engine=false", "max_time_s=1", "snapshot_every_s=0.5",
                     "num_eval=4", "threads=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                     "rollout.max_new_tokens=8", "report_at=[1]"],
        }
        if argv[0] == "bench" and argv[1] in own_knobs:
            extra = [x for kv in own_knobs[argv[1]] for x in ("--set", kv)] + ["--out", str(tmp_path / "bench")]
        if argv[0] == "eval":
            extra = ["--set", "num_eval=8"]
        if "<" in argv:  # stdin redirection: feed the file the command names
            stdin_path = argv[argv.index("<") + 1]
            (tmp_path / stdin_path).write_text('{"response": "so \\\\boxed{12}", "answer": "12"}\n')
            monkeypatch.setattr("sys.stdin", open(tmp_path / stdin_path))
            argv = argv[: argv.index("<")]
        code = main(argv + extra)
        assert code == 0, f"`tidal {' '.join(argv)}` failed: {capsys.readouterr().err}"


@pytest.mark.parametrize("cmd", ["make run", "make test"])
def test_makefile_targets_exist(cmd):
    makefile = (README.parent / "Makefile").read_text()
    assert re.search(rf"^{cmd.split()[1]}:", makefile, flags=re.M)
