"""Request bookkeeping of the multi-worker engine, without Ray: placement, requeue, exactly-once; weights as arrays."""

import random

from tidal.api import GenRequest
from tidal.system.dispatch import Dispatch
from tidal.types import Prompt


def requests(num_prompts, group_size, start=0):
    return [GenRequest(Prompt(f"p{start + i}", "1+1=", "2"), (1, 2), j)
            for i in range(num_prompts) for j in range(group_size)]


def test_groups_go_whole_to_the_least_loaded_worker():
    d = Dispatch(capacity=8)
    d.add_worker(0)
    d.add_worker(1)
    d.add(requests(3, 2))
    placed = d.assign()
    assert [[r.prompt.uid for _, r in placed[w]] for w in (0, 1)] == [["p0", "p0", "p2", "p2"], ["p1", "p1"]]
    assert (d.in_flight(0), d.in_flight(1)) == (4, 2)
    assert d.free() == 16 - 6


def test_a_full_worker_waits_and_free_counts_the_queue():
    d = Dispatch(capacity=4)
    d.add_worker(0)
    d.add(requests(3, 2))
    assert sum(map(len, d.assign().values())) == 4
    assert len(d.queue) == 2 and d.free() == -2  # nothing more should be pulled from the source
    rid = next(iter(d.load[0]))
    assert d.complete(0, rid) is not None
    assert d.assign() == {}  # one free row, but the next group needs two
    d.complete(0, next(iter(d.load[0])))
    assert [r.prompt.uid for _, r in d.assign()[0]] == ["p2", "p2"]


def test_a_dead_workers_requests_are_requeued_first_and_delivered_once():
    d = Dispatch(capacity=8)
    for w in (0, 1):
        d.add_worker(w)
    d.add(requests(2, 2))
    placed = d.assign()
    done_on_0 = placed[0][0][0]
    assert d.complete(0, done_on_0) is not None  # delivered before the death: stays delivered
    d.add(requests(1, 2, start=9))  # queued behind the requeued ones
    lost = d.fail(0)
    assert lost == [placed[0][1][0]] and d.num_requeued == 1
    assert list(d.queue)[0] == lost[0]
    assert d.complete(0, lost[0]) is None, "a dead worker's late result must not be delivered"
    again = d.assign()
    assert list(again) == [1] and again[1][0][0] == lost[0]
    assert d.complete(1, lost[0]) is not None
    assert d.complete(1, lost[0]) is None, "never deliver twice"


def test_random_deaths_lose_nothing_and_duplicate_nothing():
    rng = random.Random(0)
    d = Dispatch(capacity=5)
    next_worker = 0
    for _ in range(3):
        d.add_worker(next_worker)
        next_worker += 1
    reqs = requests(40, 3)
    d.add(reqs)
    delivered: list[GenRequest] = []
    while not d.idle:
        d.assign()
        event = rng.random()
        if event < 0.1 and len(d.load) > 1:  # a worker dies; sometimes a replacement joins
            d.fail(rng.choice(d.workers))
            if rng.random() < 0.5:
                d.add_worker(next_worker)
                next_worker += 1
        else:  # a worker finishes some of its requests (maybe also reporting a stale id)
            w = rng.choice(d.workers)
            for rid in rng.sample(sorted(d.load[w]), k=min(2, len(d.load[w]))):
                if (r := d.complete(w, rid)) is not None:
                    delivered.append(r)
            assert d.complete(w, -1) is None
    assert sorted(map(id, delivered)) == sorted(map(id, reqs))
    assert d.num_delivered == len(reqs) and d.num_requeued > 0


def test_weights_cross_the_object_store_as_arrays_and_come_back_exactly():
    import torch

    from tidal.system.ray_engine import from_arrays, to_arrays

    state = {"w": torch.randn(3, 4), "b16": torch.randn(5).to(torch.bfloat16), "i": torch.arange(4)}
    back = from_arrays(to_arrays(state))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in state.items())
