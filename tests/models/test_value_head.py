"""The value model: a copy of the policy's decoder, a scalar head, V of the state before each token."""

import pytest
import torch

from tidal.models.value_head import ValueModel


def test_values_are_the_head_on_the_previous_columns_hidden_state(model, batch):
    ids, mask = batch
    critic = ValueModel.from_policy(model)
    assert torch.equal(critic(ids, mask), torch.zeros(ids.shape)), "a zero-initialized head predicts 0"
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(1))
    torch.nn.init.constant_(critic.head.bias, 0.25)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    by_hand = hidden @ critic.head.weight[0] + 0.25  # the policy's own decoder: the copy starts equal
    v = critic(ids, mask)
    assert v.dtype == torch.float32 and v.shape == ids.shape
    assert torch.equal(v[:, 0], torch.zeros(3))  # nothing precedes column 0
    torch.testing.assert_close(v[:, 1:], by_hand[:, :-1])


def test_the_critic_is_a_copy_trained_apart_from_the_policy(model, batch):
    ids, mask = batch
    critic = ValueModel.from_policy(model)
    policy_before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.nn.init.ones_(critic.head.weight)
    critic(ids, mask).sum().backward()
    assert all(p.grad is not None for p in critic.parameters() if p.requires_grad)
    with torch.no_grad():
        for p in critic.decoder.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in policy_before.items())
    assert all(p.grad is None for p in model.parameters())


def test_a_model_without_a_decoder_is_refused():
    with pytest.raises(TypeError, match="get_decoder"):
        ValueModel.from_policy(torch.nn.Linear(2, 2))
