"""``tidal curate mixture``: choose the proportions of several domain datasets for one held-out set.

Every candidate mixture is, in principle, a training run. This module holds what the search methods
share: the checked inputs, the proxy training on a mixture, and the compute meter; the methods live
in ``mixture_methods.py``. The proxy is ``tidal curate compare``'s (``proxy.py``: the tiny
character-level Qwen2, AdamW, clipped, held-out next-character loss on fixed windows of the eval texts).

A batch of a mixture is filled row by row with *smooth weighted round-robin* (each domain gains its
proportion of credit per row; the domain with the most credit takes the row and pays 1): after n rows
every domain has had its share to within one row, with no sampling noise, so two mixtures that differ
a little train on data that differs a little. Each row is a random window of its domain's text.

Compute is counted in **proxy training steps** of ``batch_size`` rows. Held-out evaluations are
forward passes only; one training row costs about three forward passes (forward + backward, Kaplan
et al. 2020's 6N vs 2N FLOPs per token), so an evaluation of ``eval_windows`` windows is charged
``eval_windows / (3 * batch_size)`` steps. The report gives both counts and the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.config import ConfigError
from tidal.data.proxy import ProxyConfig, _encode, build_proxy, held_out_loss, train_step, windows
from tidal.utils.rules import COUNT, NONNEG, Rule, check, number, one_of, positive, unit

METHODS = ("grid", "merge", "aioli", "bayes")


@dataclass
class MergeConfig:
    """Merging as the proxy (Merge to Mix, arXiv 2505.16066; MergeMix, arXiv 2601.17858)."""

    base_frac: float = 0.9
    """Fraction of ``budget`` spent on the shared base (uniform mixture) the experts start from."""
    expert_frac: float = 0.1
    """Steps of each domain's expert, as a fraction of ``budget``. Short: MergeMix trains its experts
    from one base on minimal tokens at a constant rate so they stay near it, where the weighted merge
    tracks mixed training (on ``tidal bench mixture``, scoring 165 mixtures, 0.5/0.5 picked one 24% worse
    than the grid's best and 0.9/0.1 one 5.5% worse; 0.9/0.1 on the grid's 35 picked the best;
    on a second corpus it picked one 85% worse: docs/curate.md)."""
    resolution: int = 0
    """Merged candidates scored: every mixture in steps of 1/resolution (evaluation only, no training);
    0: the grid's (``grid_resolution``), so merging estimates exactly the runs a grid would train."""


@dataclass
class AioliConfig:
    """Aioli's online run (arXiv 2411.05735, Alg. 1-2; defaults of HazyResearch/aioli's scripts noted)."""

    rounds: int = 4
    """Rounds T of LearnParams + training in the run (the paper: max_steps / update_steps = 20)."""
    lp_rounds: int = 1
    """Sweeps over the k domains in each LearnParams (paper: 4; 1 here, so at proxy budgets of ~100
    steps LearnParams stays a small part of each round)."""
    lp_steps: int = 2
    """Steps on each smoothed one-hot mixture in LearnParams (paper: 4)."""
    eta: float = 1.0
    """Exponentiated-gradient step size. The paper's 0.2 over 20 rounds lets log-proportions move by up
    to 0.2 x 20 = 4; with ``rounds`` 4 the same total needs eta = 1."""
    one_hot_factor: float = 0.625
    """Share of the LearnParams batch from the swept domain (paper: 0.625)."""


@dataclass
class BayesConfig:
    """Black-box Bayesian optimisation of the mixture (ADMIRE-BayesOpt, arXiv 2508.11551), with optuna."""

    trials: int = 12
    """Proxy runs (each ``budget`` steps on the first seed)."""
    sampler: str = "gp"
    """``gp``: optuna's GPSampler (a Gaussian process with expected improvement, as ADMIRE); ``tpe``."""
    startup_trials: int = 4
    """Random mixtures before the model proposes (optuna's GPSampler default is 10; 4 fits 12 trials)."""


