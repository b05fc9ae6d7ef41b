import json

import numpy as np
import pytest

from tidal.sim.lengths import Cycle, GroupStream, LengthStream, LogNormal, one_over_n, parse_lengths, read_lengths


def test_one_over_n_is_the_repeat_task_law():
    d = one_over_n(48)
    # tasks/arithmetic.py: n in 1..48 with max(1, round(48 / n)) copies; the response is n letters + EOS.
    weights = {n: max(1, round(48 / n)) for n in range(1, 49)}
    assert d.mean == pytest.approx(sum((n + 1) * w for n, w in weights.items()) / sum(weights.values()))
    assert d.max == 49 and min(d.values) == 2


def test_specs_parse_and_bad_specs_say_why():
    assert parse_lengths("constant:7").mean == 7
    b = parse_lengths("bimodal:10,100,0.25")
    assert b.mean == pytest.approx(0.75 * 10 + 0.25 * 100) and b.max == 100
    assert parse_lengths("cycle:3,5").mean == 4
    assert isinstance(parse_lengths("lognormal:1000,1.0,4000"), LogNormal)
    with pytest.raises(ValueError, match="unknown length distribution 'zipf'"):
        parse_lengths("zipf:3")
    with pytest.raises(ValueError, match="bad length spec"):
        parse_lengths("bimodal:10")


def test_lognormal_keeps_its_mean_and_clips_the_tail():
    d = LogNormal(1000, 0.5, 10_000)
    x = d.sample(np.random.default_rng(0), 200_000)
    assert x.mean() == pytest.approx(1000, rel=0.01) and x.max() <= 10_000 and x.min() >= 1
    clipped = LogNormal(1000, 1.0, 2000).sample(np.random.default_rng(0), 100_000)
    assert (clipped == 2000).mean() > 0.05  # the truncated responses all take the cap


def test_streams_are_reproducible_and_cycles_exact():
    a, b = LengthStream(one_over_n(48), seed=3), LengthStream(one_over_n(48), seed=3)
    assert [a[i] for i in range(10_000)] == [b[i] for i in reversed(range(10_000))][::-1]
    assert [LengthStream(Cycle((5, 1)), 0)[i] for i in range(4)] == [5, 1, 5, 1]


def test_read_lengths_formats(tmp_path):
    (tmp_path / "a.json").write_text("[3, 4]")
    (tmp_path / "b.json").write_text(json.dumps({"values": [2, 9], "weights": [2, 1]}))
    (tmp_path / "c.jsonl").write_text('{"num_tokens": 5}\n{"token_ids": [1, 2]}\n')
    (tmp_path / "d.txt").write_text("7\n8\n")
    assert read_lengths(tmp_path / "a.json") == [3, 4]
    assert read_lengths(tmp_path / "b.json") == [2, 2, 9]
    assert read_lengths(tmp_path / "c.jsonl") == [5, 2]
    assert read_lengths(tmp_path / "d.txt") == [7, 8]
    assert parse_lengths(f"empirical:{tmp_path / 'd.txt'}").mean == 7.5


def test_group_stream_draws_recorded_groups_whole(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"groups": [{"lengths": [1, 2], "informative": True},
                                           {"lengths": [9, 9], "informative": False}]}))
    stream = GroupStream(f"groups:{path}", group_size=2, seed=0)
    drawn = [stream[i] for i in range(200)]
    assert set(map(lambda g: (tuple(g[0]), g[1]), drawn)) == {((1, 2), True), ((9, 9), False)}
    assert drawn == [GroupStream(f"groups:{path}", 2, seed=0)[i] for i in range(200)]
    with pytest.raises(AssertionError, match="group_size=3"):
        GroupStream(f"groups:{path}", group_size=3)


def test_drop_prob_marks_that_share_of_groups_uninformative():
    stream = GroupStream("constant:4", group_size=2, drop_prob=0.3, seed=0)
    kept = [stream[i][1] for i in range(5000)]
    assert 1 - sum(kept) / len(kept) == pytest.approx(0.3, abs=0.03)
