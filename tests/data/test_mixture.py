"""``tidal curate mixture``: bad inputs are one line, batches keep their proportions exactly, the
compute meter counts what each method trains, and the whole command runs end to end on a tiny corpus."""

import json
import random

import pytest
import torch

from tidal.cli import main
from tidal.data.io import write_rows
from tidal.data.mixture import Meter, MixedBatches, MixtureConfig
from tidal.data.proxy import ProxyConfig

FAST = ["--set", "mixture.budget=12", "--set", "mixture.seeds=[0]", "--set", "mixture.grid_resolution=2",
        "--set", "mixture.proxy.hidden_size=16", "--set", "mixture.proxy.batch_size=4",
        "--set", "mixture.proxy.seq_len=16", "--set", "mixture.proxy.eval_windows=6",
        "--set", "mixture.merge.resolution=4", "--set", "mixture.aioli.rounds=2",
        "--set", "mixture.bayes.trials=3", "--set", "mixture.bayes.startup_trials=2",
        "--set", "mixture.bayes.sampler=tpe"]


def corpus(tmp_path):
    rng = random.Random(0)
    sums = [{"text": " ".join(f"{a}+{b}={a + b}." for a, b in ((rng.randrange(50), rng.randrange(50))
                                                              for _ in range(8)))} for _ in range(20)]
    words = [{"text": " ".join(rng.choice(["the cat", "a dog", "sees", "my bird", "runs"]) for _ in range(15))}
             for _ in range(20)]
    write_rows(tmp_path / "sums.jsonl", sums[:16])
    write_rows(tmp_path / "words.jsonl", words[:16])
    write_rows(tmp_path / "eval.jsonl", sums[16:] + words[16:])
    return [str(tmp_path / "sums.jsonl"), str(tmp_path / "words.jsonl")], str(tmp_path / "eval.jsonl")


def run(tmp_path, *sets, fast=True):
    out = tmp_path / "mix.json"
    return main(["curate", "mixture", "--out", str(out), *(FAST if fast else []), *sets]), out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_domain_with_no_rows_is_one_line(tmp_path, capsys):
    domains, ev = corpus(tmp_path)
    write_rows(tmp_path / "empty.jsonl", [{"prompt": "no text field here"}])
    rc, _ = run(tmp_path, "--set", f"mixture.domains=[{domains[0]}, {tmp_path / 'empty.jsonl'}]",
                "--set", f"mixture.eval={ev}")
    assert rc == 2
    line = one_error_line(capsys)
    assert "empty.jsonl has no rows with a string 'text'" in line


def test_weights_that_do_not_sum_to_one_are_one_line(tmp_path, capsys):
    domains, ev = corpus(tmp_path)
    rc, _ = run(tmp_path, "--set", f"mixture.domains=[{', '.join(domains)}]", "--set", f"mixture.eval={ev}",
                "--set", "mixture.weights=[0.5, 0.6]")
    assert rc == 2
    assert "the weights sum to 1.1, not 1" in one_error_line(capsys)
    rc, _ = run(tmp_path, "--set", f"mixture.domains=[{', '.join(domains)}]", "--set", f"mixture.eval={ev}",
                "--set", "mixture.weights=[1.0]")
    assert rc == 2 and "1 weights for 2 domains" in one_error_line(capsys)


def test_an_eval_set_sharing_rows_names_the_decontamination_command(tmp_path, capsys):
    domains, ev = corpus(tmp_path)
    rows = [json.loads(line) for line in open(domains[1])]
    write_rows(tmp_path / "leaky.jsonl", rows[:3] + [{"text": "something held out."}])
    rc, _ = run(tmp_path, "--set", f"mixture.domains=[{', '.join(domains)}]",
                "--set", f"mixture.eval={tmp_path / 'leaky.jsonl'}")
    assert rc == 2
    line = one_error_line(capsys)
    assert f"shares 3 row(s) with domain {domains[1]}" in line
    assert f"tidal curate decontaminate --in {domains[1]} --out CLEAN.jsonl --set eval={tmp_path / 'leaky.jsonl'}" \
        in line


