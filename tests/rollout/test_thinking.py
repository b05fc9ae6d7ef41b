"""Budget forcing in the local engine: the close tokens replace samples once the budget is spent, are
masked out of the loss, and leave the tokens before them unchanged."""

import dataclasses

import torch

from tidal.api import GenRequest
from tidal.rollout.local import LocalEngine, SamplingConfig, _Row
from tidal.rollout.requests import group_requests
from tidal.rollout.thinking import ThinkingConfig, close_ids, train_budget, with_budgets
from tidal.types import Prompt


def _requests(tokenizer, budget, n=4):
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(n)]
    close = close_ids(tokenizer, ThinkingConfig())
    return with_budgets(group_requests(tokenizer, prompts, 2), lambda p: budget, close), close


def test_close_is_forced_at_the_budget_and_masked(small_model, tokenizer):
    cfg = SamplingConfig(max_new_tokens=16)
    plain = LocalEngine(small_model, tokenizer, cfg).generate(_requests(tokenizer, None)[0])
    reqs, close = _requests(tokenizer, 3)
    assert len(close) == len("</think>")  # one token per character in the tiny vocabulary
    forced = LocalEngine(small_model, tokenizer, cfg).generate(reqs)
    for p, f in zip(plain, forced):
        if tuple(p.token_ids[:3]) == close[:3] or tokenizer.eos_token_id in p.token_ids[:3]:
            continue  # ended or closed within budget (the random model does neither here)
        assert f.token_ids[:3] == p.token_ids[:3], "thinking before the budget is the same sample"
        assert tuple(f.token_ids[3:3 + len(close)]) == close
        assert f.loss_mask == [1] * 3 + [0] * len(close) + [1] * (f.num_tokens - 3 - len(close))
        assert all(f.logprobs[i] == 0.0 for i in range(3, 3 + len(close)))
        assert f.text.startswith(tokenizer.decode(p.token_ids[:3], skip_special_tokens=True) + "</think>")
    assert sum(f.loss_mask is not None for f in forced) >= 6


def test_budget_zero_closes_first_and_unbudgeted_requests_are_untouched(small_model, tokenizer):
    reqs, close = _requests(tokenizer, 0)
    mixed = [reqs[0], dataclasses.replace(reqs[1], thinking_budget=None)]
    a, b = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)).generate(mixed)
    assert tuple(a.token_ids[: len(close)]) == close and a.loss_mask[: len(close)] == [0] * len(close)
    assert b.loss_mask is None


def test_a_section_the_model_closed_itself_is_not_forced(tokenizer):
    close = close_ids(tokenizer, ThinkingConfig())
    req = GenRequest(Prompt("u", "1+1=", "2"), (1, 5), 0, thinking_budget=len(close), thinking_close=close)
    row = _Row(req, key=0, tokens=list(close))  # the model sampled the close itself, using the whole budget
    tokens, logps = torch.tensor([9]), torch.tensor([-1.5])
    LocalEngine._force_think_close([row], tokens, logps)
    assert (tokens.item(), logps.item(), row.think_closed, row.forced_at) == (9, -1.5, True, [])


def test_interrupted_forcing_resumes_with_the_same_tokens(small_model, tokenizer):
    reqs, _ = _requests(tokenizer, 2)
    plain = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=14)).generate(reqs)
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=14))
    same = {k: v.clone() for k, v in engine.model.state_dict().items()}
    apply, calls = engine._apply_pending_update, []

    def interrupt():
        calls.append(1)
        if len(calls) == 5:  # mid-forcing: budget 2, close tokens at positions 2..9
            engine.request_weight_update(same, version=1)
        return apply()

    engine._apply_pending_update = interrupt
    resumed = engine.generate(reqs)
    assert engine.num_interruptions == 1
    assert [t.token_ids for t in resumed] == [t.token_ids for t in plain]
    assert [t.loss_mask for t in resumed] == [t.loss_mask for t in plain]


def test_training_budget_is_per_prompt_and_seeded():
    cfg = ThinkingConfig(budgets=[0, 8, 16, 32])
    budgets = [train_budget(cfg, 0, f"train-{i}") for i in range(400)]
    assert set(budgets) == {0, 8, 16, 32} and budgets == [train_budget(cfg, 0, f"train-{i}") for i in range(400)]
    assert train_budget(ThinkingConfig(), 0, "train-0") is None


def test_accuracy_by_budget_applies_each_budget(small_model, tokenizer):
    """Answers set to what the model says after the close forced at budget 2: accuracy 1 there, and the
    curve keys each budget (None as "unlimited") by the budget the engine really enforced."""
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardConfig, RewardPool
    from tidal.rollout.evaluate import accuracy_by_budget, greedy_samples

    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=14))
    pool = RewardPool(build_reward("answer_match"), RewardConfig(name="answer_match", num_workers=0))
    close = close_ids(tokenizer, ThinkingConfig())
    prompts = [Prompt(f"p{i}", f"{i}+{i}=<think>", "?") for i in range(4)]
    at2 = greedy_samples(engine, tokenizer, prompts, pool, (2, close))
    answers = [t.text.rsplit("</think>", 1)[1].strip() for t in at2]
    keyed = [dataclasses.replace(p, answer=a) for p, a in zip(prompts, answers)]
    curve = accuracy_by_budget(engine, tokenizer, keyed, pool, [2, 0, None], close)
    assert list(curve) == ["2", "0", "unlimited"] and curve["2"] == 1.0
    at0 = greedy_samples(engine, tokenizer, keyed, pool, (0, close))
    assert curve["0"] == sum(t.reward >= 1.0 for t in at0) / 4
    assert all(t.text.startswith("</think>") for t in at0)


def test_a_close_begun_at_the_budget_is_completed_not_restarted(tokenizer):
    """The model wrote "</" when its budget of 4 ran out: forcing adds "think>", not "</think>"."""
    from tidal.rollout.thinking import open_close_prefix

    close = close_ids(tokenizer, ThinkingConfig())
    assert open_close_prefix(list(close[:2]), close) == 2 and open_close_prefix([5, 6], close) == 0
    assert open_close_prefix(list(close[:1]) + list(close[:3]), close) == 3
    req = GenRequest(Prompt("u", "1+1=", "2"), (1, 5), 0, thinking_budget=4, thinking_close=close)
    row = _Row(req, key=0, tokens=[7, 8, *close[:2]])
    for _ in range(len(close) - 2):
        tokens, logps = torch.tensor([9]), torch.tensor([-1.5])
        LocalEngine._force_think_close([row], tokens, logps)
        row.tokens.append(int(tokens[0]))
    assert tuple(row.tokens) == (7, 8, *close) and row.think_closed
    assert row.forced_at == list(range(4, 4 + len(close) - 2))
