"""Parity of tidal's stages with TRL 1.16: preference losses, reward-model loss, assistant masks.

Run with a python that imports TRL 1.16 (``tidal bench trl``'s venv, ``.tidal_cache/bench-trl-venv``)::

    .tidal_cache/bench-trl-venv/bin/python benchmarks/_trl_stages_parity.py --out parity.json

``tests/stages/test_trl_parity.py`` runs it and asserts on the JSON. Nothing of TRL is re-implemented: each
TRL side is TRL's own method, called on fixed tensors through a stand-in ``self`` that carries only the
attributes the method reads:

- DPO (sigmoid, hinge, ipo): ``DPOTrainer._compute_loss(self, model, inputs)`` with ``precompute_ref_logps``;
  the "model" returns fixed per-token log-probs (a leaf tensor, zero outside the completion, as TRL's
  fused head returns them for label -100). tidal's side: ``dpo.sequence_logps``'s sum over the same
  tokens, then ``PREFERENCE_LOSSES``. Compared: loss and the gradient w.r.t. the per-token log-probs.
- SimPO: TRL 1.16 has it in ``CPOTrainer.cpo_loss`` (loss_type simpo, on average log-probs).
- Reward model: ``RewardTrainer.compute_loss`` with a "model" whose logits are fixed rewards.
- Assistant masks: a real ``SFTTrainer(assistant_only_loss=True)`` tokenizes the rows; its
  ``assistant_masks`` column against ``chat_data.encode_sft`` on the same tokenizer and template.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

# The script's own folder holds benchmarks/trl.py, which would shadow the trl package: the repo root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from tidal.stages.dpo_losses import PREFERENCE_LOSSES  # noqa: E402
from tidal.stages.rm_loss import bradley_terry_loss  # noqa: E402


class _Accel:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


def _fake(**attrs):
    return SimpleNamespace(accelerator=_Accel(), model=SimpleNamespace(training=True), _metrics=defaultdict(
        lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1, **attrs)


def fixed_case(seed: int = 0, pairs: int = 3, width: int = 9):
    """Per-token log-probs [2B, T-1] (chosen rows then rejected), completion masks [2B, T], ref logps."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand((2 * pairs, width - 1), generator=g, dtype=torch.float64) * 3
    mask = torch.zeros((2 * pairs, width), dtype=torch.long)
    for i in range(2 * pairs):
        start = 2 + i % 3
        mask[i, start: width - (i % 2)] = 1  # varied prompt and completion lengths
    ref = -torch.rand((2, pairs), generator=g, dtype=torch.float64) * 10
    return logp, mask, ref


def trl_dpo(loss_type: str, beta: float, logp, mask, ref):
    from trl import DPOTrainer

    leaf = logp.clone().requires_grad_(True)
    shift = mask[:, 1:]

    def model(**kw):
        lp = leaf * shift
        zeros = torch.zeros_like(lp)
        return SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    fake = _fake(aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                 loss_types=[loss_type], loss_weights=[1.0], beta=beta, use_weighting=False)
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref[0], "ref_rejected_logps": ref[1]}
    loss = DPOTrainer._compute_loss(fake, model, inputs, False)
    loss.backward()
    return float(loss.detach()), leaf.grad


def tidal_pref(loss_type: str, beta: float, gamma: float, logp, mask, ref):
    leaf = logp.clone().requires_grad_(True)
    logp_bt = torch.nn.functional.pad(leaf, (1, 0))  # tidal's layout: column 0 is never predicted
    m = mask.to(leaf.dtype)
    m[:, 0] = 0
    sums, counts = (logp_bt * m).sum(1), m.sum(1)
    n = len(sums) // 2
    loss = PREFERENCE_LOSSES.get(loss_type)(sums[:n], sums[n:], ref[0], ref[1], counts[:n], counts[n:],
                                            beta, gamma).mean()
    loss.backward()
    return float(loss.detach()), leaf.grad


