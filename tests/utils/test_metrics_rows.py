"""Reading a run's metrics.jsonl back on resume (utils/metrics.py): the rows through the checkpoint's step,
skipping a row torn by the crash, and the last logged step."""

from tidal.utils.metrics import last_logged_step, logged_rows


def test_logged_rows_keep_the_steps_through_the_checkpoint_and_skip_torn_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval/accuracy": 0.5}\n{"step": 1, "loss": 2.0}\n[1, 2]\n'
                    '{"step": "2"}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert logged_rows(path, 1) == [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "loss": 2.0}]
    assert [r["step"] for r in logged_rows(path, 5)] == [0, 1, 2]
    assert logged_rows(tmp_path / "missing.jsonl", 3) == []


def test_last_logged_step_is_none_for_a_torn_or_missing_last_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_logged_step(path) is None
    path.write_text('{"step": 0}\n{"step": 4, "loss": 1.0}\n')
    assert last_logged_step(path) == 4
    path.write_text('{"step": 0}\n{"step": 5, "lo')
    assert last_logged_step(path) is None
