"""``tidal inspect RUN_DIR [RUN_DIR ...]``: one self-contained ``inspect.html`` to read what the policy wrote.

The page has four views: *Rollouts* (the recorded groups and evaluation answers of ``samples.jsonl``,
filtered by step, reward, finish reason, truncation, staleness, task or text, each row showing what the
policy wrote: every sample's response, cut to ``PREVIEW_CHARS`` characters, with its reward; a group's samples with
their tokens coloured by behaviour log-prob, trainer log-prob, engine/trainer mismatch or advantage,
the numbers on hover (an MoE policy's experts per layer too), and an agent episode's turns and observations;
a vision-language prompt's images beside its tokens, each run of ``<|image_pad|>`` tokens one chip, and an
agent episode's observation pictures drawn after their chips in its token view),
*Prompt across steps* (every
recorded answer to one prompt, e.g. a held-out prompt at each evaluation), *Curves* (any metric key of
every run on one Plotly chart, with smoothing and a step or wall-clock x-axis) and *Config* (the keys
that differ between the runs).

Why one file: like ``report.html`` it must open from ``file://`` on a laptop after being copied off a
cluster, so the data (as JSON), Plotly's script and the page's own script are all embedded; nothing is
fetched. Plotly is the one charting library (``plotly.offline.get_plotlyjs``, ~4.8 MB); the page's
own script only filters records and colours tokens, which no charting library does.

Bad input never stops the page: malformed lines of ``metrics.jsonl`` or ``samples.jsonl`` are skipped
and counted in a note, a missing ``samples.jsonl`` or ``config.yaml`` is a note, and only a directory
that holds neither metrics nor samples is an error.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from tidal.inspector.samples import FILE_NAME as SAMPLES_FILE
from tidal.inspector.samples import clean, read_samples
from tidal.utils.files import replace_text
from tidal.utils.report import read_metrics
from tidal.utils.runs import MISSING, config_diff, read_config, run_names

ASSETS = Path(__file__).resolve().parent / "assets"
PAGE_NAME = "inspect.html"
PREVIEW_CHARS = 48  # a 2-digit answer or a tool call fits whole; a long chain of thought shows how it starts


def response_preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """One sample's response as its row in the rollout table shows it: on one line (a newline is "↵", a
    tab "⇥", as the token view writes them), cut to ``limit`` characters with "…" as the last one when
    longer, and "∅" when empty (an answer that is nothing is not a blank cell)."""
    if not text:
        return "∅"
    shown = text.replace("\n", "↵").replace("\t", "⇥")
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def load_run(run_dir: str | Path) -> dict:
    """One run's metrics rows, records, config and notes, as the page embeds them."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    metrics_path, samples_path = run_dir / "metrics.jsonl", run_dir / SAMPLES_FILE
    if not metrics_path.is_file() and not samples_path.is_file():
        raise FileNotFoundError(f"{run_dir}: holds neither metrics.jsonl nor {SAMPLES_FILE}; is it a run directory "
                                "(tidal train --out DIR)?")
    notes = []
    rows, skipped = read_metrics(metrics_path) if metrics_path.is_file() else ([], 0)
    if not metrics_path.is_file():
        notes.append("no metrics.jsonl: no curves")
    if skipped:
        notes.append(f"skipped {skipped} malformed line(s) in metrics.jsonl")
    records, skipped = read_samples(samples_path) if samples_path.is_file() else ([], 0)
    if not samples_path.is_file():
        notes.append(f"no {SAMPLES_FILE}: no rollouts were recorded (log.samples.every=0, or a run from before "
                     "tidal recorded samples)")
    if skipped:
        notes.append(f"skipped {skipped} malformed line(s) in {SAMPLES_FILE}")
    capped = [r["step"] for r in records if r["kind"] == "capped"]
    if capped:
        notes.append(f"recording stopped at step {capped[0]}: {SAMPLES_FILE} reached log.samples.max_mb")
    config_text, config, problem = read_config(run_dir)
    if config_text is None:
        notes.append("no config.yaml")
    if problem:
        notes.append(problem)
    records = [r for r in records if r["kind"] != "capped"]
    bad = sum("error" in i for r in records for i in r["prompt"].get("images", ()))
    if bad:
        notes.append(f"{bad} prompt image(s) could not be recorded (shown as errors beside their prompts)")
    bad = sum("error" in i for r in records for s in r["samples"] for i in s.get("images", ()))
    if bad:
        notes.append(f"{bad} observation image(s) could not be recorded (shown as errors at their chips)")
    return {"name": run_dir.resolve().name, "dir": str(run_dir), "rows": rows, "config": config,
            "config_text": config_text, "notes": notes, "records": records,
            "previews": [[response_preview(s["text"]) for s in r["samples"]] for r in records],
            "resumes": [r["step"] for r in rows if r.get("run/resumed")]}


