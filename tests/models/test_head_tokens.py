"""The LM head on the scored positions only (``token_logprobs(score_mask_bt=...)``, issue 51) gives the full
head's log-probs, entropies and gradients on those positions, in the padded, packed and prefix-shared
(trie) layouts; and the head's TF32 switch is scoped and restored."""

import copy

import pytest
import torch

from tidal.models import logprobs
from tidal.models.logprobs import tf32_matmul, token_logprobs
from tidal.train.packing import pack, unpack
from tidal.train.prefix_tree import pack_prefix_trees, unpack_trees


def count_head_rows(monkeypatch) -> list[int]:
    """The rows each call of the LM head's matmul (``logprobs._head_chunk``) sees, appended as they come."""
    rows = []
    real = logprobs._head_chunk

    def counting(hidden_nh, *args):
        rows.append(hidden_nh.shape[0])
        return real(hidden_nh, *args)

    monkeypatch.setattr(logprobs, "_head_chunk", counting)
    return rows


def _batch(seed=0):
    """Right-padded rows sharing a prompt per group; the loss mask keeps the responses (some tokens off)."""
    g = torch.Generator().manual_seed(seed)
    lengths, groups, prompt = [9, 12, 9, 7, 11, 10, 9], [0, 0, 0, 0, 1, 1, 1], 6
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    prompts = {k: torch.randint(3, 40, (prompt,), generator=g) for k in set(groups)}
    for i, (n, k) in enumerate(zip(lengths, groups)):
        ids[i, :prompt] = prompts[k]
        ids[i, prompt:n] = torch.randint(3, 6, (n - prompt,), generator=g)
    cols = torch.arange(width)[None]
    attn = (cols < torch.tensor(lengths)[:, None]).long()
    loss_mask = attn.bool() & (cols >= prompt)
    loss_mask[1, 8] = False  # a response token the loss leaves out (a tool output, say)
    return ids, attn, loss_mask, lengths, groups


def _run(model, layout, ids, attn, lengths, groups, score_mask, weights, **kw):
    """Log-probs and entropies in the [B, T] layout, and the parameters' gradients of sum(weights * (logp +
    0.1 * entropy)), computed through ``layout`` with or without a score mask."""
    model = copy.deepcopy(model)
    width = ids.shape[1]
    if layout == "padded":
        logp, ent = token_logprobs(model, ids, attn, 0.7, True, entropy_grad=True, score_mask_bt=score_mask, **kw)
    else:
        packed = (pack(ids, lengths, 24) if layout == "packed" else pack_prefix_trees(ids, lengths, groups, 64))
        undo = unpack if layout == "packed" else unpack_trees
        mask_rl = None
        if score_mask is not None:  # the loss mask in the packed layout: a node is scored if any row through it is
            mask_rl = torch.zeros(packed.input_ids_rl.shape, dtype=torch.bool)
            sel = score_mask[packed.dest_b, packed.dest_t]
            mask_rl[packed.source_rows[sel], packed.source_cols[sel]] = True
        parents = packed.parents_rl if layout == "trie" else None
        logp, ent = token_logprobs(model, packed.input_ids_rl, packed.attention_mask_r1ll, 0.7, True,
                                   position_ids=packed.position_ids_rl, parents_bt=parents, entropy_grad=True,
                                   score_mask_bt=mask_rl, **kw)
        logp, ent = undo(logp, packed, width), undo(ent, packed, width)
    ((logp + 0.1 * ent) * weights).sum().backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["padded", "packed", "trie"])
@pytest.mark.parametrize("chunk_size", [1024, 5])
def test_scored_positions_equal_the_full_head(small_model, layout, chunk_size):
    ids, attn, loss_mask, lengths, groups = _batch()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * loss_mask
    full_logp, full_ent, full_grads = _run(small_model, layout, ids, attn, lengths, groups, None, weights,
                                           chunk_size=chunk_size)
    logp, ent, grads = _run(small_model, layout, ids, attn, lengths, groups, loss_mask, weights,
                            chunk_size=chunk_size)
    assert torch.equal(logp[~loss_mask], torch.zeros_like(logp[~loss_mask]))  # unscored: 0
    assert torch.equal(ent[~loss_mask], torch.zeros_like(ent[~loss_mask]))
    if chunk_size == 1024:  # one chunk both ways: the same rows of the same matmul, bit for bit (measured)
        assert torch.equal(logp[loss_mask], full_logp[loss_mask]) and torch.equal(ent[loss_mask], full_ent[loss_mask])
    # Chunks of 5 rows cut the two paths' tokens differently, so CPU GEMMs of other shapes round differently:
    # 1e-7 relative measured, float tolerance here.
    torch.testing.assert_close(logp[loss_mask], full_logp[loss_mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[loss_mask], full_ent[loss_mask], rtol=0, atol=1e-5)
    for n in full_grads:
        scale = full_grads[n].abs().max().item()
        torch.testing.assert_close(grads[n], full_grads[n], rtol=0, atol=1e-5 * scale, msg=n)


def test_the_head_runs_on_the_scored_tokens_only(small_model, monkeypatch):
    """The work saved: the head's matmul sees the loss tokens' rows, not the prompt's."""
    ids, attn, loss_mask, *_ = _batch()
    rows = count_head_rows(monkeypatch)
    token_logprobs(small_model, ids, attn, score_mask_bt=loss_mask)
    assert sum(rows) == int(loss_mask.sum())
    rows.clear()
    token_logprobs(small_model, ids, attn)
    assert sum(rows) == ids.shape[0] * (ids.shape[1] - 1)


def test_no_scored_position_gives_zeros_and_a_zero_gradient(small_model):
    model = copy.deepcopy(small_model)
    ids, attn, loss_mask, *_ = _batch()
    logp, _ = token_logprobs(model, ids, attn, score_mask_bt=torch.zeros_like(loss_mask))
    assert torch.equal(logp, torch.zeros_like(logp))
    logp.sum().backward()  # still a graph: a zero-weight pass keeps collectives paired under FSDP


@pytest.mark.parametrize("before", [False, True])
def test_tf32_matmul_restores_the_setting_even_on_an_exception(before):
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = before
        with tf32_matmul():
            assert torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 is before
        with pytest.raises(RuntimeError), tf32_matmul():
            raise RuntimeError("inside the head")
        assert torch.backends.cuda.matmul.allow_tf32 is before
        with tf32_matmul(enabled=False):
            assert torch.backends.cuda.matmul.allow_tf32 is before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_the_tf32_linear_matches_linear_values_and_gradients():
    """The head's scoped-TF32 linear (CUDA only in use) is ``linear`` with the same gradients: checked here
    on CPU, where TF32 does not exist, so the results must be equal."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, requires_grad=True) for s in ((7, 5), (11, 5), (11,)))
    grad = torch.randn(7, 11, generator=g)
    out = logprobs._TF32Linear.apply(x, w, b)
    out.backward(grad)
    mine = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    ref = torch.nn.functional.linear(x, w, b)
    ref.backward(grad)
    torch.testing.assert_close(out, ref)
    for got, t in zip(mine, (x, w, b)):
        torch.testing.assert_close(got, t.grad)
