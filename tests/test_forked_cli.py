"""``tests/forked_cli.py`` gives what a fresh ``python -m tidal.cli`` gives: exit code, stdout, stderr, and a
process of its own that a signal to its group reaches."""

import os
import signal
import subprocess
import sys

from tests import forked_cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _fresh(argv, cwd):
    return subprocess.run([sys.executable, "-m", "tidal.cli", *argv], capture_output=True, env=ENV, cwd=cwd,
                          timeout=120)


def test_a_bad_value_and_help_match_a_fresh_interpreter(tmp_path):
    for argv in (["train", "quickstart_grpo", "--out", str(tmp_path / "run"), "--set", "rollout.group_size=0"],
                 ["train", "--help"], ["no-such-command"]):
        fresh, forked = _fresh(argv, tmp_path), forked_cli.run(argv, env=ENV, cwd=tmp_path, timeout=120)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and b"invalid choice" in forked.stderr


def test_a_signal_to_its_group_ends_it_and_only_it(tmp_path):
    proc = forked_cli.start(["train", "quickstart_grpo", "--out", str(tmp_path / "run"), "--set", "max_steps=1000",
                             "--set", f"sft.cache_dir={tmp_path / 'cache'}", "--set", "log.progress=false"], env=ENV,
                            cwd=tmp_path)
    assert proc.poll() is None
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)  # a session of its own, as start_new_session gives
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    assert forked_cli.run(["--help"], env=ENV, timeout=60).returncode == 0  # the server goes on
