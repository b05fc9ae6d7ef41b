"""``tidal bench distill_vocab`` on a toy size (the full-size numbers are in docs/distill.md): a locally built
BPE teacher's k-sparse store loses less and covers more as k grows, bytes follow the formula, and the
sparse loss's change against the full KL is hand-checked on a 3-token example."""

import math

import pytest
import torch

from tidal.bench import load

bd = load("distill_vocab")


def test_objective_gap_hand_computed():
    teacher = torch.tensor([[0.5, 0.3, 0.2]]).log()
    student = torch.tensor([[0.25, 0.25, 0.5]]).log()
    full = 0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
    tail = 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)  # outcomes {token 0, other}: (0.5, 0.5) vs (0.25, 0.75)
    assert bd.objective_gap(student, teacher, 1) == pytest.approx(tail / full - 1, abs=1e-3)  # fp16 log-probs
    rounded = teacher.half().float()  # k = V: the full KL to the fp16-rounded teacher, the store's only change
    assert bd.objective_gap(student, teacher, 3) == pytest.approx(
        float((rounded.exp() * (rounded - student)).sum()) / full - 1, abs=1e-6)


def test_toy_run(tmp_path):
    out = bd.run(["vocab_size=300", "corpus_files=12", "heldout_files=2", "steps=4", "student_step=2",
                  "eval_windows=4", "seq_len=32", "batch_size=4", "hidden_size=32", "ks=[1,8,32,1000]"], tmp_path)
    rows = out["table"]
    vocab = out["num_vocab"]
    assert 256 <= vocab <= 300 and [r["k"] for r in rows] == [1, 8, 32]  # k above the vocabulary is skipped
    for r in rows:
        assert r["bytes_per_pos"] == 4 * r["k"] + 4
        assert r["bytes_fraction"] == pytest.approx(r["bytes_per_pos"] / (4 * vocab))
        assert -1 < r["objective_gap"] < 1e-3  # the tail bucket never exceeds the full KL (up to fp16)
    for a, b in zip(rows, rows[1:]):
        assert a["info_loss"] > b["info_loss"] and a["residual"] > b["residual"] and a["covered"] <= b["covered"]
        assert a["objective_gap"] < b["objective_gap"]
    assert out["positions"] == 4 * 31 and out["student_full_kl"] > 0
    with pytest.raises(ValueError, match="corpus_files=3"):
        bd.run(["corpus_files=3", "heldout_files=3"], tmp_path)
