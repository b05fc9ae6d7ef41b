"""When the engine behind the endpoint raises (issue 33): one request's failure is that request's alone,
an engine that has really failed stops the run with one line and a non-zero exit, and a run whose agents
send the fuzz table's requests trains every step.

A request could crash the engine before the server validated token ids (``[5, 99999]``: an
``IndexError`` in the embedding), and the engine thread then ended, so every later request of every
episode got 503 while the run went on training nothing and exited 0. Ids are validated now; these
tests make the engine raise on a valid request (``Poisoned``) or on everything (a "CUDA error"), which
is what is left for the bridge to survive or report.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from tidal.api import EngineFailed, GenRequest
from tidal.cli import main
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.serve.bridge import EngineBridge, EngineClosed, RequestFailed
from tidal.serve.server import HarnessServer, ServeConfig
from tidal.types import Prompt

from .test_endpoint_fuzz import CMPL, send
from .test_harness_engine import chat_model, two_turn_agent  # noqa: F401  (fixture)
from .test_harness_run import DIGIT_AGENT, TINY, cfg_for, run

POISON = 49  # "?" in the tiny chat tokenizer: a valid id this engine raises on


class Poisoned(LocalEngine):
    """Raises in prefill on a request holding ``POISON``, as the embedding did on an id past the vocabulary.
    ``stream`` waits for ``gate``, so the requests queued meanwhile enter the engine in one batch."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    def _prefill(self, slots, rows):
        if any(POISON in row.request.prompt_ids for row in rows):
            raise IndexError("index out of range in self")
        return super()._prefill(slots, rows)

    def stream(self, source, on_done, greedy=False):
        self.gate.wait(30)
        return super().stream(source, on_done, greedy=greedy)


def test_an_engine_error_fails_only_the_request_that_caused_it(chat_model):  # noqa: F811
    model, tok = chat_model
    engine = Poisoned(model, tok, SamplingConfig(max_new_tokens=4), seed=0)
    server = HarnessServer(engine, tok, 64, ServeConfig()).start()
    try:
        prompts = {f"ep-{i}": [4, 40, 4 + i, 44] for i in range(5)} | {"culprit": [4, POISON]}
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futures = {e: pool.submit(send, server.port, e, CMPL, {"model": "policy", "prompt": p, "max_tokens": 3})
                       for e, p in prompts.items()}
            deadline = time.monotonic() + 30
            while server.bridge._queue.qsize() < len(prompts) and time.monotonic() < deadline:
                time.sleep(0.01)
            engine.gate.set()  # all six in one batch: the culprit takes the batch down with it
            answers = {e: f.result(timeout=60) for e, f in futures.items()}
        status, body = answers.pop("culprit")
        assert status == 500 and body["error"]["code"] == "engine_error" and "IndexError" in body["error"]["message"]
        assert all(status == 200 for status, _ in answers.values()), answers
        assert server.bridge.max_in_flight == len(prompts), "the requests never shared a batch"
        alone = {e: server.finish(e, 0.0)[0].token_ids for e in answers}
        assert send(server.port, "later", CMPL, {"model": "policy", "prompt": [4, 40], "max_tokens": 2})[0] == 200
        assert server.bridge.error is None and server.bridge.num_failed == 1
    finally:
        server.stop()
    # the retried requests sampled what they sample in a batch nobody poisoned
    engine = Poisoned(model, tok, SamplingConfig(max_new_tokens=4), seed=0)
    engine.gate.set()
    server = HarnessServer(engine, tok, 64, ServeConfig()).start()
    try:
        for e in alone:
            send(server.port, e, CMPL, {"model": "policy", "prompt": prompts[e], "max_tokens": 3})
            assert server.finish(e, 0.0)[0].token_ids == alone[e]
    finally:
        server.stop()


def broken_after(version: int, monkeypatch) -> None:
    """Every ``LocalEngine`` fails whatever it runs once its weights reach ``version``."""
    prefill = LocalEngine._prefill

    def failing(self, slots, rows):
        if self.version >= version:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return prefill(self, slots, rows)

    monkeypatch.setattr(LocalEngine, "_prefill", failing)


def request(i: int) -> GenRequest:
    return GenRequest(Prompt(f"r{i}", "", ""), (4, 40, 4 + i), 0, 2)


def test_an_engine_that_fails_whatever_it_runs_is_declared_failed(chat_model, monkeypatch):  # noqa: F811
    model, tok = chat_model
    broken_after(0, monkeypatch)
    bridge = EngineBridge(LocalEngine(model, tok, SamplingConfig(max_new_tokens=2), seed=0))
    try:
        futures = [bridge.submit(request(i)) for i in range(4)]
        errors = [f.exception(timeout=30) for f in futures]
        assert sum(isinstance(e, RequestFailed) for e in errors) == 2, errors  # two alone in a row: the engine
        assert all(isinstance(e, (RequestFailed, EngineClosed)) for e in errors)
        with pytest.raises(EngineFailed, match="the rollout engine failed: RuntimeError: CUDA error"):
            bridge.check()
        with pytest.raises(EngineClosed):
            bridge.submit(request(9))
    finally:
        bridge.close()


