"""The mixture search methods of ``tidal curate mixture`` and the report that compares them.

- ``grid``: every mixture of the lattice (steps of 1/grid_resolution) trained at every seed; the best
  mean held-out loss is the ground truth the others are measured against.
- ``merge``: one shared base (uniform mixture, ``merge.base_frac`` of the budget), one expert per domain
  fine-tuned from it (``merge.expert_frac``), then every lattice mixture (steps of 1/merge.resolution;
  by default the grid's own mixtures) scored by the held-out loss of the weighted merge
  ``base + sum a_k (expert_k - base)``, no training (Merge to Mix, arXiv 2505.16066; MergeMix, arXiv
  2601.17858). Cost: base + k experts + evaluations.
- ``aioli``: one online run that re-estimates the mixing law and moves the proportions as it trains
  (arXiv 2411.05735; ``tidal/algo/mixing.py`` has the update). Its choice is the final proportions
  (the paper's "restricted" use: proportions learned in a shorter run); the online run's own held-out
  loss is reported beside it (``search.online_run_loss``, first seed).
- ``bayes``: optuna's Gaussian-process sampler proposes mixtures, each a full proxy run on the first
  seed (ADMIRE-BayesOpt, arXiv 2508.11551: mixture choice as black-box Bayesian optimisation).

Each method searches with the first seed and is charged what it trains and evaluates (``Meter``); the
mixture it picks is then trained at every seed (the grid's own runs are reused: a run is a pure function
of mixture and seed) for the held-out loss it is judged by. Regret is relative: (loss - grid best) /
grid best; compute is the method's search as a fraction of the grid's.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tidal.algo.mixing import (
    aioli_interactions,
    aioli_normalize,
    aioli_step,
    merge_weights,
    simplex_lattice,
    smoothed_one_hot,
)
from tidal.config import ConfigError
from tidal.data.mixture import Meter, MixtureConfig, Problem, check_config, check_weights, load_inputs, methods_of
from tidal.utils.progress import progress_bar

GOAL_REGRET, GOAL_COMPUTE = 0.01, 0.20  # issue 40: within 1% of the grid's best at <= 20% of its compute


def _key(mix) -> tuple:
    return tuple(round(float(p), 9) for p in mix)


class Runs:
    """Held-out loss of (mixture, seed), trained once and remembered (a search that proposes a mixture twice
    pays once)."""

    def __init__(self, problem: Problem):
        self.problem, self.cache = problem, {}

    def loss(self, mix, seed: int) -> float:
        key = (_key(mix), seed)
        if key not in self.cache:
            self.cache[key] = self.problem.loss_of(list(mix), seed)
        return self.cache[key]


def search_grid(problem: Problem, runs: Runs, progress: bool) -> dict:
    cfg = problem.cfg
    mixes = simplex_lattice(problem.k, cfg.grid_resolution)
    jobs = [(m, s) for m in mixes for s in cfg.seeds]
    for m, s in progress_bar(progress, iterable=jobs, desc="grid"):
        runs.loss(m, s)
    means = {m: statistics.fmean(runs.loss(m, s) for s in cfg.seeds) for m in mixes}
    best = min(mixes, key=means.get)
    return {"mix": list(best), "search": {"mixes": len(mixes),
                                          "table": [{"mix": list(m), "mean_loss": means[m]} for m in mixes]}}


def search_merge(problem: Problem, runs: Runs, progress: bool) -> dict:
    import torch

    from tidal.data.proxy import build_proxy

    cfg, seed, k = problem.cfg, problem.cfg.seeds[0], problem.k
    base_steps = round(cfg.budget * cfg.merge.base_frac)
    expert_steps = round(cfg.budget * cfg.merge.expert_frac)  # >= 1: mixture.check_config
    model, opt, batches = problem.train([1.0 / k] * k, seed, base_steps)
    base, base_opt = {n: t.detach().clone() for n, t in model.state_dict().items()}, opt.state_dict()
    experts = []
    for d in range(k):
        expert, expert_opt = build_proxy(cfg.proxy, seed)
        expert.load_state_dict(base)
        expert_opt.load_state_dict(base_opt)
        one_hot = [1.0 if i == d else 0.0 for i in range(k)]
        problem.train(one_hot, seed + 1 + d, expert_steps, expert, expert_opt)
        experts.append({n: t.detach().clone() for n, t in expert.state_dict().items()})
    scored = []
    candidates = simplex_lattice(k, cfg.merge.resolution or cfg.grid_resolution)
    for mix in progress_bar(progress, iterable=candidates, desc="merged candidates"):
        with torch.no_grad():
            model.load_state_dict(merge_weights(base, experts, mix))
        scored.append((problem.evaluate(model), mix))
    loss, best = min(scored)
    return {"mix": list(best), "search": {"candidates": len(scored), "merged_loss": loss,
                                          "base_steps": base_steps, "expert_steps": expert_steps}}


def aioli_run(problem: Problem, seed: int) -> tuple[float, list[float], list[list[float]]]:
    """One Aioli online run: (final held-out loss, final proportions, proportions of each round)."""
    import random

    cfg, a, k = problem.cfg, problem.cfg.aioli, problem.k
    per_round = cfg.budget // a.rounds
    learn = a.lp_rounds * k * a.lp_steps  # < per_round: mixture.check_config
    rng = random.Random(seed)
    p = [1.0 / k] * k
    model, opt, batches = problem.train(p, seed, 0)
    trajectory, done = [], 0
    for r in range(a.rounds):
        prev = [problem.evaluate(model)]  # one evaluation group: the held-out set
        drops = [[0.0] * k for _ in prev]
        for _ in range(a.lp_rounds):
            order = list(range(k))
            rng.shuffle(order)
            for j in order:
                problem.train(smoothed_one_hot(k, j, a.one_hot_factor), seed, a.lp_steps, model, opt, batches)
                new = [problem.evaluate(model)]
                for i in range(len(new)):
                    drops[i][j] += (prev[i] - new[i]) / a.lp_rounds
                prev = new
        p = aioli_step(p, aioli_normalize(aioli_interactions(drops, a.one_hot_factor)), a.eta)
        trajectory.append(p)
        rest = (cfg.budget - done - learn) if r == a.rounds - 1 else per_round - learn
        problem.train(p, seed, rest, model, opt, batches)
        done += learn + rest
    return problem.evaluate(model), p, trajectory


def search_aioli(problem: Problem, runs: Runs, progress: bool) -> dict:
    loss, p, trajectory = aioli_run(problem, problem.cfg.seeds[0])
    return {"mix": p, "search": {"trajectory": trajectory, "online_run_loss": loss}}


def search_bayes(problem: Problem, runs: Runs, progress: bool) -> dict:
    try:
        import optuna
    except ImportError:
        raise ConfigError("mixture.method=bayes needs optuna: pip install 'tidal[mixture]'") from None
    cfg, seed, k = problem.cfg, problem.cfg.seeds[0], problem.k
    b = cfg.bayes
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if b.sampler == "gp":
        sampler = optuna.samplers.GPSampler(seed=seed, n_startup_trials=b.startup_trials)
    elif b.sampler == "tpe":
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=b.startup_trials)
    else:
        raise ConfigError(f"mixture.bayes.sampler={b.sampler!r}: use gp or tpe")

    def mix_of(params: dict) -> list[float]:
        raw = [params[f"x{d}"] for d in range(k)]
        total = sum(raw)
        return [x / total for x in raw] if total > 0 else [1.0 / k] * k

    def objective(trial) -> float:
        mix = mix_of({f"x{d}": trial.suggest_float(f"x{d}", 0.0, 1.0) for d in range(k)})
        return runs.loss(mix, seed)

    study = optuna.create_study(direction="minimize", sampler=sampler)
    for _ in progress_bar(progress, iterable=range(b.trials), desc="bayes trials"):
        study.optimize(objective, n_trials=1)
    return {"mix": mix_of(study.best_params), "search": {"trials": b.trials, "best_trial_loss": study.best_value}}


SEARCH = {"grid": search_grid, "merge": search_merge, "aioli": search_aioli, "bayes": search_bayes}


def run_mixture(cfg: MixtureConfig, progress: bool = True) -> dict:
    """Run the chosen methods and compare them (see the module docstring); returns the report."""
    import torch

    check_config(cfg)
    names, texts, eval_texts = load_inputs(cfg)
    methods = methods_of(cfg)
    given = check_weights(cfg.weights, len(names)) if cfg.weights else None
    if not cfg.seeds:
        raise ConfigError("mixture.seeds: needs at least one seed")
    if cfg.proxy.threads:
        torch.set_num_threads(cfg.proxy.threads)
    problem = Problem(cfg, names, texts, eval_texts)
    runs = Runs(problem)
    out = {}
    for name in ["grid", *[m for m in methods if m != "grid"]] if "grid" in methods else methods:
        problem.meter = Meter(cfg, len(problem.windows))
        own = Runs(problem)  # a method is charged for every run it asks for, even one another method trained
        found = SEARCH[name](problem, own, progress)
        spent = problem.meter.as_dict()
        runs.cache.update(own.cache)
        problem.meter = Meter(cfg, len(problem.windows))  # checking the choice is not the method's cost
        losses = [runs.loss(found["mix"], s) for s in cfg.seeds]
        out[name] = {"mix": dict(zip(names, map(float, found["mix"]))), "held_out_loss": statistics.fmean(losses),
                     "losses": losses, "compute": spent, "search": found["search"]}
    if given is not None:
        losses = [runs.loss(given, s) for s in cfg.seeds]
        out["given"] = {"mix": dict(zip(names, given)), "held_out_loss": statistics.fmean(losses), "losses": losses}
    report = {"domains": names, "eval": cfg.eval, "budget": cfg.budget, "seeds": list(cfg.seeds), "methods": out}
    if "grid" in out:
        best, grid_compute = out["grid"]["held_out_loss"], out["grid"]["compute"]["step_equivalents"]
        regret = {m: (r["held_out_loss"] - best) / best for m, r in out.items()}
        frac = {m: r["compute"]["step_equivalents"] / grid_compute for m, r in out.items() if "compute" in r}
        others = [m for m in frac if m != "grid"]
        cheap = [m for m in others if frac[m] <= GOAL_COMPUTE] or others
        report.update({"grid_best_loss": best, "regret_by_method": regret, "compute_frac_by_method": frac,
                       "best_method": min(cheap, key=regret.get) if cheap else "grid",
                       "goal": f"regret <= {GOAL_REGRET:.0%} at compute_frac <= {GOAL_COMPUTE:.0%}",
                       "goal_met_by": [m for m in others if regret[m] <= GOAL_REGRET and frac[m] <= GOAL_COMPUTE]})
    return report


def main_mixture(overrides: list[str], out: str | Path, progress: bool = True, overwrite: bool = False) -> dict:
    """Check the config, then ``out`` (never a folder, an input, or an existing file without ``overwrite``:
    ``utils/outputs.py``) before the search; write the report to ``out`` whole."""
    import json

    from tidal.config import apply_overrides
    from tidal.utils.files import replace_text
    from tidal.utils.outputs import claim_file

    cfg = apply_overrides(MixtureConfig(), [o.removeprefix("mixture.") for o in overrides])
    inputs = {"mixture.eval": cfg.eval, **{f"mixture.domains[{i}]": p for i, p in enumerate(cfg.domains)}}
    claim_file(out, inputs, overwrite)
    report = run_mixture(cfg, progress)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    replace_text(out, json.dumps(report, indent=2))
    return report
