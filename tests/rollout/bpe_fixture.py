"""A small BPE tokenizer trained in-process (no files, no hub), for tests where merges matter.

The tiny model's tokenizer is one token per character, so ``encode(decode(ids)) == ids`` always holds
there and re-tokenization drift cannot show. A BPE vocabulary has multi-character tokens: a sampled
``"1" "2"`` decodes to ``"12"``, which re-encodes as the single merged token, so decoding an episode's
context and re-encoding it changes its ids (the classic agentic-RL bug that token-in/token-out avoids).
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
WORDS = ("the", "sum", "of", "and", "is", "add", "then", "answer", "call", "tool", "result", "error", "timeout")
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=()<>/:.,"


def training_lines(n: int = 400, seed: int = 0) -> list[str]:
    """Arithmetic expressions, tool-call-like tags and words: the text the merges are learned from."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        lines.append(f"{a}+{b}={a + b} {words} <c>{a}*{b % 10}</c>={a * (b % 10)}")
    return lines


def build_bpe_tokenizer(vocab_size: int = 240, seed: int = 0) -> PreTrainedTokenizerFast:
    """BPE over raw text (no pre-tokenizer: merges may span spaces and digits), decoded by fusing
    token strings, so ``decode`` is the exact text of the ids; pad=0, bos=1, eos=2 as in ``tiny``."""
    core = Tokenizer(models.BPE(unk_token=None))
    core.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=list(ALPHABET), show_progress=False)
    core.train_from_iterator(training_lines(seed=seed), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                  clean_up_tokenization_spaces=False)
    tok.padding_side = "left"
    return tok
