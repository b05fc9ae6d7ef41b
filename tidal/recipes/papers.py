"""The papers' recipes as presets: each paper's algorithm settings on the quickstart's tiny model and task.

A preset changes only what its paper defines about the *algorithm* (estimator, loss, aggregation,
clip ranges, KL, filters, optimizer constants, staleness); scale knobs (model, task, lr, group size,
lengths) stay the quickstart's so every recipe runs on a laptop CPU in minutes. To run a paper's
recipe at its own scale, override those (``--set model.path=... rollout.group_size=16 optim.lr=1e-6``);
the paper's values for them are listed in the sources, which ``tidal recipes show NAME`` prints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidal.config import set_key
from tidal.recipes import RECIPES
from tidal.recipes.quickstart import quickstart
from tidal.system.config import RunConfig

SOURCES: dict[str, dict[str, str]] = {}
"""recipe name -> {config key it sets: where the value comes from}."""

NOTES: dict[str, list[str]] = {}
"""recipe name -> the paper's scale settings the CPU preset deliberately does not copy."""

DEEPSEEKMATH = "DeepSeekMath (arXiv 2402.03300)"
DR_GRPO = "Dr. GRPO (arXiv 2503.20783)"
DAPO = "DAPO (arXiv 2503.14476)"
MAGISTRAL = "Magistral (arXiv 2506.10910)"
MINIMAX = "MiniMax-M1 (arXiv 2506.13585)"
GSPO = "GSPO (arXiv 2507.18071)"
AREAL = "AReaL (arXiv 2505.24298)"


def preset(name: str, summary: str, settings: dict[str, tuple[Any, str]], notes: list[str],
           base: Callable[[], RunConfig] = quickstart) -> None:
    """Register recipe ``name``: ``base()`` with ``settings`` ({key: (value, source)}) applied."""

    def build() -> RunConfig:
        cfg = base()
        for key, (value, _) in settings.items():
            set_key(cfg, key, value)
        return cfg

    build.__doc__ = summary
    build.__name__ = name
    SOURCES[name] = {key: source for key, (_, source) in settings.items()}
    NOTES[name] = notes
    RECIPES.register(name)(build)


preset("grpo", "GRPO as DeepSeekMath defines it: group-normalized advantages, symmetric clip, k3 KL loss.", {
    "algo.advantage": ("grpo", f"{DEEPSEEKMATH} sec. 4.1.2: (r - mean) / std within the group"),
    "algo.policy_loss": ("ppo_clip", f"{DEEPSEEKMATH} eq. 3: PPO's clipped surrogate"),
    "algo.eps_low": (0.2, f"{DEEPSEEKMATH} eq. 3 with PPO's epsilon 0.2"),
    "algo.eps_high": (0.2, f"{DEEPSEEKMATH}: symmetric clip"),
    "algo.dual_clip": (None, f"{DEEPSEEKMATH}: no dual clip"),
    "algo.loss_agg": ("seq_mean_token_mean", f"{DEEPSEEKMATH} eq. 3: 1/G sum_i 1/|o_i| sum_t"),
    "algo.kl_coef": (0.04, f"{DEEPSEEKMATH} sec. 4.2: beta = 0.04"),
    "algo.kl_estimator": ("k3", f"{DEEPSEEKMATH} eq. 4: the unbiased estimator pi_ref/pi - log(pi_ref/pi) - 1"),
    "rollout.max_staleness": (0, f"{DEEPSEEKMATH}: on-policy, one update per exploration stage"),
    "system.mode": ("sync", f"{DEEPSEEKMATH}: generate, then train"),
}, ["paper: 64 samples per question, lr 1e-6, batch 1024, max length 1024 (sec. 4.2)"])

preset("dr_grpo", "Dr. GRPO: no std normalization and a constant length normalizer (no length or difficulty bias).", {
    "algo.advantage": ("dr_grpo", f"{DR_GRPO} sec. 3.2: A = r - mean(r), no division by the std"),
    "algo.policy_loss": ("ppo_clip", f"{DR_GRPO}: the clipped surrogate"),
    "algo.eps_low": (0.2, f"{DR_GRPO}: PPO's 0.2"),
    "algo.eps_high": (0.2, f"{DR_GRPO}: symmetric clip"),
    "algo.dual_clip": (None, f"{DR_GRPO}: no dual clip"),
    "algo.loss_agg": ("seq_mean_token_sum_norm", f"{DR_GRPO} sec. 3.2: sum over tokens / a constant (the budget)"),
    "algo.max_gen_len": (6, f"{DR_GRPO}: the generation budget (here rollout.max_new_tokens)"),
    "algo.kl_coef": (0.0, f"{DR_GRPO} sec. 3.2: no KL term (rule-based rewards)"),
}, ["paper: Qwen2.5-Math, 8 samples per prompt, lr 1e-6, context 4096 (sec. 4)"])

