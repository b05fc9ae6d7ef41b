"""The trainer's settings (``trainer.*``): how a batch is laid out in passes (micro-batches, packing, prefix
sharing), precision, and how ranks share the training. Kept apart from ``trainer.py`` so that reading or
validating a run's config does not import the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.config import ConfigError
from tidal.train.data_parallel import DiLoCoConfig, ElasticConfig, validate_elastic
from tidal.train.packing import PACKED_ATTENTION
from tidal.train.routing import MoeConfig, validate_moe


@dataclass
class TrainerConfig:
    num_minibatches: int = 1
    """Optimizer steps per batch (PPO-style reuse; 1 keeps every update on fresh samples)."""
    temperature: float = 1.0
    """Must equal the sampling temperature so trainer and engine score the same distribution."""
    micro_batch_tokens: int | None = None
    """Token budget of one forward/backward pass; a minibatch is split into micro-batches (Magistral's
    greedy collation: sorted by length, filled to this many padded tokens; with ``packing``, real
    tokens; with ``share_prefixes``, whole groups by trie nodes) and their gradients accumulated,
    weighted so the result equals the whole minibatch's.
    None: the whole minibatch in one pass."""
    packing: bool = False
    """Pack sequences end to end without padding (position ids restart per sequence, block-diagonal
    causal attention; see ``train/packing.py``). Same loss and gradients as padded. How attention is
    isolated inside a row: ``packed_attention``."""
    share_prefixes: bool = False
    """Pack each group's sequences as one token trie, so the prompt and every other prefix the samples
    share is computed once (``train/prefix_tree.py``; Prefix Grouper, arXiv 2506.05433). Same loss and
    gradients as padded; needs SDPA or eager attention (a trie is not a varlen flash segment). Rows
    hold at most ``pack_tokens`` trie nodes; with ``packed_attention=block`` they may be long (no
    [L, L] mask: a node's ancestors are an interval of columns)."""
    pack_tokens: int = 512
    """Longest packed row, in tokens. With ``packed_attention=dense`` attention inside a row costs an
    [L, L] mask and O(row^2) work, so rows stay short (a 32k row is 1 GiB of mask); with ``block``
    (the default on CUDA) or varlen flash attention, memory is linear in the row and long rows are
    cheap."""
    packed_attention: str = "auto"
    """How a packed row (``packing``, ``share_prefixes``) isolates its sequences in attention: ``dense``,
    the boolean [R, 1, L, L] mask through SDPA; ``block``, no [L, L] tensor: a block mask built from each
    token's interval of visible queries (``models/attention.py``), run by FlexAttention on CUDA and by
    query-chunked SDPA on CPU; same log-probs and gradients. ``auto``: ``block`` when the model is on
    CUDA, ``dense`` otherwise, decided at each forward from the model's device. ``block`` switches an
    SDPA or eager model to the ``tidal_packed`` attention, which runs SDPA for every other mask.
    Flash-attention models take packed rows without a mask either way."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the FP32 LM head + log-softmax (``models/logprobs.py``): the full
    [tokens x vocab] logits are never materialized (about 3 x chunk x vocab x 4 bytes at peak)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass: same gradients, far less activation memory,
    about one extra forward of compute."""
    precision: str = "auto"
    """``fp32``, or ``bf16``: bf16 autocast around every forward (policy, reference, critic) with float32
    master weights and optimizer state; the LM head and log-softmax stay float32 (``models/logprobs.py``).
    ``auto``: bf16 on CUDA, fp32 on CPU (``utils/device.py``)."""
    weights: str = "fp32"
    """The policy's parameters: ``fp32`` (float32 weights, each forward under ``precision``'s autocast) or
    ``bf16_master`` (bf16 parameters and no autocast, so the residual stream, norms and RoPE run in bf16 too, with
    a float32 master of each trained parameter that the optimizer steps, float32 optimizer state and float32
    gradient accumulation across micro-batches: ``train/precision.py``). The reference model is bf16 too; the LM
    head and log-softmax stay float32 (``models/logprobs.py``), and checkpoints hold the float32 masters. Costs
    18 bytes per trained parameter with AdamW against 16 and saves activation memory (docs/memory.md). Not yet
    with data parallel, DiLoCo or SDC recording (``sdc.record``). The MFU gain on a GPU is unmeasured
    (``tidal bench gpu --set weights=bf16_master``)."""
    head_matmul: str = "fp32"
    """The float32 LM-head matmul on CUDA: ``fp32`` (IEEE float32 products on the CUDA cores, ~67 TFLOP/s on an
    H100/H200) or ``tf32`` (tensor cores: inputs rounded to 10 mantissa bits, float32 accumulation and output,
    several times faster). The body runs under bf16 autocast, so the head (and the critic's value head) are the
    only float32 matmuls this affects; with a 152k vocabulary the head is a quarter of a 0.5B model's FLOPs
    and an fp32 head caps its MFU near 0.2 (docs/gpu.md). PyTorch's TF32 switch is process-wide; it is set
    around the head's own matmuls only (forward, checkpoint recompute, backward: ``models/logprobs.py``'s
    ``tf32_matmul``) and restored after each, so the rest of the step, and the critic's value head, stay
    float32; a float32 rollout engine decoding in another thread during those matmuls would still get TF32
    (a bf16 one is unaffected). No effect on CPU."""
    head_tokens: str = "all"
    """Which tokens the LM head (the float32 matmul, log-softmax and entropy) scores in the trainer's passes:
    ``all``, every position (the path every measurement so far used), or ``loss``, only the tokens the loss
    mask keeps, which are the only ones the loss and the logged metrics read (``train/entropy`` is their
    mean). An RL batch is about half prompt (52% in the H200 bench, issue 51), so ``loss`` about halves the
    head's work, its checkpoint recompute and its backward. Same log-probs, entropies and gradients on the
    loss tokens (``tests/models/test_head_tokens.py``: bit-equal on CPU when the head runs as one chunk,
    within float rounding otherwise; ``tests/train/test_trainer_head_tokens.py`` for whole steps); tokens
    outside the loss mask then carry the sampler's log-prob (``behav_logp_bt``, so every ratio there is 1)
    and entropy 0, in the step's log-probs the sample recorder keeps too. The default stays ``all`` until
    the device check (``tests/gpu/test_cuda.py``) confirms the equality in bf16 on CUDA."""
    head_kernel: str = "chunked"
    """How the trainer's LM head (float32 matmul, log-softmax, log-prob, entropy) runs (``models/logprobs.py``):
    ``chunked`` (``logprob_chunk_size`` tokens at a time under ``torch.utils.checkpoint``: 4 head matmuls per
    chunk, the checkpoint's recompute included), ``fused`` (one autograd Function with a hand-written backward:
    the same values bit for bit and the same gradients within float rounding, 3 matmuls on the last chunk and 4
    on the others, at most two [chunk x vocab] blocks at a time: 511 against 862 MiB peak RSS for 2,048 tokens
    at SmolLM2's 576 x 49,152 on a CPU) or ``compiled`` (``fused`` with its elementwise work compiled by
    ``torch.compile``: the first step compiles, 8-18 s measured on a 2-core CPU, and each new temperature or
    entropy setting compiles again). Fewer than 4 matmuls per chunk would need the loss's gradient during the forward
    (Liger Kernel's fused linear cross-entropy, arXiv 2410.10989, does that only for a scalar cross-entropy
    loss) or [tokens x vocab] logits kept; neither Liger's nor Cut Cross-Entropy's (arXiv 2411.09009) kernel
    returns the entropy, so neither is an option here. ``chunked`` stays the default until ``tidal bench gpu``'s
    ``head_kernel`` part measures the others on a GPU (tests/models/test_head_kernel.py for the equality)."""
    data_parallel: str = "fsdp"
    """How ranks under torchrun share the training: ``fsdp`` (one update from every rank's gradients,
    ``parallel/fsdp.py``) or ``diloco`` (each rank a full replica training on its own groups, synced
    every ``diloco.sync_every`` optimizer steps, ``parallel/diloco_trainer.py``); both are ignored in one
    process. ``elastic`` is launched without torchrun: the run's process starts ``elastic.replicas - 1``
    replica processes and keeps training when one dies (``parallel/elastic_leader.py``, docs/faults.md)."""
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    """The outer loop with ``data_parallel=diloco``. ``sync_every`` counts optimizer steps
    (``num_minibatches`` per trainer step); the default H=500 is the paper's, far apart for an RL run."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """The replicas with ``data_parallel=elastic``: how many, failure timeouts, restarts."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts models: routing replay (``off``/``r2``/``r3``) and the router's auxiliary losses
    (``train/routing.py``, docs/moe.md). Ignored for dense models."""


def validate(cfg: TrainerConfig) -> None:
    """Raise a ConfigError naming the key when the trainer config cannot run (overrides bypass __init__)."""
    if cfg.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"trainer.precision must be auto, fp32 or bf16, got {cfg.precision!r}")
    if cfg.weights not in ("fp32", "bf16_master"):
        raise ConfigError(f"trainer.weights must be fp32 or bf16_master, got {cfg.weights!r}")
    if cfg.weights == "bf16_master" and cfg.precision == "fp32":
        raise ConfigError("trainer.weights=bf16_master computes in bf16, which trainer.precision=fp32 contradicts "
                          "(use trainer.precision=auto or bf16, or trainer.weights=fp32)")
    if cfg.head_matmul not in ("fp32", "tf32"):
        raise ConfigError(f"trainer.head_matmul must be fp32 or tf32, got {cfg.head_matmul!r}")
    if cfg.head_tokens not in ("all", "loss"):
        raise ConfigError(f"trainer.head_tokens must be all or loss, got {cfg.head_tokens!r}")
    if cfg.head_kernel not in ("chunked", "fused", "compiled"):
        raise ConfigError(f"trainer.head_kernel must be chunked, fused or compiled, got {cfg.head_kernel!r}")
    if cfg.data_parallel not in ("fsdp", "diloco", "elastic"):
        raise ConfigError(f"trainer.data_parallel must be fsdp, diloco or elastic, got {cfg.data_parallel!r}")
    if cfg.packed_attention not in PACKED_ATTENTION:
        raise ConfigError(f"trainer.packed_attention must be one of {', '.join(PACKED_ATTENTION)}, "
                          f"got {cfg.packed_attention!r}")
    validate_elastic(cfg.elastic)
    validate_moe(cfg.moe)
    try:
        cfg.diloco.__post_init__()
    except ValueError as e:
        raise ConfigError(f"trainer.{e}") from None
