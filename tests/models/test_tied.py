"""Tied weights (``models/tied.py``): which names are aliases, dropping and filling them in, and a strict
load that accepts a state dict holding a tied parameter once and leaves the model tied."""

import copy

import pytest
import torch

from tidal.models.tied import load_weights, retie, tied_names, untie


def untied(model):
    """A copy of a tied model with its own head (the same values, separate storage)."""
    model = copy.deepcopy(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


def test_tied_names_of_a_tied_and_an_untied_model(small_model):
    assert tied_names(small_model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_names(untied(small_model)) == {}


def test_untie_and_retie_are_inverse_without_copies(small_model):
    tied = tied_names(small_model)
    sd = small_model.state_dict()
    once = untie(sd, tied)
    assert set(sd) - set(once) == {"lm_head.weight"}
    again = retie(once, tied)
    assert again.keys() == sd.keys() and again["lm_head.weight"] is once["model.embed_tokens.weight"]
    assert untie({"lm_head.weight": sd["lm_head.weight"]}, tied).keys() == {"lm_head.weight"}  # the name kept is sent


def test_load_weights_loads_a_tied_parameter_once_and_stays_tied(small_model):
    model = copy.deepcopy(small_model)
    new = {k: v + 1.0 for k, v in untie(small_model.state_dict(), tied_names(small_model)).items()}
    load_weights(model, new)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, small_model.model.embed_tokens.weight + 1.0)
    del new["model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"missing \['model.norm.weight'\]"):
        load_weights(model, new)
    with pytest.raises(RuntimeError, match="unexpected"):
        load_weights(model, {**small_model.state_dict(), "extra.weight": torch.ones(1)})
    separate = untied(small_model)  # an untied model needs its head
    with pytest.raises(RuntimeError, match=r"missing \['lm_head.weight'\]"):
        load_weights(separate, untie(small_model.state_dict(), tied_names(small_model)))
