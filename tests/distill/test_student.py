"""Student losses: the packed SFT loss equals the padded one; sparse KL at k = V equals full KL."""

import pytest
import torch

from tidal.algo.distill import RESIDUAL_MODES, full_forward_kl, topk_sparsify
from tidal.distill.shards import SparseSequence
from tidal.distill.student import (
    StudentConfig,
    full_kl_loss_with,
    response_logprobs,
    sft_loss,
    sparse_kl_loss,
    student_lr,
    train_student,
)
from tidal.models import tiny

SEQS = [([1, 13, 14, 15], [16, 17, 2]), ([1, 20], [21, 2]), ([1, 22, 23, 24, 25], [26, 27, 28, 2])]


def small(seed):
    tok = tiny.build_tokenizer()
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64,
                           init_seed=seed)
    return tiny.build_model(cfg, tok), tok


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_packed_micro_batched_sft_equals_the_padded_labels_loss():
    model, tok = small(0)
    cfg = StudentConfig(micro_batch_tokens=8, pack_tokens=8)  # several micro-batches and packed rows
    loss, n = sft_loss(model, SEQS, tok.pad_token_id, cfg)
    packed = grads(model)
    model.zero_grad()
    width = max(len(p) + len(r) for p, r in SEQS)
    ids = torch.full((3, width), tok.pad_token_id)
    labels = torch.full((3, width), -100)
    attn = torch.zeros(3, width, dtype=torch.long)
    for i, (p, r) in enumerate(SEQS):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
        attn[i, : len(p) + len(r)] = 1
    ref = model(input_ids=ids, attention_mask=attn, labels=labels).loss  # HF: mean NLL over labelled tokens
    ref.backward()
    assert n == 9 and abs(loss - ref.item()) < 1e-5
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(packed, grads(model)))


@pytest.mark.parametrize("residual", RESIDUAL_MODES)
def test_sparse_kl_with_k_equal_to_vocab_equals_full_kl(residual):
    teacher, tok = small(1)
    student, _ = small(2)
    with torch.no_grad():
        logp = response_logprobs(teacher, SEQS, tok.pad_token_id)
    assert logp.shape == (9, len(tok))
    data, row = [], 0
    for p, r in SEQS:
        ids, lp, res = topk_sparsify(logp[row : row + len(r)], len(tok))
        data.append(SparseSequence(p, r, ids, lp, res))
        row += len(r)
    cfg = StudentConfig(residual=residual)  # every reading of the residual is exact with no residual
    sparse, _ = sparse_kl_loss(student, data, tok.pad_token_id, cfg)
    g_sparse = grads(student)
    student.zero_grad()
    full, _ = full_kl_loss_with(teacher)(student, SEQS, tok.pad_token_id, cfg)
    assert abs(sparse - full) < 1e-5 and full > 0.01
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_sparse, grads(student)))


@pytest.mark.parametrize("residual", ["tail_bucket", "uniform_tail"])
def test_a_one_token_tail_is_exact_through_the_student_loss(residual):
    """k = V - 1: the tail is one token, so the bucket and the flat reading both equal the full KL."""
    teacher, tok = small(1)
    student, _ = small(2)
    with torch.no_grad():
        logp = response_logprobs(teacher, SEQS, tok.pad_token_id)
    data, row = [], 0
    for p, r in SEQS:
        data.append(SparseSequence(p, r, *topk_sparsify(logp[row : row + len(r)], len(tok) - 1)))
        row += len(r)
    sparse, _ = sparse_kl_loss(student, data, tok.pad_token_id, StudentConfig(residual=residual))
    student.zero_grad()
    full, _ = full_kl_loss_with(teacher)(student, SEQS, tok.pad_token_id, StudentConfig())
    assert abs(sparse - full) < 1e-5 and full > 0.01


def test_training_on_the_teacher_distribution_lowers_the_kl():
    teacher, tok = small(1)
    student, _ = small(2)
    loss_fn = full_kl_loss_with(teacher)
    before = loss_fn(student, SEQS, tok.pad_token_id, StudentConfig())[0]
    student.zero_grad()
    result = train_student(student, SEQS, loss_fn, StudentConfig(steps=30, batch_size=3, lr=1e-2), tok.pad_token_id,
                           evaluate=lambda m: 0.0, progress=False)
    after = loss_fn(student, SEQS, tok.pad_token_id, StudentConfig())[0]
    assert after < 0.5 * before, (before, after)
    assert [c["step"] for c in result.curve] == [0, 25, 30]


