"""The LM head's kernels (``head_kernel``: ``chunked``, ``fused``, ``compiled``; ``models/logprobs.py``, issue 51)
give the same log-probs, entropies and gradients, and the matmul FLOPs each costs are counted: ``chunked`` 4
matmuls per chunk (forward, checkpoint recompute, two for the gradient), ``fused`` 4 except 3 for its last chunk.

``compiled`` compiles with ``torch.compile`` (inductor's C++ on a CPU): a few seconds per shape family here,
so it is checked on one small head, in one layout through the model."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tidal.models import logprobs
from tidal.models.logprobs import HEAD_KERNELS, chunked_head_logprobs, token_logprobs

from .test_head_tokens import _batch, _run


def _head(n=37, h=16, v=50, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (1, n), generator=g)
    upstream = torch.randn(2, 1, n, generator=g, dtype=torch.float32)  # d loss / d logp, d loss / d entropy
    return hidden, weight, b, targets, upstream


def _head_run(kernel, hidden, weight, bias, targets, upstream, temperature=0.7, chunk_size=8, entropy_grad=True):
    """log-probs, entropies and the gradients of sum(a logp + b entropy) wrt hidden, weight (and bias)."""
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    logp, ent = chunked_head_logprobs(hidden, weight, bias, targets, temperature, True, chunk_size, entropy_grad,
                                      kernel=kernel)
    loss = (logp * upstream[0]).sum() + ((ent * upstream[1]).sum() if entropy_grad else 0.0)
    grads = torch.autograd.grad(loss, inputs)
    return logp.detach(), ent.detach(), grads


def test_the_fused_backward_is_the_exact_gradient_in_float64():
    """The closed-form gradient (onehot - p for the log-prob, -p (log p + H) for the entropy, / T) against
    finite differences, in float64, with a bias, several chunks and a temperature."""
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((13, 5), (7, 5), (7,)))
    y = torch.randint(0, 7, (13,), generator=g)
    for temperature, entropy_grad in [(0.7, True), (1.0, False), (1.3, True)]:
        def head(h, w, b, temperature=temperature, entropy_grad=entropy_grad):
            logp, ent = logprobs._FusedHead.apply(h, w, b, y, temperature, True, entropy_grad, False, 4, False)
            return (logp, ent) if entropy_grad else logp
        assert torch.autograd.gradcheck(head, (h, w, b))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [8, 1024])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_equals_chunked_values_and_gradients(temperature, chunk_size, entropy_grad):
    hidden, weight, bias, targets, upstream = _head()
    ref = _head_run("chunked", hidden, weight, bias, targets, upstream, temperature, chunk_size, entropy_grad)
    got = _head_run("fused", hidden, weight, bias, targets, upstream, temperature, chunk_size, entropy_grad)
    # The forward is the same ops on the same chunks: bit-equal. The backward is another formula for the same
    # gradient: float32 rounding apart (measured <= 2e-6 absolute at these sizes).
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for mine, theirs in zip(got[2], ref[2]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_float64_inputs_agree_too():
    """The head casts to float32 (the trainer's contract: an fp32 head whatever the model's dtype), so float64
    inputs give float32 results; both kernels cast the same way and the gradients come back in float64."""
    hidden, weight, bias, targets, upstream = _head(dtype=torch.float64)
    ref = _head_run("chunked", hidden, weight, bias, targets, upstream)
    got = _head_run("fused", hidden, weight, bias, targets, upstream)
    assert got[0].dtype == torch.float32 and got[2][0].dtype == torch.float64
    assert torch.equal(got[0], ref[0])
    for mine, theirs in zip(got[2], ref[2]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_compiled_equals_chunked():
    """``compiled``: the same values and gradients within float32 rounding (inductor reduces in its own order),
    and a shorter last chunk (37 = 4 x 8 + 5 rows) does not break the compiled kernels."""
    pytest.importorskip("torch._inductor")
    hidden, weight, bias, targets, upstream = _head()
    ref = _head_run("chunked", hidden, weight, bias, targets, upstream)
    got = _head_run("compiled", hidden, weight, bias, targets, upstream)
    for mine, theirs in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_entropy_without_its_gradient_and_no_entropy():
    hidden, weight, bias, targets, _ = _head()
    logp, ent = chunked_head_logprobs(hidden, weight, bias, targets, 1.0, True, 8, False, kernel="fused")
    assert logp.requires_grad and not ent.requires_grad  # the metric keeps no graph
    logp, ent = chunked_head_logprobs(hidden, weight, bias, targets, 1.0, False, 8, False, kernel="fused")
    assert ent is None
    with torch.no_grad():
        again, _ = chunked_head_logprobs(hidden, weight, bias, targets, 1.0, False, 8, False, kernel="fused")
    assert torch.equal(again, logp.detach()) and again.grad_fn is None


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_the_right_one():
    hidden, weight, _, targets, upstream = _head(bias=False)
    weight.requires_grad_(False)
    (ref,) = torch.autograd.grad((chunked_head_logprobs(hidden, weight, None, targets, 0.7)[0] * upstream[0]).sum(),
                                 hidden)
    logp, _ = chunked_head_logprobs(hidden, weight, None, targets, 0.7, kernel="fused")
    (got,) = torch.autograd.grad((logp * upstream[0]).sum(), hidden)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_the_head_stays_float32_under_bf16_autocast():
    """Under a caller's bf16 autocast the head's matmuls stay float32, forward and backward. The fused backward
    turns autocast off itself, so its gradients are the float32 ones even when the backward is called inside the
    autocast block (there, the checkpointed path's recomputed matmuls' backward runs in bf16: 4e-2 off,
    measured; the trainer calls backward outside autocast)."""
    hidden, weight, bias, targets, upstream = _head()
    plain = _head_run("fused", hidden, weight, bias, targets, upstream)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _head_run("fused", hidden, weight, bias, targets, upstream)
        ref = chunked_head_logprobs(hidden, weight, bias, targets, 0.7, True, 8, True)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], plain[0]) and torch.equal(ref[0], plain[0])
    for mine, theirs in zip(got[2], plain[2]):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def _matmul_flops(kernel, n, h, v, chunk_size, weight_grad=True):
    hidden, weight, _, targets, upstream = _head(n=n, h=h, v=v, bias=False)
    weight.requires_grad_(weight_grad)
    with FlopCounterMode(display=False) as counter:
        logp, ent = chunked_head_logprobs(hidden, weight, None, targets, 0.7, True, chunk_size, True, kernel=kernel)
        ((logp * upstream[0]).sum() + (ent * upstream[1]).sum()).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("n, chunk_size", [(40, 64), (40, 16), (64, 16)])
def test_matmul_flops_chunked_4_fused_3_on_its_last_chunk(n, chunk_size):
    """FLOPs of every matmul (torch's FlopCounterMode, 2 x rows x hidden x vocab each): ``chunked`` runs 4 per
    chunk; ``fused`` 3 on the last chunk (its logits are kept) and 4 on the others. One chunk: 3 against 4."""
    h, v = 16, 50
    one = 2 * h * v  # one token through one head matmul
    last = n - (n - 1) // chunk_size * chunk_size  # rows of the last chunk
    assert _matmul_flops("chunked", n, h, v, chunk_size) == 4 * n * one
    assert _matmul_flops("fused", n, h, v, chunk_size) == (4 * n - last) * one
    # A frozen head (LoRA): no weight gradient, one matmul fewer per token for both.
    assert _matmul_flops("chunked", n, h, v, chunk_size, weight_grad=False) == 3 * n * one
    assert _matmul_flops("fused", n, h, v, chunk_size, weight_grad=False) == (3 * n - last) * one


@pytest.mark.parametrize("layout", ["padded", "packed", "trie"])
@pytest.mark.parametrize("scored", ["all", "loss"])
def test_fused_equals_chunked_through_the_model(small_model, layout, scored):
    """Through ``token_logprobs`` on the tied tiny model (the head is the embedding: one parameter gets both
    gradients), temperature 0.7, entropy with its gradient, chunks of 5 tokens, in the padded, packed and
    prefix-shared layouts, on every token or the loss tokens only (``head_tokens``)."""
    assert small_model.lm_head.weight is small_model.model.embed_tokens.weight  # tied
    ids, attn, loss_mask, lengths, groups = _batch()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * loss_mask
    score = loss_mask if scored == "loss" else None
    ref = _run(small_model, layout, ids, attn, lengths, groups, score, weights, chunk_size=5)
    got = _run(small_model, layout, ids, attn, lengths, groups, score, weights, chunk_size=5, head_kernel="fused")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])  # the forward: bit-equal
    for n in ref[2]:
        scale = ref[2][n].abs().max().item()
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=0, atol=1e-5 * scale, msg=n)


def test_compiled_equals_chunked_through_the_model(small_model):
    pytest.importorskip("torch._inductor")
    ids, attn, loss_mask, lengths, groups = _batch()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * loss_mask
    ref = _run(small_model, "packed", ids, attn, lengths, groups, loss_mask, weights, chunk_size=5)
    got = _run(small_model, "packed", ids, attn, lengths, groups, loss_mask, weights, chunk_size=5,
               head_kernel="compiled")
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for n in ref[2]:
        scale = ref[2][n].abs().max().item()
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=0, atol=1e-5 * scale, msg=n)


def test_no_scored_position_still_gives_a_graph_and_zero_gradients(small_model):
    model = copy.deepcopy(small_model)
    ids, attn, loss_mask, *_ = _batch()
    logp, _ = token_logprobs(model, ids, attn, score_mask_bt=torch.zeros_like(loss_mask), head_kernel="fused")
    assert torch.equal(logp, torch.zeros_like(logp))
    logp.sum().backward()  # a zero-weight pass keeps collectives paired under FSDP
    assert torch.equal(model.lm_head.weight.grad, torch.zeros_like(model.lm_head.weight))


def test_an_unknown_kernel_is_refused():
    hidden, weight, bias, targets, _ = _head()
    with pytest.raises(AssertionError, match="head kernel"):
        chunked_head_logprobs(hidden, weight, bias, targets, kernel="liger")
    assert HEAD_KERNELS == ("chunked", "fused", "compiled")


def test_a_retained_graph_gives_the_same_gradient_twice():
    """The last chunk's kept block is consumed by the first backward; a second one (``retain_graph``) recomputes
    it and gets the same gradient."""
    hidden, weight, bias, targets, upstream = _head()
    logp, ent = chunked_head_logprobs(hidden, weight, bias, targets, 0.7, True, 8, True, kernel="fused")
    loss = (logp * upstream[0]).sum() + (ent * upstream[1]).sum()
    first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, bias))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_bench_parts_flop_formula_is_what_runs():
    """``benchmarks/_gpu_head.py``'s ``matmul_flops`` (the ``head_kernel`` part of ``tidal bench gpu``) against the
    FLOP counter, and the part's measurement on toy shapes: every arm ran, and matches ``chunked``."""
    from tidal.bench import load

    gpu_head = load("_gpu_head")
    for kernel in ("chunked", "fused"):
        for n, chunk in [(40, 16), (64, 16), (5, 1024)]:
            assert gpu_head.matmul_flops(kernel, n, 16, 50, chunk) == _matmul_flops(kernel, n, 16, 50, chunk)
    out = gpu_head.measure(64, 8, 24, 8, torch.device("cpu"), kernels=("chunked", "fused"), reps=1)
    fused = out["head_kernel_arms"]["fused fp32"]
    assert fused["max_abs_logp_diff"] == 0.0 and fused["max_rel_grad_weight_diff"] < 1e-5
    assert set(out["head_kernel_speedup"]) == {"chunked fp32", "fused fp32"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tf32", [False, True])
def test_the_kernels_agree_on_cuda_at_a_real_head_shape(tf32):
    """On the device (the device check's ``tests`` stage runs ``-m gpu tests/models``): 2,048 tokens through a
    Qwen2.5-0.5B-sized head (hidden 896, vocabulary 151,936) in chunks of 1,024, ``fused`` against ``chunked``,
    float32 or TF32 matmuls: log-probs within 1e-4 (TF32: 1e-2), gradients within 1e-4 (TF32: 1e-2) of the
    largest. ``compiled`` is left to the bench's ``head_kernel`` part (its differences from ``chunked`` are in
    ``head_kernel_arms``), so this stage pays no ``torch.compile``."""
    from tidal.bench import load

    gpu_head = load("_gpu_head")
    inputs = gpu_head.head_inputs(151936, 896, 2048, torch.device("cuda"))
    ref = [x.clone() for x in gpu_head.head_step("chunked", tf32, inputs, 1024, temperature=0.7)]
    tol = 1e-2 if tf32 else 1e-4
    for kernel in ("fused",):
        got = gpu_head.head_step(kernel, tf32, inputs, 1024, temperature=0.7)
        assert (got[0] - ref[0]).abs().max().item() <= tol, kernel
        for mine, theirs in zip(got[1:], ref[1:]):
            assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= tol, kernel
