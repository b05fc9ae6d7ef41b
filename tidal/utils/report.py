"""Turn a run's ``metrics.jsonl`` into one self-contained HTML report.

``write_report(run_dir)`` reads ``run_dir/metrics.jsonl`` (one JSON object per line, each with an
int ``step`` and namespaced float keys such as ``reward/mean`` or ``eval/accuracy``) plus
``run_dir/config.yaml`` if present, and writes ``run_dir/report.html``: a summary table, one plot
per panel (reward, held-out accuracy, response length, entropy, staleness, throughput), the
algorithm-health panels (loss, gradient norm, learning rate, clip fractions, KL, ESS, engine/trainer
mismatch, dropped groups, truncation, each reward component with its spread) and the config. Every
plot marks where the run was resumed (``run/resumed``), where per-process counters such as the
throughput restart. ``report_compare.py`` draws the same panels for several runs.

Why self-contained: the report is meant to be copied off a cluster, attached to an issue or opened
straight from a ``file://`` URL, so it needs no server, no JavaScript and no sibling files (it links
to the run's ``inspect.html`` for rollouts, but reads nothing from it). Plots are drawn with
matplotlib's Agg canvas (no display, no global pyplot state) and embedded as base64 PNG data URIs;
the CSS is inline. Interactive curves (any key, smoothing, wall-clock axis) are the inspector's.

A run that crashed mid-write can leave a truncated last line; malformed lines are skipped and
counted (the count is shown in the report) rather than failing the whole report.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from tidal.utils.files import read_jsonl, replace_text


@dataclass(frozen=True)
class Line:
    """One metric key drawn in a panel."""

    key: str
    label: str | None = None
    """Legend text (default: the key)."""
    right: bool = False
    """On a secondary y-axis: a key on a different scale."""
    dashed: bool = False
    band: str | None = None
    """Key of a spread (a standard deviation) drawn as a band of +- it around the line."""


# The run's progress.
PANELS: list[tuple[str, list[Line]]] = [
    ("Reward", [Line("reward/mean", "reward/mean (band: +- reward/std)", band="reward/std")]),
    ("Held-out accuracy", [Line("eval/accuracy")]),
    ("Response length", [Line("rollout/response_len_mean"), Line("eval/response_len_mean")]),
    ("Entropy", [Line("train/entropy")]),
    # The max is drawn dashed *under* the mean: in sync mode (or eta = 0) both are 0 and the mean must show.
    ("Staleness", [Line("async/staleness_max", "staleness max", dashed=True),
                   Line("async/staleness_mean", "staleness mean")]),
    ("Throughput", [Line("perf/gen_tokens_per_s", "gen tokens/s (left)"),
                    Line("perf/trained_samples_per_s", "trained samples/s (right)", right=True)]),
]

# Algorithm health: what goes wrong before the reward curve shows it (docs/metrics.md defines each key).
HEALTH_PANELS: list[tuple[str, list[Line]]] = [
    ("Loss", [Line("train/loss")]),
    ("Gradient norm (before clipping)", [Line("train/grad_norm")]),
    ("Learning rate", [Line("train/lr", "train/lr (left)"),
                       Line("algo/lr_scale", "algo/lr_scale (right)", right=True)]),
    ("Clipped tokens", [Line("algo/clip_frac"), Line("algo/clip_frac_low", dashed=True),
                        Line("algo/clip_frac_high", dashed=True), Line("algo/dual_clip_frac")]),
    ("KL", [Line("algo/approx_kl", "algo/approx_kl (to pi_old)"), Line("algo/kl", "algo/kl (to the reference)"),
            Line("algo/kl_reward_penalty")]),
    ("Effective sample size", [Line("algo/ess"), Line("algo/seq_ess"), Line("algo/is_ess")]),
    ("Engine/trainer mismatch", [Line("train/logp_mismatch_mean", "mean (left)"),
                                 Line("train/logp_mismatch_max", "max (right)", right=True)]),
    ("Dropped and filtered groups", [Line("algo/zero_adv_groups"), Line("algo/dropped_groups"),
                                     Line("algo/shortfall_groups"), Line("async/dropped_stale"),
                                     Line("algo/overlong_filtered", "algo/overlong_filtered (samples)")]),
    ("Truncated and interrupted samples", [Line("rollout/truncated_frac"), Line("rollout/early_stopped_frac"),
                                           Line("rollout/interrupted_frac")]),
]


def component_panel(rows: list[dict]) -> tuple[str, list[Line]]:
    """Each reward component (``reward/<name>/mean``, e.g. correctness vs a length penalty) with its spread."""
    names = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("reward/") and k.endswith("/mean")
                    and k.count("/") == 2})
    return "Reward components (mean +- std)", [Line(f"reward/{n}/mean", n, band=f"reward/{n}/std") for n in names]


def resume_steps(rows: list[dict]) -> list[int]:
    """The checkpoint steps a run was resumed from (``run/resumed`` marks the first step after each)."""
    return sorted({r["step"] - 1 for r in rows if r.get("run/resumed")})


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 980px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } td, th { padding: 4px 12px; border-bottom: 1px solid #eee; }
th { text-align: left; font-weight: 600; } td { font-variant-numeric: tabular-nums; }
img { max-width: 100%; } .nodata { color: #888; font-style: italic; }
.warn { color: #a35a00; } .grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(460px, 1fr)); }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
"""


