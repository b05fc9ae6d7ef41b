"""``last_number``: the last number of a prose answer against the gold, and the cheats it refuses."""

import pickle

import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.types import Prompt

Q = "What is 22+13?"


def score(response, answer="35", question=Q, **params):
    return build_reward("last_number", params)(response, Prompt("u", question, answer))


@pytest.mark.parametrize("response, question, gold", [
    ("37 + 48 = 85", "What is 37+48?", "85"),  # the chat model's natural style
    ("37 + 48 = 85.", "What is 37+48?", "85"),
    ("The answer is 35.", Q, "35"),
    ("x = 35", Q, "35"),
    ("22 + 13 = 35", Q, "35"),
    ("What is 22+13? It is 35", Q, "35"),  # the echoed question is stripped first
    ("20 + 10 = 30, 2 + 3 = 5, so 30 + 5 = 35.", Q, "35"),  # steps whose results are used again
    ("Check: 35 - 13 = 22, so the answer is 35.", Q, "35"),
    ("22 13 35", Q, "35"),  # the question's numbers are not candidates
    ("It is 33. No, wait: 35.", Q, "35"),  # a change of mind: the last statement counts
    ("It is −5.", "What is 2-7?", "-5"),
    ("2 - 7 = -5", "What is 2-7?", "-5"),
    ("The total is $1,234.50.", "Sum?", "1234.5"),
    ("35.0", Q, "35"),
    ("52", "07+45=", "052"),
    ("Half: 1/2", "Half of 1?", "0.5"),
    ("<think>33? 34?</think> 35", Q, "35"),  # candidates inside the thoughts do not count
])
def test_stated_values_score_one(response, question, gold):
    reward, details = score(response, gold, question)
    assert (reward, details["reason"]) == (1.0, "correct"), details


@pytest.mark.parametrize("response, reason", [
    ("22+13 is 22+13.", "restates the question"),  # issue 49's string
    ("35? 22+13", "restates the question"),  # the value, then the expression last
    ("22 plus 13", "restates the question"),
    ("(22)+(13)", "restates the question"),
    ("13 + 22", "restates the question"),
    ("35 * 1", "not a value: arithmetic left to do"),
    ("70/2", "not a value: arithmetic left to do"),
    ("22 13", "wrong answer"),  # copying the inputs
    ("33 34 35 36", "hedging: 4 values in the final statement"),
    ("33, 34, 36 or 35", "hedging: 4 values in the final statement"),  # the gold last does not help
    ("Maybe 34.\n36\n35", "hedging: 2 values in the final statement"),  # a list, one per line (34 is prose)
    ("33. 34. 35.", "hedging: 3 values in the final statement"),
    (r"\boxed{}", "no number in the answer"),
    ("<answer></answer>", "no number in the answer"),
    ("", "empty answer"),
    ("  \n ", "empty answer"),
    (Q, "empty answer"),  # only the question, echoed
    ("lorem ipsum " * 400 + "35", "answer too long (4802 chars > max_chars 4000)"),
    ("<think>it is 35", "unfinished thinking: no </think>, so no final answer"),
    ("<think>35</think> I am not sure.", "no number in the answer"),
    ("36", "wrong answer"),
])
def test_cheats_score_zero(response, reason):
    reward, details = score(response)
    assert (reward, details["reason"]) == (0.0, reason), details
    assert "error" not in details


def test_options_change_the_rules():
    assert score("33 35", max_candidates=2)[0] == 1.0
    assert score("lorem ipsum " * 400 + "35", max_chars=10_000)[0] == 1.0
    assert score("13 + 22", reject_restated=False)[1]["reason"] == "wrong answer"  # last number 22
    assert score("<think>x</think> 35", after_think=False)[0] == 1.0
    assert score("What is 22+13?", strip_question=False)[1]["reason"] == "restates the question"
    assert score("0.33", "0.3333", "What is 1/3?")[0] == 0.0
    assert score("0.3333", "0.33333", "What is 1/3?", rel_tol=1e-3)[0] == 1.0


def test_bad_gold_is_an_error_and_bad_params_are_config_errors():
    reward, details = score("35", answer="thirty-five")
    assert reward == 0.0 and "thirty-five" in details["error"] and details["reason"] == "gold not a number"
    for bad in ({"max_chars": 0}, {"max_candidates": 0}, {"rel_tol": -1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build_reward("last_number", bad)


def test_pickles_for_the_pool():
    fn = pickle.loads(pickle.dumps(build_reward("last_number", {"max_chars": 100})))
    assert fn("35", Prompt("u", Q, "35"))[0] == 1.0 and fn.max_chars == 100