def test_a_whole_vocabulary_store_reproduces_full_kl_through_the_shards(tmp_path):
    """k = V written to disk and read back: the loss and ten training steps in the same order equal the full
    KL to the fp16-rounded teacher computed on the fly (the store's only change: ids, order and positions
    are exact), and match the unrounded full KL to the rounding. This random teacher is nearly uniform,
    log-probs near -4, so fp16 moves each by ~2e-3 and the loss by ~3e-3; the trained quickstart teacher's
    peaked distribution moved it by ~1e-6."""
    from tidal.distill.logits import LogitsConfig, write_store
    from tidal.distill.shards import LogitShards

    teacher, tok = small(1)
    write_store(teacher, tok, SEQS * 4, LogitsConfig(top_k=len(tok), report_k=[1], batch_size=5), tmp_path / "s",
                progress=False)
    data = list(LogitShards(tmp_path / "s"))
    assert [(d.prompt_ids, d.response_ids) for d in data] == SEQS * 4
    assert all(float(d.residual.abs().max()) == 0.0 for d in data)  # nothing outside the whole vocabulary
    cfg = StudentConfig(steps=10, batch_size=4, lr=1e-2, eval_every=5)
    student, _ = small(2)
    sparse, _ = sparse_kl_loss(student, data[:3], tok.pad_token_id, cfg)
    g_sparse = grads(student)
    student.zero_grad()
    full, _ = full_kl_loss_with(teacher)(student, SEQS, tok.pad_token_id, cfg)
    g_full = grads(student)
    with torch.no_grad():
        logq = response_logprobs(student, SEQS, tok.pad_token_id)
        rounded = full_forward_kl(logq, response_logprobs(teacher, SEQS, tok.pad_token_id).half().float()).mean()
    assert abs(sparse - rounded.item()) < 1e-6
    assert abs(sparse / full - 1) < 5e-3, (sparse, full)
    assert float(torch.cat([(a - b).flatten() for a, b in zip(g_sparse, g_full)]).norm()
                 / torch.cat([b.flatten() for b in g_full]).norm()) < 1e-2
    def rounded_full_kl(model, seqs, pad_id, cfg):
        with torch.no_grad():
            target = response_logprobs(teacher, seqs, pad_id).half().float()
        loss = full_forward_kl(response_logprobs(model, seqs, pad_id), target).mean()
        loss.backward()
        return loss.item(), len(target)

    curves = []
    for loss_fn, d in [(sparse_kl_loss, data), (rounded_full_kl, SEQS * 4)]:
        model, _ = small(2)
        measure = lambda m: {"accuracy": 0.0, "kl": full_kl_loss_with(teacher)(m, SEQS, tok.pad_token_id, cfg)[0]}  # noqa: E731
        curves.append([c["kl"] for c in train_student(model, d, loss_fn, cfg, tok.pad_token_id, measure,
                                                      progress=False).curve])
    assert curves[0][-1] < 0.5 * curves[0][0]
    assert all(abs(a / b - 1) < 1e-4 for a, b in zip(*curves)), curves


def test_student_lr_schedule_hand_computed():
    import pytest

    from tidal.config import ConfigError

    cos = StudentConfig(steps=4, lr=1e-3, schedule="cosine")
    expect = [1e-3, 0.853553e-3, 0.5e-3, 0.146447e-3, 0.0]  # lr (1 + cos(pi t / 4)) / 2
    assert [student_lr(t, cos) for t in range(5)] == pytest.approx(expect, rel=1e-5)
    assert student_lr(3, StudentConfig(steps=4, lr=1e-3)) == 1e-3  # constant
    assert student_lr(4, StudentConfig(steps=4, lr=1e-3, schedule="cosine", min_lr_ratio=0.1)) == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="student.schedule"):
        StudentConfig(schedule="linear")
