import gzip
import json

import pytest

from tests.data.corpus import corpus_with_duplicates
from tidal.cli import main
from tidal.config import ConfigError
from tidal.data.curate import load_recipe
from tidal.data.io import read_rows, write_rows
from tidal.data.pipeline import Pipeline
from tidal.data.verify import Verifiable


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".parquet", ""])
def test_rows_round_trip_unchanged_in_every_format(tmp_path, suffix):
    rows = [{"text": "a", "n": 1}, {"text": "b", "n": 2}]
    path = tmp_path / f"rows{suffix}"
    assert write_rows(path, rows) == 2
    assert list(read_rows(path)) == rows


def test_bad_jsonl_lines_are_skipped_and_counted_or_named(tmp_path):
    from tidal.data.io import BadRows

    path = tmp_path / "x.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"text": "ok"}\nnot json\n[1, 2]\n\n{"text": "ok2"}\n')
    bad = BadRows()
    assert [r["text"] for r in read_rows(path, bad)] == ["ok", "ok2"]
    assert bad.count == 2 and bad.examples == [f"{path}:2: invalid JSON (Expecting value at column 1)",
                                               f"{path}:3: not a JSON object (list)"]
    with pytest.raises(ValueError, match=r"x.jsonl.gz:2"):
        list(read_rows(path))


def test_cli_dedup_writes_kept_rows_unchanged_and_a_report(tmp_path, capsys):
    rows, exact_ids, near_ids = corpus_with_duplicates(seed=5, originals=80, exact=10, near=10)
    src = tmp_path / "in.jsonl"
    write_rows(src, rows)
    out = tmp_path / "out" / "kept.jsonl"
    assert main(["curate", "dedup", "--in", str(src), "--out", str(out), "--set", "workers=2"]) == 0
    kept = list(read_rows(out))
    assert kept == [r for r in rows if r["id"] in {k["id"] for k in kept}]  # unchanged, in order
    report = json.loads((tmp_path / "out" / "kept.jsonl.report.json").read_text())
    assert report["rows_in"] == len(rows) and report["rows_out"] == len(kept)
    assert [b["name"] for b in report["blocks"]] == ["exact_dedup", "near_dedup"]
    assert report["blocks"][0]["dropped"]["duplicate"] == len(exact_ids)
    assert "kept" in capsys.readouterr().out


def test_recipes_and_overrides_and_errors(tmp_path):
    cfg = load_recipe("decontaminate", ["eval=evals.jsonl", "decontaminate.ngram=8"])
    assert cfg.eval == "evals.jsonl" and cfg.decontaminate.ngram == 8
    assert load_recipe("rl-problems", []).text_key == "prompt"
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("blocks: [exact_dedup, c4]\nc4_min_sentences: 1\n")
    assert load_recipe(str(recipe), []).blocks == ["exact_dedup", "c4"]
    with pytest.raises(ConfigError, match="unknown recipe"):
        load_recipe("nope", [])
    with pytest.raises(ConfigError, match="near_dedup.treshold"):
        load_recipe("dedup", ["near_dedup.treshold=0.5"])
    with pytest.raises(ConfigError, match="choose from"):
        load_recipe("dedup", ["blocks=[exact_dedup, magic]"])


def test_decontaminate_without_eval_is_a_one_line_error(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_rows(src, [{"text": "a"}])
    assert main(["curate", "decontaminate", "--in", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "eval=PATH" in err and "Traceback" not in err


def test_verifiable_keeps_problems_whose_reference_passes_the_real_verifier():
    io = {"kind": "io", "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]}
    rows = [
        {"id": "frac", "prompt": "1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"id": "int", "prompt": "2+2?", "answer": "4"},
        {"id": "empty", "prompt": "x?", "answer": ""},
        {"id": "noprompt", "answer": "4"},
        {"id": "code_ok", "prompt": "Add.", "solution": "a, b = map(int, input().split())\nprint(a + b)",
         "tests": io},
        {"id": "code_bad", "prompt": "Add.", "solution": "a, b = map(int, input().split())\nprint(a - b)",
         "tests": io},
        {"id": "code_malformed", "prompt": "Add.", "solution": "print(3)", "tests": {"asserts": ["x"]}},
    ]
    p = Pipeline([Verifiable()])
    assert [r["id"] for r in p.run(rows)] == ["frac", "int", "code_ok"]
    assert p.report()["blocks"][0]["dropped"] == {"no_answer": 1, "no_prompt": 1, "reference_fails_tests": 1,
                                                  "bad_tests": 1}
