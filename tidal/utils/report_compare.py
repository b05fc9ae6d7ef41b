"""``tidal report RUN_A RUN_B ...``: the report's panels with every run on the same axes, and their config diff.

An ablation is two runs; reading it means the same curves side by side and the keys that differ. The
page is static and self-contained like ``report.html`` (matplotlib PNGs, no script): a colour per run,
a line style per key. The inspector (``tidal inspect RUN_A RUN_B``) has the interactive version.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from tidal.utils.files import replace_text
from tidal.utils.report import CSS, PANELS, health_html, panel_html, read_metrics, summary
from tidal.utils.runs import MISSING, config_diff, read_config, run_names


def render_comparison(title: str, names: list[str], rows: list[list[dict]], configs: list[dict],
                      notes: list[str]) -> str:
    esc = html.escape
    runs = list(zip(names, rows))
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{esc(title)}</title><style>{CSS}</style></head><body>", f"<h1>{esc(title)}</h1>"]
    parts += [f'<p class="warn">{esc(n)}</p>' for n in notes]
    summaries = [dict(summary(r)) for r in rows]
    labels = list(dict.fromkeys(k for s in summaries for k in s))
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    parts.append(f'<h2>Summary</h2><table id="summary"><tr><th></th>{head}</tr>')
    parts += [f"<tr><th>{esc(k)}</th>" + "".join(f"<td>{esc(s.get(k, '—'))}</td>" for s in summaries) + "</tr>"
              for k in labels]
    parts.append("</table>")
    for panel_title, lines in PANELS:
        parts.append(f"<h2>{esc(panel_title)}</h2>")
        img = panel_html(runs, panel_title, lines)
        parts.append(img or f'<p class="nodata">No data ({esc(", ".join(line.key for line in lines))}).</p>')
    parts.append("<h2>Algorithm health</h2>")
    parts += health_html(runs)
    diff = config_diff(configs)
    parts.append(f"<h2>Config keys that differ ({len(diff)})</h2>")
    if diff:
        parts.append(f'<table id="config-diff"><tr><th>key</th>{head}</tr>')
        parts += [f"<tr><td><code>{esc(key)}</code></td>"
                  + "".join(f"<td>{esc(v if v == MISSING else json.dumps(v))}</td>" for v in values) + "</tr>"
                  for key, values in diff]
        parts.append("</table>")
    else:
        parts.append('<p class="nodata">The runs have the same config.</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_comparison(run_dirs: Sequence[str | Path], out: str | Path | None = None, title: str | None = None) -> Path:
    """Compare the runs in ``run_dirs`` into ``out`` (default ``compare.html`` in the current directory);
    return its path. A run without ``metrics.jsonl`` is an error naming it."""
    if not run_dirs:
        raise ValueError("tidal report needs at least one run directory")
    names, rows, configs, notes = run_names(run_dirs), [], [], []
    for name, d in zip(names, run_dirs):
        path = Path(d) / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"no metrics.jsonl in {d}")
        run_rows, skipped = read_metrics(path)
        rows.append(run_rows)
        if skipped:
            notes.append(f"{name}: skipped {skipped} malformed line(s) in metrics.jsonl")
        text, config, problem = read_config(d)
        configs.append(config)
        if text is None:
            notes.append(f"{name}: no config.yaml")
        if problem:
            notes.append(f"{name}: {problem}")
    out = Path(out) if out is not None else Path("compare.html")
    title = title or "tidal runs compared — " + ", ".join(names)
    replace_text(out, render_comparison(title, names, rows, configs, notes))
    return out
