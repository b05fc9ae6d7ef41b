"""tidal.utils.runs: run names and the config diff, by hand."""

from tidal.utils.runs import MISSING, config_diff, flatten, read_config, run_names


def test_flatten_names_keys_as_set_does():
    assert flatten({"seed": 0, "optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "env": {}}) == {
        "seed": 0, "optim.lr": 1e-3, "optim.betas": [0.9, 0.95], "env": {}}


def test_config_diff_lists_changed_and_missing_keys_only():
    a = {"seed": 0, "optim.lr": 1e-3, "name": None}
    b = {"seed": 0, "optim.lr": 2e-3, "name": None, "extra": 1}
    assert config_diff([a, b]) == [("extra", [MISSING, 1]), ("optim.lr", [1e-3, 2e-3])]
    assert config_diff([a, dict(a)]) == [] and config_diff([]) == []


def test_run_names_tell_same_named_runs_apart(tmp_path):
    assert run_names([tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "z"]) == ["x/run", "y/run", "z"]


def test_read_config_reports_a_broken_file_without_raising(tmp_path):
    assert read_config(tmp_path) == (None, {}, None)
    (tmp_path / "config.yaml").write_text("- a list\n")
    text, keys, problem = read_config(tmp_path)
    assert text == "- a list\n" and keys == {} and problem.endswith("not a YAML mapping")