preset("dapo", "DAPO: clip-higher, dynamic sampling, token-level loss, overlong reward shaping, no KL.", {
    "algo.advantage": ("grpo", f"{DAPO}: group-normalized advantage, as GRPO"),
    "algo.policy_loss": ("ppo_clip", f"{DAPO}: the clipped surrogate with decoupled clip range"),
    "algo.eps_low": (0.2, f"{DAPO} sec. 3.1: epsilon_low 0.2"),
    "algo.eps_high": (0.28, f"{DAPO} sec. 3.1: clip-higher, epsilon_high 0.28"),
    "algo.dual_clip": (None, f"{DAPO}: no dual clip in the objective"),
    "algo.loss_agg": ("token_mean", f"{DAPO} sec. 3.3: token-level policy gradient loss"),
    "algo.kl_coef": (0.0, f"{DAPO} sec. 2.3: KL penalty removed"),
    "rollout.dynamic_sampling": (True, f"{DAPO} sec. 3.2: over-sample and drop groups with accuracy 0 or 1"),
    "reward.name": ("compose", f"{DAPO} sec. 3.4: correctness plus the soft overlong penalty"),
    "reward.params": ({"terms": [{"reward": "exact_match"},
                                 {"reward": "length", "params": {"max_len": 6, "cache_len": 2}}]},
                      f"{DAPO} eq. 13: penalty in the last L_cache tokens before L_max (paper 4096 / 20480; "
                      "here 2 / 6 tokens)"),
}, ["paper: Qwen2.5-32B, 16 samples per prompt, 512 prompts per batch, lr 1e-6, L_max 20480 (sec. 4.1)"])

preset("magistral", "Magistral: no KL, group-length loss normalization, minibatch advantage normalization.", {
    "algo.advantage": ("magistral", f"{MAGISTRAL} sec. 2.1: group mean baseline, then normalized per minibatch"),
    "algo.policy_loss": ("ppo_clip", f"{MAGISTRAL} sec. 2.1"),
    "algo.eps_low": (0.2, f"{MAGISTRAL} sec. 2.1: epsilon_low 0.2"),
    "algo.eps_high": (0.28, f"{MAGISTRAL} sec. 2.1: epsilon_high raised to ~0.26-0.28 (clip-higher)"),
    "algo.dual_clip": (None, f"{MAGISTRAL}: no dual clip"),
    "algo.loss_agg": ("group_length", f"{MAGISTRAL} sec. 2.1: divide by the total length of the group's outputs"),
    "algo.kl_coef": (0.0, f"{MAGISTRAL} sec. 2.1: KL divergence penalty eliminated"),
    "algo.skip_zero_adv_groups": (True, f"{MAGISTRAL} sec. 2.1: filter groups with zero advantage"),
    "trainer.num_minibatches": (2, f"{MAGISTRAL} sec. 2.1: advantages normalized within each minibatch"),
}, ["paper: Mistral Medium 3; format, correctness, length and language rewards (sec. 2.2)"])

preset("cispo", "MiniMax-M1's CISPO: clip the importance weight (stop-gradient), never drop a token's gradient.", {
    "algo.advantage": ("grpo", f"{MINIMAX} sec. 3.1: group-relative advantage"),
    "algo.policy_loss": ("cispo", f"{MINIMAX} sec. 3.1: the CISPO objective"),
    "algo.loss_agg": ("token_mean", f"{MINIMAX} sec. 3.1: normalized by the total token count, 1 / sum_i |o_i|"),
    "algo.eps_low_is": (1.0, f"{MINIMAX} sec. 3.1: no lower bound in practice"),
    "algo.eps_high_is": (4.0, "MiniMax-M1 tunes epsilon_high_IS without publishing it; 4.0 from ScaleRL (arXiv "
                              "2510.13786)"),
    "algo.kl_coef": (0.0, f"{MINIMAX}: no KL term"),
    "optim.betas": ([0.9, 0.95], f"{MINIMAX}: AdamW beta2 = 0.95"),
    "optim.eps": (1e-15, f"{MINIMAX}: AdamW epsilon 1e-15 (their gradients are tiny; a larger epsilon mutes them)"),
}, ["paper: the LM head runs in FP32; tidal's log-probs are always computed in FP32"])

preset("gspo", "GSPO: sequence-level importance ratio (length-normalized) with a tiny clip range.", {
    "algo.advantage": ("grpo", f"{GSPO}: group-normalized advantage, as GRPO"),
    "algo.policy_loss": ("gspo", f"{GSPO}: sequence ratio s_i = (pi / pi_old)^(1/|y_i|), clipped per sequence"),
    "algo.eps_low": (3e-4, f"{GSPO} sec. 5.1: clipping range 3e-4"),
    "algo.eps_high": (4e-4, f"{GSPO} sec. 5.1: clipping range 4e-4"),
    "algo.loss_agg": ("seq_mean_token_mean", f"{GSPO}: the objective averages over sequences"),
    "algo.dual_clip": (None, f"{GSPO}: no dual clip"),
    "algo.kl_coef": (0.0, f"{GSPO}: no KL term"),
    "trainer.num_minibatches": (2, f"{GSPO}: each rollout batch is split into 4 minibatches for gradient updates"),
}, ["paper: Qwen3-30B-A3B, 4 minibatches per rollout batch"])

preset("areal", "AReaL: fully asynchronous RL with decoupled PPO and staleness bound eta = 4.", {
    "algo.advantage": ("grpo", f"{AREAL}: group-normalized advantages"),
    "algo.policy_loss": ("decoupled_ppo", f"{AREAL}: the decoupled PPO objective"),
    "algo.eps_low": (0.2, f"{AREAL}: PPO clip 0.2"),
    "algo.eps_high": (0.2, f"{AREAL}: symmetric clip"),
    "algo.dual_clip": (None, f"{AREAL}: no dual clip"),
    "algo.behav_weight_cap": (5.0, f"{AREAL} example configs: behav_imp_weight_cap 5"),
    "algo.kl_coef": (0.0, f"{AREAL}: no KL term"),
    "rollout.max_staleness": (4, f"{AREAL}: staleness eta = 4 keeps accuracy while keeping most of the throughput"),
    "system.mode": ("async", f"{AREAL}: generation never waits for training"),
    "trainer.num_minibatches": (4, "AReaL's example configs: ppo_n_minibatches 4"),
}, ["paper: interruptible generation, 16 samples per prompt, 512 prompts per batch"])
