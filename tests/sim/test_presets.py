import json

import pytest

from tidal.cli import main
from tidal.config import ConfigError
from tidal.sim.presets import AREAL_SOURCES, areal, build, cpu
from tidal.sim.simulator import compare

SMALL_AREAL = ["preset=areal", "layout.devices=8", "layout.gen_devices=6", "layout.max_batch=64",
               "workload.prompts_per_step=4", "workload.lengths=lognormal:500,1.0,2000", "steps=4", "warmup_steps=1"]


def test_areal_preset_matches_its_sources():
    cfg = areal()
    assert cfg.layout.devices == 128 and cfg.layout.gen_devices == 96  # 16 nodes x 8; 3/4 generate
    assert cfg.workload.prompts_per_step * cfg.workload.group_size == 512 * 16
    assert cfg.workload.lengths.endswith(",31744")  # 32k context - 1k prompt
    assert {"2.77x", "gpus", "split", "batch", "max_gen", "eta", "lengths"} <= set(AREAL_SOURCES)


def test_build_applies_overrides_after_the_preset():
    cfg = build(SMALL_AREAL)
    assert cfg.preset == "areal" and cfg.layout.devices == 8 and cfg.steps == 4
    out = compare(cfg)
    assert set(out["results"]) == {"sync", "periodic", "async"} and out["speedup_vs_sync"]["sync"] == 1.0
    with pytest.raises(ConfigError, match="unknown preset"):
        build(["preset=tpu"])
    with pytest.raises(ConfigError, match="layout.devices"):
        build(["preset=areal", "layout.device=4"])


def test_cpu_preset_reads_a_calibration(tmp_path):
    decode = {"step_s": 1e-3, "per_seq_s": 1e-5, "per_ctx_token_s": 0.0}
    train = {"step_s": 0.05, "per_padded_token_s": 1e-5, "weight_sync_s": 1e-3, "weight_load_s": 1e-3}
    cal = {"decode": {"1": decode, "2": {**decode, "step_s": 0.7e-3}},
           "train": {"1": train, "2": {**train, "step_s": 0.03}},
           "prefill_per_token_s": {"1": 1e-5, "2": 1e-5}, "overlap": {"gen_slowdown": 1.2, "train_slowdown": 1.1},
           "reward_s": {"group": 1e-3, "batch": 2e-3}, "prompt_len": 5.0, "lengths": {"mean": 11.0},
           "groups": [{"lengths": [3] * 8, "informative": True}, {"lengths": [20] * 8, "informative": False}]}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    cfg = cpu(path)
    assert cfg.layout.shared_pool and cfg.layout.sync_colocated and cfg.workload.max_staleness == 2
    assert 0 < cfg.costs.gen_scaling < 1 and 0 < cfg.costs.train_scaling < 1
    cfg.steps = 5
    assert compare(cfg)["results"]["async"].staleness_max <= 2
    with pytest.raises(FileNotFoundError, match="simulate_calibrate"):
        cpu(tmp_path / "missing.json")


def test_cli_prints_the_table_and_writes_json_and_png(tmp_path, capsys):
    args = ["simulate", "--out", str(tmp_path), "--plot", "eta"]
    for item in SMALL_AREAL:
        args += ["--set", item]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| mode" in out and "async" in out
    result = json.loads((tmp_path / "result.json").read_text())
    assert [row["mode"] for row in result["table"]] == ["sync", "periodic", "async"]
    assert [r["eta"] for r in result["sweep_eta"]] == [0, 1, 2, 4, 8, 16]
    assert (tmp_path / "simulate.png").stat().st_size > 0


def test_cli_bad_key_is_a_one_line_error(tmp_path, capsys):
    assert main(["simulate", "--set", "preset=areal", "--set", "workload.eta=3", "--out", str(tmp_path)]) == 2
    assert "unknown config key" in capsys.readouterr().err


@pytest.mark.parametrize("override,message", [
    ("steps=0", "steps=0: simulate at least 1 step"),
    ("layout.devices=0", "layout.devices=0: needs at least 1 device"),
    ("layout.gen_devices=128", "layout.gen_devices=128: must be >= 1 and leave at least one of layout.devices=128"),
    ("workload.lengths=lognormal:abc", "workload.lengths='lognormal:abc': bad length spec"),
    ("workload.lengths=constant:0", "lengths (0,) must be >= 1"),
    ("workload.lengths=groups:/no/such.json", "No such file"),
    ("workload.drop_prob=1", "workload.drop_prob=1.0: must be in [0, 1)"),
    ("costs.decode_step_s=-1", "costs.decode_step_s=-1.0: must be >= 0"),
])
def test_cli_values_the_simulator_cannot_run_are_one_line_errors(tmp_path, capsys, override, message):
    assert main(["simulate", "--set", "preset=areal", "--set", override, "--out", str(tmp_path), "--plot", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not list(tmp_path.iterdir())  # nothing written


def test_build_accepts_every_preset_as_shipped():
    build(["preset=areal"])
    build(SMALL_AREAL)


def test_eta_plot_needs_a_layout_async_can_run(tmp_path, capsys):
    args = ["simulate", "--set", "preset=areal", "--set", "modes=[sync]", "--set", "layout.gen_devices=128",
            "--set", "steps=8", "--out", str(tmp_path)]
    assert main(args) == 2  # the eta sweep simulates async, which needs a training device
    assert "(--plot eta simulates async)" in capsys.readouterr().err
