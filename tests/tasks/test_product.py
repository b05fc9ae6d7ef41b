"""product: one calculator call solves it; the trace the warm start learns is a correct episode."""

import pytest

from tidal.envs.calculator import Calculator
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig


def _task(**params):
    return TASKS.get("product")(TaskConfig(name="product", num_eval=50, params=params))


def test_prompts_answers_and_split():
    task = _task()
    assert task.num_train == 90 * 90 - 50
    p = task.train_prompt(0)
    a, b = p.text.rstrip("=").split("*")
    assert len(a) == 2 and len(b) == 2 and p.answer == str(int(a) * int(b))
    held_out = {q.text for q in task.eval_prompts()}
    assert not held_out & {task.train_prompt(i).text for i in range(task.num_train)}
    assert _task(digits=[2, 1]).num_train == 90 * 9 - 50


def test_trace_is_a_correct_episode():
    task = _task()
    p = TASKS.get("product")(TaskConfig(name="product", num_eval=50)).train_prompt(3)
    trace = task.sft_example(p)
    a, b = p.text.rstrip("=").split("*")
    assert trace == f"<c>{a}*{b}</c>={p.answer} {p.answer}"
    env = Calculator()
    env.reset(p)
    call, rest = trace.split("</c>", 1)
    step = env.step(call + "</c>")
    assert step.observation == f"={p.answer} " and not step.done
    final = env.step(rest.removeprefix(step.observation))
    assert final.done and final.reward == 1.0
    assert _task(demos="answer").sft_example(p) == p.answer
    chat = _task(demos="chat_tool").sft_example(p)
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"] and chat[-1]["content"] == p.answer
    with pytest.raises(ValueError, match="task.params.demos"):
        _task(demos="scratch").sft_example(p)


@pytest.mark.parametrize("digits", [[3], [0, 2], "32", [3, 7]])
def test_bad_digits_name_the_key(digits):
    with pytest.raises(ValueError, match="params.digits"):
        _task(digits=digits)
