"""Turn a run's ``metrics.jsonl`` into one self-contained HTML report.

``write_report(run_dir)`` reads ``run_dir/metrics.jsonl`` (one JSON object per line, each with an
int ``step`` and namespaced float keys such as ``reward/mean`` or ``eval/accuracy``) plus
``run_dir/config.yaml`` if present, and writes ``run_dir/report.html``: a summary table, one plot
per panel (reward, held-out accuracy, response length, entropy, staleness, throughput) and the
config.

Why self-contained: the report is meant to be copied off a cluster, attached to an issue or opened
straight from a ``file://`` URL, so it needs no server, no JavaScript and no sibling files. Plots are
drawn with matplotlib's Agg canvas (no display, no global pyplot state) and embedded as base64 PNG
data URIs; the CSS is inline.

A run that crashed mid-write can leave a truncated last line; malformed lines are skipped and
counted (the count is shown in the report) rather than failing the whole report.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# (title, [(key, label, secondary y-axis?)]); the secondary axis is for keys on a different scale.
PANELS: list[tuple[str, list[tuple[str, str, bool]]]] = [
    ("Reward", [("reward/mean", "reward/mean", False)]),
    ("Held-out accuracy", [("eval/accuracy", "eval/accuracy", False)]),
    (
        "Response length",
        [
            ("rollout/response_len_mean", "rollout/response_len_mean", False),
            ("eval/response_len_mean", "eval/response_len_mean", False),
        ],
    ),
    ("Entropy", [("train/entropy", "train/entropy", False)]),
    (
        "Staleness",
        [("async/staleness_mean", "staleness mean", False), ("async/staleness_max", "staleness max", False)],
    ),
    (
        "Throughput",
        [
            ("perf/gen_tokens_per_s", "gen tokens/s (left)", False),
            ("perf/trained_samples_per_s", "trained samples/s (right)", True),
        ],
    ),
]

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 980px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } td, th { padding: 4px 12px; border-bottom: 1px solid #eee; }
th { text-align: left; font-weight: 600; } td { font-variant-numeric: tabular-nums; }
img { max-width: 100%; } .nodata { color: #888; font-style: italic; }
.warn { color: #a35a00; } pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
"""


def read_metrics(path: str | Path) -> tuple[list[dict], int]:
    """Parse a metrics.jsonl file; return (rows, number of skipped malformed lines).

    Blank lines are ignored; a line that is not a JSON object with an int ``step`` is skipped.
    """
    rows: list[dict] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                skipped += 1
                continue
            rows.append(row)
    return rows, skipped


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) for ``key``, sorted by step, keeping only finite numeric values."""
    points = []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            points.append((row["step"], float(v)))
    points.sort(key=lambda p: p[0])
    return [p[0] for p in points], [p[1] for p in points]


def fmt(v: float | None) -> str:
    """Compact human-readable number; '—' for missing."""
    if v is None:
        return "—"
    if abs(v) >= 1000:
        return f"{v:,.1f}"
    return f"{v:.4g}"


def summary(rows: list[dict]) -> list[tuple[str, str]]:
    """(label, value) pairs for the summary table."""
    train_steps = {r["step"] for r in rows if any(not k.startswith("eval/") and k != "step" for k in r)}
    acc_steps, acc = series(rows, "eval/accuracy")
    _, reward = series(rows, "reward/mean")
    _, elapsed = series(rows, "time/elapsed_s")
    _, samples = series(rows, "perf/trained_samples_per_s")
    out = [
        ("Steps run", str(len(train_steps))),
        ("Last step", str(max((r["step"] for r in rows), default="—"))),
    ]
    if acc:
        best = max(range(len(acc)), key=lambda i: acc[i])
        out += [
            ("Base eval/accuracy", f"{fmt(acc[0])} (step {acc_steps[0]})"),
            ("Last eval/accuracy", f"{fmt(acc[-1])} (step {acc_steps[-1]})"),
            ("Best eval/accuracy", f"{fmt(acc[best])} (step {acc_steps[best]})"),
        ]
    else:
        out.append(("eval/accuracy", "—"))
    out += [
        ("Final reward/mean", fmt(reward[-1] if reward else None)),
        ("Total time/elapsed_s", fmt(elapsed[-1] if elapsed else None)),
        ("Mean perf/trained_samples_per_s", fmt(sum(samples) / len(samples) if samples else None)),
    ]
    return out


def plot_panel(rows: list[dict], title: str, specs: list[tuple[str, str, bool]]) -> str | None:
    """Base64 PNG of one panel, or None if none of its keys has data."""
    data = [(series(rows, key), label, secondary) for key, label, secondary in specs]
    if not any(xs for (xs, _), _, _ in data):
        return None
    fig = Figure(figsize=(8, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax2 = ax.twinx() if any(sec and xs for (xs, _), _, sec in data) else None
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    handles = []
    for i, ((xs, ys), label, secondary) in enumerate(data):
        if not xs:
            continue
        target = ax2 if secondary and ax2 is not None else ax
        marker = "o" if len(xs) <= 30 else None
        (line,) = target.plot(xs, ys, label=label, color=colors[i % len(colors)], marker=marker, ms=3)
        handles.append(line)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def render_html(title: str, rows: list[dict], skipped: int, config_text: str | None, source: str) -> str:
    """The whole report as one HTML string."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p>Source: <code>{esc(source)}</code> — {len(rows)} rows read.</p>",
    ]
    if skipped:
        parts.append(f'<p class="warn">Skipped {skipped} malformed line(s) in metrics.jsonl.</p>')
    parts.append("<h2>Summary</h2><table>")
    parts += [f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in summary(rows)]
    parts.append("</table>")
    for panel_title, specs in PANELS:
        parts.append(f"<h2>{esc(panel_title)}</h2>")
        png = plot_panel(rows, panel_title, specs)
        if png is None:
            keys = ", ".join(key for key, _, _ in specs)
            parts.append(f'<p class="nodata">No data ({esc(keys)} not logged in this run).</p>')
        else:
            parts.append(f'<img alt="{esc(panel_title)}" src="data:image/png;base64,{png}">')
    parts.append("<h2>Config</h2>")
    if config_text is None:
        parts.append('<p class="nodata">No config.yaml found.</p>')
    else:
        parts.append(f"<pre>{esc(config_text)}</pre>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(run_dir: str | Path, title: str | None = None) -> Path:
    """Read run_dir/metrics.jsonl and write run_dir/report.html; return its path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows, skipped = read_metrics(metrics_path)
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8", errors="replace") if config_path.is_file() else None
    if title is None:
        title = f"tidal run report — {run_dir.resolve().name}"
    out = run_dir / "report.html"
    out.write_text(render_html(title, rows, skipped, config_text, str(metrics_path)), encoding="utf-8")
    return out
