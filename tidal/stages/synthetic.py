"""A small synthetic domain for the stage chain, built locally: two-number addition in words and digits.

Every stage gets the data it needs from one generator, with held-out questions no stage trains on:

- DAPT corpus (``corpus.jsonl``, ``{"text"}``): lines ``a+b=c``, the domain's raw text.
- SFT chats (``sft.jsonl``, ``{"messages"}``): ``what is a+b?`` -> ``c``.
- Preference pairs (``pairs.jsonl``, ``{"prompt", "chosen", "rejected"}``): the right sum against a near
  miss (off by 1 to 10, or digits swapped), the mistakes a partly trained model makes.
- RL questions (``rl.jsonl``, ``{"prompt", "answer"}``, for ``task.name=jsonl`` and ``exact_match``).
- Held out, on questions no stage trains on: ``eval.jsonl`` (greedy accuracy), ``pairs_eval.jsonl``
  (preference accuracy), ``corpus_eval.jsonl`` (the corpus's per-token loss).

    python -m tidal.stages.synthetic --out runs/stages/domain

Numbers are 0..``max_operand``; the tiny chat tokenizer spells every character of it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def question(a: int, b: int) -> str:
    return f"what is {a}+{b}?"


def near_miss(c: int, rng: random.Random) -> int:
    swapped = int(str(c)[::-1]) if c >= 10 else -1
    if swapped not in (-1, c) and rng.random() < 0.3:
        return swapped
    return max(0, c + rng.choice([-1, 1]) * rng.randint(1, 10))


def build(out: str | Path, num_sft: int = 2000, num_pairs: int = 2000, num_eval: int = 200,
          max_operand: int = 49, seed: int = 0) -> dict[str, Path]:
    """Write the domain's files under ``out``; returns their paths by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    held, train = pairs[:num_eval], pairs[num_eval:]

    def draw(n):
        return [train[rng.randrange(len(train))] for _ in range(n)]

    names = ("corpus", "sft", "pairs", "rl", "eval", "corpus_eval", "pairs_eval")
    files = {name: out / f"{name}.jsonl" for name in names}

    def corpus(pairs_ab):
        lines = [f"{a}+{b}={a + b}" for a, b in pairs_ab]
        return [{"text": "\n".join(lines[i: i + 8])} for i in range(0, len(lines), 8)]

    def prefs(pairs_ab):
        return [{"prompt": question(a, b), "chosen": str(a + b), "rejected": str(near_miss(a + b, rng))}
                for a, b in pairs_ab]

    rows = {
        "corpus": corpus(train),
        "sft": [{"messages": [{"role": "user", "content": question(a, b)},
                              {"role": "assistant", "content": str(a + b)}]} for a, b in draw(num_sft)],
        "pairs": prefs(draw(num_pairs)),
        "rl": [{"prompt": question(a, b), "answer": str(a + b)} for a, b in train],
        "eval": [{"prompt": question(a, b), "answer": str(a + b)} for a, b in held],
        "corpus_eval": corpus(held),
        "pairs_eval": prefs(held),
    }
    for name in names:
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
    return files


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tidal.stages.synthetic", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-sft", type=int, default=2000, help="SFT chats")
    p.add_argument("--num-pairs", type=int, default=2000, help="training preference pairs")
    p.add_argument("--num-eval", type=int, default=200, help="held-out questions (and their pairs)")
    args = p.parse_args(argv)
    for name, path in build(args.out, num_sft=args.num_sft, num_pairs=args.num_pairs, num_eval=args.num_eval,
                            seed=args.seed).items():
        print(f"{name:12s} {path}")


if __name__ == "__main__":
    main()
