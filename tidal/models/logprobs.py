"""Per-token log-probabilities and entropies of given sequences under a causal LM: exact and memory-bounded.

``logp_bt[:, t]`` is log p(input_ids[:, t] | input_ids[:, :t]); position 0 (nothing predicts it) is 0.
Logits are divided by the sampling temperature so trainer and engine score the same distribution.

Exact: the LM head and the log-softmax run in float32 whatever the model's dtype. MiniMax-M1 (arXiv
2506.13585, sec. 3.2, "Computational Precision Mismatch in Generation and Training", Fig. 3) traced the
training/inference probability mismatch to high-magnitude activations in the LM head and fixed it by
computing the head in FP32 (token-probability correlation 0.9x -> 0.99x). A bf16 head rounds each logit
to 8 significant bits, an error that grows with the logit's magnitude (tests/models/test_logprobs.py
measures it).

Memory-bounded: the naive path materializes [tokens x vocab] float32 logits, plus the same again for the
log-softmax and again for its gradient. With a 152k vocabulary, 16k tokens are 10 GB per copy. Here the
decoder's last hidden state [tokens x hidden] goes through the head ``chunk_size`` tokens at a time; each
chunk is run under ``torch.utils.checkpoint`` (non-reentrant), so the forward keeps only the chunk's
per-token outputs and the backward recomputes one chunk's logits at a time. Peak extra memory is a few
[chunk x vocab] blocks instead of a few [tokens x vocab] ones, for one extra head matmul per chunk in the
backward. docs/memory.md has the measured numbers.

Only where it scores (``score_mask_bt``): the trainer's loss reads log-probs and entropies of the tokens
its loss mask keeps, and in an RL batch about half the tokens are prompt (52% in the H200 bench, issue 51).
Given a mask, the head (forward, the checkpoint's recompute and the backward) runs on those tokens only;
the others come back 0. Each scored token's log-prob is the same row of the same float32 matmul, so it
equals the full path's (tests/models/test_head_tokens.py checks values, entropies and gradients).

Kernels (``head_kernel``, ``trainer.head_kernel``): ``chunked`` is the path above. ``fused`` is one
``torch.autograd.Function`` over all chunks with a hand-written backward: the forward keeps per token only
its log-prob, entropy (when its gradient is asked for) and, of the logits, only the last chunk's; the
backward forms d/d logits in closed form (d logp_y/dz = onehot(y) - p, dH/dz = -p (log p + H), z = logits / T)
from one matmul per chunk and projects it (grad hidden = G W, grad W += G^T hidden). Matmuls per chunk of
C tokens (2 C hidden vocab FLOPs each): ``chunked`` 4 (forward, checkpoint recompute, two for the gradient);
``fused`` 4 as well, except the last chunk's 3, whose logits are still there (one chunk: 3, the minimum). A
head that feeds an arbitrary loss cannot do better without keeping [tokens x vocab] logits: its gradient
needs the loss's per-token d loss/d logp and d loss/d entropy, known only after the forward. Liger Kernel's
fused linear cross-entropy (arXiv 2410.10989) reaches 3 by computing the gradient in the forward, which holds
only when the cross-entropy is the end of the graph (a scalar, ``reduction`` mean or sum); with
``reduction="none"`` it recomputes in the backward (4, like ``chunked``) and it returns no entropy (nor does
Cut Cross-Entropy, arXiv 2411.09009, which also recomputes). What ``fused`` saves on every chunk is
elementwise work and memory: one log-softmax pass in the backward instead of the checkpoint's recompute of
log-softmax, exp and entropy and autograd's backward through each, and no [C x vocab] intermediates saved
for autograd. ``compiled`` is ``fused`` with its elementwise parts (log-softmax + gather + entropy; the
gradient of the logits) compiled by ``torch.compile`` into a few fused passes, no [C x vocab] log-softmax
materialized; it compiles once per process and shape family (tens of seconds on a CPU: see
``trainer.head_kernel``). tests/models/test_head_kernel.py checks the three give the same log-probs,
entropies and gradients and counts their matmul FLOPs.

TF32 (``tf32``): PyTorch's TF32 switch is process-wide, so it is set around the head's own matmuls only
(``tf32_matmul``), forward, recompute and backward, and put back after each, exceptions included.

Models that do not fit the Hugging Face causal-LM pattern (``get_decoder()`` + a linear
``get_output_embeddings()`` applied directly to the last hidden state) take the plain full-logits path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from tidal.utils.device import model_device
from tidal.utils.phases import phase

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per LM-head chunk. One float32 [1024 x vocab] block is 4 KiB per vocab entry: 128 MiB at a 32k
vocabulary, 594 MiB at Qwen2.5's 152k; the backward holds about three (measured, docs/memory.md). That
bounds the head's peak whatever the microbatch size, while each chunk's matmul stays one large GEMM
(1024 x hidden x vocab) rather than many small ones; at the tiny model's 51-token vocabulary a typical
microbatch is a handful of chunks."""

