import torch

from tidal.rollout.sampling import sample_tokens, uniform_noise


def test_noise_is_a_function_of_key_and_position_only():
    keys = torch.tensor([5, 7, 5], dtype=torch.int64)
    pos = torch.tensor([0, 0, 1], dtype=torch.int64)
    u = uniform_noise(keys, pos, 10)
    assert torch.equal(u[0], uniform_noise(keys[:1], pos[:1], 10)[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u > 0).all() and (u < 1).all()


def test_gumbel_sampling_matches_the_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    keys = torch.arange(n, dtype=torch.int64) * 7919
    tokens, logp = sample_tokens(logits.expand(n, 4), keys, torch.zeros(n, dtype=torch.int64), temperature=1.0)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.015), freq
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[tokens])


def test_temperature_scales_logprobs_and_zero_is_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    key, pos = torch.tensor([1]), torch.tensor([0])
    tok, lp = sample_tokens(logits, key, pos, temperature=0.0)
    assert tok.item() == 0 and torch.allclose(lp, torch.log_softmax(logits, -1)[:, 0])
    tok, lp = sample_tokens(logits, key, pos, temperature=2.0)
    assert torch.allclose(lp, torch.log_softmax(logits / 2.0, -1)[0, tok])


def test_top_p_restricts_to_nucleus_and_renormalizes():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 5000
    tokens, logp = sample_tokens(logits.expand(n, 4), torch.arange(n) * 31, torch.zeros(n, dtype=torch.int64),
                                 temperature=1.0, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8: the nucleus is the top two
    assert torch.allclose(logp[tokens == 0], torch.tensor(0.5 / 0.8).log())
