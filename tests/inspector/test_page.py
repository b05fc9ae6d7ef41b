"""inspect.html from real runs: what it embeds, bad input, `tidal inspect` and its loopback server."""

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from tidal.cli import main
from tidal.inspector.page import PREVIEW_CHARS, load_run, response_preview, write_inspector
from tidal.inspector.samples import read_samples
from tidal.inspector.serve import make_server


def embedded(page_path):
    text = page_path.read_text(encoding="utf-8")
    data = re.search(r'<script type="application/json" id="tidal-data">(.*?)</script>', text, flags=re.S).group(1)
    return text, json.loads(data)


def test_training_writes_the_inspector_and_the_report_links_to_it(inspector_runs):
    run = inspector_runs["a"]
    text, data = embedded(run / "inspect.html")
    (only,) = data["runs"]
    records, _ = read_samples(run / "samples.jsonl")
    assert only["records"] == records  # every recorded prompt, exactly as recorded
    assert [r["step"] for r in only["rows"]] == [0, 1, 2, 3]
    assert only["config"]["optim.lr"] == 0.01 and only["notes"] == []
    assert "Plotly" in text and "<script src=" not in text  # plotly.js embedded: nothing to fetch
    assert 'href="inspect.html"' in (run / "report.html").read_text()


def test_response_preview_is_one_line_cut_to_the_limit():
    assert PREVIEW_CHARS == 48
    assert response_preview("1998") == "1998"
    assert response_preview("") == "∅"
    assert response_preview("<c>37*54</c>\n=1998\tok") == "<c>37*54</c>↵=1998⇥ok"
    assert response_preview("x" * 48) == "x" * 48  # exactly the limit: whole, no ellipsis
    assert response_preview("x" * 49) == "x" * 47 + "…"  # one over: 47 characters and the ellipsis, 48 in all
    assert response_preview("ab\ncdef", limit=4) == "ab↵…"


@pytest.mark.parametrize("name", ["a", "agent"])
def test_each_row_carries_its_samples_responses_for_the_table(inspector_runs, name):
    """The rollout table's rows show what the policy wrote: the page embeds, per record, every sample's
    response preview (the table's "responses (reward)" column; inspector.js puts each beside its reward)."""
    text, data = embedded(inspector_runs[name] / "inspect.html")
    records, _ = read_samples(inspector_runs[name] / "samples.jsonl")
    (only,) = data["runs"]
    assert only["previews"] == [[response_preview(s["text"]) for s in r["samples"]] for r in records]
    assert sum(len(p) for p in only["previews"]) == sum(len(r["samples"]) for r in records) > 0
    assert any(p != "∅" for previews in only["previews"] for p in previews), "every response empty: nothing tested"
    header = re.search(r'<table id="groups"><thead><tr>(.*?)</tr>', text).group(1)
    assert re.findall(r"<th>(.*?)</th>", header) == ["step", "kind", "task", "prompt", "responses (reward)", "match",
                                                     "mean reward", "finish reasons", "max staleness"]


def test_several_runs_embed_each_and_diff_their_configs(inspector_runs, tmp_path):
    out = write_inspector([inspector_runs["a"], inspector_runs["b"]], tmp_path / "both.html")
    text, data = embedded(out)
    assert [r["name"] for r in data["runs"]] == ["a", "b"]
    diff_keys = re.findall(r'<tr data-key="([^"]+)">', text)
    assert diff_keys == ["seed"]  # the one key the runs differ in


def test_malformed_lines_are_skipped_counted_and_shown(inspector_runs, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "samples.jsonl", "config.yaml"):
        (run / name).write_bytes((inspector_runs["a"] / name).read_bytes())
    with open(run / "samples.jsonl", "a") as f:
        f.write('{"step": 4, "kind": "train", "prompt": {"text": "1+1="}, "samples": [{"text": "2", "ids": [1], '
                '"tokens": [], "behav_logp": [0.0], "versions": [0]}]}\n')  # a token list that does not match its ids
        f.write("[1, 2]\n")
        f.write('{"step": 5, "kind": "tr')  # torn by a crash
    with open(run / "metrics.jsonl", "a") as f:
        f.write("not json\n")
    _, data = embedded(write_inspector([run]))
    assert data["runs"][0]["notes"] == ["skipped 1 malformed line(s) in metrics.jsonl",
                                        "skipped 3 malformed line(s) in samples.jsonl"]
    assert len(data["runs"][0]["records"]) == len(read_samples(inspector_runs["a"] / "samples.jsonl")[0])


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="neither metrics.jsonl nor samples.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    (tmp_path / "config.yaml").write_text("a: [1, 2\n")
    notes = load_run(tmp_path)["notes"]
    assert notes[0].startswith("no samples.jsonl") and "not valid YAML" in notes[1]


def test_cli_inspect_writes_the_page_and_bad_input_is_one_line(inspector_runs, tmp_path, capsys):
    out = tmp_path / "page.html"
    assert main(["inspect", str(inspector_runs["a"]), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.is_file()
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no such run directory" in err and err.count("\n") == 1


def test_the_server_binds_loopback_and_serves_only_the_page(inspector_runs):
    page = inspector_runs["a"] / "inspect.html"
    server = make_server(page, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://{host}:{port}/") as r:
            assert r.read() == page.read_bytes()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://{host}:{port}/metrics.jsonl")
        with pytest.raises(OSError, match="cannot serve on 127.0.0.1"):
            make_server(page, port=port)  # taken
    finally:
        server.shutdown()
        server.server_close()


def test_text_that_looks_like_html_cannot_end_the_data_block(tmp_path):
    text = 'say </script><script>alert(1)</script><!-- "&'
    record = {"step": 1, "kind": "eval", "prompt": {"text": text, "task": "t"},
              "samples": [{"text": text, "ids": [1], "tokens": [text], "behav_logp": [float("nan")], "reward": 0.0,
                           "finish_reason": "stop", "versions": [0]}]}
    (tmp_path / "samples.jsonl").write_text(json.dumps(record) + "\n")  # json.dumps writes NaN: the page must not
    _, data = embedded(write_inspector([tmp_path]))
    (rec,) = data["runs"][0]["records"]
    assert rec["prompt"]["text"] == rec["samples"][0]["tokens"][0] == text
    assert rec["samples"][0]["behav_logp"] == [None]