def read_metrics(path: str | Path) -> tuple[list[dict], int]:
    """Parse a metrics.jsonl file; return (rows, number of skipped malformed lines).

    Blank lines are ignored; a line that is not a JSON object with an int ``step`` is skipped.
    """

    def valid(row) -> bool:
        step = row.get("step") if isinstance(row, dict) else None
        return isinstance(step, int) and not isinstance(step, bool)

    return read_jsonl(path, valid)


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
    resumes = resume_steps(rows)
    if resumes:
        out.append(("Resumed from step", ", ".join(map(str, resumes)) + " (dotted lines in the plots)"))
    return out


COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
STYLES = ["-", "--", ":", "-."]


def plot_panel(runs: list[tuple[str, list[dict]]], title: str, lines: list[Line],
               size: tuple[float, float] = (8, 3.2)) -> str | None:
    """Base64 PNG of one panel, or None if none of its keys has data. One run: a colour per line. Several
    runs (a comparison): a colour per run and a line style per key. Dotted verticals mark resumes."""
    several = len(runs) > 1
    drawn = []  # (xs, ys, line, colour, style, band)
    for r, (_, rows) in enumerate(runs):
        for i, line in enumerate(lines):
            xs, ys = series(rows, line.key)
            if not xs:
                continue
            colour = COLORS[(r if several else i) % len(COLORS)]
            style = STYLES[i % len(STYLES)] if several else ("--" if line.dashed else "-")
            band = dict(zip(*series(rows, line.band))) if line.band else {}
            drawn.append((r, xs, ys, line, colour, style, band))
    if not drawn:
        return None
    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax2 = ax.twinx() if any(line.right for *_, line, _, _, _ in drawn) else None
    handles = []
    for z, (r, xs, ys, line, colour, style, band) in enumerate(drawn):
        target = ax2 if line.right else ax
        label = line.label or line.key
        if several:
            label = f"{runs[r][0]}: {label}"
        marker = "o" if len(xs) <= 30 else None
        (h,) = target.plot(xs, ys, label=label, color=colour, ls=style, marker=marker, ms=3, zorder=2 + z)
        handles.append(h)
        spread = [(x, y, band[x]) for x, y in zip(xs, ys) if x in band]
        if spread:
            target.fill_between([x for x, _, _ in spread], [y - b for _, y, b in spread], [y + b for _, y, b in spread],
                                color=colour, alpha=0.15, lw=0)
    for r, (_, rows) in enumerate(runs):
        for i, step in enumerate(resume_steps(rows)):
            h = ax.axvline(step, color=COLORS[r % len(COLORS)] if several else "0.4", ls=":", lw=1.2)
            if i == 0 and r == 0:
                h.set_label("resumed (per-process counters restart)")
                handles.append(h)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def panel_html(runs: list[tuple[str, list[dict]]], title: str, lines: list[Line], small: bool = False) -> str | None:
    """The panel as an <img>, or None without data."""
    png = plot_panel(runs, title, lines, size=(5.6, 2.9) if small else (8, 3.2))
    return None if png is None else f'<img alt="{html.escape(title)}" src="data:image/png;base64,{png}">'


def health_html(runs: list[tuple[str, list[dict]]]) -> list[str]:
    """The algorithm-health section: its panels in a grid, then one line naming the panels not logged."""
    rows = [row for _, rs in runs for row in rs]
    parts, missing = ['<div class="grid">'], []
    for title, lines in [*HEALTH_PANELS, component_panel(rows)]:
        img = panel_html(runs, title, lines, small=True) if lines else None
        if img is None:
            missing.append(f"{title} ({', '.join(line.key for line in lines) or 'reward/<name>/mean'})")
        else:
            parts.append(f"<div>{img}</div>")
    parts.append("</div>")
    if missing:
        parts.append(f'<p class="nodata">Not logged in this run: {html.escape("; ".join(missing))}.</p>')
    return parts


INSPECTOR_LINK = ('<p>Rollouts, token by token: <a href="inspect.html">inspect.html</a> (the rollout inspector, '
                  "written at the end of training and by <code>tidal inspect RUN_DIR</code>).</p>")


def render_html(title: str, rows: list[dict], skipped: int, config_text: str | None, source: str) -> str:
    """The whole report as one HTML string."""
    esc = html.escape
    runs = [("", rows)]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p>Source: <code>{esc(source)}</code> — {len(rows)} rows read.</p>",
        INSPECTOR_LINK,
    ]
    if skipped:
        parts.append(f'<p class="warn">Skipped {skipped} malformed line(s) in metrics.jsonl.</p>')
    parts.append("<h2>Summary</h2><table>")
    parts += [f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in summary(rows)]
    parts.append("</table>")
    for panel_title, lines in PANELS:
        parts.append(f"<h2>{esc(panel_title)}</h2>")
        img = panel_html(runs, panel_title, lines)
        if img is None:
            keys = ", ".join(line.key for line in lines)
            parts.append(f'<p class="nodata">No data ({esc(keys)} not logged in this run).</p>')
        else:
            parts.append(img)
    parts.append("<h2>Algorithm health</h2>")
    parts += health_html(runs)
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
    replace_text(out, render_html(title, rows, skipped, config_text, str(metrics_path)))
    return out
