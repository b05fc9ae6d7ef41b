"""sum_think: the prompt opens <think>, the warm-start thoughts rewrite the sum one addition at a time,
and answer_match scores only what follows </think>."""

import pytest

from tidal.rewards import build_reward
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.tasks.think import rewrite_trace
from tidal.types import Prompt


def _task(**kw):
    return TASKS.get("sum_think")(TaskConfig(name="sum_think", max_operand=9, max_terms=6, num_eval=50, **kw))


def test_rewrite_trace_by_hand():
    assert rewrite_trace([7, 5, 9, 3]) == "12+9+3 21+3 24"
    assert rewrite_trace([4, 0]) == "4"
    assert rewrite_trace([9, 9, 9, 9, 9, 9]) == "18+9+9+9+9 27+9+9+9 36+9+9 45+9 54"
    with pytest.raises(AssertionError, match="two terms"):
        rewrite_trace([3])


def test_prompt_opens_thinking_and_demo_closes_it():
    task = _task()
    for i in range(20):
        p = task.train_prompt(i)
        terms = [int(x) for x in p.text.removesuffix("=<think>").split("+")]
        assert p.text.endswith("=<think>") and 2 <= len(terms) <= 6 and all(0 <= t <= 9 for t in terms)
        assert p.answer == str(sum(terms))
        assert task.sft_example(p) == rewrite_trace(terms) + "</think>" + p.answer


def test_thought_lengths_vary_across_the_budgets():
    """Budgets 8, 16 and 32 each cut some of the warm start's thoughts and leave others whole."""
    task = _task()
    lengths = [len(task.sft_example(p).split("</think>")[0]) for p in task.eval_prompts()]
    for budget in (8, 16, 32):
        assert any(n > budget for n in lengths) and any(n <= budget for n in lengths), budget


def test_answer_match_scores_after_the_last_close():
    score = build_reward("answer_match")
    p = Prompt(uid="u", text="7+5+9+3=<think>", answer="24")
    assert score("12+9+3 21+3 24</think>24", p)[0] == 1.0
    assert score("12+9</think> 24 ", p)[0] == 1.0  # a forced close after a cut thought: the answer counts
    assert score("24</think>23", p)[0] == 0.0  # the thought is not the answer
    reward, details = score("12+9+3 21+3 24", p)
    assert reward == 0.0 and "no </think>" in details["reason"]
