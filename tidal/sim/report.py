"""``tidal simulate``'s output: a table per mode, the JSON, and a PNG of throughput against eta or
against the number of devices (each point is one more simulation of the same config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tidal.sim.config import SimConfig, validate
from tidal.sim.simulator import compare, simulate

COLUMNS = ["mode", "samples_per_s", "speedup", "step_s", "gen_idle_frac", "train_idle_frac", "device_idle_frac",
           "gen_mean_batch", "staleness_mean", "staleness_max", "gen_devices", "train_devices"]


def table(out: dict) -> list[dict]:
    return [{"speedup": out["speedup_vs_sync"].get(m), **dataclasses.asdict(r)} for m, r in out["results"].items()]


def format_table(rows: list[dict]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[cell(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def eta_sweep(cfg: SimConfig, etas=(0, 1, 2, 4, 8, 16)) -> list[dict]:
    """Async throughput at each eta (the other modes do not depend on it)."""
    rows = []
    for eta in etas:
        c = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, max_staleness=eta))
        rows.append({"eta": eta, "samples_per_s": simulate(c, "async").samples_per_s})
    return rows


def device_sweep(cfg: SimConfig, scales=(0.25, 0.5, 1, 2, 4)) -> list[dict]:
    """Every mode with the pool scaled (same generation share of devices, same workload)."""
    rows, lay = [], cfg.layout
    for s in scales:
        devices = max(2, round(lay.devices * s))
        gen = min(devices - 1, max(1, round(lay.gen_devices * s)))
        if lay.engine_devices and gen < lay.engine_devices:
            continue
        c = dataclasses.replace(cfg, layout=dataclasses.replace(lay, devices=devices, gen_devices=gen))
        res = compare(c)["results"]
        rows.append({"devices": devices, **{m: r.samples_per_s for m, r in res.items()}})
    return rows


def plot(cfg: SimConfig, out: dict, kind: str, path: Path) -> list[dict]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if kind == "eta":
        rows = eta_sweep(cfg)
        ax.plot([r["eta"] for r in rows], [r["samples_per_s"] for r in rows], "o-", label="async")
        for mode, style in [("sync", "--"), ("periodic", ":")]:
            if mode in out["results"]:
                ax.axhline(out["results"][mode].samples_per_s, linestyle=style, color="gray", label=mode)
        ax.set_xlabel("max staleness eta")
    else:
        rows = device_sweep(cfg)
        for mode in cfg.modes:
            ax.plot([r["devices"] for r in rows], [r[mode] for r in rows], "o-", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
    ax.set_ylabel("trained samples / s")
    ax.set_title(f"tidal simulate: preset {cfg.preset}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return rows


def main(overrides: list[str], out_dir: str | Path, plot_kind: str = "eta") -> dict:
    """Build the config (``preset=NAME`` plus overrides), simulate every mode, print the table and
    JSON, write ``result.json`` (and ``simulate.png`` unless ``plot_kind`` is ``none``) to ``out_dir``."""
    from tidal.sim.presets import build

    cfg = validate(build(overrides), async_plot=plot_kind == "eta")
    out = compare(cfg)
    result = {"config": dataclasses.asdict(cfg), "table": table(out)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plot_kind != "none":
        result[f"sweep_{plot_kind}"] = plot(cfg, out, plot_kind, out_dir / "simulate.png")
        result["plot"] = str(out_dir / "simulate.png")
    print(format_table(result["table"]))
    print(json.dumps(result, indent=2))
    tmp = out_dir / "result.json.tmp"  # renamed into place: an interrupted run leaves the last result whole
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out_dir / "result.json")
    return result
