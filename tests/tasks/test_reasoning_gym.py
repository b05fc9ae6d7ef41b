"""The reasoning_gym task and reward: generation offline, scoring with the dataset's own scorer."""

import json
import time

import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig
from tidal.types import Prompt

reasoning_gym = pytest.importorskip("reasoning_gym")
from reasoning_gym.factory import DATASETS  # noqa: E402

# Puzzles with many valid answers: reasoning-gym's entry answer is None and the scorer checks a
# response against the metadata (measured on 0.1.25).
NO_REFERENCE = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}


def _task(dataset, size=6, num_eval=2, **params):
    cfg = TaskConfig(name="reasoning_gym", num_eval=num_eval, params={"dataset": dataset, "size": size, **params})
    return TASKS.get("reasoning_gym")(cfg)


def test_task_generates_holds_out_and_keeps_metadata():
    task = _task("basic_arithmetic", size=20, num_eval=5, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    train = [task.train_prompt(i) for i in range(task.num_train)]
    evals = task.eval_prompts()
    assert len(evals) == 5 and task.num_train <= 20  # 25 generated; repeats of eval questions dropped
    assert not {p.text for p in train} & {p.text for p in evals}
    p = train[0]
    assert p.meta["metadata"]["source_dataset"] == "basic_arithmetic" and p.meta["question"] == p.text
    for q in train + evals:  # two 1-digit terms, e.g. "( -9 / 9 )" -> "-1": check by evaluating independently
        assert q.answer == str(int(eval(q.meta["metadata"]["expression"]))), q.meta["metadata"]
    assert task.sft_example(p) == p.answer
    assert _task("basic_arithmetic", size=20, num_eval=5).eval_prompts() == _task(
        "basic_arithmetic", size=20, num_eval=5).eval_prompts()  # seeded: the same problems every time


def test_task_errors_are_clear():
    with pytest.raises(ConfigError, match="did you mean 'basic_arithmetic'"):
        _task("basic_arithmetc")
    with pytest.raises(ConfigError, match="needs task.params.dataset"):
        TASKS.get("reasoning_gym")(TaskConfig(name="reasoning_gym"))
    with pytest.raises(ConfigError, match="reasoning-gym 'basic_arithmetic' with config"):
        _task("basic_arithmetic", no_such_option=3)
    with pytest.raises(ConfigError, match=r"task.params.size='abc': must be a whole number >= 1"):
        _task("basic_arithmetic", size="abc")
    with pytest.raises(ConfigError, match=r"task.params.seed=-1: must be a whole number >= 0"):
        _task("basic_arithmetic", seed=-1)
    with pytest.raises(ConfigError, match="cannot be warm-started"):
        task = _task("graph_color")
        task.sft_example(task.train_prompt(0))


def test_template_wraps_the_question_and_the_reward_still_scores():
    cfg = TaskConfig(name="reasoning_gym", num_eval=1, template="{question}\nAnswer in <answer></answer>.",
                     params={"dataset": "leg_counting", "size": 3})
    p = TASKS.get("reasoning_gym")(cfg).train_prompt(0)
    assert p.text == p.meta["question"] + "\nAnswer in <answer></answer>."
    assert build_reward("reasoning_gym")(f"I think <answer> {p.answer} </answer>", p)[0] == 1.0


def test_lowercase_prompts_for_a_vocabulary_without_capitals():
    from tidal.models.tiny import CHARS

    task = _task("basic_arithmetic", size=8, num_eval=2, max_terms=2, max_digits=1, lowercase=True)
    for p in [task.train_prompt(i) for i in range(task.num_train)] + task.eval_prompts():
        assert p.text == p.meta["question"].lower() != p.meta["question"]  # "Calculate ..." -> "calculate ..."
        assert set(p.text) <= set(CHARS), p.text  # the tiny model's character vocabulary encodes it
        assert build_reward("reasoning_gym")(f"<answer>{p.answer}</answer>", p)[0] == 1.0  # scored on its own question
    assert _task("basic_arithmetic", size=8, num_eval=2, max_terms=2).train_prompt(0).text[0] == "C"
    with pytest.raises(ConfigError, match=r"task.params.lowercase='yes': must be true or false"):
        _task("basic_arithmetic", lowercase="yes")


def _leg_prompt():
    return _task("leg_counting", size=3, num_eval=1).train_prompt(0)


def test_reward_binary_by_default_partial_on_request():
    p = _leg_prompt()
    wrong = p.answer + "0"  # leg_counting gives a longer answer containing the right one len(a)/len(r)
    binary, partial = build_reward("reasoning_gym"), build_reward("reasoning_gym", {"partial_credit": True})
    assert binary(p.answer, p)[0] == 1.0 and binary(wrong, p) == (0.0, binary(wrong, p)[1])
    expected = len(p.answer) / len(wrong)
    assert binary(wrong, p)[1]["score"] == pytest.approx(expected)
    assert partial(wrong, p)[0] == pytest.approx(expected)
    assert build_reward("reasoning_gym", {"threshold": 0.5})(wrong, p)[0] == float(expected >= 0.5)


def test_reward_extract_modes():
    p = _leg_prompt()
    tagged = f"<answer>{p.answer}</answer>"
    assert build_reward("reasoning_gym", {"extract": "tag"})(p.answer, p) == (
        0.0, {"score": 0.0, "correct": False, "dataset": "leg_counting", "reason": "no <answer> tag"})
    assert build_reward("reasoning_gym", {"extract": "tag"})(f"<answer>1</answer> then {tagged}", p)[0] == 1.0
    assert build_reward("reasoning_gym", {"extract": "none"})(tagged, p)[0] == 0.0
    with pytest.raises(ConfigError, match="extract='regex'"):
        build_reward("reasoning_gym", {"extract": "regex"})


def test_score_above_one_is_scorer_drift_not_correct():
    p = _task("spell_backward", size=3, num_eval=1).train_prompt(0)
    reward, details = build_reward("reasoning_gym")(p.answer + "x", p)  # right prefix, one extra letter
    assert details["score"] > 1.0 and reward == 0.0


def test_reward_from_json_metadata_including_arc_grids():
    fn = build_reward("reasoning_gym")
    for dataset in ("arc_agi", "basic_arithmetic"):
        p = _task(dataset, size=2, num_eval=1).train_prompt(0)
        meta = json.loads(json.dumps(p.meta))  # what `tidal score` rows carry
        assert fn(p.answer, Prompt("x", p.text, p.answer, meta))[0] == 1.0
        assert fn(p.answer, Prompt("x", p.text, p.answer, {"metadata": json.dumps(meta["metadata"])}))[0] == 1.0
    with pytest.raises(ValueError, match="needs the entry's metadata"):
        fn("1", Prompt("x", "q", "1", {}))


def _coverage(names):
    """Generate 3 entries of each dataset, score the reference through a JSON round trip."""
    fn = build_reward("reasoning_gym")
    covered = []
    for name in names:
        params = {"datasets": [{"name": "leg_counting"}, {"name": "chain_sum", "weight": 2}]} if name == "composite" \
            else {}
        task = _task(name, size=2, num_eval=1, **params)
        for p in [task.train_prompt(i) for i in range(task.num_train)] + task.eval_prompts():
            row = json.loads(json.dumps({"answer": p.answer, "question": p.text, "metadata": p.meta["metadata"]}))
            prompt = Prompt("x", row["question"], row["answer"], {"metadata": row["metadata"]})
            reward, details = fn(f"<answer>{p.answer}</answer>", prompt)
            expect = 0.0 if name in NO_REFERENCE else 1.0
            assert (reward, "error" in details) == (expect, False), (name, p.answer, details)
        covered.append(name)
    return covered


def test_every_dataset_generates_and_scores_offline():
    start = time.perf_counter()
    covered = _coverage(sorted(DATASETS))  # ~13 s on 2 cores: the fast suite keeps it
    assert len(covered) == len(DATASETS) == 106, time.perf_counter() - start
