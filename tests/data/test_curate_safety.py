"""``tidal curate`` never loses data: it refuses to write over its input, writes its output only once it
is complete, skips (and counts, by 1-based line) input lines that are not UTF-8 JSON objects, and
names every problem in one line."""

import json

import pytest

from tidal.cli import build_parser, main
from tidal.config import ConfigError
from tidal.data.curate import RECIPES, curate, load_recipe
from tidal.data.io import BadRows, read_rows, write_rows

TEXT = "The council met on Tuesday and agreed that the library will open longer hours this winter."


def _jsonl(path, lines: list[bytes]):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


@pytest.mark.parametrize("recipe", [*RECIPES, "mine.yaml", "train-classifier"])
def test_out_same_as_in_is_refused_and_the_input_is_untouched(tmp_path, monkeypatch, capsys, recipe):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("blocks: [exact_dedup]\n")
    src = _jsonl(tmp_path / "same.jsonl", [json.dumps({"text": TEXT, "label": 1}).encode()] * 3)
    before = src.read_bytes()
    # spelled differently (./same.jsonl vs an absolute path): still the same file
    assert main(["curate", recipe, "--in", "same.jsonl", "--out", str(src)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out {src} is the same file as --in same.jsonl" in err[0]
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml", "same.jsonl"]


def test_out_same_as_an_eval_set_is_refused(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": TEXT}).encode()])
    ev = _jsonl(tmp_path / "eval.jsonl", [json.dumps({"text": "an evaluation item"}).encode()])
    with pytest.raises(ConfigError, match=r"same file as eval="):
        curate("decontaminate", src, ev, [f"eval={ev}", "workers=1"], progress=False)


def test_compare_refuses_to_write_over_a_dataset(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [json.dumps({"text": TEXT}).encode()])
    before = a.read_bytes()
    assert main(["curate", "compare", "--out", str(a), "--set", f"proxy.datasets=[{a}, {a}]",
                 "--set", f"proxy.eval={a}"]) == 2
    assert a.read_bytes() == before


def test_non_utf8_and_malformed_lines_are_skipped_and_reported_by_line(tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [
        json.dumps({"id": 1, "text": TEXT}).encode(),
        b'{"id": 2, "text": "caf\xe9"}',  # Latin-1, not UTF-8
        b"",
        b"not json",
        json.dumps({"id": 5, "text": TEXT}).encode(),  # a duplicate of line 1
        json.dumps({"id": 6, "text": "Something else entirely, with enough words to keep."}).encode(),
    ])
    out = tmp_path / "out.jsonl"
    assert main(["curate", "dedup", "--in", str(src), "--out", str(out), "--set", "workers=1"]) == 0
    printed = capsys.readouterr().out
    assert "3 rows in, 2 malformed lines skipped, 2 kept" in printed
    assert f"malformed: {src}:2: not UTF-8 (byte 0xe9 at column 23)" in printed
    assert f"malformed: {src}:4: invalid JSON" in printed
    assert [r["id"] for r in read_rows(out)] == [1, 6]
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert report["malformed_lines"] == 2
    # the dropped duplicate is named by its line in the file (5), not its position among good rows (2)
    assert report["blocks"][0]["examples"] == [{"row": 5, "reason": "duplicate"}]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("content", [b"", b"\x00\xff\xfe binary \x89PNG\r\n\x1a\n" * 4, b"not json\n[1]\n"])
def test_input_without_a_valid_row_is_an_error_and_leaves_out_as_it_was(tmp_path, capsys, content):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    out = tmp_path / "out.jsonl"
    out.write_text("earlier output\n")
    assert main(["curate", "dedup", "--in", str(src), "--out", str(out), "--set", "workers=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {src}: no valid rows")
    assert out.read_text() == "earlier output\n" and not list(tmp_path.glob("*.tmp"))


def test_write_rows_that_fails_midway_leaves_no_partial_file(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("earlier output\n")

    def rows():
        yield {"text": "a"}
        raise RuntimeError("upstream failure")

    with pytest.raises(RuntimeError):
        write_rows(out, rows())
    assert out.read_text() == "earlier output\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    plain = tmp_path / "plain_dir"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a Hugging Face dataset directory; refusing to replace it"):
        write_rows(plain, [{"text": "a"}])
    assert (plain / "notes.txt").read_text() == "mine"


def test_read_rows_names_a_bad_line_without_a_counter(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [b'{"a": 1}', b"\xff\xfe"])
    bad = BadRows()
    assert list(read_rows(src, bad)) == [{"a": 1}] and bad.count == 1
    with pytest.raises(ValueError, match=r"in.jsonl:2: not UTF-8 \(byte 0xff at column 1\)"):
        list(read_rows(src))


def test_recipe_yaml_syntax_error_names_file_and_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("blocks: [exact_dedup]\ntext_key: prompt\nnear_dedup: {threshold: 0.8\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:4: YAML syntax error"):
        load_recipe(str(recipe), [])


def test_curate_help_lists_every_recipe(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens (rl-|difficulty)
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["curate"]
    text = sub.format_help()
    for name in [*RECIPES, "train-classifier", "compare"]:
        assert name in text, name


@pytest.mark.parametrize("override,message", [
    ("chunk_size=0", "chunk_size=0: must be >= 1"),  # read nothing and reported "no valid rows"
    ("workers=-1", "workers=-1: must be >= 0"),
    ("executor=dask", "executor='dask': must be local or ray"),  # these were assertion tracebacks
    ("near_dedup.threshold=2", "near_dedup.threshold=2.0: must be in (0, 1]"),
    ("near_dedup.bands=0", "near_dedup.bands=0: must be >= 1"),
    ("near_dedup.ngram=0", "near_dedup.ngram=0: must be >= 1"),
    ("decontaminate.ngram=0", "decontaminate.ngram=0: must be >= 1"),
    ("difficulty.min_pass_rate=0.9", "difficulty.min_pass_rate=0.9: must be 0 <= min_pass_rate <= max_pass_rate"),
])
def test_settings_no_block_can_run_with_are_config_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_recipe("dedup", ["difficulty.max_pass_rate=0.5", override])
    assert message in str(e.value)


def test_bad_input_or_output_path_fails_before_any_work(tmp_path):
    # rl-difficulty with a missing model: the path errors come first, before the blocks (and models) load
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"prompt": "1+1", "answer": "2"}).encode()])
    no_model = [f"difficulty.model={tmp_path / 'no_model'}"]
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        curate("rl-difficulty", tmp_path / "nope.jsonl", tmp_path / "out.jsonl", no_model, progress=False)
    with pytest.raises(ValueError, match="out.txt: unknown format"):
        curate("rl-difficulty", src, tmp_path / "out.txt", no_model, progress=False)
    with pytest.raises(ConfigError, match="difficulty.model: no Hugging Face model"):
        curate("rl-difficulty", src, tmp_path / "out.jsonl", no_model, progress=False)


def test_ctrl_c_leaves_the_earlier_output_and_prints_one_line(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    fifo, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    os.mkfifo(fifo)  # the input never ends until we say so: the run is mid-way when Ctrl-C comes
    out.write_text("earlier output\n")
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "curate", "dedup", "--in", str(fifo), "--out", str(out),
                             "--set", "workers=2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    with open(fifo, "wb") as writer:  # returns once curate has opened its input
        writer.write(b"".join(json.dumps({"text": f"{TEXT} {i}"}).encode() + b"\n" for i in range(3)))
        writer.flush()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group, pool workers included
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode().strip() == "error: tidal curate interrupted; its outputs were not replaced"
    assert out.read_text() == "earlier output\n" and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl",
                                                                                                   "out.jsonl"]
