"""The local engine's sampling settings (``rollout.*`` inherits them: ``system/config.py``'s ``RolloutConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.rollout.speculative import SpeculativeConfig


@dataclass
class SamplingConfig:
    """How responses are sampled."""

    temperature: float = 1.0
    """1.0 samples from the policy itself (DAPO/GRPO setups); 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 keeps the full distribution (on-policy log-probs)."""
    max_new_tokens: int = 8
    """Generation length cap; a sample that hits it has finish_reason 'length'."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (EOS always stops)."""
    max_batch_size: int = 512
    """Most sequences decoded in one forward pass."""
    cuda_graphs: str = "auto"
    """Decode steps with static shapes, replayed from CUDA graphs (``rollout/graphs.py``): a small model's
    decode step is launch-bound, and a graph issues it in one launch. ``auto``: on CUDA, not on CPU;
    ``on``: static shapes everywhere (run eagerly off CUDA: for tests); ``off``: dynamic shapes. With
    graphs every row is decoded (``share_identical_rows`` applies to prefills only)."""
    graph_widths: str = "full"
    """How many buffer columns a static decode step's attention reads (``rollout/graphs.py``, issue 51): ``full``
    reads every column of the slot cache, which is sized for prompt + the whole length budget, so a long budget makes
    every early step read it all; ``buckets`` reads the write column's width bucket (a power of two >= the live
    width, one recorded graph per rows and width bucket). Same samples and log-probs; ``full`` until a GPU has
    measured ``buckets`` (docs/gpu.md)."""
    dtype: str = "auto"
    """The local engine's weights and KV cache: ``fp32`` or ``bf16`` (as vLLM serves); ``auto`` is bf16 on
    CUDA, fp32 on CPU (``utils/device.py``). The engine lives on the device of the model it copies
    (``system.device``). A bf16 engine samples from slightly different log-probs than the trainer computes:
    ``train/logp_mismatch_mean`` shows the gap and ``algo.correction`` (TIS/MIS) corrects for it."""
    head_dtype: str = "auto"
    """The engine's LM head: ``auto`` in ``dtype`` like the rest of the copy; ``fp32`` keeps its weights in fp32
    (an untied copy where the head is tied) and upcasts its input, so a bf16 engine's log-probs lose the head's
    rounding, its largest share of the gap to the trainer's fp32 head (``rollout/head.py``)."""
    decode_attention: str = "repeat"
    """How the engine's attention reads grouped KV heads (GQA) under its boolean masks
    (``rollout/decode_attention.py``): ``repeat`` is transformers' SDPA, which copies each layer's keys and values
    out to every query head (``repeat_kv``) whenever a mask is passed; ``gqa`` calls SDPA with ``enable_gqa=True``
    (torch >= 2.5); ``fold`` folds each group's query heads into query rows of its KV head. Same samples and
    log-probs (up to summation order); which is faster depends on the SDPA kernel the device picks: unmeasured
    on a GPU (docs/gpu.md)."""
    early_stop_run: int | None = None
    """MiniMax-M1's early truncation (arXiv 2506.13585, sec. 4): stop a sample once this many
    consecutive sampled tokens each had probability > ``early_stop_prob`` (finish_reason
    'repetition'); the paper uses 3,000 tokens at 0.99 to cut degenerate repetition loops short.
    None disables it."""
    early_stop_prob: float = 0.99
    """The per-token probability above which a token counts toward ``early_stop_run``."""
    reuse_turn_kv: bool = True
    """Agent episodes: keep the keys and values of a finished turn (a request with ``episode`` set, not
    ended by EOS), and when the episode's next turn arrives (its context = that turn + the observation)
    compute only the new tokens instead of re-reading the whole context. A weight update drops what is
    kept; at most ``max_batch_size`` turns, and no more positions than the running batch's cache holds,
    are kept (oldest dropped first)."""
    share_identical_rows: bool = True
    """Compute rows whose whole context is identical once: a group's samples share their prompt and
    often their first tokens (all of them, once a policy is confident), so each prefill runs every
    distinct sequence once and each decode step only the distinct (context, token) pairs, copying the
    new keys, values and logits to the duplicates. Sampling stays per row (its own noise key), so the
    tokens drawn are the same as without sharing; only work is saved. False decodes every row."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding (``speculative.py``): drafted tokens verified in one forward, accepted only where
    they equal what the policy samples, so samples, log-probs and versions are unchanged. Off by default."""
    host_reads: str = "sync"
    """How the local engine reads each step's sampled tokens back (issue 51): ``sync`` reads them before the next
    decode (the host waits for the device each step); ``late`` keeps each row's sampling key and position on the
    device, feeds the sampled tokens to the next decode straight from the device and reads them through a pinned
    buffer one step later, so the host's per-row work overlaps the device's step (``rollout/late_reads.py``; a
    finished row costs one wasted decode step). Same trajectories. Speculative decoding, budget forcing and
    ``share_identical_rows`` in a dynamic decode need the tokens on the host first: with them the engine reads
    synchronously and says so. ``sync`` until a GPU has measured ``late`` (docs/gpu.md)."""
