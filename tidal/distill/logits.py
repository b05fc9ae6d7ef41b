"""k-sparse teacher logits: run the teacher over sequences, keep its top-k distribution per position.

The sequences are the teacher's own responses to the first ``num_prompts`` training prompts (one
sample each at ``temperature``: the distribution the student should match is the teacher's on text
the teacher writes, as in sequence-level KD, Kim & Rush, arXiv 1606.07947), or, with ``traces``, the
verified traces of ``tidal distill traces``. For every response position the teacher's log-softmax is
computed once, reduced to top-k ids, log-probs and the residual mass (``algo/distill.topk_sparsify``)
and written to safetensors shards (``shards.py``). While the full distribution is at hand, the
information the store loses is measured too: the mean KL between the full teacher and its k-sparse
reading (``algo/distill.sparse_information_loss``) for ``k`` and for each of ``report_k``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.algo.distill import bytes_per_position, full_bytes_per_position, sparse_information_loss, topk_sparsify
from tidal.config import ConfigError
from tidal.distill.shards import LogitShardWriter
from tidal.distill.student import Sequence, response_logprobs
from tidal.rollout.local import LocalEngine
from tidal.rollout.requests import group_requests
from tidal.utils.progress import progress_bar


@dataclass
class LogitsConfig:
    """What the k-sparse store holds (``tidal distill logits --top-k K --set logits.KEY=...``)."""

    top_k: int = 32
    """Token ids kept per position (Gemini 2.5's k-sparse distillation, arXiv 2507.06261)."""
    num_prompts: int = 2000
    """Training prompts whose teacher responses are stored (ignored with ``--traces``)."""
    temperature: float = 1.0
    """Sampling temperature of the teacher's responses (1.0: its own distribution)."""
    positions_per_shard: int = 65_536
    """Response positions per safetensors shard (bounds a reader's memory)."""
    batch_size: int = 256
    """Sequences per teacher forward pass."""
    report_k: list[int] = field(default_factory=lambda: [1, 8, 32])
    """Also measure the information lost at these k (KL from the full teacher to its k-sparse reading)."""

    def __post_init__(self):
        validate(self)


def validate(cfg: LogitsConfig) -> None:
    for key in ("top_k", "num_prompts", "positions_per_shard", "batch_size"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"logits.{key} must be >= 1, got {getattr(cfg, key)}")


def teacher_samples(teacher, tokenizer, task, run_cfg, cfg: LogitsConfig) -> list[Sequence]:
    """One teacher response per prompt: (prompt ids, response ids)."""
    if cfg.num_prompts > task.num_train:
        raise ConfigError(f"logits.num_prompts={cfg.num_prompts} exceeds the task's {task.num_train} training prompts")
    engine = LocalEngine(teacher, tokenizer, dataclasses.replace(run_cfg.rollout, temperature=cfg.temperature),
                         run_cfg.seed, 0)
    prompts = [task.train_prompt(i) for i in range(cfg.num_prompts)]
    return [(list(t.prompt_ids), list(t.token_ids)) for t in engine.generate(group_requests(tokenizer, prompts, 1))]


@torch.no_grad()
def write_store(teacher, tokenizer, seqs: list[Sequence], cfg: LogitsConfig, out_dir: Path, progress: bool = True,
                extra_meta: dict | None = None) -> dict:
    """Write the k-sparse store of ``seqs`` under ``out_dir``; return its meta (with information loss)."""
    validate(cfg)
    num_vocab = len(tokenizer)
    if cfg.top_k > num_vocab:
        raise ConfigError(f"--top-k {cfg.top_k} exceeds the vocabulary ({num_vocab} tokens)")
    seqs = [s for s in seqs if s[1]]  # an empty response has no position to distill
    if not seqs:
        raise ConfigError("no teacher responses to store")
    teacher.eval()
    writer = LogitShardWriter(out_dir, cfg.top_k, num_vocab, cfg.positions_per_shard, extra_meta)
    ks = sorted({k for k in [*cfg.report_k, cfg.top_k] if k <= num_vocab})
    lost = {k: 0.0 for k in ks}
    positions = 0
    bar = progress_bar(progress, total=len(seqs), desc=f"teacher top-{cfg.top_k}", leave=False)
    for start in range(0, len(seqs), cfg.batch_size):
        chunk = seqs[start : start + cfg.batch_size]
        logp_nv = response_logprobs(teacher, chunk, tokenizer.pad_token_id)
        ids, logp, residual = topk_sparsify(logp_nv, cfg.top_k)
        row = 0
        for prompt, response in chunk:
            n = len(response)
            writer.add(prompt, response, ids[row : row + n], logp[row : row + n], residual[row : row + n])
            row += n
        for k in ks:
            lost[k] += float(sparse_information_loss(logp_nv.double(), k).sum())
        positions += len(logp_nv)
        bar.update(len(chunk))
    bar.close()
    meta = writer.close()
    meta_extra = {
        "info_loss_kl": {str(k): lost[k] / positions for k in ks},
        "bytes_per_position_at": {str(k): bytes_per_position(k, num_vocab) for k in ks},
        "full_bytes_per_position": full_bytes_per_position(num_vocab),
    }
    meta.update(meta_extra)
    (Path(out_dir) / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