HEAD_KERNELS = ("chunked", "fused", "compiled")
"""``head_kernel`` values (module docstring): checkpointed chunks; a fused autograd Function; the same with its
elementwise work compiled by ``torch.compile``."""

# Config fields of HF models that transform the head's output before the softmax (Gemma-2 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling); such models take the full-logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_logprobs(
    model: torch.nn.Module,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor | None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    position_ids: torch.Tensor | None = None,
    parents_bt: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy_grad: bool = False,
    score_mask_bt: torch.Tensor | None = None,
    tf32: bool = False,
    head_kernel: str = "chunked",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs ``logp_bt`` [B, T] (float32, differentiable) and, if asked, entropies [B, T]
    (float32; no gradient unless ``entropy_grad``, for an entropy bonus: the metric alone keeps no graph
    and costs no backward). ``attention_mask_bt`` and ``position_ids`` [B, T] go to the model unchanged,
    so a packed batch can pass per-sequence position ids and a block-causal [B, 1, T, T] mask (or, on
    transformers versions that detect packing from position ids, no mask), or a dict of such masks keyed
    by layer type (``train/packing.py``'s ``packed_attention_mask`` for sliding-window models).

    ``parents_bt`` [B, T] names each token's predecessor by its column (-1: none, log-prob 0), for
    layouts where it is not the column before: prefix-shared tries (``train/prefix_tree.py``). Each
    token is then scored from its parent's output. Default: the column before.

    ``score_mask_bt`` [B, T] (bool): the positions whose log-prob (and entropy) the caller reads; the head
    runs on those only and every other position is 0. Pass it on the host: the positions are then found
    without waiting for the device. None: every position (the full head). ``tf32``: the head's float32
    matmuls on CUDA use TF32 (``tf32_matmul``). ``head_kernel``: one of ``HEAD_KERNELS`` (module docstring)."""
    assert chunk_size > 0, f"chunk_size must be positive, got {chunk_size}"
    device = model_device(model)  # inputs built on the host (packing, tries) go where the weights are
    host_parents_bt = parents_bt  # where the caller built it: scored positions are found there
    input_ids_bt, position_ids, parents_bt = (x.to(device) if x is not None else None
                                              for x in (input_ids_bt, position_ids, parents_bt))
    if isinstance(attention_mask_bt, dict):  # one mask per layer type (sliding windows, ``models/architecture.py``)
        attention_mask_bt = {kind: mask.to(device) for kind, mask in attention_mask_bt.items()}
    elif attention_mask_bt is not None:
        attention_mask_bt = attention_mask_bt.to(device)
    head = _linear_head(model)
    if head is None:
        extra = {} if position_ids is None else {"position_ids": position_ids}
        out_btx = model(input_ids=input_ids_bt, attention_mask=attention_mask_bt, **extra).logits
    else:
        out = model.get_decoder()(input_ids=input_ids_bt, attention_mask=attention_mask_bt,
                                  position_ids=position_ids, use_cache=False)
        out_btx = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if score_mask_bt is not None and head is not None:
        return _scored_positions(out_btx, head, input_ids_bt, host_parents_bt, score_mask_bt, temperature,
                                 with_entropy, chunk_size, entropy_grad, tf32, head_kernel)
    if parents_bt is None:  # the column before predicts each token; nothing predicts column 0
        preceding, targets = out_btx[:, :-1], input_ids_bt[:, 1:]
    else:
        index = parents_bt.clamp(min=0)[..., None].expand(-1, -1, out_btx.shape[-1])
        preceding, targets = out_btx.gather(1, index), input_ids_bt
    if head is None:
        logp, ent = _logp_and_entropy(preceding.float(), targets, temperature, with_entropy, entropy_grad)
    else:
        with phase("head"):  # the trainer's ``perf/trainer_head_ms`` (``utils/phases.py``)
            logp, ent = chunked_head_logprobs(preceding, head.weight, head.bias, targets, temperature,
                                              with_entropy, chunk_size, entropy_grad, tf32, head_kernel)
    if score_mask_bt is not None:  # the full-logits path computed everything: keep the asked-for positions
        keep = score_mask_bt.to(logp.device, torch.bool)
        keep = keep[:, 1:] if parents_bt is None else keep
        logp, ent = logp * keep, ent * keep if with_entropy else None
    if parents_bt is None:
        return torch.nn.functional.pad(logp, (1, 0)), torch.nn.functional.pad(ent, (1, 0)) if with_entropy else None
    orphan = parents_bt < 0
    return logp.masked_fill(orphan, 0.0), ent.masked_fill(orphan, 0.0) if with_entropy else None


def _scored_positions(out_btx, head, input_ids_bt, parents_bt, score_mask_bt, temperature, with_entropy,
                      chunk_size, entropy_grad, tf32, head_kernel="chunked"):
    """``token_logprobs``'s head on the positions ``score_mask_bt`` keeps: their predecessors' hidden states
    are gathered into one [N, hidden] block, scored as the full path scores them, and scattered back into
    zeros."""
    b, t, h = out_btx.shape
    keep_bt = score_mask_bt.to(torch.bool).clone()
    keep_bt[:, 0] = False  # nothing precedes column 0
    if parents_bt is None:
        source_bt = torch.arange(-1, t - 1, device=keep_bt.device).expand(b, t)
    else:
        source_bt = parents_bt.to(keep_bt.device)
        keep_bt &= source_bt >= 0  # a root or padding has no parent: 0, as in the full path
    target_n = keep_bt.flatten().nonzero().squeeze(1)  # on the host when the caller passes a host mask
    row_n = torch.div(target_n, t, rounding_mode="floor")
    source_n = row_n * t + source_bt.flatten()[target_n]
    device = out_btx.device
    non_blocking = device.type == "cuda" and target_n.device.type == "cpu"
    if non_blocking:  # pinned, so the upload does not wait for the host copy
        target_n, source_n = target_n.pin_memory(), source_n.pin_memory()
    target_n, source_n = target_n.to(device, non_blocking=non_blocking), source_n.to(device, non_blocking=non_blocking)
    hidden_1nh = out_btx.reshape(b * t, h).index_select(0, source_n)[None]
    targets_1n = input_ids_bt.reshape(b * t).index_select(0, target_n)[None]
    with phase("head"):
        logp_1n, ent_1n = chunked_head_logprobs(hidden_1nh, head.weight, head.bias, targets_1n, temperature,
                                                with_entropy, chunk_size, entropy_grad, tf32, head_kernel)
    zeros = torch.zeros(b * t, dtype=logp_1n.dtype, device=device)
    logp_bt = zeros.index_put((target_n,), logp_1n[0]).reshape(b, t)
    ent_bt = zeros.index_put((target_n,), ent_1n[0]).reshape(b, t) if with_entropy else None
    return logp_bt, ent_bt


def chunked_head_logprobs(
    hidden_bth: torch.Tensor,
    weight_vh: torch.Tensor,
    bias_v: torch.Tensor | None,
    targets_bt: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy_grad: bool = False,
    tf32: bool = False,
    kernel: str = "chunked",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T + bias)[target] per position, in float32, ``chunk_size`` positions at
    a time; returns ([B, T] log-probs, [B, T] entropies or None; differentiable if ``entropy_grad``).
    ``tf32``: the matmuls (forward, recompute, backward) in TF32 on CUDA (``tf32_matmul``). ``kernel``: one
    of ``HEAD_KERNELS`` (module docstring); all give the same values and gradients within float rounding."""
    assert kernel in HEAD_KERNELS, f"head kernel must be one of {HEAD_KERNELS}, got {kernel!r}"
    b, t, h = hidden_bth.shape
    # Cast once, outside the chunks: a bf16 weight's gradient is then summed over chunks in float32 and
    # rounded to bf16 once, as in the unchunked head, rather than once per chunk.
    hidden_nh = hidden_bth.reshape(b * t, h).float()
    weight_vh = weight_vh.float()
    bias_v = bias_v.float() if bias_v is not None else None
    targets_n = targets_bt.reshape(b * t)
    if kernel != "chunked":
        with torch.autocast(hidden_nh.device.type, enabled=False):  # the Function's matmuls stay float32
            logp_n, ent_n = _FusedHead.apply(hidden_nh, weight_vh, bias_v, targets_n, float(temperature),
                                             with_entropy, entropy_grad, tf32, chunk_size, kernel == "compiled")
        return logp_n.reshape(b, t), ent_n.reshape(b, t) if with_entropy else None
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (hidden_nh, weight_vh, bias_v))
    logps, ents = [], []
    for start in range(0, max(b * t, 1), chunk_size):  # one (empty) chunk when nothing is scored
        args = (hidden_nh[start:start + chunk_size], weight_vh, bias_v, targets_n[start:start + chunk_size],
                temperature, with_entropy, entropy_grad, tf32)
        if needs_grad:
            logp_n, ent_n = checkpoint(_head_chunk, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            logp_n, ent_n = _head_chunk(*args)
        logps.append(logp_n)
        ents.append(ent_n)
    logp_bt = torch.cat(logps).reshape(b, t)
    ent_bt = torch.cat(ents).reshape(b, t) if with_entropy else None
    return logp_bt, ent_bt


def _head_chunk(hidden_nh, weight_vh, bias_v, targets_n, temperature, with_entropy, entropy_grad, tf32=False):
    # Under a caller's bf16 autocast the matmul would silently drop back to bf16: keep the head in fp32.
    with torch.autocast(hidden_nh.device.type, enabled=False):
        if tf32 and hidden_nh.device.type == "cuda":
            logits_nv = _TF32Linear.apply(hidden_nh, weight_vh, bias_v)
        else:
            logits_nv = torch.nn.functional.linear(hidden_nh, weight_vh, bias_v)
        return _logp_and_entropy(logits_nv, targets_n, temperature, with_entropy, entropy_grad)


@contextlib.contextmanager
def tf32_matmul(enabled: bool = True) -> Iterator[None]:
    """CUDA float32 matmuls in TF32 inside the block, the previous setting restored on the way out
    (exceptions too). The switch is PyTorch's process-wide one (``torch.backends.cuda.matmul.allow_tf32``;
    there is no per-thread or per-call TF32), so keeping the block to the head's matmuls is what limits
    which other work sees it: a float32 engine decoding in another thread at that moment still would."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = before or enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class _TF32Linear(torch.autograd.Function):
    """``linear`` whose forward and backward matmuls both run inside ``tf32_matmul``: the backward runs
    after the forward's block has closed (on CUDA, in autograd's own thread), so it opens its own."""

    @staticmethod
    def forward(ctx, x_nh, weight_vh, bias_v):
        ctx.save_for_backward(x_nh, weight_vh)
        ctx.has_bias = bias_v is not None
        with tf32_matmul():
            return torch.nn.functional.linear(x_nh, weight_vh, bias_v)

    @staticmethod
    def backward(ctx, grad_nv):
        x_nh, weight_vh = ctx.saved_tensors
        with tf32_matmul():
            grad_x = grad_nv @ weight_vh if ctx.needs_input_grad[0] else None
            grad_w = grad_nv.t() @ x_nh if ctx.needs_input_grad[1] else None
        grad_b = grad_nv.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _FusedHead(torch.autograd.Function):
    """The ``fused``/``compiled`` head (module docstring): [N] log-probs and entropies of ``targets_n`` under
    softmax((hidden @ weight.T + bias) / T), ``chunk_size`` rows at a time, keeping no [N x vocab] tensor for
    the backward but the last chunk's (its log-softmax, or its logits when compiled), whose backward then
    needs no recompute. Eager, a chunk holds at most two [C x vocab] float32 blocks at a time, forward and
    backward (the logits are dropped once their log-softmax exists; the gradient is formed in place)."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, targets_n, temperature, with_entropy, entropy_grad, tf32,
                chunk_size, compiled):
        n = hidden_nh.shape[0]
        elementwise = _compiled("forward") if compiled else _chunk_logp_entropy
        logp_n = hidden_nh.new_empty(n)
        ent_n = hidden_nh.new_empty(n) if with_entropy else hidden_nh.new_empty(0)
        x_cv = None
        for start in range(0, n, chunk_size):
            x_cv = None  # the previous chunk's block goes before this one's is made
            x_cv = _scaled_logits(hidden_nh[start:start + chunk_size], weight_vh, bias_v, temperature, tf32)
            if not compiled:
                x_cv = torch.log_softmax(x_cv, dim=-1)  # the logits' block is freed here
            logp_c, ent_c = elementwise(x_cv, targets_n[start:start + chunk_size], with_entropy)
            logp_n[start:start + chunk_size] = logp_c
            if with_entropy:
                ent_n[start:start + chunk_size] = ent_c
        ctx.set_materialize_grads(False)
        ctx.entropy_grad = with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent_n)
        ctx.save_for_backward(hidden_nh, weight_vh, bias_v, targets_n, ent_n if ctx.entropy_grad else None)
        # Not saved_for_backward (which would hold it until the whole backward ends): the backward takes it off
        # ctx and drops it after the last chunk; a retained graph's second backward recomputes that chunk too.
        ctx.kept_cv = x_cv
        ctx.args = (temperature, tf32, chunk_size, compiled)
        return logp_n, ent_n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp_n, g_ent_n):
        hidden_nh, weight_vh, bias_v, targets_n, ent_n = ctx.saved_tensors
        kept_cv, ctx.kept_cv = ctx.kept_cv, None
        temperature, tf32, chunk_size, compiled = ctx.args
        n = hidden_nh.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden_nh) if need_h else None
        grad_w = torch.zeros_like(weight_vh) if need_w else None
        grad_b = torch.zeros_like(bias_v) if need_b else None
        if g_ent_n is None or not ctx.entropy_grad:
            g_ent_n = None
        if g_logp_n is None:
            g_logp_n = hidden_nh.new_zeros(n)
        elementwise = _compiled("backward") if compiled else _chunk_grad_logits
        with torch.autocast(hidden_nh.device.type, enabled=False):
            for i, start in enumerate(reversed(range(0, n, chunk_size))):  # the last chunk first: it is kept
                rows = slice(start, start + chunk_size)
                h_ch = hidden_nh[rows]
                if i == 0 and kept_cv is not None:
                    x_cv, kept_cv = kept_cv, None
                else:
                    x_cv = _scaled_logits(h_ch, weight_vh, bias_v, temperature, tf32)
                    if not compiled:
                        x_cv = torch.log_softmax(x_cv, dim=-1)
                g_cv = elementwise(x_cv, targets_n[rows], g_logp_n[rows], None if g_ent_n is None else g_ent_n[rows],
                                   None if ent_n is None else ent_n[rows], temperature)
                x_cv = None
                with tf32_matmul(tf32 and hidden_nh.device.type == "cuda"):
                    if need_h:
                        torch.mm(g_cv, weight_vh, out=grad_h[rows])
                    if need_w:
                        torch.addmm(grad_w, g_cv.t(), h_ch, out=grad_w)  # (not addmm_: FLOP counters skip it)
                if need_b:
                    grad_b += g_cv.sum(0)
                g_cv = None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def _scaled_logits(hidden_ch, weight_vh, bias_v, temperature, tf32):
    """z = (hidden @ weight.T + bias) / T for one chunk (T 0 or 1: unscaled, as ``_logp_and_entropy``)."""
    with tf32_matmul(tf32 and hidden_ch.device.type == "cuda"):
        z_cv = torch.nn.functional.linear(hidden_ch, weight_vh, bias_v)
    return z_cv.div_(temperature) if temperature not in (0.0, 1.0) else z_cv


