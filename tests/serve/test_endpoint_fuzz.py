"""The endpoint under bad input (issue 33): a fuzz table of what a buggy agent, another local process or a
web page the user opens can send, and the fixes it proves.

Every row of the table is answered with a 4xx and OpenAI's error body (or, for a client that went
away, nothing), leaves no traceback in the server's log, and the next well-formed request on another
episode is still served within a second. The server is the one ``harness_quickstart`` trains through:
the tiny chat tokenizer, whose template renders an assistant's ``tool_calls`` (a malformed call made it
raise), in front of a real ``LocalEngine``. Rows sent over raw HTTP, so headers, bodies and disconnects
are exactly what the row says.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import logging
import socket
import threading
import time

import openai
import pytest

from tidal.models import tiny
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.serve.server import HarnessServer, ServeConfig, has_key, is_loopback_host

from .test_harness_engine import TINY, harness, two_turn_agent

CONTEXT = 128
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def send(port: int, episode: str, route: str, body, headers: dict | None = None, timeout: float = 60) -> tuple:
    """POST ``body`` (a dict as JSON, or raw bytes) with ``headers`` (None drops one); (status, JSON body)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    given = {"Content-Type": "application/json", **(headers or {})}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", f"/episodes/{episode}{route}", raw, {k: v for k, v in given.items() if v is not None})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


def chat(*messages, **extra) -> dict:
    return {"model": "policy", "messages": list(messages), **extra}


USER = {"role": "user", "content": "12*3="}


def assistant_calls(*calls) -> dict:
    return chat(USER, {"role": "assistant", "content": None, "tool_calls": list(calls)},
                {"role": "tool", "content": "36"})


def disconnect_mid_body(port: int, episode: str) -> None:
    """Headers promising 1,000 bytes, 10 of them, then the connection closes."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST /episodes/{episode}{CMPL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 1000\r\n\r\n{{\"model\": ".encode())
        time.sleep(0.1)


def disconnect_mid_stream(port: int, episode: str) -> None:
    """A streamed completion whose client reads the first bytes of the answer, then goes away."""
    body = json.dumps({"model": "policy", "prompt": "1+1=", "max_tokens": 4, "stream": True})
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST /episodes/{episode}{CMPL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        s.recv(16)


def large_bodies(port: int, episode: str) -> list[cf.Future]:
    """Four 512 KiB conversations at once (each most of a second to tokenize here; far past the context):
    answered 400 ``context_length_exceeded``, while other episodes are served."""
    pool = cf.ThreadPoolExecutor(4)
    big = chat({"role": "user", "content": "7" * (512 << 10)})
    futures = [pool.submit(send, port, f"{episode}-{i}", CHAT, big) for i in range(4)]
    pool.shutdown(wait=False)
    time.sleep(0.5)  # the bodies are in: tokenizing
    return futures


# (id, what is sent, the status expected: None for a client that is gone before any answer)
FUZZ = [
    ("id-past-vocab", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": [5, 99999]}), 400),
    ("id-negative", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": [5, -1]}), 400),
    ("id-past-2**63", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": [5, 2**64]}), 400),
    ("ids-empty", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": []}), 400),
    ("text-empty", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": ""}), 400),
    ("ids-nested", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": [[5, 6]]}), 400),
    ("max-tokens-0", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": "1", "max_tokens": 0}), 400),
    ("call-without-function", lambda p, e: send(p, e, CHAT, assistant_calls({"id": "c", "type": "function"})), 400),
    ("call-function-a-string", lambda p, e: send(p, e, CHAT, assistant_calls(
        {"id": "c", "type": "function", "function": "calc"})), 400),
    ("call-without-name", lambda p, e: send(p, e, CHAT, assistant_calls(
        {"id": "c", "type": "function", "function": {"arguments": "{}"}})), 400),
    ("calls-not-a-list", lambda p, e: send(p, e, CHAT, chat(USER, {"role": "assistant", "tool_calls": "x"})), 400),
    ("part-text-a-number", lambda p, e: send(p, e, CHAT, chat(
        {"role": "user", "content": [{"type": "text", "text": 5}]})), 400),
    ("part-image", lambda p, e: send(p, e, CHAT, chat(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})), 400),
    ("tool-without-function", lambda p, e: send(p, e, CHAT, chat(USER, tools=[{"type": "function"}])), 400),
    ("role-unknown", lambda p, e: send(p, e, CHAT, chat({"role": "wizard", "content": "hi"})), 400),
    ("message-not-an-object", lambda p, e: send(p, e, CHAT, chat("hi")), 400),
    ("messages-empty", lambda p, e: send(p, e, CHAT, chat()), 400),
    ("body-not-json", lambda p, e: send(p, e, CHAT, b"{"), 400),
    ("body-not-utf8", lambda p, e: send(p, e, CHAT, b"\xff\xfe"), 400),
    ("body-a-list", lambda p, e: send(p, e, CHAT, b"[]"), 400),
    ("model-unknown", lambda p, e: send(p, e, CMPL, {"model": "gpt-4o", "prompt": "1"}), 404),
    ("type-text-plain", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": [5, 99999]},
                                          {"Content-Type": "text/plain"}), 415),
    ("type-form", lambda p, e: send(p, e, CMPL, b"model=policy", {"Content-Type": "application/x-www-form-urlencoded"}),
     415),
    ("type-none", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": "1"}, {"Content-Type": None}), 415),
    ("host-foreign", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": "1"}, {"Host": "evil.example"}), 403),
    ("host-rebound", lambda p, e: send(p, e, CMPL, {"model": "policy", "prompt": "1"},
                                       {"Host": "attacker.test:8000"}), 403),
    ("disconnect-mid-body", disconnect_mid_body, None),
    ("disconnect-mid-stream", disconnect_mid_stream, None),
    ("large-bodies-at-once", large_bodies, 400),
]


class Log(logging.Handler):
    """Every record the server's loggers emit (uvicorn's do not propagate to the root)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def attach(self) -> None:
        """Listen from now on (again: every uvicorn server's start resets the ``uvicorn`` logger's handlers)."""
        self.records.clear()
        for name in ("uvicorn", ""):
            logging.getLogger(name).addHandler(self)

    def detach(self) -> None:
        for name in ("uvicorn", ""):
            logging.getLogger(name).removeHandler(self)

    def tracebacks(self) -> list[str]:
        return [self.format(r) for r in self.records if r.exc_info or r.levelno >= logging.ERROR
                or "Traceback" in r.getMessage()]