def _config_view(runs: list[dict]) -> str:
    esc = html.escape
    parts = []
    if len(runs) > 1:
        diff = config_diff([r["config"] for r in runs])
        parts.append(f"<h2>Config keys that differ ({len(diff)})</h2>")
        if diff:
            head = "".join(f"<th>{esc(r['name'])}</th>" for r in runs)
            body = "".join(
                f'<tr data-key="{esc(key)}"><td><code>{esc(key)}</code></td>'
                + "".join(f"<td>{esc(v if v == MISSING else json.dumps(v))}</td>" for v in values) + "</tr>"
                for key, values in diff)
            parts.append(f'<table id="config-diff"><thead><tr><th>key</th>{head}</tr></thead>'
                         f"<tbody>{body}</tbody></table>")
        else:
            parts.append('<p id="config-diff" class="muted">The runs have the same config.</p>')
    for r in runs:
        text = r["config_text"] if r["config_text"] is not None else "(no config.yaml)"
        parts.append(f"<details><summary>{esc(r['name'])}: config.yaml</summary><pre>{esc(text)}</pre></details>")
    return "\n".join(parts)


def _select(id_: str, options: Sequence[tuple[str, str]]) -> str:
    items = "".join(f'<option value="{v}">{html.escape(t)}</option>' for v, t in options)
    return f'<select id="{id_}">{items}</select>'


def _number(id_: str, label: str) -> str:
    return f'<label>{html.escape(label)}<input type="number" step="any" id="{id_}"></label>'


