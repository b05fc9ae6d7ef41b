"""A pair's common prefix computed once (``stages/pair_tree.py``): the same DPO losses, gradients and reference
log-probs, and the same reward-model rewards and gradients, as the two-row packing; and fewer tokens fed."""

import pytest
import torch

from tidal.config import apply_overrides
from tidal.models import tiny
from tidal.models.reward_model import from_policy
from tidal.stages import dpo, reward_model
from tidal.stages.chat_data import PairExample, SFTExample, encode_pair
from tidal.stages.pair_tree import pack_pairs, right_padded, row_width
from tidal.stages.sft import masks, padded
from tidal.train.prefix_tree import pack_prefix_trees, trie, unpack_trees

from .conftest import SMALL

MODEL = dict(SMALL, num_layers=2)


def _pairs(tok) -> list[PairExample]:
    """Rows whose chosen and rejected share the prompt and part of the answer (``46``/``45``), share the prompt
    only, and differ in length; plus hand-made pairs where one sequence is a prefix of the other (a cut at
    ``max_length``) and where the two share nothing at all."""
    rows = [("what is 12+34?", "46", "45"), ("what is 3+4?", "7", "12"), ("hi", "hello there", "no"),
            ("what is 9+9?", "18", "81"), ("x", "yy", "zzz"), ("tell me", "a longer answer", "a long answer")]
    pairs = [encode_pair(tok, {"prompt": p, "chosen": c, "rejected": r}, 64) for p, c, r in rows]
    base = pairs[0]
    cut = len(base.rejected_ids) - 1  # chosen: the rejected's ids cut one short, an interior node of the trie
    pairs.append(PairExample(base.rejected_ids[:cut], base.rejected_mask[:cut], base.rejected_ids, base.rejected_mask))
    pairs.append(PairExample([5, 6, 7, 8], [0, 0, 1, 1], [9, 10, 11], [0, 1, 1]))  # no common token
    return pairs


@pytest.fixture(scope="module")
def setup():
    tok = tiny.build_chat_tokenizer()
    torch.manual_seed(0)
    model = tiny.build_model(tiny.ModelConfig(**MODEL, tokenizer="chat"), tok).double()
    reference = tiny.build_model(tiny.ModelConfig(**MODEL, tokenizer="chat", init_seed=3), tok).double()
    return model, reference, _pairs(tok)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_reference_logps_equal_the_two_row_ones(setup):
    _, reference, pairs = setup
    shared = dpo.reference_logps(reference, pairs, 3, 24, share_prefix=True)
    two_row = dpo.reference_logps(reference, pairs, 3, 24, share_prefix=False)
    assert shared.shape == (len(pairs), 2)
    assert torch.allclose(shared, two_row, atol=1e-5, rtol=0), (shared - two_row).abs().max()
    assert float(shared.std()) > 0.1  # the check could fail: log-probs differ by pair


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "simpo"])
def test_dpo_loss_and_gradients_equal_the_two_row_ones(setup, loss_type):
    model, reference, pairs = setup
    ref = dpo.reference_logps(reference, pairs, 8, 24, share_prefix=False)
    rows = list(zip(pairs, ref))
    out = {}
    for share in (True, False):
        cfg = apply_overrides(dpo.DPOStageConfig(), [f"loss_type={loss_type}", f"share_prefix={share}"])
        loss, metrics = dpo.pair_loss(cfg, model, rows, pack_length=24)
        out[share] = float(loss.detach()), metrics, _grads(model, loss)
    (loss_s, m_s, g_s), (loss_t, m_t, g_t) = out[True], out[False]
    assert abs(loss_s - loss_t) < 1e-6, (loss_s, loss_t)
    assert abs(loss_s) > 1e-3 and m_s["pref_acc"] == m_t["pref_acc"] and m_s["num_tokens"] == m_t["num_tokens"]
    assert g_s.keys() == g_t.keys() and len(g_s) > 0
    for name in g_s:
        assert torch.allclose(g_s[name], g_t[name], atol=1e-6, rtol=1e-5), (name, (g_s[name] - g_t[name]).abs().max())
    assert max(float(g.abs().max()) for g in g_s.values()) > 1e-4  # the gradients are not all zero
    assert m_s["computed_tokens"] < m_t["computed_tokens"] == m_t["num_tokens"]


