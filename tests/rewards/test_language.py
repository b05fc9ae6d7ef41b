import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.rewards.language import split_segments, strip_non_prose
from tidal.types import Prompt

FR = Prompt("u", "Combien font deux plus trois ? Donnez la réponse finale.", "5")
EN = Prompt("u", "How much is two plus three? Give the final answer.", "5")


def lang(response, prompt=FR, **params):
    return build_reward("language", params)(response, prompt)


def test_strip_non_prose_removes_math_code_and_numbers():
    text = "Soit $x^2 + 1$ et \\[\\frac{a}{b}\\] puis `f(x)`:\n```python\nprint('hello world')\n```\n\\boxed{42} fin."
    assert strip_non_prose(text) == "Soit et puis : fin."


def test_segments():
    seg = split_segments("<think>a</think> b", "q")
    assert seg == {"problem": "q", "thoughts": "a", "answer": " b"}
    assert split_segments("b", "q")["thoughts"] is None


def test_same_language_scores_one():
    reward, details = lang(
        "<think>Je dois additionner deux et trois, cela fait cinq.</think> La réponse est \\boxed{5}."
    )
    assert reward == 1.0, details
    assert details["languages"] == {"problem": "fr", "thoughts": "fr", "answer": "fr"}


def test_mixed_languages_score_zero():
    # French problem, English thoughts, French answer (Magistral's failure mode: reasoning switches language).
    reward, details = lang(
        "<think>I need to add two and three, which gives five.</think> La réponse est donc cinq, voilà le résultat."
    )
    assert reward == 0.0 and details["reason"] == "mixed languages ['en', 'fr']"
    reward, details = lang("<think>Let me add two and three: that gives five.</think> The answer is five.", EN)
    assert reward == 1.0 and details["languages"]["answer"] == "en"
    # LaTeX and code do not make a response "English": only the prose is classified.
    fr_with_code = (
        "<think>Je calcule la somme avec un petit programme.</think> ```python\nprint(2 + 3)\n``` donc \\boxed{5}"
    )
    assert lang(fr_with_code)[1]["languages"]["thoughts"] == "fr"


def test_unclassifiable_segments():
    only_math = "<think>Je dois additionner deux et trois, cela fait cinq.</think> \\boxed{5}"
    reward, details = lang(only_math)
    assert reward == 1.0 and details["languages"]["answer"] is None  # ignored by default
    reward, details = lang(only_math, on_unknown="fail")
    assert reward == 0.0 and details["reason"] == "cannot classify answer"
    assert lang("\\boxed{5}", on_unknown="fail")[1]["reason"] == "cannot classify thoughts, answer"
    assert lang("")[0] == 1.0  # nothing to compare: passes under "ignore"
    with pytest.raises(ConfigError):
        build_reward("language", {"on_unknown": "skip"})


def test_languages_restricts_the_candidates():
    reward, details = lang(
        "<think>Je dois additionner deux et trois.</think> La réponse est cinq.", languages=["en", "fr"]
    )
    assert reward == 1.0 and set(details["languages"].values()) == {"fr"}