def render_page(runs: list[dict], title: str) -> str:
    """The whole page as one HTML string."""
    import plotly.offline

    esc = html.escape
    runs_html = "".join(f"<li><b>{esc(r['name'])}</b> <span class='muted'>{esc(r['dir'])}</span> — "
                        f"{len(r['records'])} recorded prompts, {len(r['rows'])} metric rows</li>" for r in runs)
    notes = "".join(f'<p class="warn">{esc(r["name"])}: {esc(n)}</p>' for r in runs for n in r["notes"])
    data = json.dumps(clean({"runs": runs}, digits=None), separators=(",", ":"), allow_nan=False)
    data = data.replace("<", "\\u003c")  # no "</script>" or "<!--" can end the data block early
    filters = "".join([
        f'<label id="f-run-wrap">run{_select("f-run", [])}</label>',
        f'<label>kind{_select("f-kind", [("", "any"), ("train", "train"), ("eval", "eval")])}</label>',
        f'<label>task{_select("f-task", [])}</label>',
        _number("f-step-min", "step ≥"), _number("f-step-max", "step ≤"),
        _number("f-reward-min", "reward ≥"), _number("f-reward-max", "reward ≤"),
        f'<label>finish reason{_select("f-finish", [])}</label>',
        f'<label>truncated{_select("f-truncated", [("", "any"), ("yes", "yes"), ("no", "no")])}</label>',
        _number("f-stale-min", "staleness ≥"), _number("f-stale-max", "staleness ≤"),
        '<label>text<input type="search" id="f-text" placeholder="in prompt or answer"></label>',
    ])
    colour_modes = [("behav_logp", "behaviour log-prob"), ("trainer_logp", "trainer log-prob"),
                    ("mismatch", "engine/trainer mismatch"), ("advantage", "advantage")]
    group_cols = "".join(f"<th>{c}</th>" for c in ("step", "kind", "task", "prompt", "responses (reward)", "match",
                                                    "mean reward", "finish reasons", "max staleness"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>{(ASSETS / "inspector.css").read_text()}</style></head><body>
<header><h1>{esc(title)}</h1><ul id="runs-list">{runs_html}</ul><div class="notes" id="notes">{notes}</div>
<nav><button id="tab-rollouts" class="active">Rollouts</button><button id="tab-history">Prompt across steps</button>
<button id="tab-curves">Curves</button><button id="tab-config">Config</button></nav></header>
<main>
<section id="view-rollouts" class="view active">
<div class="filters">{filters}</div>
<p id="match-count"></p>
<table id="groups"><thead><tr>{group_cols}</tr></thead><tbody></tbody></table>
<div id="group-view" style="display:none">
<h2 id="group-title"></h2>
<div>prompt <pre id="group-prompt"></pre><div id="group-images" style="display:none"></div>
reference answer <code id="group-answer"></code></div>
<div class="controls"><label>colour tokens by {_select("color-mode", colour_modes)}</label>
<button id="to-history">This prompt across steps</button></div>
<p class="legend" id="legend"></p>
<div id="samples"></div>
</div>
</section>
<section id="view-history" class="view">
<div class="controls"><label>prompt {_select("h-prompt", [])}</label></div>
<div id="h-chart" class="chart"></div>
<table id="h-list"><thead><tr><th>step</th><th>kind</th><th>answers (green: full reward)</th></tr></thead>
<tbody></tbody></table>
</section>
<section id="view-curves" class="view">
<div class="controls"><label>metric {_select("c-key", [])}</label>
<label>x-axis {_select("c-x", [("step", "step"), ("time/elapsed_s", "wall-clock (time/elapsed_s)")])}</label>
<label>smoothing <input type="range" id="c-smooth" min="0" max="0.99" step="0.01" value="0">
<span id="c-smooth-val">0.00</span></label>
</div>
<div id="c-chart" class="chart"></div>
<p class="muted">Dotted vertical lines: where a run was resumed (its throughput counters restart there).</p>
<table id="c-stats"><thead><tr><th>run</th><th>points</th><th>last</th><th>min</th><th>max</th></tr></thead>
<tbody></tbody></table>
</section>
<section id="view-config" class="view">{_config_view(runs)}</section>
</main>
<div id="tip"></div>
<script type="application/json" id="tidal-data">{data}</script>
<script>{plotly.offline.get_plotlyjs()}</script>
<script>{(ASSETS / "inspector.js").read_text()}</script>
</body></html>
"""


def default_out(run_dirs: Sequence[str | Path]) -> Path:
    """``RUN_DIR/inspect.html`` for one run; ``inspect.html`` here for several (no run owns a comparison)."""
    return Path(run_dirs[0]) / PAGE_NAME if len(run_dirs) == 1 else Path(PAGE_NAME)


def write_inspector(run_dirs: Sequence[str | Path], out: str | Path | None = None, title: str | None = None) -> Path:
    """Write the inspector of ``run_dirs`` to ``out`` (``default_out`` if None); return its path. Written
    under a temporary name first, so an interrupted command leaves the previous page whole."""
    if not run_dirs:
        raise ValueError("tidal inspect needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    for run, name in zip(runs, run_names(run_dirs)):
        run["name"] = name
    out = Path(out) if out is not None else default_out(run_dirs)
    if title is None:
        title = "tidal inspector — " + ", ".join(r["name"] for r in runs)
    replace_text(out, render_page(runs, title))
    return out