def test_reward_model_rewards_and_gradients_equal_the_two_row_ones(setup):
    policy, _, pairs = setup
    rm = from_policy(policy).double()
    torch.nn.init.normal_(rm.score.weight)
    out = {}
    for share in (True, False):
        rc, rr = reward_model.pair_rewards(rm, pairs, pack_length=24, share_prefix=share)
        out[share] = rc.detach(), rr.detach(), _grads(rm, (torch.nn.functional.logsigmoid(rc - rr)).mean().neg())
    (rc_s, rr_s, g_s), (rc_t, rr_t, g_t) = out[True], out[False]
    # the rewards leave the head as float32 (``.float()``), so float32's rounding is the tolerance
    assert torch.allclose(rc_s, rc_t, atol=1e-6) and torch.allclose(rr_s, rr_t, atol=1e-6), (rc_s - rc_t, rr_s - rr_t)
    assert float(torch.cat([rc_t, rr_t]).std()) > 0  # rewards differ by sequence
    for name in g_t:
        assert torch.allclose(g_s[name], g_t[name], atol=1e-6, rtol=1e-5), (name, (g_s[name] - g_t[name]).abs().max())


def _fed_tokens(model, fn) -> int:
    """Tokens the model's embedding is given in ``fn()`` (padding slots included)."""
    fed = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: fed.append(args[0].numel()))
    try:
        fn()
    finally:
        hook.remove()
    return sum(fed)


def test_a_pair_sharing_n_tokens_feeds_n_fewer(setup):
    """By hand: ``what is 12+34?`` -> ``46`` / ``45`` share every token up to the answer's last digit; one pair in
    one row (no padding) feeds the model exactly len(chosen) + len(rejected) - N tokens, the two-row path all."""
    model, reference, pairs = setup
    pair = pairs[0]
    n = next(i for i, (a, b) in enumerate(zip(pair.chosen_ids, pair.rejected_ids)) if a != b)
    assert pair.chosen_ids[n - 1] == pair.rejected_ids[n - 1] and n > len(pair.chosen_ids) // 2
    total = len(pair.chosen_ids) + len(pair.rejected_ids)
    for share, want in ((True, total - n), (False, total)):
        fed = _fed_tokens(model, lambda s=share: dpo.sequence_logps(model, [pair], 64, share_prefix=s))
        assert fed == want, (share, fed, want)
    rm = from_policy(model)
    assert _fed_tokens(rm, lambda: reward_model.pair_rewards(rm, [pair], 64, share_prefix=True)) == total - n
    layout, _ = pack_pairs([pair.chosen_ids], [pair.rejected_ids], 64)
    assert layout.num_tokens == total - n and layout.input_ids_rl.shape == (1, total - n)


@pytest.mark.parametrize("pack_length, hidden", [(24, 32), (64, 10**6), (200, 10**6)])
def test_pair_layout_is_the_prefix_tries(setup, pack_length, hidden):
    """``pack_pairs`` builds, with tensor ops, the layout ``train/prefix_tree.pack_prefix_trees`` builds by walking
    each pair's trie: the same ids, positions, parents and subtree ends, and the same values unpacked."""
    _, _, pairs = setup
    chosen, rejected = [p.chosen_ids for p in pairs], [p.rejected_ids for p in pairs]
    layout, lengths = pack_pairs(chosen, rejected, pack_length, hidden)
    ids_bt, _ = padded(chosen + rejected)
    sizes = [len(trie([c, r])[0]) for c, r in zip(chosen, rejected)]
    capacity = row_width(sizes, max(pack_length, ids_bt.shape[1]), hidden)
    want = pack_prefix_trees(ids_bt, lengths, list(range(len(pairs))) * 2, capacity)
    for name in ("input_ids_rl", "position_ids_rl", "parents_rl", "end_rl"):
        assert torch.equal(getattr(layout, name), getattr(want, name)), name
    assert (layout.num_tokens, layout.num_sequences) == (want.num_tokens, want.num_sequences) == (sum(sizes), 16)
    values = torch.randn(layout.input_ids_rl.shape)
    width = ids_bt.shape[1]
    assert torch.equal(unpack_trees(values, layout, width), unpack_trees(values, want, width))


def test_right_padded_is_sft_padded(setup):
    _, _, pairs = setup
    rows = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    ids, lengths = right_padded(rows)
    want, want_lengths = padded(rows)
    assert torch.equal(ids, want) and lengths == want_lengths
    mask, _ = right_padded([p.chosen_mask for p in pairs], torch.float)
    mask[:, 0] = 0
    assert torch.equal(mask, masks([SFTExample(p.chosen_ids, p.chosen_mask) for p in pairs], mask.shape[1]))


def test_row_width_never_splits_a_pair_and_weighs_attention():
    """Capacity is never under the largest trie (a split pair would compute its prefix twice); short tries get
    narrow rows (attention's W^2 outweighs the padding), and a large hidden size (attention cheap per token)
    takes the widest, least padded rows."""
    sizes = [20] * 5 + [10]  # one row of 110 columns holds all; rows of 20, 40 or 60 pad 10 more slots
    assert row_width(sizes, 110, hidden_size=32) == 20
    assert row_width(sizes, 110, hidden_size=10**6) == 110
    assert row_width([30, 90], 64, hidden_size=128) == 90  # one trie wider than the limit: the trie's width
