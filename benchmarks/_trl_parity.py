"""Step parity between tidal's Trainer and TRL's GRPOTrainer: the same loss and gradient for the same data?

Run with the TRL benchmark's own virtual environment (it has TRL 1.16 and tidal, editable)::

    .tidal_cache/bench-trl-venv/bin/python benchmarks/_trl_parity.py [--out parity.json]

(``tests/test_trl_parity.py`` runs it and asserts on the JSON; the leading underscore keeps
``tidal bench`` from listing it as a benchmark.)

Both sides come from one source, as in ``tidal bench trl``: the quickstart recipe resolved by
``benchmarks/trl.py`` (``resolve``) with a toy model (hidden 32, one layer) and 3 prompts x 4 samples.
tidal's side is its ``Trainer`` built with the recipe's ``algo``/``trainer`` config (grpo advantages,
ppo_clip 0.2/0.28, token_mean, skip_zero_adv_groups, dual clip 3); TRL's side is a real
``trl.GRPOTrainer`` built exactly as ``benchmarks/trl_grpo.py`` builds it (its ``grpo_config`` from
``trl_settings``: loss_type dapo, beta 0, num_iterations 1, scale_rewards group, CPU, float32), from
the same saved weights.

The batch is crafted, not sampled: prompts ``[bos, chars...]`` (left-padded for TRL, right-padded
rows for tidal), completions of 2 to 5 tokens each ending in EOS, rewards from tidal's ``exact_match``
(``trl_grpo.tidal_reward``, as the benchmark's TRL run scores) on the completion text. One batch has all
three groups informative; the other has one group all wrong (zero advantage).

How each side's loss and gradient are taken (nothing is re-implemented):

- TRL: ``trainer._compute_loss(model, inputs)`` then ``backward()``, which is what
  ``GRPOTrainer.compute_loss`` and transformers' ``training_step`` do once generation is done
  (``training_step`` itself would call ``_prepare_inputs`` and generate). ``inputs`` carries the keys
  ``_generate_and_score_completions`` returns: prompt_ids/mask, completion_ids/mask, advantages,
  num_items_in_batch (completion tokens of the whole batch), and old_per_token_logps only when the
  data is stale (on-policy with num_iterations 1, TRL leaves it out and uses the detached log-probs).
  ``current_gradient_accumulation_steps`` is set to 1, the value TRL's training loop sets with
  gradient_accumulation_steps 1. Advantages use TRL's formula from ``_generate_and_score_completions``
  (scale_rewards group): (r - group nanmean) / (TRL's ``nanstd`` (unbiased) + 1e-4).
- tidal: the real ``Trainer.step(batch)`` on a ``TrainBatch`` from ``build_train_batch`` (what the
  controller does), on a fresh load of the same weights. The gradient is read by an optimizer
  step-pre-hook, i.e. after the trainer's backward and clipping and right before the update; the
  update then happens (the model is discarded). ``optim.grad_clip`` is set to infinity so that
  clipping is the identity (both frameworks clip the total norm outside the loss, TRL in the HF
  loop, to the same max_grad_norm; it is no part of "the loss's gradient"). The loss is the step's
  ``train/loss``; advantages come from ``Trainer._advantages``, the trainer's own call.

Each comparison is made twice: TRL with its own advantages (eps 1e-4), where everything differs by
the advantage eps (relative ~1e-4 / std), and TRL fed tidal's advantages, where only the loss
machinery is compared (float error). Cases:

(a) on-policy (behaviour log-prob = current log-prob), all groups informative: the normalizers
    coincide (completion tokens of the batch), so losses and gradients should be equal.
(b) on-policy, one zero-advantage group: TRL keeps the group (its gradient is exactly 0) but counts
    its tokens in the normalizer; tidal drops it (skip_zero_adv_groups). Gradients parallel, with
    norm ratio tidal/TRL = tokens(all groups) / tokens(informative groups).
(c) stale: behaviour log-probs from a perturbed copy of the weights (async, eta = 1), so both clip
    sides and tidal's dual clip are active. TRL has no dual clip: with tidal's dual_clip = None they
    should agree; with dual_clip = 3 the difference should be exactly the tokens where it binds
    (A < 0 and ratio > 3: tidal's loss there is the constant -3A, no gradient). That is checked by
    masking those tokens out of TRL's loss through its ``tool_mask`` (loss mask only, not attention,
    normalizer unchanged): the gradients must then agree, and the losses differ by sum(-3A)/tokens.

Writes (and prints) one JSON object; see ``compare``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import math
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent

TOY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
       "model.intermediate_size=64", "rollout.prompts_per_step=3", "rollout.group_size=4"]

# (prompt, answer, completions): tidal's exact_match scores them. Lengths vary (2..5 tokens with EOS).
INFORMATIVE = [
    ("3+4=", "7", ["7", "8", "17", "7"]),
    ("12+30=", "42", ["42", "4", "402", "24"]),
    ("45+67=", "112", ["112", "1120", "12", "112"]),
]
WITH_ZERO_GROUP = [INFORMATIVE[0], ("12+30=", "42", ["41", "4", "4020", "24"]), INFORMATIVE[2]]

PERTURB_STD = 4.0
"""Noise added to a copy of the weights for the stale behaviour policy of case (c), in units of (each
tensor's std + 0.02). At 4 the ratios span about 0.14 to 11: on the 37 tokens, 27% are clipped low,
19% high and 16% (6 tokens) hit the dual clip (at 0.5 nothing reaches ratio 3; at 2 still nothing)."""


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the JSON here too")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--perturb-std", type=float, default=PERTURB_STD)
    args = parser.parse_args(argv)
    # benchmarks/trl.py would shadow the ``trl`` package: drop this directory from the path (as trl_grpo does)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl.trainer.utils import nanstd

    from tidal.models import tiny
    from tidal.train.batch import build_train_batch
    from tidal.train.trainer import Trainer
    from tidal.types import Group, Prompt, Trajectory

    bench = load_module(HERE / "trl.py", "tidal_benchmark_trl_for_parity")
    grpo = bench.grpo  # benchmarks/trl_grpo.py: grpo_config, tidal_reward, with_bos

    s, cfg = bench.resolve(TOY, seed=0)
    work = Path(tempfile.mkdtemp(prefix="tidal-trl-parity-"))
    model_dir = work / "model"
    tokenizer = tiny.build_tokenizer()
    tiny.save(tiny.build_model(cfg.model, tokenizer), tokenizer, model_dir)
    settings = bench.trl_settings(cfg, s, model_dir, work)
    G = settings["group_size"]
    assert settings["prompts_per_step"] * G == sum(len(c) for _, _, c in INFORMATIVE)

    # ---- TRL: the trainer exactly as benchmarks/trl_grpo.py builds it ---------------------------------
    torch.manual_seed(settings["seed"])
    tok = PreTrainedTokenizerFast.from_pretrained(settings["model_dir"], local_files_only=True)
    tok.padding_side = "left"
    trl_model = AutoModelForCausalLM.from_pretrained(settings["model_dir"], local_files_only=True, dtype=torch.float32)
    rows = grpo.with_bos([{"prompt": p, "answer": a, "question": p} for p, a, _ in INFORMATIVE], tok.bos_token)
    reward = grpo.tidal_reward(settings["reward"]["name"], settings["reward"]["params"])  # tidal's exact_match
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(model=trl_model, reward_funcs=reward,
                                  args=grpo.grpo_config(settings, str(work / "trl")),
                                  train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # what TRL's loop sets with gradient_accumulation_steps=1
    trainer.model.train()
    assert trainer.loss_type == "dapo" and trainer.beta == 0.0 and trainer.num_iterations == 1
    assert trainer.epsilon_low == settings["eps_low"] and trainer.epsilon_high == settings["eps_high"]
    temperature = trainer.temperature
    assert temperature == cfg.trainer.temperature, (temperature, cfg.trainer.temperature)

    def encode(spec):
        """Per row: prompt ids [bos, chars...] (TRL's own tokenization of the bos-prefixed text, as in
        trl_grpo), completion ids chars + [eos], the reward, and the group index."""
        out = []
        for g, (prompt, answer, completions) in enumerate(spec):
            p_ids = tok(text=tok.bos_token + prompt)["input_ids"]
            assert p_ids[0] == tok.bos_token_id and len(p_ids) == len(prompt) + 1
            rewards = reward(completions, [answer] * len(completions), question=[prompt] * len(completions))
            for c, r in zip(completions, rewards, strict=True):
                c_ids = tok(text=c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                assert len(c_ids) == len(c) + 1
                out.append({"group": g, "prompt": prompt, "answer": answer, "text": c, "prompt_ids": p_ids,
                            "completion_ids": c_ids, "reward": r})
        return out

    @torch.no_grad()
    def row_logps(model, row) -> list[float]:
        """log pi(token | prefix) of each completion token, one unpadded row at a time (a plain HF
        forward, independent of both trainers' log-prob code)."""
        ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        return logp[len(row["prompt_ids"]) - 1:].tolist()

    def trl_advantages(rows_) -> torch.Tensor:
        """TRL 1.16 _generate_and_score_completions, scale_rewards='group', sum_then_normalize."""
        rewards = torch.tensor([r["reward"] for r in rows_], dtype=torch.float32)
        mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        return (rewards - mean) / (std + 1e-4)

    def pad(seqs, value, side):
        width = max(len(x) for x in seqs)
        fill = [[value] * (width - len(x)) for x in seqs]
        return torch.tensor([f + list(x) if side == "left" else list(x) + f for f, x in zip(fill, seqs, strict=True)])

    def trl_inputs(rows_, adv_b, old=None, loss_keep=None):
        completion_mask = pad([[1] * len(r["completion_ids"]) for r in rows_], 0, "right")
        inputs = {
            "prompt_ids": pad([r["prompt_ids"] for r in rows_], tok.pad_token_id, "left"),
            "prompt_mask": pad([[1] * len(r["prompt_ids"]) for r in rows_], 0, "left"),
            "completion_ids": pad([r["completion_ids"] for r in rows_], tok.pad_token_id, "right"),
            "completion_mask": completion_mask,
            "advantages": adv_b.float(),
            "num_items_in_batch": completion_mask.sum(),
        }
        if old is not None:
            inputs["old_per_token_logps"] = pad(old, 0.0, "right").float()
        if loss_keep is not None:  # loss mask only (TRL multiplies it into completion_mask for the loss)
            inputs["tool_mask"] = pad(loss_keep, 1, "right")
        return inputs

    def trl_step(inputs):
        model = trainer.model
        model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        clip = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("clip_ratio")}
        return loss.item(), grads, clip

    def tidal_step(spec, rows_, behav, algo):
        """tidal's real Trainer.step on build_train_batch's batch; gradient read by an optimizer pre-hook."""
        groups = []
        for g, (prompt, answer, _) in enumerate(spec):
            trajs = [Trajectory(prompt_uid=f"p{g}", sample_index=i, prompt_ids=r["prompt_ids"],
                                token_ids=r["completion_ids"], logprobs=b, versions=[0] * len(b),
                                finish_reason="stop", text=r["text"], reward=r["reward"])
                     for i, (r, b) in enumerate((r, b) for r, b in zip(rows_, behav, strict=True) if r["group"] == g)]
            groups.append(Group(Prompt(f"p{g}", prompt, answer), trajs))
        batch, batch_metrics = build_train_batch(groups, algo, tok.pad_token_id)
        kept = [i for i, r in enumerate(rows_) if r["group"] in set(batch.group_index_b.tolist())]
        model, _ = tiny.load(model_dir)
        optim = dataclasses.replace(cfg.optim, grad_clip=math.inf)  # clipping: the identity (see docstring)
        t = Trainer(model, algo, optim, cfg.trainer)
        grads: dict = {}
        t.optimizer.register_step_pre_hook(
            lambda opt, a, k: grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()}))
        adv = t._advantages(batch, torch.arange(batch.num_sequences), batch.rewards_b, None)
        metrics = t.step(batch)
        assert grads, "the optimizer step was not reached"
        return {"loss": metrics["train/loss"], "grads": grads, "adv": adv, "kept": kept, "metrics": metrics,
                "tokens": batch.num_response_tokens, **batch_metrics}

    def flat(grads):
        return torch.cat([g.reshape(-1).double() for g in grads.values()])

    def compare(tidal_out, trl_loss, trl_grads, scale=1.0):
        """tidal vs TRL; ``scale`` multiplies TRL's loss and gradient first (case b's token ratio)."""
        a, b = flat(tidal_out["grads"]), flat(trl_grads) * scale
        assert tidal_out["grads"].keys() == trl_grads.keys()
        per_param = {n: (tidal_out["grads"][n].double() - trl_grads[n].double() * scale).abs().max().item()
                     for n in trl_grads}
        return {
            "loss_tidal": tidal_out["loss"], "loss_trl": trl_loss * scale,
            "loss_abs_diff": abs(tidal_out["loss"] - trl_loss * scale),
            "grad_max_abs_diff": max(per_param.values()),
            "grad_max_abs": max(a.abs().max().item(), b.abs().max().item()),
            "grad_max_abs_diff_per_param": per_param,
            "grad_cosine": (a @ b / (a.norm() * b.norm())).item(),
            "grad_norm_ratio": (a.norm() / b.norm()).item(),  # tidal / TRL
            "grad_norm_tidal": a.norm().item(), "grad_norm_trl": b.norm().item(),
        }

    def full_adv(tidal_out, n):
        """tidal's advantages laid out on all n TRL rows (0 on rows of dropped groups)."""
        out = torch.zeros(n)
        out[tidal_out["kept"]] = tidal_out["adv"].float()
        return out

    base = tiny.load(model_dir)[0]
    report: dict = {"versions": {"trl": trl.__version__, "torch": torch.__version__,
                                 "transformers": transformers.__version__},
                    "settings": {k: settings[k] for k in ("group_size", "prompts_per_step", "temperature",
                                                           "eps_low", "eps_high")},
                    "algo": dataclasses.asdict(cfg.algo)}

    # ---- advantages --------------------------------------------------------------------------------------
    adv_report = {}
    for name, spec in (("informative", INFORMATIVE), ("with_zero_group", WITH_ZERO_GROUP)):
        rows_ = encode(spec)
        rewards = torch.tensor([r["reward"] for r in rows_]).view(-1, G)
        std = rewards.std(dim=1, unbiased=True).repeat_interleave(G)
        trl_adv = trl_advantages(rows_)
        out = tidal_step(spec, rows_, [row_logps(base, r) for r in rows_], cfg.algo)
        tid = full_adv(out, len(rows_))
        # TRL's advantage with tidal's eps: (r - mean) / (std + 1e-6) = trl_adv * (std + 1e-4) / (std + 1e-6)
        rescaled = torch.where(std > 0, trl_adv * (std + 1e-4) / (std + cfg.algo.adv_eps), trl_adv)
        adv_report[name] = {
            "rewards": rewards.tolist(), "trl": trl_adv.tolist(), "tidal": tid.tolist(),
            "max_abs_diff": (trl_adv - tid).abs().max().item(),
            "max_abs_diff_same_eps": (rescaled - tid).abs().max().item(),
            "eps": {"trl": 1e-4, "tidal": cfg.algo.adv_eps},
        }
    report["advantages"] = adv_report

    # ---- (a) on-policy, all groups informative; (b) on-policy, one zero-advantage group -------------------
    cases = {}
    for name, spec in (("a_on_policy", INFORMATIVE), ("b_zero_adv_group", WITH_ZERO_GROUP)):
        rows_ = encode(spec)
        behav = [row_logps(base, r) for r in rows_]
        out = tidal_step(spec, rows_, behav, cfg.algo)
        all_tokens = sum(len(r["completion_ids"]) for r in rows_)
        ratio = all_tokens / out["tokens"]
        own = trl_step(trl_inputs(rows_, trl_advantages(rows_)))
        same = trl_step(trl_inputs(rows_, full_adv(out, len(rows_))))
        cases[name] = {
            "tokens_all_groups": all_tokens, "tokens_informative_groups": out["tokens"],
            "zero_adv_groups": out["algo/zero_adv_groups"], "expected_norm_ratio": ratio,
            "trl_own_advantages": compare(out, own[0], own[1]),
            "same_advantages": compare(out, same[0], same[1]),
            "same_advantages_trl_scaled": compare(out, same[0], same[1], scale=ratio),
            "tidal_ratio_mean": out["metrics"]["algo/ratio_mean"], "tidal_clip_frac": out["metrics"]["algo/clip_frac"],
        }

    # ---- (c) stale behaviour log-probs from a perturbed copy of the weights -------------------------------
    stale = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * args.perturb_std * (p.std() + 0.02))
    rows_ = encode(INFORMATIVE)
    old = [row_logps(stale, r) for r in rows_]
    cur = [row_logps(base, r) for r in rows_]
    dual = cfg.algo.dual_clip
    assert dual is not None, "the recipe's dual clip is expected on (case c compares it)"
    with_dual = tidal_step(INFORMATIVE, rows_, old, cfg.algo)
    no_dual = tidal_step(INFORMATIVE, rows_, old, dataclasses.replace(cfg.algo, dual_clip=None))
    adv_same = full_adv(with_dual, len(rows_))
    # tokens where tidal's dual clip binds: A < 0 and ratio > c (then TRL's term -A r exceeds the cap -c A)
    binds = [[float(a < 0 and math.exp(c - o) > dual) for c, o in zip(cr, orow, strict=True)]
             for a, cr, orow in zip(adv_same.tolist(), cur, old, strict=True)]
    n_tokens = sum(len(r["completion_ids"]) for r in rows_)
    capped_loss = sum(-dual * a * sum(b) for a, b in zip(adv_same.tolist(), binds, strict=True)) / n_tokens
    ratios = [math.exp(c - o) for cr, orow in zip(cur, old, strict=True) for c, o in zip(cr, orow, strict=True)]
    own = trl_step(trl_inputs(rows_, trl_advantages(rows_), old=old))
    same = trl_step(trl_inputs(rows_, adv_same, old=old))
    masked = trl_step(trl_inputs(rows_, adv_same, old=old, loss_keep=[[1 - x for x in b] for b in binds]))
    explained = compare(with_dual, masked[0], masked[1])
    explained["loss_abs_diff_minus_cap_term"] = abs(with_dual["loss"] - masked[0] - capped_loss)
    cases["c_stale"] = {
        "perturb_std": args.perturb_std, "tokens": n_tokens,
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        "dual_clip_tokens": int(sum(map(sum, binds))), "dual_clip_cap_loss_term": capped_loss,
        "tidal_metrics": {k: v for k, v in with_dual["metrics"].items() if "clip" in k or "ratio" in k},
        "trl_clip_metrics": same[2],
        "dual_clip_none": {"trl_own_advantages": compare(no_dual, own[0], own[1]),
                           "same_advantages": compare(no_dual, same[0], same[1])},
        "dual_clip_on": {"trl_own_advantages": compare(with_dual, own[0], own[1]),
                         "same_advantages": compare(with_dual, same[0], same[1]),
                         "trl_without_dual_clipped_tokens": explained},
    }
    report["cases"] = cases
    report["seconds"] = time.perf_counter() - start
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
