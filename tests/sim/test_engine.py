import pytest

from tidal.sim.costs import CostModel, decode_time, engine_costs, steps_until, train_time
from tidal.sim.engine import SimEngine


def test_decode_time_sums_the_steps_in_closed_form():
    c = CostModel(decode_step_s=1.0, decode_per_seq_s=0.1, decode_per_ctx_token_s=0.01)
    n, ctx, steps = 3, 20, 4
    by_hand = sum(1.0 + 0.1 * n + 0.01 * (ctx + n * i) for i in range(steps))
    assert decode_time(c, n, ctx, steps, speed=2.0) == pytest.approx(by_hand / 2)


def test_measured_costs_replace_the_scaling_law_at_their_device_count():
    c = CostModel(decode_step_s=1.0, decode_per_seq_s=0.2, gen_scaling=1.0,
                  measured={2: {"decode_step_s": 1.5, "decode_per_seq_s": 0.1}})
    two, speed2 = engine_costs(c, 2)  # measured: a second thread costs fixed time, halves per-row work
    assert speed2 == 1.0 and two.decode_step_s == 1.5 and two.decode_per_seq_s == 0.1
    assert decode_time(two, 1, 0, 1, speed2) == pytest.approx(1.6)  # the tail is slower, not 2x faster
    four, speed4 = engine_costs(c, 4)  # not measured: the law
    assert four is c and speed4 == 4.0


def test_steps_until_lands_on_the_boundary_at_or_after_the_event():
    c = CostModel(decode_step_s=1.0)
    assert steps_until(c, 1, 0, 2.5, 1.0, 10) == 3
    assert steps_until(c, 1, 0, 3.0, 1.0, 10) == 3
    assert steps_until(c, 1, 0, 50.0, 1.0, 10) == 10  # never past the next finish
    assert steps_until(c, 1, 0, 0.0, 1.0, 10) == 0


def test_train_time_counts_padding_only_when_asked():
    c = CostModel(train_step_s=1.0, train_per_token_s=0.5, train_per_token_ctx_s=0.25)
    assert train_time(c, [2, 4], 1.0) == pytest.approx(1 + 0.5 * 6 + 0.25 * (4 + 16) / 2)
    padded = CostModel(train_per_token_s=1.0, train_padded=True)
    assert train_time(padded, [2, 4], 2.0) == pytest.approx(2 * 4 / 2)


def test_rows_leave_the_batch_as_they_finish():
    e = SimEngine(CostModel(decode_step_s=1.0, decode_per_seq_s=1.0), speed=1.0, max_batch=4)
    e.admit([(0, [1, 3]), (1, [2, 2])], prompt_len=0)
    assert e.next_finish_time() == pytest.approx(1 * (1 + 4))
    done = e.advance_to_next_finish()
    assert [(r.group, r.length) for r in done] == [(0, 1)] and e.n == 3
    done = e.advance_to_next_finish()  # one step of 3 rows: both length-2 rows finish
    assert sorted(r.group for r in done) == [1, 1] and e.t == pytest.approx(5 + 4)
    e.advance_to_next_finish()
    assert e.n == 0 and e.t == pytest.approx(9 + 2) and e.row_steps == 1 + 3 + 2 + 2  # one per token


def test_an_interruption_lands_on_a_step_boundary_and_re_prefills_everything():
    c = CostModel(decode_step_s=1.0, prefill_per_token_s=0.5, weight_load_s=2.0)
    e = SimEngine(c, speed=1.0, max_batch=8)
    e.admit([(0, [10, 10])], prompt_len=3)  # prefill: one shared prompt of 3 tokens
    assert e.t == pytest.approx(1.5)
    e.advance_to_boundary(4.2)  # 1.5 + 3 steps = 4.5 is the first boundary at or after 4.2
    assert e.t == pytest.approx(4.5) and e.step == 3
    e.load_weights(version=1)
    # context: 2 rows x (3 prompt + 3 generated) = 12 tokens re-read
    assert e.t == pytest.approx(4.5 + 2.0 + 0.5 * 12) and e.version == 1 and e.interruptions == 1
    assert e.update_s == pytest.approx(2.0 + 6.0)
