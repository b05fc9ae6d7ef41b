import random
import threading

import pytest

from tidal.system.buffer import BufferClosed, RolloutBuffer
from tidal.system.staleness import StalenessManager, capacity


def test_capacity_rule_hand_computed():
    # B=4 groups/step, eta=1: at version 0 up to 8 groups may start; at version 2, 16.
    assert capacity(0, 0, 4, 1) == 8
    assert capacity(0, 8, 4, 1) == 0
    assert capacity(2, 8, 4, 1) == 8
    assert capacity(0, 0, 4, 0) == 4  # eta = 0: exactly one batch ahead of nothing: synchronous


@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("seed", range(5))
def test_staleness_bound_never_exceeded_under_random_schedule(eta, seed):
    """Randomly interleave admissions, generation progress (version changes mid-sample) and
    training; every trained sample's staleness must be <= eta and no sample may be dropped."""
    rng = random.Random(seed)
    b = rng.randint(1, 5)
    mgr = StalenessManager(groups_per_step=b, max_staleness=eta)
    in_flight: dict[int, int] = {}  # group index -> oldest version (version when its first token was sampled)
    done: dict[int, int] = {}
    next_group, step = 0, 0
    while step < 40:
        action = rng.random()
        if action < 0.4:
            n = mgr.admit(rng.randint(1, 2 * b), timeout=0)
            for _ in range(n):
                in_flight[next_group] = mgr.version  # first token sampled at the current version
                next_group += 1
        elif action < 0.7 and in_flight:
            g = rng.choice(list(in_flight))
            done[g] = in_flight.pop(g)
        else:
            batch = range(step * b, (step + 1) * b)
            if all(g in done for g in batch):
                for g in batch:
                    assert step - done.pop(g) <= eta
                step += 1
                mgr.set_version(step)
    assert mgr.num_admitted == next_group


def test_admit_blocks_until_a_new_version():
    mgr = StalenessManager(groups_per_step=2, max_staleness=0)
    assert mgr.admit(5) == 2
    got = []
    t = threading.Thread(target=lambda: got.append(mgr.admit(5)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got
    mgr.set_version(1)
    t.join(2)
    assert got == [2]


def test_ceiling_caps_indices_even_when_releases_give_slots_back():
    """Step 0 (2 groups, draw limit 4) drops three groups: the third release must not start group 4,
    which belongs to step 1 (sync draws it after step 0's update)."""
    mgr = StalenessManager(groups_per_step=2, max_staleness=0, next_index=0)
    mgr.set_ceiling(4)
    assert mgr.admit(5) == 2  # groups 0, 1
    mgr.release()
    mgr.release()
    assert mgr.admit(5) == 2 and mgr.next_index == 4  # replacements 2, 3: the draw limit
    mgr.release()  # group 2 dropped too: its slot is free, but index 4 is past the ceiling
    assert mgr.admit(5, timeout=0) == 0
    mgr.charge(1)  # the step trained 1 group, short by 1
    mgr.set_ceiling(4 + 4)
    assert mgr.admit(5, timeout=0) == 0  # still version 0: nothing for step 1 yet
    mgr.set_version(1)
    assert mgr.admit(5, timeout=0) == 2 and mgr.next_index == 6  # step 1's two groups, 4 and 5


def test_close_releases_waiters():
    mgr = StalenessManager(groups_per_step=1, max_staleness=0)
    mgr.admit(1)
    got = []
    t = threading.Thread(target=lambda: got.append(mgr.admit(1)))
    t.start()
    mgr.close()
    t.join(2)
    assert got == [0]


def test_buffer_returns_contiguous_batches_in_order_and_surfaces_failures():
    buf = RolloutBuffer()
    for i in (2, 0, 1, 3):
        buf.put(i, f"g{i}")
    assert buf.take(0, 2) == ["g0", "g1"]
    assert buf.take(2, 2) == ["g2", "g3"]
    with pytest.raises(TimeoutError):
        buf.take(4, 1, timeout=0.01)
    buf.fail(ValueError("engine died"))
    with pytest.raises(BufferClosed) as err:
        buf.take(4, 1)
    assert isinstance(err.value.__cause__, ValueError)