def test_a_failed_weight_update_ends_the_engine_and_is_never_skipped(chat_model):  # noqa: F811
    """The bridge restarts the engine after an error; a weight update that failed must not be lost by that
    (generating on with the old weights while the trainer counts the new version)."""
    model, tok = chat_model
    engine = LocalEngine(model, tok, SamplingConfig(max_new_tokens=2), seed=0)
    bridge = EngineBridge(engine)
    try:
        assert bridge.submit(request(0)).result(timeout=30).versions == [0, 0]
        engine.request_weight_update({"no.such.weight": torch.zeros(1)}, 1)
        deadline = time.monotonic() + 30
        while bridge.error is None and time.monotonic() < deadline:  # raised with no request in the engine
            time.sleep(0.01)
        with pytest.raises(EngineFailed, match="no.such.weight"):
            bridge.check()
        with pytest.raises(RuntimeError, match="no.such.weight"):  # still staged: raised again, not skipped
            engine.generate([request(2)])
    finally:
        bridge.close()


def test_a_run_whose_engine_failed_stops_with_one_line_and_a_nonzero_exit(tmp_path, monkeypatch, capsys):
    """``tidal train harness_quickstart`` whose engine fails from version 2 on: exit 1, the last line names the
    failure and how to resume, the steps that trained are checkpointed (before: every later step trained
    on nothing, ``harness/finished`` 0, and the run exited 0)."""
    broken_after(2, monkeypatch)
    out = tmp_path / "run"
    sets = [*TINY, f"sft.cache_dir={tmp_path / 'cache'}", DIGIT_AGENT, "system.mode=sync", "max_steps=5"]
    code = main(["train", "harness_quickstart", "--out", str(out), *(a for s in sets for a in ("--set", s))])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1, last
    assert last.startswith("error: the rollout engine failed: RuntimeError: CUDA error") and "--resume" in last, last
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["harness/finished"] >= 12  # 2 trained, its eval failed
    assert (out / "checkpoints" / "step_2").is_dir()


FUZZ_BODIES = [  # (route, body, content type): the table's rows an agent can send to its own episode
    (CMPL, {"model": "policy", "prompt": [5, 99999]}, "application/json"),
    (CMPL, {"model": "policy", "prompt": [5, -1]}, "application/json"),
    (CMPL, {"model": "policy", "prompt": [5, 2**64]}, "application/json"),
    (CMPL, {"model": "policy", "prompt": []}, "application/json"),
    ("/v1/chat/completions", {"model": "policy", "messages": [
        {"role": "user", "content": "1"}, {"role": "assistant", "tool_calls": [{"id": "c", "function": "calc"}]},
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, "application/json"),
    (CMPL, {"model": "gpt-4o", "prompt": "1"}, "application/json"),
    (CMPL, {"model": "policy", "prompt": [5, 99999]}, "text/plain"),
]


def fuzzing_agent(client, task):
    """``two_turn_agent`` after sending the fuzz rows to its own episode (each must be refused with a 4xx)."""
    base = str(client.base_url).rstrip("/")
    for route, body, content_type in FUZZ_BODIES:
        headers = {"Content-Type": content_type, "Authorization": f"Bearer {client.api_key}"}
        req = urllib.request.Request(base.removesuffix("/v1") + route, json.dumps(body).encode(), headers)
        try:
            urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as e:
            assert 400 <= e.code < 500, (e.code, e.read())
        else:
            raise AssertionError(f"served: {body}")
    return two_turn_agent(client, task)


def test_a_run_whose_agents_send_the_fuzz_trains_every_step(tmp_path):
    result = run(cfg_for(tmp_path, "harness.function=tests.serve.test_engine_failure:fuzzing_agent",
                         "system.mode=async", "max_steps=3"), tmp_path / "fuzzed")
    rows = result.history[1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["harness/finished"] >= 12 * r["step"] and r["harness/crashed"] == 0 for r in rows)
    assert all(r["agent/infra_failures"] == 0 and r["agent/turns_mean"] == 2.0 for r in rows)
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows) and "eval/accuracy" in result.history[-1]
    # the held-out episodes sent the fuzz to the evaluation server: every one of them still made both requests
    evals = [r for r in result.history if "eval/turns_mean" in r]
    assert [r["step"] for r in evals] == [0, 2, 3] and all(r["eval/turns_mean"] == 2.0 for r in evals)