@pytest.fixture(scope="module")
def served():
    tok = tiny.build_chat_tokenizer()
    engine = LocalEngine(tiny.build_model(TINY, tok), tok, SamplingConfig(max_new_tokens=4), seed=0)
    server = HarnessServer(engine, tok, CONTEXT, ServeConfig()).start()
    log = Log()
    yield server, log
    log.detach()
    server.stop()


def served_within_a_second(server: HarnessServer, episode: str) -> None:
    start = time.monotonic()
    status, body = send(server.port, episode, CMPL, {"model": "policy", "prompt": "1+1=", "max_tokens": 2})
    took = time.monotonic() - start
    assert status == 200 and body["choices"][0]["text"] is not None, body
    assert took < 1.0, f"a well-formed request on another episode took {took:.2f} s"


@pytest.mark.parametrize("make, expected", [row[1:] for row in FUZZ], ids=[row[0] for row in FUZZ])
def test_fuzz_is_a_4xx_without_a_traceback_and_the_engine_serves_on(served, make, expected, request):
    server, log = served
    log.attach()
    episode = request.node.callspec.id
    got = make(server.port, episode)
    concurrent = isinstance(got, list)
    if concurrent:  # still in flight: another episode is served meanwhile
        served_within_a_second(server, f"ok-{episode}")
        answers = [f.result(timeout=120) for f in got]
    else:
        answers = [] if got is None else [got]
        served_within_a_second(server, f"ok-{episode}")
    for status, body in answers:
        assert status == expected, body
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    time.sleep(0.05)  # a handler that failed after answering logs just after
    assert not log.tracebacks(), "\n".join(log.tracebacks())
    assert server.bridge.error is None and server.bridge.num_failed == 0


def test_the_fuzz_rows_name_what_is_wrong(served):
    """The 400s say which field and why, in one line (a sample of the table's rows)."""
    server, _ = served
    _, body = send(server.port, "why-1", CMPL, {"model": "policy", "prompt": [5, 99999]})
    assert body["error"]["param"] == "prompt" and "token id 99999" in body["error"]["message"]
    _, body = send(server.port, "why-2", CHAT, assistant_calls({"id": "c", "type": "function"}))
    assert body["error"]["param"] == "messages.1.tool_calls.0.function"
    _, body = send(server.port, "why-3", CMPL, {"model": "gpt-4o", "prompt": "1"})
    assert body["error"]["code"] == "model_not_found" and "'policy'" in body["error"]["message"]
    _, body = send(server.port, "why-4", CHAT, chat({"role": "user", "content": "7" * 5000}))
    assert body["error"]["code"] == "context_length_exceeded"