def test_an_unknown_method_is_one_line(tmp_path, capsys):
    domains, ev = corpus(tmp_path)
    rc, _ = run(tmp_path, "--set", f"mixture.domains=[{', '.join(domains)}]", "--set", f"mixture.eval={ev}",
                "--set", "mixture.method=doremi")
    assert rc == 2 and "unknown method 'doremi'" in one_error_line(capsys)


def test_batches_keep_the_proportions_exactly():
    streams = [torch.full((100,), 5), torch.full((100,), 7), torch.full((100,), 9)]
    batches = MixedBatches(streams, ProxyConfig(batch_size=4, seq_len=8), seed=0)
    rows = torch.cat([batches.next([0.75, 0.25, 0.0]) for _ in range(2)])
    # smooth weighted round-robin: 8 rows at 3/4 : 1/4 -> exactly 6 and 2, and never the 0-weight domain
    assert [int((rows[:, 0] == t).sum()) for t in (5, 7, 9)] == [6, 2, 0]
    assert batches.next([0.0, 0.0, 1.0])[:, 0].tolist() == [9, 9, 9, 9]


def test_meter_charges_an_evaluation_a_third_of_a_row_per_window():
    cfg = MixtureConfig(proxy=ProxyConfig(batch_size=4))
    meter = Meter(cfg, num_windows=6)
    meter.steps, meter.evals = 10, 3
    assert meter.total == 10 + 3 * 6 / (3 * 4)  # 11.5
    assert meter.as_dict() == {"train_steps": 10, "evals": 3, "step_equivalents": 11.5}


def test_every_method_end_to_end(tmp_path, capsys):
    pytest.importorskip("optuna")
    domains, ev = corpus(tmp_path)
    rc, out = run(tmp_path, "--set", f"mixture.domains=[{', '.join(domains)}]", "--set", f"mixture.eval={ev}",
                  "--set", "mixture.weights=[0.5, 0.5]")
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    m = report["methods"]
    assert list(m) == ["grid", "merge", "aioli", "bayes", "given"]
    # the grid: mixtures (1,0), (.5,.5), (0,1) at one seed, 12 steps each, one evaluation each
    table = m["grid"]["search"]["table"]
    assert [r["mix"] for r in table] == [[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]]
    assert m["grid"]["compute"] == {"train_steps": 36, "evals": 3, "step_equivalents": 36 + 3 * 6 / 12}
    assert m["grid"]["held_out_loss"] == min(r["mean_loss"] for r in table)
    # the uniform mixture is a grid point: the same run, the same loss
    assert m["given"]["held_out_loss"] == table[1]["mean_loss"]
    # merge: base round(0.9 x 12) = 11 + 2 experts x round(0.1 x 12) = 1 step, then 5 merged candidates evaluated
    assert m["merge"]["compute"]["train_steps"] == 13 and m["merge"]["compute"]["evals"] == 5
    # aioli: one run of the budget; per round one evaluation before and one per swept domain, plus the last
    assert m["aioli"]["compute"]["train_steps"] == 12 and m["aioli"]["compute"]["evals"] == 2 * (1 + 2) + 1
    assert len(m["aioli"]["search"]["trajectory"]) == 2
    assert m["bayes"]["compute"]["train_steps"] == 36
    assert report["regret_by_method"]["grid"] == 0 and report["compute_frac_by_method"]["grid"] == 1
    for name, r in m.items():
        assert abs(sum(r["mix"].values()) - 1) < 1e-9, name
        assert report["regret_by_method"][name] == pytest.approx(
            (r["held_out_loss"] - report["grid_best_loss"]) / report["grid_best_loss"])
    assert report["best_method"] in ("merge", "aioli", "bayes")
    printed = capsys.readouterr().out
    assert "regret" in printed and f"report: {out}" in printed


