"""``tidal train`` over bad inputs and interruptions, run as a user runs it (a subprocess with a time limit).

A bad value or an unusable ``--out`` is a non-zero exit, exactly one ``error:`` line on stderr naming the
key or path, no traceback, and nothing written. A directory holding a previous run is never overwritten
by accident, and ``--overwrite`` deletes it only once every input of the new run has been checked.
Ctrl-C is one line naming the checkpoint and the exact command that resumes it (exit 130); ``kill -9``
leaves no helper process behind, and the resumed run logs each step once. A checkpoint
that cannot be written (a full disk) is one line, and leaves a directory that ``--overwrite`` restarts.
Every run is the tiny model for a few steps, so each case takes seconds.
"""

import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import forked_cli

TIMEOUT_S = 120
TINY = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
    "model.intermediate_size=64", "sft.steps=2", "sft.accuracy_band=null", "sft.batch_size=16",
    "reward.name=digit_match", "reward.num_workers=0", "rollout.group_size=4", "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=4", "max_steps=4", "max_time_s=null", "target_accuracy=null", "eval_every=2",
    "num_eval=16", "checkpoint_every=2", "system.num_threads=1", "system.mode=sync", "log.progress=false",
    "log.tensorboard=false", "log.report=false"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The warm-started tiny base, built once (later runs only read it)."""
    d = tmp_path_factory.mktemp("cache")
    proc = _start(d / "warm", [], d, "max_steps=1")
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    return d


def _argv(out: Path, extra: list[str], cache: Path, *sets: str, recipe: str = "quickstart_grpo") -> list[str]:
    sets_ = [a for s in [*TINY, f"sft.cache_dir={cache}", *sets] for a in ("--set", s)]
    return [sys.executable, "-m", "tidal.cli", "train", recipe, "--out", str(out), *sets_, *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _start(out: Path, extra: list[str], cache: Path, *sets: str, recipe: str = "quickstart_grpo", **kw):
    return subprocess.Popen(_argv(out, extra, cache, *sets, recipe=recipe), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True, **kw)


def _train(out: Path, extra: list[str], cache: Path, *sets: str, recipe: str = "quickstart_grpo",
           **kw) -> subprocess.CompletedProcess:
    """A run to its end. Forked from a process that imported torch and transformers once (``forked_cli``:
    a process of its own all the same); with Popen keywords (``preexec_fn``), a fresh interpreter."""
    if not kw:
        return forked_cli.run(_argv(out, extra, cache, *sets, recipe=recipe)[3:], env=_env(), stdin=b"",
                              timeout=TIMEOUT_S, text=True)
    proc = _start(out, extra, cache, *sets, recipe=recipe, **kw)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _tidal(*argv: str) -> subprocess.CompletedProcess:
    """``tidal <argv>`` to its end, forked as ``_train`` runs are."""
    return forked_cli.run(list(argv), env=_env(), stdin=b"", timeout=TIMEOUT_S, text=True)


def _one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode not in (0, None), proc.stdout[-500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


BAD_VALUES = [  # a run that used to crash with a traceback, spin forever, or train nothing and exit 0
    ("rollout.group_size=0", "rollout.group_size"),  # ZeroDivisionError, then BufferClosed
    ("rollout.group_size=-1", "rollout.group_size"),  # spun at 100% CPU forever
    ("rollout.group_size=1", "rollout.group_size"),  # trained nothing, exit 0
    ("rollout.prompts_per_step=0", "rollout.prompts_per_step"),  # trained nothing, exit 0
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),  # trained nothing, exit 0
    ("rollout.max_batch_size=2", "rollout.max_batch_size"),  # smaller than the group: spun forever
    ("optim.betas=[0.9]", "optim.betas"),  # IndexError
    ("rollout.temperature=-1", "rollout.temperature"),  # said "trainer.temperature must equal ..."
    ("reward.num_workers=-3", "reward.num_workers"),  # silently ran 1 worker
    ("system.device=tpu", "system.device"),
    ("trainer.precision=fp16", "trainer.precision"),
    ("rollout.dtype=int8", "rollout.dtype"),
    ("rollout.cuda_graphs=yes", "rollout.cuda_graphs"),
    # a GPU asked for on a machine without one: one line, not a CUDA traceback after the warm start
    *([("system.device=cuda", "system.device")] if not torch.cuda.is_available() else []),
]


@pytest.mark.parametrize("override,key", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_the_key_before_any_work(tmp_path, override, key):
    proc = _train(tmp_path / "run", [], tmp_path / "cache", override, "system.mode=async")
    assert _one_error_line(proc, key).startswith(f"error: {key}")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists(), "it did work before failing"


@pytest.mark.parametrize("sets,message", [
    (['rollout.thinking.close=""'], "encodes to no tokens"),  # was an AssertionError traceback, after files
    (["rollout.thinking.close=", "rollout.thinking.budgets=[2]"], "encodes to no tokens"),
    (["rollout.thinking.close=</THINK>", "rollout.thinking.budgets=[2]"],  # was forced as <pad> tokens, silently
     "has characters the tokenizer cannot encode: ['H', 'I', 'K', 'N', 'T']"),
    (["rollout.thinking.close=</THINK>", "rollout.thinking.eval_budget=4"], "cannot encode"),
], ids=["empty", "empty-with-budget", "unknown-characters", "unknown-characters-eval-budget"])
def test_a_thinking_close_the_model_cannot_write_is_one_line_before_any_work(tmp_path, sets, message):
    proc = _train(tmp_path / "run", [], tmp_path / "cache", *sets)
    assert _one_error_line(proc, message).startswith("error: rollout.thinking.close=")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists(), "it did work before failing"


@pytest.mark.parametrize("where,message", [
    ("a_file", "is a file, not a directory"),  # FileExistsError
    ("/sys/tidal-test-run", "cannot write a run there"),  # a read-only place (OSError)
    ("/dev/null/run", "cannot write a run there (Not a directory)"),
])
def test_an_unusable_out_is_one_line(tmp_path, where, message):
    (tmp_path / "a_file").write_text("a user's file")
    out = tmp_path / where if not where.startswith("/") else Path(where)
    _one_error_line(_train(out, [], tmp_path / "cache"), message)
    assert (tmp_path / "a_file").read_text() == "a user's file"


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


JSONL = ("task.name=jsonl", "task.eval_fraction=0.25")
OVERWRITE_BAD_INPUTS = [  # (id, overrides with {d}: a scratch directory, what the error line names)
    ("task-path-missing", [*JSONL, "task.path={d}/nope.jsonl"], "task.path='{d}/nope.jsonl': no .jsonl"),
    ("task-path-empty", [*JSONL, "task.path={d}/empty.jsonl"], "empty.jsonl): no rows"),
    ("task-row-not-in-vocabulary", [*JSONL, "task.path={d}/accents.jsonl", "model.path=null"],
     "characters the tokenizer cannot encode"),
    ("task-no-warm-start-solution", [*JSONL, "task.path={d}/no_solution.jsonl"], "task.fields.solution"),
    ("harness-function-missing", ["harness.function={d}/nope.py:run_episode"], "harness.function="),
    ("thinking-close-unknown-tokens", ["rollout.thinking.close=</THINK>", "rollout.thinking.budgets=[2]"],
     "rollout.thinking.close"),
    ("reward-unknown-parameter", ["reward.params.nope=1"], "reward 'digit_match' takes no parameters"),
    ("env-unknown-parameter", ["env.name=calculator", "env.params.nope=1"], "env.params for 'calculator'"),
]


@pytest.mark.parametrize("sets,message", [pytest.param(*c[1:], id=c[0]) for c in OVERWRITE_BAD_INPUTS])
def test_overwrite_deletes_nothing_when_an_input_is_bad(tmp_path, cache, sets, message):
    """Every input the run reads is checked before --overwrite deletes the previous run: these inputs used
    to be met only after it had been deleted."""
    (tmp_path / "empty.jsonl").write_text("")
    _rows(tmp_path / "accents.jsonl", [{"prompt": f"caf\u00e9 {i}", "answer": "1"} for i in range(8)])
    _rows(tmp_path / "no_solution.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)])
    out = tmp_path / "run"
    shutil.copytree(cache / "warm", out)  # a finished run: metrics, checkpoint, config, samples
    before = _files(out)
    proc = _train(out, ["--overwrite"], cache, *(s.replace("{d}", str(tmp_path)) for s in sets))
    _one_error_line(proc, message.replace("{d}", str(tmp_path)))
    assert _files(out) == before, "the previous run was changed"


def test_resume_and_overwrite_together_are_refused(tmp_path):
    _one_error_line(_train(tmp_path / "run", ["--resume", "--overwrite"], tmp_path / "cache"), "--overwrite")


def test_resume_of_a_missing_directory_is_one_line_and_creates_nothing(tmp_path):
    _one_error_line(_train(tmp_path / "run", ["--resume"], tmp_path / "cache"), "does not exist")
    assert not (tmp_path / "run").exists()


def test_a_missing_yaml_config_or_a_directory_is_one_line(tmp_path):
    proc = _train(tmp_path / "run", [], tmp_path / "cache", recipe=str(tmp_path / "nope.yaml"))
    _one_error_line(proc, "nope.yaml: no such config file")
    (tmp_path / "old_run").mkdir()
    proc = _train(tmp_path / "run", [], tmp_path / "cache", recipe=str(tmp_path / "old_run"))
    _one_error_line(proc, "old_run is a directory", "old_run/config.yaml", "--resume")
    assert not (tmp_path / "run").exists()


def test_metrics_without_a_checkpoint_are_kept_unless_overwrite(tmp_path, cache):
    """A run stopped before its first checkpoint left metrics.jsonl (and a failed save's .tmp leftover):
    a new run used to overwrite them silently; --resume has nothing to continue; --overwrite restarts."""
    out = tmp_path / "run"
    (out / "checkpoints" / ".tmp_step_2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    (out / "notes.txt").write_text("a user's file")
    _one_error_line(_train(out, [], cache), "metrics.jsonl", "no checkpoint", "--overwrite")
    _one_error_line(_train(out, ["--resume"], cache), "no checkpoint")
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "eval/accuracy": 0.5}\n'

    proc = _train(out, ["--overwrite"], cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"--overwrite: deleted the previous run's metrics.jsonl, checkpoints/ from {out}"]
    assert _steps(out) == [0, 1, 2, 3, 4] and (out / "notes.txt").read_text() == "a user's file"
    assert not list((out / "checkpoints").glob(".tmp_*"))

    _one_error_line(_train(out, [], cache), "already holds a run", "checkpoints/step_4", "--resume")


def test_ctrl_c_is_one_line_with_the_resume_command_and_exit_130(tmp_path, cache):
    """Ctrl-C at a terminal signals the whole process group (reward workers included)."""
    out = tmp_path / "run"
    proc, err = _signal_after_two_steps(out, cache, signal.SIGINT)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = err.strip().splitlines()
    saved = (out / "checkpoints" / "latest").read_text()
    assert line == (f"interrupted; checkpoint saved in {out / 'checkpoints' / saved}; resume with: "
                    f"tidal train quickstart_grpo --out {out} --resume")
    step = int(saved.removeprefix("step_"))

    command = shlex.split(line.split("resume with: ")[1])
    assert command[:2] == ["tidal", "train"]
    resumed = _tidal(*command[1:], "--set", f"max_steps={step + 2}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["steps"] == step + 2 and summary["base_accuracy"] is not None  # was null after a resume
    assert _steps(out) == list(range(step + 3))


@pytest.mark.slow  # ~5 s; by default SIGTERM's exit 143 and its "interrupted; checkpoint saved in" line are checked by
# test_sigterm_stops_an_agent_run_with_episodes_in_flight, the checkpoint and the steps logged once by the Ctrl-C test
def test_sigterm_checkpoints_and_says_how_to_resume(tmp_path, cache):
    """A scheduler's SIGTERM (sent to the whole job) stops the run as Ctrl-C does, with exit 143."""
    out = tmp_path / "run"
    proc, err = _signal_after_two_steps(out, cache, signal.SIGTERM)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted; checkpoint saved in "), err
    saved = int((out / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert saved >= 2 and _steps(out) == list(range(saved + 1))


def test_sigterm_stops_an_agent_run_with_episodes_in_flight(tmp_path, cache):
    out = tmp_path / "run"
    proc, err = _signal_after_two_steps(out, cache, signal.SIGTERM, "task.name=sum_chain", "env.name=calculator",
                                        "rollout.max_new_tokens=8")
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("interrupted; checkpoint saved in "), err[-3000:]


def _signal_after_two_steps(out: Path, cache: Path, sig: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """An async run with a reward worker, sent ``sig`` on its whole process group (as a terminal's Ctrl-C
    or a scheduler does) once it has logged two steps; returns the process and its stderr."""
    proc = _start(out, [], cache, "max_steps=1000", "reward.num_workers=1", "system.mode=async", *extra)
    try:
        _wait_for_steps(out, 2, proc)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, err


def _wait_for_steps(out: Path, n: int, proc) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(_steps(out)) > n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not log {n} steps: {proc.poll()}")


def _group(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes through /proc")
def test_kill_9_leaves_no_helper_process_and_the_resumed_run_logs_each_step_once(tmp_path, cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    opts = ("max_steps=1000", "reward.num_workers=1", "checkpoint_every=3", "log.tensorboard=true")
    proc = _start(out, [], cache, *opts)
    try:
        _wait_for_steps(out, 4, proc)  # a checkpoint at step 3, steps after it logged
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT_S)
        deadline = time.monotonic() + 15
        while _group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _group(proc.pid)
    finally:
        for pid in _group(proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"helper processes outlived the run: {left}"
    logged = _steps(out)[-1]  # past the last checkpoint unless the kill landed right after one
    assert logged >= int((out / "checkpoints" / "latest").read_text().removeprefix("step_")) >= 3

    resumed = _train(out, ["--resume"], cache, *opts[1:], f"max_steps={logged + 1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["base_accuracy"] is not None
    assert _steps(out) == list(range(logged + 2))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("reward/mean")]
    assert steps == list(range(1, logged + 2)), f"TensorBoard holds a step twice: {steps}"


def _disk_full_at(limit: int):
    def preexec():  # writes past `limit` bytes fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_overwrite_restarts(tmp_path, cache):
    out = tmp_path / "run"
    proc = _train(out, [], cache, preexec_fn=_disk_full_at(20_000))  # the policy alone is ~50 kB
    line = _one_error_line(proc, f"could not write checkpoint {out / 'checkpoints' / 'step_2'}",
                           "no earlier checkpoint exists")
    assert "File too large" in line
    assert not list((out / "checkpoints").iterdir()), "a failed save left files behind"
    _one_error_line(_train(out, [], cache), "metrics.jsonl", "no checkpoint", "--overwrite")
    assert _train(out, ["--overwrite"], cache).returncode == 0
    assert (out / "checkpoints" / "latest").read_text() == "step_4"


def test_a_saved_config_yaml_reproduces_its_run(tmp_path, cache):
    first = _train(tmp_path / "a", [], cache, "max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _tidal("train", str(tmp_path / "a" / "config.yaml"), "--out", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "b" / "config.yaml").read_text() == (tmp_path / "a" / "config.yaml").read_text()
    rows = [[{k: v for k, v in json.loads(x).items() if k.startswith(("step", "reward/", "eval/", "train/loss"))}
             for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    assert rows[0] == rows[1] and len(rows[0]) == 3

    more = _tidal("train", str(tmp_path / "a" / "config.yaml"), "--out", str(tmp_path / "c"), "--set", "max_steps=3")
    assert more.returncode == 0 and json.loads(more.stdout)["steps"] == 3, more.stderr[-3000:]


def test_progress_bars_stay_out_of_redirected_logs(tmp_path, cache):
    proc = _train(tmp_path / "run", [], cache, "log.progress=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr and "RL (sync)" not in proc.stderr, proc.stderr[-2000:]
    # a cold cache: the warm start's bar (with its accuracy checks) stays out of the log too
    cold = _train(tmp_path / "cold", [], tmp_path / "cold-cache", "log.progress=true", "sft.steps=20",
                  "sft.accuracy_band=[0.0, 1.0]", "sft.check_every=5")
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert "\r" not in cold.stderr and "warm start" not in cold.stderr, cold.stderr[-2000:]


def test_overwrite_of_the_run_model_path_points_into_deletes_nothing(tmp_path, cache):
    """Issue 50 item 1: ``check_inputs`` did not look at where model.path is, so ``--overwrite`` deleted the
    checkpoint it named before the run failed to load it."""
    out = tmp_path / "run"
    shutil.copytree(cache / "warm", out)
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    before = _files(out)
    proc = _train(out, ["--overwrite"], cache, f"model.path={ckpt}")
    _one_error_line(proc, f"error: model.path={ckpt} is (or holds) the previous run's ", "--overwrite would delete")
    after = _files(out)
    after.pop(".tidal_lock"), before.pop(".tidal_lock")  # it took the lock (the file holds its pid), then refused
    assert after == before, "the previous run was changed"


def test_overwrite_keeps_a_users_file_in_checkpoints_and_a_second_process_is_refused(tmp_path, cache):
    """Issue 50 items 2 and 5: --overwrite deleted all of checkpoints/; a second process on a run being written
    (a --resume while the first still wrote) wrote into it too."""
    from tidal.system.run_dir import TRAIN
    from tidal.utils.outputs import RunDir

    out = tmp_path / "run"
    shutil.copytree(cache / "warm", out)
    (out / "checkpoints" / "rows.jsonl").write_text("a user's rows\n")
    with RunDir.open(out, TRAIN, resume=True):  # another process, still writing
        _one_error_line(_train(out, ["--resume"], cache), f"{out} is being written by another tidal process "
                                                          f"(pid {os.getpid()})")
    proc = _train(out, ["--overwrite"], cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kept 1 file(s) tidal did not write: checkpoints/rows.jsonl" in proc.stderr.splitlines()[0]
    assert (out / "checkpoints" / "rows.jsonl").read_text() == "a user's rows\n"
    assert _steps(out) == [0, 1, 2, 3, 4]