def trl_simpo(beta: float, gamma: float, logp, mask):
    from trl.experimental.cpo import CPOTrainer

    leaf = logp.clone().requires_grad_(True)
    shift = mask[:, 1:].to(leaf.dtype)
    avg = (leaf * shift).sum(1) / shift.sum(1)
    n = len(avg) // 2
    fake = _fake(alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=0.0)
    losses, _, _ = CPOTrainer.cpo_loss(fake, avg[:n], avg[n:])
    loss = losses.mean()
    loss.backward()
    return float(loss.detach()), leaf.grad


def rm_parity() -> dict:
    from trl import RewardTrainer

    g = torch.Generator().manual_seed(1)
    rewards = torch.randn((8, 1), generator=g, dtype=torch.float64)
    out = {}
    for center in (None, 0.01):
        leaf = rewards.clone().requires_grad_(True)
        fake = _fake(args=SimpleNamespace(center_rewards_coefficient=center))
        loss = RewardTrainer.compute_loss(fake, lambda leaf=leaf, **kw: SimpleNamespace(logits=leaf),
                                          {"input_ids": torch.zeros((8, 3)), "attention_mask": torch.ones((8, 3))})
        loss.backward()
        mine = rewards.clone().requires_grad_(True)
        ours = bradley_terry_loss(mine[:4, 0], mine[4:, 0], center=center or 0.0)
        ours.backward()
        out[f"rm_center_{center}"] = {"loss_diff": abs(float(loss) - float(ours)),
                                      "grad_diff": float((leaf.grad - mine.grad).abs().max())}
    return out


MASK_ROWS = [
    {"messages": [{"role": "user", "content": "what is 2+3?"}, {"role": "assistant", "content": "5"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and 1+1?"},
                  {"role": "assistant", "content": "2"}]},
    {"prompt": [{"role": "user", "content": "name a color"}], "completion": [{"role": "assistant", "content": "red"}]},
]


def mask_parity() -> dict:
    import datasets
    from trl import SFTConfig, SFTTrainer

    from tidal.models import tiny
    from tidal.stages.chat_data import GENERATION_CHAT_TEMPLATE, encode_sft

    tok = tiny.build_chat_tokenizer()
    tok.chat_template = GENERATION_CHAT_TEMPLATE
    model = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                              intermediate_size=64), tok)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(MASK_ROWS):
            args = SFTConfig(output_dir=tmp, assistant_only_loss=True, report_to=[], use_cpu=True,
                             dataset_num_proc=None, max_length=None)
            trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list([row]),
                                 processing_class=tok)
            theirs = trainer.train_dataset[0]  # TRL folds assistant_masks into labels: -100 where the mask is 0
            their_mask = [int(label != -100) for label in theirs["labels"]]
            mine = encode_sft(tok, row, 10_000)
            out[f"mask_row_{i}"] = {"ids_equal": list(theirs["input_ids"]) == mine.ids,
                                    "mask_equal": their_mask == mine.mask,
                                    "num_assistant": sum(mine.mask)}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    import trl

    result = {"trl_version": trl.__version__}
    logp, mask, ref = fixed_case()
    for loss_type, beta in (("sigmoid", 0.1), ("sigmoid", 0.5), ("hinge", 0.1), ("ipo", 0.1), ("ipo", 0.7)):
        tl, tg = trl_dpo(loss_type, beta, logp, mask, ref)
        ml, mg = tidal_pref(loss_type, beta, 0.0, logp, mask, ref)
        result[f"{loss_type}_beta_{beta}"] = {"loss": ml, "loss_diff": abs(tl - ml),
                                              "grad_diff": float((tg - mg).abs().max())}
    for beta, gamma in ((2.0, 0.5), (2.5, 1.4)):
        tl, tg = trl_simpo(beta, gamma, logp, mask)
        ml, mg = tidal_pref("simpo", beta, gamma, logp, mask, ref)
        result[f"simpo_beta_{beta}"] = {"loss": ml, "loss_diff": abs(tl - ml),
                                        "grad_diff": float((tg - mg).abs().max())}
    result.update(rm_parity())
    result.update(mask_parity())
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
