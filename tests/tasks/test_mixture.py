"""Task mixtures: weight schedules against hand-computed values, draws pure in the index, bad entries named."""

import pytest

from tidal.config import ConfigError
from tidal.tasks.mixture import MixtureTask, mixture_weights, parse_components, weight_at, weight_points

REWARD = {"name": "exact_match", "params": {}}


def components(*items):
    return parse_components(list(items), seed=0, default_reward=REWARD)


def test_weight_schedules_by_hand():
    pts = [(0, 1.0), (10, 0.0), (20, 0.5)]
    assert [weight_at(pts, s, "linear") for s in (0, 5, 10, 15, 20, 99)] == [1.0, 0.5, 0.0, 0.25, 0.5, 0.5]
    assert [weight_at(pts, s, "stages") for s in (0, 5, 10, 15, 20, 99)] == [1.0, 1.0, 0.0, 0.0, 0.5, 0.5]
    assert weight_at([(5, 2.0)], 0, "linear") == 2.0  # flat before the first point
    assert weight_points(3, "w") == [(0, 3.0)]
    assert weight_points([[10, 1], [0, 2]], "w") == [(0, 2.0), (10, 1.0)]  # sorted


def test_normalised_weights_ramp():
    cs = components({"name": "a", "task": {"name": "addition"}, "weight": [[0, 1.0], [10, 0.0]]},
                    {"name": "b", "task": {"name": "repeat"}, "weight": [[0, 0.0], [10, 3.0]]})
    assert mixture_weights(cs, 0, "linear") == [1.0, 0.0]
    # step 5: raw 0.5 and 1.5 -> 0.25 / 0.75
    assert mixture_weights(cs, 5, "linear") == [0.25, 0.75]
    assert mixture_weights(cs, 5, "stages") == [1.0, 0.0]


@pytest.mark.parametrize("items, message", [
    ([], "at least one component"),
    ([{"name": "a"}], r"mixture\[0\]: must be a mapping with 'name' and 'task'"),
    ([{"name": "a", "task": {"name": "addition"}, "wieght": 1}], r"mixture\[0\]: unknown keys \['wieght'\]"),
    ([{"name": "a", "task": {"max_operandd": 9}}], r"mixture\[0\]\.task: unknown config key 'max_operandd'"),
    ([{"name": "a", "task": {}}, {"name": "a", "task": {}}], r"mixture\[1\]\.name='a': two components"),
    ([{"name": "a", "task": {}, "weight": -1}], r"mixture\[0\]\.weight: the weight must be a finite number >= 0"),
    ([{"name": "a", "task": {}, "weight": float("nan")}], r"mixture\[0\]\.weight: the weight must be a finite "
                                                          "number >= 0, got nan"),  # routed every draw to one task
    ([{"name": "a", "task": {}, "weight": [[0, float("inf")]]}], r"mixture\[0\]\.weight: \[0\] weight must be"),
    ([{"name": "a", "task": {}, "weight": [[0, 1], [0, 2]]}], "two points at the same step"),
    ([{"name": "a/b", "task": {}}], "without '/'"),
    ([{"name": "a", "task": {}, "reward": {"nam": "x"}}], r"mixture\[0\]\.reward: expected"),
])
def test_bad_entries_name_the_entry_and_key(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_components(items, 0, REWARD)


def mixture(groups_per_step=10, seed=0):
    cs = components({"name": "add", "task": {"name": "addition", "max_operand": 9, "num_eval": 5}, "weight": 3},
                    {"name": "rep", "task": {"name": "repeat", "max_repeat": 3, "num_eval": 5},
                     "reward": "exact_match", "weight": [[0, 0.0], [20, 1.0]], })
    return MixtureTask(cs, "stages", groups_per_step, seed)


def test_draws_follow_the_schedule_and_are_pure_in_the_index():
    m = mixture()
    # steps 0-19 (indices < 200): only 'add'; from step 20 on: 3:1
    first = [m.train_prompt(i) for i in range(200)]
    assert {p.meta["task"] for p in first} == {"add"}
    assert [p.uid for p in first[:3]] == ["train-0", "train-1", "train-2"]
    late = [m.train_prompt(i).meta["task"] for i in range(200, 4200)]
    assert abs(late.count("rep") / len(late) - 0.25) < 0.03
    # each component walks its own stream in order: the k-th 'add' draw is the task's k-th prompt
    assert [p.text for p in first[:50]] == [m.tasks[0].train_prompt(j).text for j in range(50)]
    # a fresh mixture asked for a late index directly gives the same prompt (resume needs only the cursor)
    assert mixture().train_prompt(4000) == m.train_prompt(4000)
    other = [mixture(seed=1).train_prompt(i).meta["task"] for i in range(200, 400)]
    assert other != late[:200], "the seed moves the draws"
    with pytest.raises(ConfigError, match="every component's weight is 0 at step 0"):
        MixtureTask(components({"name": "a", "task": {}, "weight": 0}), "linear", 4, 0).train_prompt(0)


def test_eval_prompts_interleave_components_and_route_sft():
    m = mixture()
    evals = m.eval_prompts()
    assert [p.meta["task"] for p in evals[:4]] == ["add", "rep", "add", "rep"]
    assert len(evals) == 10 and len({p.uid for p in evals}) == 10
    assert m.sft_example(evals[0]) == evals[0].answer
    assert m.num_train == m.tasks[0].num_train + m.tasks[1].num_train
