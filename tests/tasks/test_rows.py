"""Row parsing, templates, bad-row accounting, the hash split and the training stream."""

import pytest

from tidal.config import ConfigError, apply_overrides
from tidal.tasks.config import FieldMap, TaskConfig
from tidal.tasks.rows import BadRow, RowTask, numbered, parse_rows, render, split_eval, to_prompt
from tidal.types import Prompt


def test_render_leaves_latex_braces_alone():
    row = {"question": "1/2 + 1/3", "n": 3}
    template = "{question}\nPut the final answer in \\boxed{}."
    assert render(template, row) == "1/2 + 1/3\nPut the final answer in \\boxed{}."
    assert render("{{n}} is {n}; \\frac{1}{2}", row) == "{n} is 3; \\frac{1}{2}"


def test_render_missing_column_names_it():
    with pytest.raises(BadRow, match="'questoin': missing"):
        render("{questoin}", {"question": "x"})


def test_unquoted_template_parsed_as_yaml_mapping_is_caught():
    cfg = apply_overrides(TaskConfig(), ["template={question}"])  # YAML: {question: null}
    with pytest.raises(ConfigError, match="names no {column}; on the command line quote it"):
        parse_rows(numbered([{"question": "q"}]), cfg.fields, cfg.template, "src")


def test_to_prompt_maps_fields_and_keeps_the_rest_in_meta():
    fields = FieldMap(prompt="q", answer="a", id="uid", solution="sol")
    p = to_prompt({"q": "2+2?", "a": 4, "uid": 17, "sol": "It is 4.", "tests": ["assert f()"]}, fields, None)
    assert (p.text, p.answer) == ("2+2?", "4")
    assert p.meta == {"tests": ["assert f()"], "id": "17", "solution": "It is 4."}


def test_to_prompt_meta_whitelist_and_no_answer_column():
    p = to_prompt({"prompt": "x", "tests": [1], "junk": 2}, FieldMap(answer=None, meta=["tests"]), None)
    assert (p.answer, p.meta) == ("", {"tests": [1]})


@pytest.mark.parametrize("row,match", [
    ({"answer": "1"}, "'prompt': missing"),
    ({"prompt": ["a"], "answer": "1"}, "'prompt': prompt must be a string or a number, got list"),
    ({"prompt": "x", "answer": True}, "'answer': answer must be a string or a number, got bool"),
    ({"prompt": "  ", "answer": "1"}, "'prompt': empty prompt"),
    ([1, 2], "row must be an object, got list"),
])
def test_bad_rows_name_the_key(row, match):
    with pytest.raises(BadRow, match=match):
        to_prompt(row, FieldMap(), None)


def test_parse_rows_skips_and_counts_with_one_warning():
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(4)] + [{"prompt": "p"}, {"answer": "x"}]
    with pytest.warns(UserWarning) as record:
        loaded = parse_rows(numbered(rows), FieldMap(), None, "src")
    assert len(record) == 1
    message = str(record[0].message)
    assert "skipped 2 of 6 rows" in message
    assert "row 5: 'answer': missing" in message and "row 6: 'prompt': missing" in message
    assert [p.text for p in loaded.prompts] == ["p0", "p1", "p2", "p3"]


def test_all_bad_rows_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"skipped 2 of 2 rows .* no usable rows"):
        parse_rows(numbered([{"q": 1}, {"q": 2}]), FieldMap(), None, "src")


def _prompts(n):
    return [Prompt(uid="", text=f"problem {i}", answer=str(i)) for i in range(n)]


def test_count_split_is_disjoint_deterministic_and_drops_duplicates():
    prompts = _prompts(50) + [Prompt(uid="", text="problem 7", answer="7")]  # a duplicate of row 7
    cfg = TaskConfig(num_eval=10)
    train, evals = split_eval(prompts, cfg, "src")
    assert len(evals) == 10
    assert not {p.text for p in train} & {p.text for p in evals}
    # 51 rows = 41 train + 10 eval, or 40 + 10 + one dropped copy when "problem 7" is held out.
    in_eval = any(p.text == "problem 7" for p in evals)
    assert len(train) == (40 if in_eval else 41)
    assert split_eval(prompts, cfg, "src")[1] == evals
    assert split_eval(prompts, TaskConfig(num_eval=10, seed=1), "src")[1] != evals


def test_fraction_split_is_stable_when_rows_are_added():
    cfg = TaskConfig(eval_fraction=0.2)
    _, eval_small = split_eval(_prompts(500), cfg, "src")
    _, eval_big = split_eval(_prompts(1000), cfg, "src")
    assert 70 <= len(eval_small) <= 130  # binomial(500, 0.2): mean 100, sd 9
    assert {p.text for p in eval_big} & {p.text for p in _prompts(500)} == {p.text for p in eval_small}


def test_split_that_leaves_nothing_to_train_is_an_error():
    with pytest.raises(ConfigError, match="lower task.num_eval"):
        split_eval(_prompts(5), TaskConfig(num_eval=5), "src")


def test_training_stream_is_an_endless_reshuffled_permutation():
    train, evals = _prompts(7), _prompts(2)
    task = RowTask(TaskConfig(), train, evals)
    epoch0 = [task.train_prompt(i) for i in range(7)]
    epoch1 = [task.train_prompt(7 + i) for i in range(7)]
    assert sorted(p.text for p in epoch0) == sorted(p.text for p in train) == sorted(p.text for p in epoch1)
    assert [p.text for p in epoch0] != [p.text for p in epoch1]
    assert [p.uid for p in epoch1] == [f"train-{7 + i}" for i in range(7)]
    assert [p.uid for p in task.eval_prompts()] == ["eval-0", "eval-1"]
    assert RowTask(TaskConfig(), train, evals).train_prompt(9) == task.train_prompt(9)


def test_sft_example_needs_a_solution_column():
    cfg = TaskConfig(fields=FieldMap(solution="sol"))
    p = to_prompt({"prompt": "x", "answer": "1", "sol": "so 1"}, cfg.fields, None)
    assert RowTask(cfg, [p], []).sft_example(p) == "so 1"
    with pytest.raises(ConfigError, match="set task.fields.solution"):
        RowTask(TaskConfig(), [p], []).sft_example(p)


def test_task_config_overrides_reach_nested_fields():
    template = "template=\"{question}\\nPut the final answer in \\\\boxed{}.\""  # YAML double quotes
    cfg = apply_overrides(TaskConfig(), ["name=jsonl", "fields.prompt=question", "fields.answer=null", template,
                                         "params.builder=json", "eval_fraction=0.1"])
    assert (cfg.fields.prompt, cfg.fields.answer) == ("question", None)
    assert cfg.template == "{question}\nPut the final answer in \\boxed{}."
    assert cfg.params == {"builder": "json"} and cfg.eval_fraction == 0.1
    with pytest.raises(ConfigError, match="fields.prompt"):
        apply_overrides(TaskConfig(), ["fields.promt=x"])
