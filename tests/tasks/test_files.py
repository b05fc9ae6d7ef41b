"""JSONL (plain, gz, shards), Parquet and HF-on-disk adapters, built the way a run builds them."""

import gzip
import json

import pytest

from tidal.config import ConfigError, apply_overrides
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig

ROWS = [{"question": f"{a}+{a}=", "answer": 2 * a, "id": f"q{a}", "tests": [f"assert f({a}) == {2 * a}"]}
        for a in range(20)]


def _task(**overrides):
    cfg = apply_overrides(TaskConfig(), [f"{k}={v}" for k, v in overrides.items()])
    return TASKS.get(cfg.name)(cfg)


def _write_jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def _texts(prompts):
    return sorted(p.text for p in prompts)


def test_jsonl_maps_fields_and_holds_out_num_eval(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = _task(name="jsonl", path=path, num_eval=5, **{"fields.prompt": "question", "fields.id": "id"})
    evals = task.eval_prompts()
    train = [task.train_prompt(i) for i in range(task.num_train)]
    assert (task.num_train, len(evals)) == (15, 5)
    assert _texts(train + evals) == sorted(f"{a}+{a}=" for a in range(20))
    p = next(p for p in train + evals if p.text == "7+7=")
    assert p.answer == "14" and p.meta == {"tests": ["assert f(7) == 14"], "id": "q7"}


def test_jsonl_gz_template_and_bad_rows(tmp_path):
    raw = "".join(json.dumps(r) + "\n" for r in ROWS[:6])
    raw += '{"question": "9+9=", "answer": [18]}\n\nnot json\n{"answer": 3}\n'  # lines 7, 9, 10 are bad
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(raw.encode()))
    with pytest.warns(UserWarning) as record:
        task = _task(name="jsonl", path=path, num_eval=2, template='"Q: {question} A:"')
    message = str(record[0].message)
    assert "skipped 3 of 9 rows" in message
    assert "row 7: 'answer': answer must be a string or a number, got list" in message
    assert "row 9: invalid JSON" in message and "row 10: 'question': missing" in message
    assert task.num_skipped == 3 and task.num_train == 4
    # The template columns stay in meta; the 6 good rows are a=0..5.
    assert sorted(p.text for p in task.eval_prompts()) == sorted(f"Q: {p.meta['question']} A:" for p in
                                                                 task.eval_prompts())
    assert {p.text for p in task.eval_prompts()} <= {f"Q: {a}+{a}= A:" for a in range(6)}


def test_jsonl_all_rows_bad_is_one_clear_error(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"skipped 20 of 20 rows \(row 1: 'prompt': missing"):
        _task(name="jsonl", path=path, num_eval=2)


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_line_that_is_not_utf8_is_skipped_and_counted_by_line(tmp_path, gz):
    raw = b"".join(json.dumps(r).encode() + b"\n" for r in ROWS[:5])
    raw += b'{"question": "caf\xe9", "answer": 1}\n' + json.dumps(ROWS[5]).encode() + b"\n"  # Latin-1 on line 6
    path = tmp_path / ("d.jsonl.gz" if gz else "d.jsonl")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.warns(UserWarning, match=r"skipped 1 of 7 rows \(row 6: not UTF-8 \(byte 0xe9 at column 18\)"):
        task = _task(name="jsonl", path=path, num_eval=2, **{"fields.prompt": "question"})
    assert task.num_skipped == 1 and task.num_train + len(task.eval_prompts()) == 6


def test_unreadable_parquet_or_gzip_is_one_clear_error(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"d.parquet: not a readable Parquet file"):
        _task(name="parquet", path=tmp_path / "d.parquet")
    (tmp_path / "d.jsonl.gz").write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    with pytest.raises(ConfigError, match=r"d.jsonl.gz: not a readable gzip file"):
        _task(name="jsonl", path=tmp_path / "d.jsonl.gz")
    (tmp_path / "b.jsonl").write_bytes(bytes(range(256)))
    for name, builder in (("d.parquet", "parquet"), ("b.jsonl", "json")):  # through datasets' own readers
        with pytest.raises(ConfigError, match=rf"{name}'\: {builder} files not readable \(ArrowInvalid: "):
            _task(name="hf_disk", path=tmp_path / name, **{"params.cache_dir": tmp_path / "cache"})