def _chunk_logp_entropy(logp_cv, targets_c, with_entropy):
    """The fused head's forward elementwise work from the chunk's log-softmax, as ``_logp_and_entropy`` does it
    (the same values, bit for bit), with one [C x vocab] temporary."""
    logp_c = logp_cv.gather(-1, targets_c.unsqueeze(-1)).squeeze(-1)
    ent_c = -(logp_cv.exp().mul_(logp_cv)).sum(-1) if with_entropy else None
    return logp_c, ent_c


def _chunk_grad_logits(logp_cv, targets_c, g_logp_c, g_ent_c, ent_c, temperature):
    """d loss / d logits of one chunk from its log-softmax and the loss's per-token d/d logp (a) and d/d entropy
    (b): (a (onehot(y) - p) - b p (log p + H)) / T, p = softmax(z); in place (``logp_cv`` is overwritten)."""
    p_cv = logp_cv.exp()
    if g_ent_c is not None:  # the coefficient a + b (log p + H), in the log-softmax's block
        coef = logp_cv.add_(ent_c[:, None]).mul_(g_ent_c[:, None]).add_(g_logp_c[:, None])
    else:
        coef = g_logp_c[:, None]
    del logp_cv
    g_cv = p_cv.mul_(coef).neg_()
    del coef
    g_cv.scatter_add_(1, targets_c[:, None], g_logp_c[:, None].to(g_cv.dtype))
    return g_cv.div_(temperature) if temperature not in (0.0, 1.0) else g_cv


