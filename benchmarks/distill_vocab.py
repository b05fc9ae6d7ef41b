"""What a k-sparse teacher store keeps and costs at a realistic vocabulary (``tidal bench distill``'s tiny
models have 54 tokens, where top-32 keeps nearly everything and saves little).

Nothing can be downloaded here, so the teacher is built locally: a byte-level BPE tokenizer of
``vocab_size`` tokens (Hugging Face ``tokenizers``) trained on this Python's own standard-library sources
(``*.py`` directly under the stdlib directory, sorted by name; the last ``heldout_files`` of them held out),
and a small Qwen2 causal LM trained on the rest for ``steps`` steps. The model saved at
``student_step`` plays the student (same architecture and vocabulary, less trained). On held-out windows:

- ``info_loss`` at each k: mean KL from the full teacher to its k-sparse reading (``algo/distill``), what
  the store throws away;
- ``residual``: the teacher's mean mass outside its top k; ``covered``: how often the real next token is
  among the top k;
- ``objective_gap``: the k-sparse loss the student would train on (tail bucket, fp16 log-probs, as
  stored) over the full forward KL, minus 1, on the same student parameters: what the sparse target
  changes, with no training noise;
- bytes per position of the store (k x 4 + 4) against the full fp32 distribution (4 x V).

What it does not do: train a student on the store (a CPU-trained language model of this size is far
from a real teacher, and its flatter distribution leaves more mass in the tail than a strong LLM's would,
so the losses here lean pessimistic); ``tidal bench distill_sparse`` trains k-sparse and full-KL students
at a 4,096-token vocabulary with a peaked teacher. Seconds are measured on a shared machine.

    tidal bench distill_vocab [--set vocab_size=8192] [--set steps=300] [--set ks=[1,8,32,256]]
"""

from __future__ import annotations

import dataclasses
import random
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidal.algo.distill import (
    bytes_per_position,
    full_bytes_per_position,
    full_forward_kl,
    sparse_forward_kl,
    sparse_information_loss,
    topk_sparsify,
)
from tidal.bench import load
from tidal.config import apply_overrides

train_lm = load("_lm").train_lm  # benchmarks/_lm.py

DESCRIPTION = "k-sparse teacher store at a realistic vocabulary: bytes, information lost, loss change (local BPE LM)"


@dataclass
class Settings:
    """This benchmark's knobs (``--set KEY=VALUE``)."""

    seed: int = 0
    """Initialisation and the order of training windows."""
    vocab_size: int = 8192
    """BPE vocabulary of the locally built teacher (Qwen2's is 151,936; the tiny models' 54)."""
    corpus_files: int = 168
    """Standard-library ``*.py`` files read (sorted by name), ~4.7 MB at 168 on Python 3.11."""
    heldout_files: int = 16
    """Of those, the last ones: held out for the measurements."""
    hidden_size: int = 128
    """The teacher's width (4 heads, MLP 4x, tied embeddings: at 8,192 tokens the embedding is 1M of ~1.4M
    parameters)."""
    num_layers: int = 2
    """The teacher's depth."""
    seq_len: int = 128
    """Tokens per training and held-out window."""
    batch_size: int = 16
    """Windows per training step (drawn at random from the training windows)."""
    steps: int = 300
    """Teacher training steps (AdamW, cosine decay)."""
    student_step: int = 60
    """The student is the same model saved after this many steps."""
    lr: float = 3e-3
    """Peak AdamW learning rate (betas 0.9 / 0.95), decayed along a half cosine to 0 over ``steps``."""
    eval_windows: int = 64
    """Held-out windows of ``seq_len`` tokens measured (positions = windows x seq_len)."""
    ks: list[int] = field(default_factory=lambda: [1, 8, 32, 256])
    """Top-k sizes measured (those above the vocabulary are skipped)."""


def corpus(s: Settings) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): whole stdlib source files."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: s.corpus_files]
    if len(files) <= s.heldout_files:
        raise ValueError(f"corpus_files={s.corpus_files}: found {len(files)} files, need more than heldout_files="
                         f"{s.heldout_files}")
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return texts[: -s.heldout_files], texts[-s.heldout_files :]


def build_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def windows(tok: Tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    ids = [i for e in tok.encode_batch(texts) for i in e.ids]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def objective_gap(student_logp: torch.Tensor, teacher_logp: torch.Tensor, k: int) -> float:
    """Mean k-sparse loss (tail bucket, fp16 log-probs as stored) over mean full KL, minus 1."""
    ids, top, residual = topk_sparsify(teacher_logp, k)
    sparse = sparse_forward_kl(student_logp, ids, top.half().float(), residual).mean()
    return float(sparse / full_forward_kl(student_logp, teacher_logp).mean()) - 1.0


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    torch.manual_seed(s.seed)
    t0 = time.perf_counter()
    train_texts, held_texts = corpus(s)
    tok = build_tokenizer(train_texts, s.vocab_size)
    vocab = tok.get_vocab_size()
    train_w, held_w = windows(tok, train_texts, s.seq_len), windows(tok, held_texts, s.seq_len)
    held_w = held_w[: s.eval_windows]
    tokenize_s = time.perf_counter() - t0
    config = Qwen2Config(vocab_size=vocab, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                         num_attention_heads=4, num_key_value_heads=4, intermediate_size=4 * s.hidden_size,
                         tie_word_embeddings=True, max_position_embeddings=s.seq_len)
    model = Qwen2ForCausalLM(config)
    rng = random.Random(s.seed)

    def step_loss(_: int) -> torch.Tensor:
        batch = train_w[[rng.randrange(len(train_w)) for _ in range(s.batch_size)]]
        return model(input_ids=batch, labels=batch).loss

    t0 = time.perf_counter()
    student_state, curve = train_lm(model, s.steps, s.lr, step_loss, s.student_step)
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        teacher_logp = model(input_ids=held_w).logits[:, :-1].float().log_softmax(-1).flatten(0, 1)
        targets = held_w[:, 1:].flatten()
        nll = float(-teacher_logp.gather(-1, targets[:, None]).mean())
        entropy = float(-(teacher_logp.exp() * teacher_logp).sum(-1).mean())
        model.load_state_dict(student_state)
        student_logp = model(input_ids=held_w).logits[:, :-1].float().log_softmax(-1).flatten(0, 1)
        full_kl = float(full_forward_kl(student_logp, teacher_logp).mean())
        table = []
        for k in sorted(k for k in s.ks if k <= vocab):
            ids, _, residual = topk_sparsify(teacher_logp, k)
            table.append({
                "k": k, "bytes_per_pos": bytes_per_position(k, vocab),
                "bytes_fraction": bytes_per_position(k, vocab) / full_bytes_per_position(vocab),
                "info_loss": float(sparse_information_loss(teacher_logp.double(), k).mean()),
                "residual": float(residual.mean()),
                "covered": float((ids == targets[:, None]).any(-1).float().mean()),
                "objective_gap": objective_gap(student_logp, teacher_logp, k)})
    return {
        "benchmark": "distill_vocab", "description": DESCRIPTION, "table": table,
        "num_vocab": vocab, "full_bytes_per_position": full_bytes_per_position(vocab),
        "positions": len(targets), "teacher_heldout_nll": nll, "teacher_entropy": entropy,
        "student_full_kl": full_kl, "train_curve": curve, "num_params": sum(p.numel() for p in model.parameters()),
        "train_windows": len(train_w), "tokenize_s": tokenize_s, "train_s": train_s,
        "settings": dataclasses.asdict(s), "overrides": overrides,
    }
