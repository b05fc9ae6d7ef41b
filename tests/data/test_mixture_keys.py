"""``tidal curate mixture``: every key a method reads is checked before any proxy trains, one line naming it
(issue 50, item 13: ``mixture.bayes.trials=0`` ended the search, after the grid, with optuna's "Record does
not exist" and no key)."""

import pytest

from .test_mixture import corpus, one_error_line, run


@pytest.mark.parametrize("key_value, message", [
    ("mixture.bayes.trials=0", "mixture.bayes.trials must be an integer >= 1 (proxy runs), got 0"),
    ("mixture.bayes.sampler=cmaes", "mixture.bayes.sampler must be one of gp, tpe, got 'cmaes'"),
    ("mixture.aioli.eta=0", "mixture.aioli.eta must be > 0, got 0.0"),
    ("mixture.proxy.lr=-1", "mixture.proxy.lr must be > 0, got -1.0"),
    ("mixture.merge.expert_frac=0.01", "mixture.merge.expert_frac=0.01: experts need at least one step"),
])
def test_a_bad_method_key_is_one_line_before_any_training(key_value, message, tmp_path, capsys, monkeypatch):
    import tidal.data.mixture as mixture

    def no_training(*a, **k):
        raise AssertionError("a proxy trained before the keys were checked")

    monkeypatch.setattr(mixture, "train_step", no_training)
    domains, ev = corpus(tmp_path)
    rc, out = run(tmp_path, "--set", f"mixture.domains=[{', '.join(domains)}]", "--set", f"mixture.eval={ev}",
                  "--set", key_value)
    assert rc == 2 and one_error_line(capsys).startswith(f"error: {message}")
    assert not out.exists()
