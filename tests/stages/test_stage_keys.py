"""Every stage key checked before any work, one ``error:`` line naming it (issue 50, items 8, 12 and 13).

``data.path`` points nowhere: a key that is checked fails first; one that is not lets the stage build its
model and fail on the missing data instead. ``--out`` must not even be created.
"""

import pytest

from tidal.cli import main
from tidal.config import ConfigError, apply_overrides


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _stage(capsys, tmp_path, stage, *sets):
    argv = [stage, "--set", "data.path=/nonexistent.jsonl", *[a for s in sets for a in ("--set", s)],
            "--out", str(tmp_path / "run")]
    return _run(capsys, *argv)


@pytest.mark.parametrize("stage, key_value, message", [
    # item 8: RL refuses these; the stages used to train with them (grad_clip=-1 uphill) or raise IndexError
    ("sft", "optim.grad_clip=-1", "optim.grad_clip must be > 0, got -1.0"),
    ("dpo", "optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1) (beta1, beta2), got [0.9]"),
    ("rm", "optim.betas=[0.9, 1.0]", "optim.betas must be two numbers in [0, 1) (beta1, beta2), got [0.9, 1.0]"),
    ("sft", "optim.weight_decay=-0.1", "optim.weight_decay must be >= 0, got -0.1"),
    ("sft", "optim.warmup_steps=-2", "optim.warmup_steps must be an integer >= 0, got -2"),
    # item 13: stage keys nothing checked
    ("sft", "pack_length=-1", "pack_length must be an integer >= 0 (0: data.max_length), got -1"),
    ("sft", "packed_attention=maybe", "packed_attention must be one of auto, dense, block, got 'maybe'"),
    ("dpo", "pack_length=-1", "pack_length must be an integer >= 0 (0: data.max_length), got -1"),
    ("dpo", "ref_batch_size=0", "ref_batch_size must be an integer >= 1, got 0"),
    ("rm", "pack_length=-1", "pack_length must be an integer >= 0 (0: data.max_length), got -1"),
    ("rm", "center=-1", "center must be >= 0, got -1.0"),
    ("sft", "run.keep=-1", "run.keep must be an integer >= 0 (0 keeps every checkpoint), got -1"),
    ("sft", "run.steps=0", "run.steps must be an integer >= 1, got 0"),
])
def test_a_bad_key_is_one_line_before_any_work(stage, key_value, message, tmp_path, capsys):
    code, out, err = _stage(capsys, tmp_path, stage, key_value)
    assert (code, err.strip()) == (2, f"error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_the_stages_and_rl_refuse_an_optimizer_value_in_the_same_words(tmp_path, capsys):
    from tidal.recipes import RECIPES
    from tidal.system.validate import validate_run_config

    with pytest.raises(ConfigError) as rl:
        validate_run_config(apply_overrides(RECIPES.get("quickstart")(), ["optim.grad_clip=-1"]))
    _, _, err = _stage(capsys, tmp_path, "sft", "optim.grad_clip=-1")
    assert err.strip() == f"error: {rl.value}"


def test_an_unknown_key_keeps_its_closing_quote(tmp_path, capsys):
    code, _, err = _stage(capsys, tmp_path, "sft", "zzqqx=1")
    assert (code, err.strip()) == (2, "error: unknown config key 'zzqqx'")


def test_pretrain_checks_its_optimizer_keys(capsys):
    """``python -m tidal.stages.pretrain --set lr=-1``: RL's rule for ``optim.lr``, one line, exit 2 (it used to
    train with it)."""
    from tidal.stages import pretrain

    small = ["model.hidden_size=16", "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=32",
             "batch_size=2", "seq_len=8", "eval_windows=2", "steps=1", "sync=none"]
    for key_value, message in (("lr=-1", "lr must be > 0, got -1.0"),
                               ("weight_decay=-1", "weight_decay must be >= 0, got -1.0")):
        with pytest.raises(SystemExit) as e:
            pretrain.main([a for kv in [*small, key_value] for a in ("--set", kv)])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip() == f"error: {message}"