@dataclass
class MixtureConfig:
    """``tidal curate mixture`` (docs/curate.md, "Choosing a data mixture")."""

    domains: list[str] = field(default_factory=list)
    """The domain datasets (JSONL/Parquet/HF paths with ``text_key``), two or more."""
    eval: str = ""
    """The held-out texts the mixture should do well on; must share no row with a domain."""
    text_key: str = "text"
    method: Any = "all"
    """``grid``, ``merge``, ``aioli``, ``bayes``, a list of them, or ``all``."""
    budget: int = 100
    """Proxy training steps of every run (the grid's, each method's, and the final check of each choice)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """The grid trains every mixture at every seed; each method searches with the first seed, and its
    choice is then trained at every seed for the reported held-out loss."""
    grid_resolution: int = 4
    """The grid: every mixture in steps of 1/grid_resolution (C(n+k-1, k-1) mixtures)."""
    weights: list[float] = field(default_factory=list)
    """A mixture of your own (e.g. today's), trained and reported beside the methods' (sums to 1)."""
    proxy: ProxyConfig = field(default_factory=lambda: ProxyConfig(batch_size=16, seq_len=32, lr=3e-3, hidden_size=32,
                                                                   num_layers=1, eval_windows=32, threads=1))
    """The proxy model and its optimiser (``proxy.steps``/``datasets``/``seeds`` unused here): smaller and
    faster than ``compare``'s, at the tiny model's usual-scale rate (3e-3 for a 32-wide model)."""
    merge: MergeConfig = field(default_factory=MergeConfig)
    aioli: AioliConfig = field(default_factory=AioliConfig)
    bayes: BayesConfig = field(default_factory=BayesConfig)


MIXTURE_RULES: list[Rule] = [
    ("budget", COUNT, "an integer >= 1 (proxy training steps)"),
    ("grid_resolution", COUNT, "an integer >= 1"),
    ("merge.base_frac", unit, "in [0, 1]"),
    ("merge.expert_frac", lambda v: number(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    ("merge.resolution", NONNEG, "an integer >= 0 (0: grid_resolution)"),
    ("aioli.rounds", COUNT, "an integer >= 1"),
    ("aioli.lp_rounds", COUNT, "an integer >= 1"),
    ("aioli.lp_steps", COUNT, "an integer >= 1"),
    ("aioli.eta", positive, "> 0"),
    ("aioli.one_hot_factor", unit, "in [0, 1]"),
    ("bayes.trials", COUNT, "an integer >= 1 (proxy runs)"),
    ("bayes.sampler", *one_of(("gp", "tpe"))),
    ("bayes.startup_trials", NONNEG, "an integer >= 0"),
    ("proxy.batch_size", COUNT, "an integer >= 1"),
    ("proxy.seq_len", COUNT, "an integer >= 1"),
    ("proxy.lr", positive, "> 0"),
    ("proxy.hidden_size", COUNT, "an integer >= 1"),
    ("proxy.num_layers", COUNT, "an integer >= 1"),
    ("proxy.eval_windows", COUNT, "an integer >= 1"),
    ("proxy.threads", NONNEG, "an integer >= 0 (0: torch's default)"),
]
"""Every key a method reads, checked before any method runs (``check_config``): ``bayes.trials=0`` used to
end the search, after the grid had trained, with optuna's "Record does not exist" and no key named."""


def check_config(cfg: MixtureConfig) -> None:
    """A ConfigError naming the first ``mixture.*`` key no method can use (``MIXTURE_RULES``), or a method's
    keys that do not fit together."""
    check(cfg, MIXTURE_RULES, where="mixture.")
    methods = methods_of(cfg)
    if "merge" in methods and round(cfg.budget * cfg.merge.expert_frac) < 1:
        raise ConfigError(f"mixture.merge.expert_frac={cfg.merge.expert_frac}: experts need at least one step "
                          f"(round(budget x expert_frac) = 0 at budget={cfg.budget})")
    a, k = cfg.aioli, len(cfg.domains)
    learn, per_round = a.lp_rounds * k * a.lp_steps, cfg.budget // a.rounds
    if "aioli" in methods and learn >= per_round:
        raise ConfigError(f"mixture.aioli: LearnParams takes lp_rounds x k x lp_steps = {learn} steps but a round "
                          f"has budget // rounds = {per_round}; lower aioli.lp_steps/lp_rounds/rounds or raise budget")


class Meter:
    """Compute spent: training steps and held-out evaluations (see the module docstring)."""

    def __init__(self, cfg: MixtureConfig, num_windows: int):
        self.steps, self.evals = 0, 0
        self.eval_cost = num_windows / (3 * cfg.proxy.batch_size)

    @property
    def total(self) -> float:
        return self.steps + self.evals * self.eval_cost

    def as_dict(self) -> dict:
        return {"train_steps": self.steps, "evals": self.evals, "step_equivalents": self.total}


def methods_of(cfg: MixtureConfig) -> list[str]:
    """``cfg.method`` as a list of known method names, in the order given."""
    names = list(METHODS) if cfg.method == "all" else [cfg.method] if isinstance(cfg.method, str) else cfg.method
    if not isinstance(names, list) or not names:
        raise ConfigError(f"mixture.method={cfg.method!r}: give one of {', '.join(METHODS)}, a list, or all")
    for name in names:
        if name not in METHODS:
            raise ConfigError(f"mixture.method: unknown method {name!r} (known: {', '.join(METHODS)}, all)")
    return names


def check_weights(weights: list, k: int, where: str = "mixture.weights") -> list[float]:
    """A mixture given by hand: k numbers >= 0 that sum to 1 (to 1e-6), else one line saying which."""
    if len(weights) != k:
        raise ConfigError(f"{where}: {len(weights)} weights for {k} domains")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
            raise ConfigError(f"{where}[{i}]={w!r}: must be a finite number >= 0")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise ConfigError(f"{where}={weights}: the weights sum to {sum(weights):.6g}, not 1 "
                          f"(proportions of the domains; divide by the sum)")
    return [float(w) for w in weights]


def _rows(path: str, key: str) -> list[str]:
    from tidal.data.dedup import text_of
    from tidal.data.io import read_rows

    if not Path(path).exists():
        raise ConfigError(f"{path}: no such file")
    return [t for row in read_rows(path) if (t := text_of(row, key))]


def load_inputs(cfg: MixtureConfig) -> tuple[list[str], list[list[str]], list[str]]:
    """(domain names, each domain's texts, eval texts), refusing an empty domain and a contaminated eval set."""
    if len(cfg.domains) < 2 or not cfg.eval:
        raise ConfigError("mixture needs mixture.domains=[A, B, ...] (two or more) and mixture.eval=PATH")
    names = [Path(p).name.split(".")[0] for p in cfg.domains]
    if len(set(names)) != len(names):
        names = [f"{i}:{n}" for i, n in enumerate(names)]
    texts = []
    for path in cfg.domains:
        rows = _rows(path, cfg.text_key)
        if not rows:
            raise ConfigError(f"mixture.domains: {path} has no rows with a string {cfg.text_key!r}")
        texts.append(rows)
    eval_texts = _rows(cfg.eval, cfg.text_key)
    if not eval_texts:
        raise ConfigError(f"mixture.eval: {cfg.eval} has no rows with a string {cfg.text_key!r}")
    held_out = {" ".join(t.lower().split()) for t in eval_texts}
    for path, rows in zip(cfg.domains, texts):
        shared = sum(" ".join(t.lower().split()) in held_out for t in rows)
        if shared:
            raise ConfigError(f"mixture.eval: {cfg.eval} shares {shared} row(s) with domain {path}; remove them "
                              f"first: tidal curate decontaminate --in {path} --out CLEAN.jsonl --set eval={cfg.eval}")
    return names, texts, eval_texts


class MixedBatches:
    """Batches drawn from several domains' token streams by smooth weighted round-robin (module docstring)."""

    def __init__(self, streams, cfg: ProxyConfig, seed: int):
        import torch

        for s in streams:
            if len(s) <= cfg.seq_len + 1:
                raise ValueError(f"a domain has {len(s)} characters; need more than seq_len+1={cfg.seq_len + 1}")
        self.streams, self.cfg = streams, cfg
        self.credit = [0.0] * len(streams)
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, mix: list[float]):
        import torch

        n = self.cfg.seq_len + 1
        rows = []
        for _ in range(self.cfg.batch_size):
            for d, p in enumerate(mix):
                self.credit[d] += p
            d = max((d for d, p in enumerate(mix) if p > 0), key=lambda d: self.credit[d])
            self.credit[d] -= 1.0
            start = int(torch.randint(0, len(self.streams[d]) - n, (1,), generator=self.gen))
            rows.append(self.streams[d][start : start + n])
        return torch.stack(rows)


