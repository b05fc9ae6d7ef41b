import json
import subprocess
import sys

from tidal.cli import main


def test_recipes_lists_quickstart(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "quickstart" in out and "quickstart_sync" in out


def test_unknown_key_is_a_one_line_error_with_suggestion(capsys):
    assert main(["train", "quickstart", "--set", "rollout.max_stalenes=2", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "rollout.max_staleness" in err


def test_unknown_recipe_is_a_clear_error(capsys):
    assert main(["train", "quickstrat"]) == 2
    assert "did you mean 'quickstart'" in capsys.readouterr().err


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    code = main(["train", "quickstart", "--out", str(tmp_path), "--resume", "--set", "sft.steps=1",
                 "--set", "sft.accuracy_band=null",
                 "--set", f"sft.cache_dir={tmp_path / 'c'}", "--set", "model.hidden_size=16",
                 "--set", "model.num_heads=2", "--set", "model.num_kv_heads=2", "--set", "model.num_layers=1"])
    assert code == 2 and "no checkpoint" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "recipes"], capture_output=True, text=True, check=True)
    assert "quickstart" in out.stdout


def test_eval_reports_accuracy_of_a_model_dir(tmp_path, tokenizer, small_model, capsys):
    from tidal.models import tiny

    tiny.save(small_model, tokenizer, tmp_path / "m")
    assert main(["eval", str(tmp_path / "m"), "--set", "num_eval=8", "--set", "reward.num_workers=0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["eval/accuracy"] <= 1.0 and result["task"] == "addition"
