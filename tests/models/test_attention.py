"""The interval mask rule and its BlockMask (exact, tile by tile), the ``tidal_packed`` attention
(chunked SDPA on CPU equals dense SDPA in values and gradients, and never holds an [L, L] tensor;
FlexAttention on CUDA, ``-m gpu``), and switching a model to it."""

import copy
import random
import subprocess
import sys

import pytest
import torch

from tidal.models import tiny
from tidal.models.attention import (
    interval_block_mask,
    interval_mask,
    packed_attention_forward,
    use_packed_attention,
)
from tidal.models.logprobs import token_logprobs
from tidal.utils.memory import tensor_peak_bytes


def random_ends(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """``end_rl`` of random pre-order forests, then padding: chains of random length (plain packing's
    sequences, a trie's prompts and responses), each branching off a random node of the last one's path
    or, one time in four, starting a new tree; the first chain is a long prompt, so rows have full
    tiles (keys whose subtrees cover a whole later query block) as well as partial and empty ones."""
    rng = random.Random(seed)
    ends = []
    for _ in range(num_rows):
        used = rng.randint(width // 2, width)
        parents, path = [], []  # path: the last node and its ancestors
        while len(parents) < used:
            path = path[: rng.randint(1, len(path))] if path and rng.random() < 0.75 else []
            length = rng.randint(width // 3, width // 2) if not parents else rng.randint(1, width // 4)
            for _ in range(min(length, used - len(parents))):
                parents.append(path[-1] if path else -1)
                path.append(len(parents) - 1)
        size = [1] * used
        for node in range(used - 1, -1, -1):
            if parents[node] >= 0:
                size[parents[node]] += size[node]
        ends.append([k + s for k, s in enumerate(size)] + list(range(used + 1, width + 1)))
    return torch.tensor(ends)


def block_sets(block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [R, nq, nk] partial and full tiles listed by ``block_mask``."""
    out = []
    for num, idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                     (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        tiles = torch.zeros(idx.shape[0], idx.shape[2], idx.shape[3], dtype=torch.bool)
        for r in range(idx.shape[0]):
            for q in range(idx.shape[2]):
                tiles[r, q, idx[r, 0, q, : num[r, 0, q]].long()] = True
        out.append(tiles)
    return out[0], out[1]


@pytest.mark.parametrize("width, block", [(5, 4), (64, 16), (200, 64), (300, 128), (513, 128)])
def test_the_block_mask_is_exact_tile_by_tile(width, block):
    half = torch.arange(width).div(width // 2, rounding_mode="floor").add(1).mul(width // 2).clamp(max=width)
    end_rl = torch.cat([random_ends(2, width, seed=width), half[None]])  # + a row of two long sequences
    dense = interval_mask(end_rl)[:, 0]
    bm = interval_block_mask(end_rl, block)
    assert bm.shape == (3, 1, width, width)
    cols = torch.arange(width)
    from_mod = bm.mask_mod(torch.arange(3)[:, None, None], 0, cols[None, :, None], cols[None, None, :])
    assert torch.equal(from_mod, dense)
    partial, full = block_sets(bm)
    assert not (partial & full).any()
    if width >= 4 * block:  # the data has all three kinds of tile
        off_diagonal = ~torch.eye(partial.shape[1], dtype=torch.bool)
        assert full.any() and (partial & off_diagonal).any() and not (partial | full).all()
    rebuilt = torch.zeros_like(dense)
    for r in range(3):
        for q in range(partial.shape[1]):
            for k in range(partial.shape[2]):
                tile = dense[r, q * block : (q + 1) * block, k * block : (k + 1) * block]
                rows, keys = slice(q * block, (q + 1) * block), slice(k * block, (k + 1) * block)
                if full[r, q, k]:
                    assert tile.all(), (r, q, k)  # a FULL tile really is all-true: no mask is evaluated there
                    rebuilt[r, rows, keys] = True
                elif partial[r, q, k]:
                    assert tile.any() and (q == k or not tile.all()), (r, q, k)  # tight: not empty, not full
                    rebuilt[r, rows, keys] = from_mod[r, rows, keys]
                else:
                    assert not tile.any(), (r, q, k)  # a skipped tile hides nothing
    assert torch.equal(rebuilt, dense)


@pytest.mark.parametrize("window", [1, 37, 130])
def test_the_windowed_block_mask_is_exact_and_skips_tiles_behind_the_window(window):
    """Sliding-window layers: the rule gains ``pos[q] - pos[kv] < window`` over position ids (a trie's depths,
    a packed row's restarting positions). Tiles listed full are all-true, skipped tiles hide nothing, and the
    tiles far behind the diagonal that the interval rule alone keeps are skipped."""
    _, _, layouts = _both_layouts()
    for layout, _, _ in layouts:
        end_rl, pos_rl = layout.end_rl, layout.position_ids_rl
        r, n = end_rl.shape
        dense = interval_mask(end_rl, pos_rl, window)[:, 0]
        assert torch.equal(dense, interval_mask(end_rl)[:, 0] & (pos_rl[:, :, None] - pos_rl[:, None, :] < window))
        bm = interval_block_mask(end_rl, 64, pos_rl=pos_rl, window=window)
        cols = torch.arange(n)
        from_mod = bm.mask_mod(torch.arange(r)[:, None, None], 0, cols[None, :, None], cols[None, None, :])
        assert torch.equal(from_mod, dense)
        partial, full = block_sets(bm)
        rebuilt = torch.zeros_like(dense)
        for b in range(r):
            for q in range(partial.shape[1]):
                for k in range(partial.shape[2]):
                    rows, keys = slice(q * 64, (q + 1) * 64), slice(k * 64, (k + 1) * 64)
                    if full[b, q, k]:
                        assert dense[b, rows, keys].all(), (b, q, k)
                        rebuilt[b, rows, keys] = True
                    elif partial[b, q, k]:
                        rebuilt[b, rows, keys] = from_mod[b, rows, keys]
                    else:
                        assert not dense[b, rows, keys].any(), (b, q, k)
        assert torch.equal(rebuilt, dense)
    # one 512-token sequence: with a window under a tile, only the diagonal tiles and the ones just below remain
    partial, full = block_sets(interval_block_mask(torch.full((1, 512), 512), 64, torch.arange(512)[None], window))
    behind = torch.arange(8)[:, None] - torch.arange(8)[None, :]  # query block - key block
    assert torch.equal((partial | full)[0], (behind >= 0) & (behind <= -(-(window - 1) // 64)))


class _Attention(torch.nn.Module):
    """What transformers passes as ``module``: only its attributes are read."""

    num_key_value_groups = 2
    is_causal = True


def test_chunked_sdpa_equals_dense_sdpa_values_and_gradients():
    end_rl = random_ends(2, 300, seed=1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 300, 16, generator=g, requires_grad=True) for _ in range(2))  # GQA: 2 kv heads
    w = torch.randn(2, 300, 4, 16, generator=g)
    grads = []
    for mask in (interval_mask(end_rl), interval_block_mask(end_rl, 64)):
        out, _ = packed_attention_forward(_Attention(), q, k, v, mask, scaling=0.25)
        (out * w).sum().backward()
        grads.append((out.detach(), *(x.grad.clone() for x in (q, k, v))))
        for x in (q, k, v):
            x.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_block_path_never_holds_an_l_by_l_tensor():
    """Forward and backward of one 4,096-token row: every tensor torch allocated, at its peak, is less
    than half of one bool [L, L] mask (the dense path's mask alone is L^2 bytes, its scores 4 L^2 per head)."""
    n = 4096
    end_rl = torch.arange(n).div(512, rounding_mode="floor").add(1).mul(512)[None]  # 8 sequences of 512
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    module = _Attention()
    module.num_key_value_groups = 1

    def step():
        out, _ = packed_attention_forward(module, q, k, v, interval_block_mask(end_rl), scaling=0.25)
        out.sum().backward()

    assert tensor_peak_bytes(step) < n * n / 2


@pytest.fixture(scope="module")
def gqa_config():
    return tiny.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            max_position_embeddings=512)


def test_a_switched_model_runs_sdpa_for_every_other_mask(tokenizer, gqa_config, batch):
    model = tiny.build_model(gqa_config, tokenizer)
    switched = copy.deepcopy(model)
    assert use_packed_attention(switched) and switched.config._attn_implementation == "tidal_packed"
    ids, mask = batch  # left-padded: a 2-D mask, turned into SDPA's 4-D mask as before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           switched(input_ids=ids, attention_mask=mask).logits)
        assert torch.equal(model(input_ids=ids).logits, switched(input_ids=ids).logits)
        greedy = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)  # prefill + cached decode
        assert torch.equal(model.generate(ids, **greedy), switched.generate(ids, **greedy))
    decoder = copy.deepcopy(model.get_decoder())  # the critic's copy of the decoder
    assert use_packed_attention(decoder) and decoder.config._attn_implementation == "tidal_packed"
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    assert not use_packed_attention(flash) and flash.config._attn_implementation == "flash_attention_2"


def test_a_switched_model_saves_a_checkpoint_that_loads_without_tidal(tmp_path, tokenizer, gqa_config):
    model = tiny.build_model(gqa_config, tokenizer)
    use_packed_attention(model)
    tiny.save(model, tokenizer, tmp_path)
    code = ("import sys; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}); "
            "assert not any(k.startswith('tidal') for k in sys.modules); print(m.config._attn_implementation)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "sdpa"


def _both_layouts():
    """A plain packed row and a prefix-trie row of the same sequences (the trainer's two layouts)."""
    from tidal.train.packing import pack, unpack
    from tidal.train.prefix_tree import pack_prefix_trees, unpack_trees

    g = torch.Generator().manual_seed(0)
    lengths, groups = [40, 170, 9, 120, 64, 200], [0, 0, 0, 1, 1, 1]
    ids = torch.randint(3, 6, (6, 200), generator=g)  # few symbols: tries share prefixes
    ids[:, :8] = ids[torch.tensor(groups) * 3, :8]
    return ids, lengths, [(pack(ids, lengths, 512), False, unpack),
                          (pack_prefix_trees(ids, lengths, groups, 512), True, unpack_trees)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_on_cuda_equals_the_dense_mask(tokenizer, gqa_config):
    """FlexAttention (compiled) against the dense-mask SDPA on the same device, both layouts:
    log-probs to fp32 kernel rounding and parameter gradients with cosine >= 0.999."""
    ids, lengths, layouts = _both_layouts()
    dense_model = tiny.build_model(gqa_config, tokenizer).cuda().train()
    flex_model = copy.deepcopy(dense_model)
    assert use_packed_attention(flex_model)
    weights = torch.randn(6, 200, generator=torch.Generator().manual_seed(1)).cuda()
    for layout, is_trie, unpack_fn in layouts:
        results = []
        for model, mask in ((dense_model, layout.attention_mask_r1ll.cuda()),
                            (flex_model, interval_block_mask(layout.end_rl.cuda()))):
            model.zero_grad(set_to_none=True)
            parents = layout.parents_rl.cuda() if is_trie else None
            logp, _ = token_logprobs(model, layout.input_ids_rl.cuda(), mask,
                                     position_ids=layout.position_ids_rl.cuda(), parents_bt=parents)
            logp_bt = unpack_fn(logp, layout, 200)
            (logp_bt * weights).sum().backward()
            results.append((logp_bt.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
        (dense_logp, dense_grad), (flex_logp, flex_grad) = results
        torch.testing.assert_close(flex_logp, dense_logp, atol=2e-3, rtol=1e-3)
        assert torch.nn.functional.cosine_similarity(flex_grad, dense_grad, dim=0) >= 0.999