def test_jsonl_separate_eval_file_is_decontaminated(tmp_path):
    train_path = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    eval_path = _write_jsonl(tmp_path / "eval.jsonl", ROWS[:3] + [{"question": "x", "answer": 0}])
    task = _task(name="jsonl", path=train_path, eval_path=eval_path, **{"fields.prompt": "question"})
    assert _texts(task.eval_prompts()) == ["0+0=", "1+1=", "2+2=", "x"]
    assert task.num_train == 17  # the 3 rows that are also eval rows are not trained on


def test_jsonl_directory_of_shards_labels_rows_by_file(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ROWS[:10])
    _write_jsonl(tmp_path / "b.jsonl", ROWS[10:], extra_lines=['{"question": 1.5}\n'])
    with pytest.warns(UserWarning, match=r"row b.jsonl:11: 'answer': missing"):
        task = _task(name="jsonl", path=tmp_path, eval_fraction=0.25, **{"fields.prompt": "question"})
    assert task.num_train + len(task.eval_prompts()) == 20


def test_sft_example_from_solution_column(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{**r, "solution": f"so {r['answer']}"} for r in ROWS])
    task = _task(name="jsonl", path=path, num_eval=2, **{"fields.prompt": "question", "fields.solution": "solution"})
    p = task.train_prompt(0)
    assert task.sft_example(p) == f"so {p.answer}"
    no_sol = _task(name="jsonl", path=path, num_eval=2, **{"fields.prompt": "question"})
    with pytest.raises(ConfigError, match="no solution column is mapped"):
        no_sol.sft_example(no_sol.train_prompt(0))


def test_parquet_matches_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    _write_jsonl(tmp_path / "d.jsonl", ROWS)
    common = {"num_eval": 4, "fields.prompt": "question"}
    pt, jt = _task(name="parquet", path=tmp_path / "d.parquet", **common), _task(name="jsonl", path=tmp_path /
                                                                                 "d.jsonl", **common)
    assert pt.eval_prompts() == jt.eval_prompts()
    assert [pt.train_prompt(i) for i in range(30)] == [jt.train_prompt(i) for i in range(30)]


def test_missing_path_never_downloads(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        _task(name="jsonl", path="openai/gsm8k")
    with pytest.raises(ConfigError, match="never downloads"):
        _task(name="hf_disk", path="hf://datasets/openai/gsm8k")
    with pytest.raises(ConfigError, match="task.path is required"):
        _task(name="parquet")


def test_hf_disk_saved_dataset_dict_with_eval_split(tmp_path):
    import datasets
    import huggingface_hub.constants as hc

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:15]),
                               "test": datasets.Dataset.from_list(ROWS[15:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    before = (datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE)
    task = _task(name="hf_disk", path=tmp_path / "dd", eval_split="test", **{"fields.prompt": "question"})
    assert (datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE) == before  # offline only while loading
    assert task.num_train == 15 and _texts(task.eval_prompts()) == sorted(f"{a}+{a}=" for a in range(15, 20))
    assert task.eval_prompts()[0].meta["tests"][0].startswith("assert f(")
    with pytest.raises(ConfigError, match=r"no split 'validation' \(splits: train, test\)"):
        _task(name="hf_disk", path=tmp_path / "dd", eval_split="validation", **{"fields.prompt": "question"})


def test_hf_disk_load_dataset_from_local_files(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = _task(name="hf_disk", path=tmp_path / "d.jsonl", num_eval=5, **{"fields.prompt": "question",
                                                                           "params.cache_dir": tmp_path / "cache"})
    assert task.num_train == 15 and len(task.eval_prompts()) == 5
    assert {p.answer for p in task.eval_prompts()} <= {str(2 * a) for a in range(20)}
