"""``tidal score``: JSONL in, the same rows plus reward/details out, malformed rows counted, not fatal."""

import io
import json
import select
import subprocess
import sys
import time

import pytest

from tidal.cli import SCORE_CHUNK, main
from tidal.rewards import REWARDS, register_fn


def _score(args, lines):
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "score", *args], input="".join(lines),
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, [json.loads(x) for x in proc.stdout.splitlines()], proc.stderr


def test_exact_match_rows_keep_fields_order_and_count_errors():
    lines = [
        '{"response": " 42 ", "answer": 42, "id": 1, "tests": ["t"]}\n',
        '{"response": "41", "answer": "42", "prompt": "6*7="}\n',
        "\n",  # blank: skipped, but it keeps its line number
        "not json\n",
        '{"answer": "1"}\n',
        '{"question": "1+1=", "response": "2", "answer": "2", "reward": 0.5}\n',  # an old reward is replaced
    ]
    code, rows, err = _score(["--reward", "exact_match", "--workers", "0"], lines)
    assert code == 0
    assert rows[0] == {"response": " 42 ", "answer": 42, "id": 1, "tests": ["t"], "reward": 1.0,
                       "details": {"correct": True}}
    assert rows[1] == {"response": "41", "answer": "42", "prompt": "6*7=", "reward": 0.0, "details": {"correct": False}}
    assert rows[2] == {"raw": "not json", "reward": 0.0,
                       "details": {"error": "line 4: invalid JSON (Expecting value at column 1)"}}
    assert rows[3] == {"answer": "1", "reward": 0.0, "details": {"error": "line 5: missing field 'response'"}}
    assert rows[4]["reward"] == 1.0 and rows[4]["question"] == "1+1="
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("score: 5 rows, mean reward 0.4000, 2 malformed, 0 reward errors, 0 timeouts, ")


def test_reasoning_gym_row_scored_in_a_worker_with_params():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    entry = reasoning_gym.create_dataset("leg_counting", size=1, seed=3)[0]
    base = {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
    wrong = entry["answer"] + "0"  # leg_counting credits a response containing the answer: len(a)/len(r)
    lines = [json.dumps({**base, "response": f"<answer>{entry['answer']}</answer>"}) + "\n",
             json.dumps({**base, "response": wrong}) + "\n"]
    code, rows, _ = _score(["--reward", "reasoning_gym"], lines)
    assert code == 0 and [r["reward"] for r in rows] == [1.0, 0.0]
    assert rows[1]["details"]["score"] == pytest.approx(len(entry["answer"]) / len(wrong))
    assert rows[0]["metadata"] == json.loads(json.dumps(entry["metadata"]))  # original fields kept
    code, rows, _ = _score(["--reward", "reasoning_gym", "--set", "partial_credit=true", "--workers", "0"], lines)
    assert rows[1]["reward"] == pytest.approx(len(entry["answer"]) / len(wrong))


def test_unknown_reward_or_param_is_a_one_line_error():
    code, _, err = _score(["--reward", "exact_mach"], [])
    assert code == 2 and "did you mean 'exact_match'" in err and err.count("\n") == 1
    code, _, err = _score(["--reward", "reasoning_gym", "--set", "treshold=0.5"], [])
    assert code == 2 and "treshold" in err and err.count("\n") == 1
    # the valid parameters are named, with the closest one
    assert "valid: threshold, partial_credit, extract (did you mean 'threshold' for 'treshold'?)" in err
    code, _, err = _score(["--reward", "math", "--set", "foo=1"], [])
    assert code == 2 and err.strip() == ("error: reward 'math': unknown parameter(s) ['foo']; "
                                         "valid: mode, formats, after_think, reject_copied, reject_restated, timeout_s")


def test_output_streams_chunk_by_chunk_before_input_ends():
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "score", "--reward", "exact_match", "--workers", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("".join(json.dumps({"response": str(i), "answer": str(i % 2)}) + "\n"
                                 for i in range(SCORE_CHUNK)))
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no output after a full chunk while stdin is still open"
        first = json.loads(proc.stdout.readline())
        assert first == {"response": "0", "answer": "0", "reward": 1.0, "details": {"correct": True}}
        proc.stdin.write(json.dumps({"response": "x", "answer": "x"}) + "\n")
        proc.stdin.close()
        rest = [json.loads(x) for x in proc.stdout.read().splitlines()]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert len(rest) == SCORE_CHUNK and [r["response"] for r in rest[:2]] == ["1", "2"]
    assert rest[-1]["reward"] == 1.0
    assert "257 rows, mean reward 0.0117" in proc.stderr.read()  # 3 of 257 correct: "0", "1" and "x"


@register_fn("_test_sleepy") if "_test_sleepy" not in REWARDS else (lambda fn: fn)
def sleepy(response, prompt):
    if response == "hang":
        time.sleep(30)
    return float(response == prompt.answer), {}


def test_a_hanging_row_times_out_and_the_rest_are_scored(monkeypatch, capsys):
    rows = [{"response": "1", "answer": "1"}, {"response": "hang", "answer": "1"}, {"response": "2", "answer": "1"}]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["score", "--reward", "_test_sleepy", "--workers", "1", "--timeout", "1"]) == 0
    out, err = capsys.readouterr()
    scored = [json.loads(x) for x in out.splitlines()]
    assert [(r["reward"], r["details"].get("error")) for r in scored] == [(1.0, None), (0.0, "timeout"), (0.0, None)]
    assert "3 rows, mean reward 0.3333, 0 malformed, 0 reward errors, 1 timeouts" in err


def test_score_doc_sends_readers_of_the_code_test_format_to_the_doc_that_has_it():
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    text = (docs / "score.md").read_text()
    para = text[text.index("Code rows carry their tests"):]
    para = para[: para.index("\n\n")]
    links = re.findall(r"\]\(([\w-]+\.md)(?:#([\w-]+))?\)", para)
    assert links, "the paragraph links the doc that defines the tests format"
    for name, anchor in links:
        doc = (docs / name).read_text()
        assert '{"kind": "io", "cases": [{"input": str, "output": str}' in doc and '"kind": "assert"' in doc, name
        headings = re.findall(r"^#+ (.*)$", doc, re.M)
        slugs = {re.sub(r"[^\w -]", "", h).strip().lower().replace(" ", "-") for h in headings}
        assert not anchor or anchor in slugs, (anchor, slugs)
