"""``tidal bench distill_sparse`` on a toy size (the full-size numbers are in docs/distill.md): the reversal
task's sequences, the positions the losses read, the hand-computed entropy and schedule, and a toy run's
table (bytes by the formula, every arm trained on every seed, gaps against the full-KL arm)."""

import math

import pytest
import torch

from tidal.bench import load
from tidal.config import apply_overrides

bs = load("distill_sparse")


def settings(**kw):
    return apply_overrides(bs.Settings(), [f"{k}={v}" for k, v in kw.items()])


def test_reversal_sequences():
    s = settings(vocab_size=50, prompt_len=6)
    seqs = bs.task_sequences(s, 20, torch.Generator().manual_seed(0))
    prompt, sep, response = seqs[:, :6], seqs[:, 6], seqs[:, 7:]
    assert seqs.shape == (20, 13) and (sep == 49).all() and (prompt < 49).all()
    assert all(len(set(row.tolist())) == 6 for row in prompt)  # distinct tokens
    assert torch.equal(response, prompt.flip(-1))  # noise 0: the exact reversal
    noisy = bs.task_sequences(settings(vocab_size=50, prompt_len=6, noise=1.0), 20, torch.Generator().manual_seed(0))
    assert all(set(r[7:].tolist()) <= set(r[:6].tolist()) for r in noisy)  # every position drawn from the prompt
    assert not torch.equal(noisy[:, 7:], noisy[:, :6].flip(-1))


def test_true_entropy_hand_computed():
    top, other = 1 - 0.1 + 0.1 / 8, 0.1 / 8  # 0.9125 on the reversed token, 0.0125 on each of 7 others
    expected = -(top * math.log(top) + 7 * other * math.log(other))
    assert bs.true_entropy(settings(prompt_len=8, noise=0.1)) == pytest.approx(expected)
    assert expected == pytest.approx(0.467, abs=1e-3)
    assert bs.true_entropy(settings(noise=0.0)) == 0.0


def test_cosine_with_warmup():
    assert bs.cosine(0, 100, 1.0, warmup=10) == pytest.approx(0.1)  # 1/10 of the way up, cosine ~1
    assert bs.cosine(9, 100, 1.0, warmup=10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.09)))
    assert bs.cosine(50, 100, 2.0) == pytest.approx(1.0)  # half way down
    assert bs.cosine(100, 100, 1.0) == pytest.approx(0.0)


def test_response_logp_reads_the_positions_that_predict_the_response():
    s = settings(vocab_size=40, prompt_len=4, hidden_size=16)
    torch.manual_seed(0)
    model = bs.build_model(s).eval()
    seqs = bs.task_sequences(s, 3, torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=seqs).logits.float().log_softmax(-1)
        got = bs.response_logp(model, seqs, 4)
    assert got.shape == (3 * 4, 40)
    # position 4 (the separator) predicts response token 0, ..., position 7 predicts response token 3
    assert torch.allclose(got, full[:, 4:8].flatten(0, 1), atol=1e-5)


def test_teacher_samples_are_fixed_by_the_generator():
    s = settings(vocab_size=40, prompt_len=4, hidden_size=16)
    torch.manual_seed(0)
    model = bs.build_model(s).eval()
    a = bs.teacher_samples(model, s, 5, torch.Generator().manual_seed(3))
    b = bs.teacher_samples(model, s, 5, torch.Generator().manual_seed(3))
    assert a.shape == (5, 9) and torch.equal(a, b) and (a[:, 4] == 39).all()
    gen = torch.Generator().manual_seed(3)  # the same draws without the KV cache: the same tokens
    seqs = torch.cat([bs.prompts(s, 5, gen), torch.full((5, 1), 39)], -1)
    with torch.no_grad():
        for _ in range(4):
            probs = model(input_ids=seqs).logits[:, -1].float().softmax(-1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=gen)], -1)
    assert torch.equal(seqs, a)


def test_toy_run(tmp_path):
    out = bs.run(["vocab_size=64", "prompt_len=4", "hidden_size=16", "batch_size=8", "teacher_steps=6",
                  "teacher_warmup=2", "student_step=3", "student_steps=3", "seeds=[0,1]", "ks=[1,8,32,100]",
                  "eval_sequences=8"], tmp_path)
    rows = out["table"]
    assert [r["k"] for r in rows] == [1, 8, 32]  # k above the vocabulary is skipped
    for r in rows:
        assert r["bytes_per_pos"] == 4 * r["k"] + 4 and r["bytes_fraction"] == pytest.approx(r["bytes_per_pos"] / 256)
        assert r["student_gap_min"] <= r["student_gap_median"] <= r["student_gap_max"]
        assert -1 < r["objective_gap_median"] < 1e-3  # the tail bucket never exceeds the full KL (up to fp16)
    for a, b in zip(rows, rows[1:]):
        assert a["residual"] > b["residual"] and a["info_loss"] > b["info_loss"]
    assert [p["seed"] for p in out["per_seed"]] == [0, 1]
    for p in out["per_seed"]:
        assert p["k32_gap"] == pytest.approx(p["k32_eval_kl"] / p["full_eval_kl"] - 1)
    assert out["k32_rel_loss_gap"] == rows[2]["student_gap_median"]
    assert out["k32_bytes_fraction"] == pytest.approx(132 / 256)
    assert out["start_eval_kl"] > 0 and 0 <= out["teacher_token_accuracy"] <= 1


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="noise=1.5"):
        bs.run(["noise=1.5"], tmp_path)
    with pytest.raises(ValueError, match="prompt_len=20"):
        bs.run(["vocab_size=20", "prompt_len=20"], tmp_path)
    with pytest.raises(ValueError, match="residual='drop'"):
        bs.run(["residual=drop"], tmp_path)
