"""Mixture math against hand-computed values: the lattice, the weighted merge, Aioli's update."""

import math

import pytest
import torch

from tidal.algo.mixing import (
    aioli_interactions,
    aioli_normalize,
    aioli_step,
    merge_weights,
    simplex_lattice,
    smoothed_one_hot,
)


def test_simplex_lattice_lists_every_mixture_once():
    assert simplex_lattice(3, 2) == [(1.0, 0.0, 0.0), (0.5, 0.5, 0.0), (0.5, 0.0, 0.5), (0.0, 1.0, 0.0),
                                     (0.0, 0.5, 0.5), (0.0, 0.0, 1.0)]
    assert len(simplex_lattice(4, 4)) == math.comb(4 + 3, 3) == 35
    assert all(abs(sum(m) - 1) < 1e-12 for m in simplex_lattice(4, 8))


def test_merge_is_base_plus_weighted_task_vectors():
    base = {"w": torch.tensor([1.0, 1.0]), "step": torch.tensor([3])}
    experts = [{"w": torch.tensor([3.0, 1.0]), "step": torch.tensor([9])},
               {"w": torch.tensor([1.0, 5.0]), "step": torch.tensor([9])}]
    merged = merge_weights(base, experts, [0.25, 0.75])
    # 1 + 0.25 * (3 - 1) = 1.5 and 1 + 0.75 * (5 - 1) = 4.0; integer buffers are the base's
    assert merged["w"].tolist() == [1.5, 4.0]
    assert merged["step"].tolist() == [3]
    assert base["w"].tolist() == [1.0, 1.0], "the base must not be modified"
    # a one-hot mixture is that expert; the uniform one the experts' mean
    assert merge_weights(base, experts, [0.0, 1.0])["w"].tolist() == [1.0, 5.0]
    assert merge_weights(base, experts, [0.5, 0.5])["w"].tolist() == [2.0, 3.0]


def test_smoothed_one_hot():
    assert smoothed_one_hot(3, 1, 0.5) == [0.25, 0.5, 0.25]
    assert smoothed_one_hot(2, 0, 0.625) == [0.625, 0.375]


def test_interactions_undo_the_smoothing():
    # true A = [[0.4, 0.0]], f = 0.75: sweep 0 drops 0.75*0.4 = 0.3, sweep 1 drops 0.25*0.4 = 0.1
    assert aioli_interactions([[0.3, 0.1]], 0.75)[0] == pytest.approx([0.4, 0.0], abs=1e-12)
    # k = 3, f = 0.5, A = [[0.2, 0.1, 0.0]]: drops 0.5*.2+.25*.1 = .125, .25*.2+.5*.1 = .1, .25*.2+.25*.1 = .075
    assert aioli_interactions([[0.125, 0.1, 0.075]], 0.5)[0] == pytest.approx([0.2, 0.1, 0.0], abs=1e-12)
    assert aioli_interactions([[0.3, 0.1]], 1.0) == [[0.3, 0.1]]


def test_normalize_shifts_negatives_then_sums_to_one():
    assert aioli_normalize([[0.3, -0.1]])[0] == pytest.approx([1.0, 0.0])  # +0.1, then / 0.4
    a = aioli_normalize([[0.1, 0.3], [0.3, 0.0]])
    assert a[0] == pytest.approx([1 / 7, 3 / 7]) and a[1] == pytest.approx([3 / 7, 0.0])
    assert aioli_normalize([[-0.2, -0.2]]) == [[0.0, 0.0]]  # nothing to prefer: no move


def test_aioli_step_on_a_hand_example():
    # one held-out group, A normalised to [[1, 0]], eta 0.2: p0 = e^0.2 / (e^0.2 + 1)
    assert aioli_step([0.5, 0.5], [[1.0, 0.0]], 0.2) == pytest.approx([0.549833997, 0.450166003], abs=1e-9)
    # two groups: column sums 4/7 and 3/7, eta 1: p0 = 1 / (1 + e^(-1/7))
    a = aioli_normalize([[0.1, 0.3], [0.3, 0.0]])
    assert aioli_step([0.5, 0.5], a, 1.0) == pytest.approx([0.535653671, 0.464346329], abs=1e-9)
    # equal column sums leave any prior unchanged; a zero A too
    assert aioli_step([0.2, 0.8], [[0.25, 0.25], [0.25, 0.25]], 3.0) == pytest.approx([0.2, 0.8])
    assert aioli_step([0.2, 0.8], [[0.0, 0.0]], 3.0) == pytest.approx([0.2, 0.8])