class Problem:
    """The encoded inputs of one search, the meter, and proxy training on a mixture."""

    def __init__(self, cfg: MixtureConfig, names: list[str], texts: list[list[str]], eval_texts: list[str]):
        from tidal.models import tiny

        tok = tiny.build_tokenizer()
        self.cfg, self.names, self.k = cfg, names, len(names)
        self.streams = [_encode(tok, t) for t in texts]
        self.windows = windows(_encode(tok, eval_texts), cfg.proxy, cfg.eval)
        self.meter = Meter(cfg, len(self.windows))

    def evaluate(self, model) -> float:
        self.meter.evals += 1
        return held_out_loss(model, self.windows)

    def train(self, mix: list[float], seed: int, steps: int | None = None, model=None, opt=None, batches=None):
        """Train (a fresh proxy unless given) ``steps`` steps on ``mix``; returns (model, opt, batches)."""
        if model is None:
            model, opt = build_proxy(self.cfg.proxy, seed)
        batches = batches or MixedBatches(self.streams, self.cfg.proxy, seed)
        for _ in range(self.cfg.budget if steps is None else steps):
            train_step(model, opt, batches.next(mix))
            self.meter.steps += 1
        return model, opt, batches

    def loss_of(self, mix: list[float], seed: int) -> float:
        """Held-out loss of a fresh proxy trained ``budget`` steps on ``mix``."""
        model, _, _ = self.train(list(mix), seed)
        return self.evaluate(model)
