"""samples.jsonl by hand: strict JSON, the size cap, resume, and what the reader skips and counts."""

import json

from tidal.inspector.samples import SampleLog, clean, read_samples


def _record(step, text="1+1=", **sample):
    s = {"text": "2", "ids": [5], "tokens": ["2"], "behav_logp": [-0.1], "versions": [0], **sample}
    return {"step": step, "kind": "train", "prompt": {"text": text}, "samples": [s]}


def test_clean_makes_strict_rounded_json():
    assert clean({"a": float("nan"), "b": (1.234567, float("-inf")), "c": {1: object}, "d": True}) == {
        "a": None, "b": [1.2346, None], "c": {"1": "<class 'object'>"}, "d": True}
    json.dumps(clean([float("inf")]), allow_nan=False)


def test_cap_stops_recording_with_one_line_saying_so(tmp_path):
    log = SampleLog(tmp_path / "s.jsonl", max_mb=0.0003)  # 300 bytes
    assert log.write(1, [_record(1)])
    assert not log.write(2, [_record(2, text="x" * 400)])
    assert not log.write(3, [_record(3)]) and log.capped
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(x["step"], x["kind"]) for x in lines] == [(1, "train"), (2, "capped")]
    resumed = SampleLog(tmp_path / "s.jsonl", max_mb=0.0003, resume_after_step=5)  # the cap outlives a resume
    assert resumed.capped and not resumed.write(6, [_record(6)])


def test_a_new_run_starts_afresh_and_a_resume_keeps_what_the_checkpoint_covers(tmp_path):
    path = tmp_path / "s.jsonl"
    log = SampleLog(path, max_mb=1)
    for step in (1, 2, 3):
        log.write(step, [_record(step)])
    SampleLog(path, max_mb=1, resume_after_step=2)
    assert [r["step"] for r in read_samples(path)[0]] == [1, 2]
    SampleLog(path, max_mb=1)
    assert not path.exists()


def test_reader_skips_and_counts_what_it_cannot_show(tmp_path):
    path = tmp_path / "s.jsonl"
    bad = [
        '{"step": 1, "kind": "tr',  # torn by a crash
        "[1, 2]",
        json.dumps({**_record(1), "kind": "other"}),
        json.dumps({**_record(1), "step": "1"}),
        json.dumps(_record(1, tokens=[])),  # tokens do not match ids
        json.dumps(_record(1, behav_logp=[-1.0, -2.0])),
        json.dumps(_record(1, versions=None)),  # the page needs every token's version
        json.dumps({**_record(1), "samples": []}),
    ]
    path.write_text("\n".join([json.dumps(_record(1)), *bad, "", json.dumps({"step": 2, "kind": "capped"})]) + "\n")
    records, skipped = read_samples(path)
    assert skipped == len(bad) and [r["kind"] for r in records] == ["train", "capped"]