def _compiled_logp_entropy(z_cv, targets_c, with_entropy):
    """``_chunk_logp_entropy`` for ``torch.compile``: the log-softmax is read, not stored."""
    lse_c = torch.logsumexp(z_cv, dim=-1)
    logp_c = z_cv.gather(-1, targets_c.unsqueeze(-1)).squeeze(-1) - lse_c
    if not with_entropy:
        return logp_c, None
    logp_cv = z_cv - lse_c[:, None]
    return logp_c, -(logp_cv.exp() * logp_cv).sum(-1)


def _compiled_grad_logits(z_cv, targets_c, g_logp_c, g_ent_c, ent_c, temperature):
    """``_chunk_grad_logits`` for ``torch.compile``, from the logits: one elementwise expression after the
    log-softmax's reductions (the one-hot as a compare)."""
    logp_cv = torch.log_softmax(z_cv, dim=-1)
    coef = g_logp_c[:, None] if g_ent_c is None else g_logp_c[:, None] + g_ent_c[:, None] * (logp_cv + ent_c[:, None])
    onehot = torch.arange(z_cv.shape[-1], device=z_cv.device)[None] == targets_c[:, None]
    g_cv = torch.where(onehot, g_logp_c[:, None], 0.0) - logp_cv.exp() * coef
    return g_cv / temperature if temperature not in (0.0, 1.0) else g_cv