def test_a_conversation_the_chat_template_refuses_is_a_400(served):
    server, _ = served
    tok = tiny.build_chat_tokenizer()
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turn') }}{% endif %}"
    strict = HarnessServer(server.engine, tok, CONTEXT, ServeConfig()).start()
    try:
        status, body = send(strict.port, "t1", CHAT, chat({"role": "system", "content": "be brief"}))
        assert status == 400 and "no system turn" in body["error"]["message"] and body["error"]["param"] == "messages"
    finally:
        strict.stop()


def test_hosts_and_keys():
    assert all(map(is_loopback_host, ["127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:80", "127.0.0.2"]))
    assert not any(map(is_loopback_host, ["evil.example", "127.0.0.1.evil.example", "10.0.0.1:80", "", "[::2]"]))
    assert all(has_key(v, "k3y") for v in ["Bearer k3y", "bearer k3y", "BEARER k3y"])
    assert not any(has_key(v, "k3y") for v in ["Bearer k3", "Basic k3y", "k3y", "Bearerk3y"])


def test_a_lowercase_bearer_scheme_is_accepted_and_a_key_lifts_the_host_rule(served):
    """RFC 7235: the scheme is case-insensitive. With a key, any Host is served (a page cannot send the key)."""
    server, _ = served
    keyed = HarnessServer(server.engine, server.tokenizer, CONTEXT, ServeConfig(api_key="s3cret")).start()
    try:
        body = {"model": "policy", "prompt": "1+1=", "max_tokens": 2}
        assert send(keyed.port, "k1", CMPL, body, {"Authorization": "bearer s3cret"})[0] == 200
        assert send(keyed.port, "k2", CMPL, body, {"Authorization": "bearer s3cret", "Host": "gpu-box:8000"})[0] == 200
        assert send(keyed.port, "k3", CMPL, body, {"Authorization": "bearer wrong"})[0] == 401
    finally:
        keyed.stop()


class Gated(LocalEngine):
    """Holds each finished turn until ``gate`` is set; ``held`` is set once one is waiting."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate, self.held = threading.Event(), threading.Event()

    def stream(self, source, on_done, greedy=False):
        def hold(request, traj):
            self.held.set()
            self.gate.wait(30)
            on_done(request, traj)

        return super().stream(source, hold, greedy=greedy)


def test_a_turn_whose_client_went_away_is_not_trained_on(served):
    """A streamed turn ready after its client disconnected is neither recorded nor trained on (counted in
    ``undelivered``): the agent never saw it, so the reward it returns owes nothing to it."""
    server, _ = served
    engine = Gated(server.engine.model, server.tokenizer, SamplingConfig(max_new_tokens=4), seed=0)
    gated = HarnessServer(engine, server.tokenizer, CONTEXT, ServeConfig()).start()
    try:
        body = json.dumps(chat(USER, stream=True))
        with socket.create_connection(("127.0.0.1", gated.port)) as s:
            s.sendall(f"POST /episodes/gone{CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            assert engine.held.wait(30), "the turn never finished"
        time.sleep(0.3)  # the server sees the connection close
        engine.gate.set()
        deadline = time.monotonic() + 10
        while gated.stats()["harness/undelivered"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gated.stats()["harness/undelivered"] == 1
        assert gated.finish("gone", 1.0) == [], "an undelivered turn was recorded for training"
        c = openai.OpenAI(base_url=gated.base_url("there"), api_key="none", max_retries=0)
        c.chat.completions.create(model="policy", messages=[USER], stream=True).close()  # a delivered one is kept
        assert len(gated.finish("there", 1.0)) == 1
    finally:
        engine.gate.set()
        gated.stop()


def test_a_runs_endpoint_needs_the_runs_key(served):
    """Episode ids are predictable (``<task uid>.<sample index>``): a run's endpoint takes a key of its own, which
    its agents' clients carry, so no other local process can add turns to a live episode or open episodes."""
    server, _ = served
    engine = harness(server.engine.model, server.tokenizer, two_turn_agent)
    try:
        run_server = engine.server()
        assert run_server.api_key is not None
        body = {"model": "policy", "prompt": "1+1=", "max_tokens": 2}
        assert send(run_server.port, "train-0.0", CMPL, body)[0] == 401
        auth = {"Authorization": f"Bearer {run_server.api_key}"}
        assert send(run_server.port, "train-0.0", CMPL, body, auth)[0] == 200
    finally:
        engine.close()
