import time

import pytest

from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.types import Prompt

P = Prompt("u", "1+1=", "2")


def slow_or_bad(response: str, prompt: Prompt):
    if response == "hang":
        time.sleep(30)
    if response == "boom":
        raise ValueError("bad input")
    return float(response == prompt.answer), {}


def test_exact_match():
    fn = build_reward("exact_match")
    assert fn(" 2 ", P)[0] == 1.0
    assert fn("3", P)[0] == 0.0
    assert fn("22", P)[0] == 0.0


@pytest.mark.parametrize("workers", [0, 1])
def test_pool_scores_in_order_and_survives_errors(workers):
    pool = RewardPool(slow_or_bad, RewardConfig(num_workers=workers, timeout_s=5))
    try:
        out = pool.score([("2", P), ("boom", P), ("1", P)])
    finally:
        pool.close()
    assert [r for r, _ in out] == [1.0, 0.0, 0.0]
    assert "ValueError" in out[1][1]["error"]
    assert pool.num_errors == 1


def test_pool_times_out_a_hanging_verifier_and_keeps_going():
    pool = RewardPool(slow_or_bad, RewardConfig(num_workers=2, timeout_s=1.0))
    try:
        start = time.monotonic()
        out = pool.score([("2", P), ("hang", P), ("2", P), ("x", P)])
        elapsed = time.monotonic() - start
        again = pool.score([("2", P)])  # the pool was restarted and still works
    finally:
        pool.close()
    assert [r for r, _ in out] == [1.0, 0.0, 1.0, 0.0]
    assert out[1][1]["error"] == "timeout"
    assert pool.num_timeouts == 1
    assert elapsed < 10, elapsed
    assert again[0][0] == 1.0


def test_a_script_without_main_guard_gets_a_clear_error(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(
        "from tidal.rewards import build_reward\n"
        "from tidal.rewards.pool import RewardConfig, RewardPool\n"
        "from tidal.types import Prompt\n"
        "RewardPool(build_reward('exact_match'), RewardConfig(num_workers=1)).score([('1', Prompt('a', 'q', '1'))])\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr.splitlines()[-1]


def test_chunks_fall_back_to_items_around_a_hang():
    """Many cheap items go in chunks; the chunk holding a hanging item misses its deadline and is
    re-scored item by item, so only that item times out and every other result is in place."""
    pool = RewardPool(slow_or_bad, RewardConfig(num_workers=2, timeout_s=1.0))
    try:
        pool.score([("2", P)] * 20)  # learn the item time: later chunks are large
        assert pool._chunk_size(200) > 4
        items = [("2" if i % 3 else "x", P) for i in range(60)]
        items[37] = ("hang", P)
        out = pool.score(items)
    finally:
        pool.close()
    want = [0.0 if i == 37 else float(i % 3 != 0) for i in range(60)]
    assert [r for r, _ in out] == want
    assert out[37][1]["error"] == "timeout" and pool.num_timeouts == 1


@pytest.mark.parametrize("cfg", [RewardConfig(num_workers=-3), RewardConfig(timeout_s=0)])
def test_a_negative_worker_count_or_no_time_is_an_error_naming_the_key(cfg):
    from tidal.config import ConfigError

    with pytest.raises(ConfigError, match="reward.num_workers must be >= 0 and reward.timeout_s > 0"):
        RewardPool(slow_or_bad, cfg)


def test_workers_exit_when_the_parent_dies():
    """kill -9 of the run must not leave its reward workers idling forever (they watch their parent)."""
    import os
    import subprocess
    import sys

    script = ("import os, sys, time\n"
              "from tidal.rewards import build_reward\n"
              "from tidal.rewards.pool import RewardConfig, RewardPool\n"
              "from tidal.types import Prompt\n"
              "if __name__ == '__main__':\n"
              "    pool = RewardPool(build_reward('exact_match'), RewardConfig(num_workers=2))\n"
              "    pool.score([('2', Prompt('u', '1+1=', '2'))])\n"
              "    print(' '.join(str(p.pid) for p in pool._executor._processes.values()), flush=True)\n"
              "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in proc.stdout.readline().split()]
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in workers if os.path.exists(f"/proc/{p}") or _signalable(p)]
    for p in alive:
        os.kill(p, 9)
    assert not alive, f"reward workers outlived their parent: {alive}"


def _signalable(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