_COMPILED: dict[str, object] = {}


def _compiled(which: str):
    """The ``compiled`` kernel's elementwise parts, compiled once per process on first use (``torch.compile``
    caches per shape family: the chunk's row count is marked dynamic, so a last, shorter chunk does not
    recompile; the backward compiles twice, as dynamo specializes the first chunk's slices at offset 0)."""
    if which not in _COMPILED:
        fn = _compiled_logp_entropy if which == "forward" else _compiled_grad_logits
        compiled = torch.compile(fn)

        def call(z_cv, *args):
            torch._dynamo.maybe_mark_dynamic(z_cv, 0)
            for a in args:
                if isinstance(a, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(a, 0)
            return compiled(z_cv, *args)
        _COMPILED[which] = call
    return _COMPILED[which]


def _logp_and_entropy(logits, targets, temperature, with_entropy, entropy_grad=False):
    """Log-prob of ``targets`` under softmax(logits / T) over the last dim, and its entropy (with a
    gradient only if ``entropy_grad``)."""
    if temperature not in (0.0, 1.0):  # 0 means greedy sampling, which scores the unscaled logits
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def _linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head if logits are exactly ``head(decoder(...).last_hidden_state)``, else None."""
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    if get_head is None or get_decoder is None:
        return None
    head = get_head()
    if not isinstance(head, torch.nn.Linear) or get_decoder() is model:
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head
