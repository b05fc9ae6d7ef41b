"""Held-out checks of a model directory on a domain: what each stage of a chain adds.

- ``accuracy``: greedy answers to held-out questions (prompted through the tokenizer's chat template with
  the generation prompt, which for ``PLAIN_TEMPLATE`` is exactly RL's BOS + text), stripped, equal to the
  answer; the RL task's ``exact_match``.
- ``pref_acc``: the share of held-out preference pairs whose chosen completion has the higher summed
  log-probability (the model's own preference, no reference).
- ``corpus_nll``: per-token negative log-likelihood of held-out domain text (``text`` rows).

    python -m tidal.stages.evaluate runs/stages/sft/model --domain runs/stages/domain
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tidal.models import tiny
from tidal.stages.chat_data import encode_pair, encode_sft, read_rows
from tidal.stages.common import chunks
from tidal.stages.dpo import sequence_logps
from tidal.stages.sft import nll_sum


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 4, batch_size: int = 64) -> float:
    correct = 0
    tokenizer.padding_side = "left"
    for part in chunks(rows, batch_size):
        prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                                      add_generation_prompt=True, return_dict=True)["input_ids"])
                   for r in part]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        attn = (ids != tokenizer.pad_token_id).long()
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for r, new in zip(part, out[:, width:]):
            correct += tokenizer.decode(new, skip_special_tokens=True).strip() == str(r["answer"]).strip()
    return correct / len(rows)


@torch.no_grad()
def preference_accuracy(model, tokenizer, rows: list[dict], max_length: int = 128) -> float:
    pairs = [encode_pair(tokenizer, r, max_length) for r in rows]
    wins = 0
    for part in chunks(pairs, 64):
        pc, pr, _, _ = sequence_logps(model, part, max_length)
        wins += int((pc > pr).sum())
    return wins / len(pairs)


@torch.no_grad()
def corpus_nll(model, tokenizer, rows: list[dict], max_length: int = 128) -> float:
    examples = [encode_sft(tokenizer, r, max_length) for r in rows]
    total, count = 0.0, 0
    for part in chunks(examples, 32):
        s, n = nll_sum(model, part, max_length)
        total, count = total + float(s), count + n
    return total / count


def held_out_checks(model_dir: str | Path, domain: str | Path) -> dict[str, float]:
    """The three checks of the model at ``model_dir`` on the domain files under ``domain``."""
    model, tokenizer = tiny.load(model_dir)
    model.eval()
    domain = Path(domain)
    return {"accuracy": greedy_accuracy(model, tokenizer, read_rows(domain / "eval.jsonl")),
            "pref_acc": preference_accuracy(model, tokenizer, read_rows(domain / "pairs_eval.jsonl")),
            "corpus_nll": corpus_nll(model, tokenizer, read_rows(domain / "corpus_eval.jsonl"))}


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tidal.stages.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--domain", required=True)
    args = p.parse_args(argv)
    print(json.dumps(held_out_checks(args.model, args.domain), indent=2))


if __name__ == "__main__":
    main()