def test_the_docs_command_runs(tmp_path, monkeypatch, capsys):
    """docs/curate.md's mixture command as written (shrunk by the FAST overrides that follow it)."""
    import re
    import shlex
    from pathlib import Path

    pytest.importorskip("optuna")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "curate.md").read_text()
    block = re.search(r"## Choosing a data mixture\n\n```\n(.*?)```", doc, flags=re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["tidal", "curate", "mixture"]
    monkeypatch.chdir(tmp_path)
    domains, ev = corpus(tmp_path)
    rows = [json.loads(line) for line in open(domains[0])]
    for name, part in (("web.jsonl", rows[:6]), ("code.jsonl", rows[6:11]), ("math.jsonl", rows[11:])):
        write_rows(tmp_path / name, part)
    write_rows(tmp_path / "heldout.jsonl", [json.loads(line) for line in open(ev)])
    assert main([*argv[1:], *FAST, "--set", "mixture.aioli.lp_steps=1"]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "mix.json").read_text())
    assert list(report["methods"]) == ["grid", "merge", "aioli", "bayes", "given"]
    assert report["domains"] == ["web", "code", "math"]


def test_a_method_pays_for_a_mixture_another_method_trained(tmp_path, capsys):
    """bayes proposing the grid's mixtures is charged for them; its own repeats are free."""
    from tidal.config import apply_overrides
    from tidal.data.mixture import Problem, load_inputs
    from tidal.data.mixture_methods import Runs, search_grid

    domains, ev = corpus(tmp_path)
    cfg = apply_overrides(MixtureConfig(), [f"domains=[{', '.join(domains)}]", f"eval={ev}", "budget=3",
                                            "seeds=[0]", "grid_resolution=1", "proxy.hidden_size=16",
                                            "proxy.batch_size=2", "proxy.seq_len=16", "proxy.eval_windows=2"])
    problem = Problem(cfg, *load_inputs(cfg))
    shared = Runs(problem)
    search_grid(problem, shared, progress=False)
    assert problem.meter.steps == 6  # (1, 0) and (0, 1), 3 steps each
    own = Runs(problem)
    assert own.loss([1.0, 0.0], 0) == shared.loss([1.0, 0.0], 0)  # the same run: a pure function of mixture, seed
    own.loss([1.0, 0.0], 0)
    assert problem.meter.steps == 9, "trained once more for the second method, not again for its repeat"


def test_an_existing_out_needs_overwrite_and_a_folder_fails_before_the_search(tmp_path, monkeypatch, capsys):
    """Issue 50 item 4: ``--out FILE`` replaced a user's data file with the report, and a folder as ``--out``
    failed only after the whole search had run."""
    from tidal.data import mixture_methods

    def searched(*args, **kwargs):
        raise AssertionError("the search ran")

    domains, ev = corpus(tmp_path)
    sets = ["--set", f"mixture.domains=[{', '.join(domains)}]", "--set", f"mixture.eval={ev}"]
    (tmp_path / "mix.json").write_text("a user's file\n")
    monkeypatch.setattr(mixture_methods, "run_mixture", searched)
    rc, out = run(tmp_path, *sets)
    assert rc == 2 and f"--out {out} exists; pass --overwrite to replace it" in one_error_line(capsys)
    assert out.read_text() == "a user's file\n"
    (tmp_path / "folder").mkdir()
    assert main(["curate", "mixture", "--out", str(tmp_path / "folder"), *FAST, *sets]) == 2
    assert f"--out {tmp_path / 'folder'} is a folder" in one_error_line(capsys)
    monkeypatch.setattr(mixture_methods, "run_mixture", lambda cfg, progress: {"methods": {}})
    rc, out = run(tmp_path, *sets, "--overwrite")
    assert rc == 0 and json.loads(out.read_text()) == {"methods": {}}
