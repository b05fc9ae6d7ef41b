"""Tests for tidal.utils.report: metrics parsing and the self-contained HTML report."""

from __future__ import annotations

import json

from tidal.utils.report import read_metrics, series, write_report


def _write_run(tmp_path, *, garbage: bool = True):
    lines = [json.dumps({"step": 0, "eval/accuracy": 0.25, "eval/response_len_mean": 120.0})]
    for step in range(1, 21):
        row = {
            "step": step,
            "reward/mean": 0.1 + 0.02 * step,
            "rollout/response_len_mean": 100.0 + step,
            "train/entropy": 1.0 - 0.01 * step,
            "train/loss": 0.5,
            "async/staleness_mean": 0.5,
            "async/staleness_max": 1.0,
            "perf/gen_tokens_per_s": 1000.0 + step,
            "perf/trained_samples_per_s": float(step % 4 + 1),
            "perf/step_s": 2.0,
            "time/elapsed_s": 2.0 * step,
        }
        if step % 5 == 0:
            row["eval/accuracy"] = {5: 0.375, 10: 0.625, 15: 0.5625, 20: 0.5}[step]
            row["eval/response_len_mean"] = 110.0
        lines.append(json.dumps(row))
    if garbage:
        lines.append('{"step": 21, "reward/me')  # truncated mid-write
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return lines


def test_full_report(tmp_path):
    _write_run(tmp_path)
    (tmp_path / "config.yaml").write_text("model: tiny\nfilter: len<512 & ok\n")
    out = write_report(tmp_path)
    assert out == tmp_path / "report.html" and out.is_file()
    text = out.read_text(encoding="utf-8")
    assert text.count("data:image/png;base64,") >= 6
    assert f"tidal run report — {tmp_path.name}" in text
    # base accuracy is the value at the lowest step with eval/accuracy (step 0); best is at step 10
    assert "0.25 (step 0)" in text
    assert "0.625 (step 10)" in text
    assert "0.5 (step 20)" in text  # last
    assert "Skipped 1 malformed line" in text
    assert "filter: len&lt;512 &amp; ok" in text
    assert "len<512" not in text
    assert "no data" not in text.lower()


def test_eval_only_report_has_no_data_note(tmp_path):
    rows = [{"step": s, "eval/accuracy": 0.1 * s} for s in (0, 5, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = write_report(tmp_path, title="eval only")
    text = out.read_text(encoding="utf-8")
    assert "<title>eval only</title>" in text
    assert "no data" in text.lower()
    assert "perf/gen_tokens_per_s" in text  # the throughput note names its missing keys
    assert text.count("data:image/png;base64,") == 1  # only the accuracy panel has data
    assert "Skipped" not in text


def test_read_metrics_rows_and_skips(tmp_path):
    lines = _write_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('\n[1, 2]\n{"no_step": 1}\n')
    rows, skipped = read_metrics(tmp_path / "metrics.jsonl")
    assert skipped == 3  # truncated line, non-object, object without step
    assert len(rows) == len(lines) - 1 == 21
    assert rows[0] == {"step": 0, "eval/accuracy": 0.25, "eval/response_len_mean": 120.0}
    steps, acc = series(rows, "eval/accuracy")
    assert steps == [0, 5, 10, 15, 20]
    assert acc == [0.25, 0.375, 0.625, 0.5625, 0.5]
    assert series(rows, "missing/key") == ([], [])
