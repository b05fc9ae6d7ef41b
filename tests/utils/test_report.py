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


def _health_rows():
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    for step in range(1, 13):
        rows.append({
            "step": step, "reward/mean": 0.5, "reward/std": 0.1, "train/loss": 0.1, "train/grad_norm": 1.0,
            "train/lr": 2e-4, "algo/clip_frac": 0.01, "algo/seq_ess": 0.9, "train/logp_mismatch_mean": 1e-6,
            "algo/zero_adv_groups": 3.0, "rollout/truncated_frac": 0.1, "reward/correct/mean": 0.5,
            "reward/correct/std": 0.5, "reward/length/mean": -0.1, "reward/length/std": 0.0,
            "async/staleness_mean": 0.0, "async/staleness_max": 0.0, "perf/trained_samples_per_s": 100.0 * step,
        })
    rows[8]["run/resumed"] = 1.0  # step 8: the first step logged after resuming from the checkpoint at step 7
    return rows


def test_health_panels_reward_components_and_resumes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _health_rows()))
    text = write_report(tmp_path).read_text()
    for title in ("Loss", "Gradient norm (before clipping)", "Learning rate", "Clipped tokens", "Effective sample size",
                  "Engine/trainer mismatch", "Dropped and filtered groups", "Truncated and interrupted samples",
                  "Reward components (mean +- std)"):
        assert f'alt="{title}"' in text, title
    assert 'alt="KL"' not in text and "Not logged in this run: KL (algo/approx_kl, algo/kl" in text
    assert "<th>Resumed from step</th><td>7 (dotted lines in the plots)</td>" in text
    assert 'href="inspect.html"' in text


def _pixels(png_b64, rgb):
    import base64
    import io

    import numpy as np
    from matplotlib.image import imread

    img = imread(io.BytesIO(base64.b64decode(png_b64)))[..., :3]
    return int((np.abs(img - np.array(rgb)).max(-1) < 0.05).sum())


def test_the_staleness_mean_is_drawn_over_its_max():
    """Sync runs log mean = max = 0: the mean must stay visible, not hidden under the max (it was)."""
    from matplotlib.colors import to_rgb

    from tidal.utils.report import PANELS, plot_panel

    lines = dict(PANELS)["Staleness"]
    both = [{"step": s, "async/staleness_mean": 0.0, "async/staleness_max": 0.0} for s in range(1, 40)]
    mean_only = [{"step": s, "async/staleness_mean": 0.0} for s in range(1, 40)]
    mean_colour = to_rgb("tab:orange")  # the panel's second line
    alone = _pixels(plot_panel([("", mean_only)], "Staleness", lines), mean_colour)
    assert alone > 500 and _pixels(plot_panel([("", both)], "Staleness", lines), mean_colour) > 0.8 * alone


def test_comparison_report_overlays_runs_and_diffs_their_configs(tmp_path, capsys):
    from tidal.cli import main

    for name, lr in (("a", 1e-3), ("b", 2e-3)):
        (tmp_path / name).mkdir()
        _write_run(tmp_path / name, garbage=False)
        (tmp_path / name / "config.yaml").write_text(f"seed: 0\noptim:\n  lr: {lr}\n  name: adamw\n")
    out = tmp_path / "compare.html"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    text = out.read_text()
    assert '<h2>Config keys that differ (1)</h2>' in text and "<td><code>optim.lr</code></td><td>0.001</td>" in text
    assert '<table id="summary"><tr><th></th><th>a</th><th>b</th></tr>' in text
    assert text.count("data:image/png;base64,") >= 6
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no metrics.jsonl in") and err.count("\n") == 1
