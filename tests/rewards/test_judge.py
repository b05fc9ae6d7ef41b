"""The judge against a local imitation of an OpenAI-compatible server (``http.server`` in a thread).

The first path segment picks the server's behaviour: ``/ok/v1``, ``/flaky/v1`` (500 once, then
OK), ``/down/v1`` (always 503), ``/slow/v1`` (answers after 1 s), ``/garbage/v1`` (no score),
``/notjson/v1``, ``/shape/v1`` (JSON without choices), ``/big/v1`` (score 15 of 10), ``/auth/v1``
(401 without the right key), ``/length/v1`` (score = words in the message, a judge biased to length).
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.rewards.judge import parse_score
from tidal.rewards.monitor import reward_metrics
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.types import Prompt

P = Prompt("u", "What is 2+3?", "5")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def _reply(self, status, payload):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client timed out and hung up (the slow server)
            pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.path.split("/")[1]
        self.server.requests.append((self.path, self.headers.get("Authorization"), body))
        calls = self.server.calls[mode] = self.server.calls.get(mode, 0) + 1
        content = "The response is correct.\nScore: 8"
        if mode == "flaky" and calls == 1 or mode == "down":
            return self._reply(500 if mode == "flaky" else 503, {"error": "overloaded"})
        if mode == "slow":
            time.sleep(1.0)
        if mode == "notjson":
            return self._reply(200, b"<html>oops</html>")
        if mode == "shape":
            return self._reply(200, {"object": "error"})
        if mode == "auth" and self.headers.get("Authorization") != "Bearer sekrit":
            return self._reply(401, {"error": "unauthorized"})
        if mode == "garbage":
            content = "What a lovely answer!!!"
        elif mode == "big":
            content = "Score: 15"
        elif mode == "length":
            content = f"Score: {min(10, len(body['messages'][-1]['content'].split()))}"
        self._reply(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
            },
        )


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.requests, srv.calls = [], {}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def judge(server, mode, **params):
    base = f"http://127.0.0.1:{server.server_address[1]}/{mode}/v1"
    return build_reward("judge", {"model": "judge", "base_url": base, "backoff_s": 0.01, **params})


def test_parse_score():
    pattern = r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
    assert parse_score("Score: 7", pattern, 10) == (0.7, "ok")
    assert parse_score("score = 3 ... final **Score:** 9.5", pattern, 10) == (0.95, "ok")  # the last one counts
    assert parse_score("SCORE: 10", pattern, 10) == (1.0, "ok")
    assert parse_score("no verdict", pattern, 10) == (None, "no score in the judge output")
    assert parse_score("Score: -1", pattern, 10) == (None, "score -1 outside [0, 10]")


def test_ok_request_shape_and_score(server):
    reward, details = judge(server, "ok")("<think>long musing</think> It is 5.", P)
    assert reward == pytest.approx(0.8) and details["reason"] == "ok" and details["attempts"] == 1
    assert "error" not in details and details["judge_output"].endswith("Score: 8")
    path, auth, body = server.requests[-1]
    assert path == "/ok/v1/chat/completions" and auth is None
    assert body["model"] == "judge" and body["temperature"] == 0.0 and body["max_tokens"] == 512
    user = body["messages"][-1]
    assert user["role"] == "user" and "What is 2+3?" in user["content"] and "It is 5." in user["content"]
    assert "long musing" not in user["content"]  # strip_think: the judge sees the answer only


def test_flaky_server_is_retried(server):
    reward, details = judge(server, "flaky")("5", P)
    assert reward == pytest.approx(0.8) and details["attempts"] == 2


def test_persistent_5xx_gives_up_with_reason(server):
    reward, details = judge(server, "down", max_retries=2)("5", P)
    assert reward == 0.0 and details["attempts"] == 3
    assert details["error"] == details["reason"] == "HTTP 503 Service Unavailable"


def test_slow_server_times_out(server):
    start = time.monotonic()
    reward, details = judge(server, "slow", timeout_s=0.2)("5", P)
    assert time.monotonic() - start < 0.9  # timeouts are not retried
    assert reward == 0.0 and details["reason"] == "timeout after 0.2s" and "error" in details


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("garbage", "no score in the judge output"),
        ("big", "score 15 outside [0, 10]"),
        ("notjson", "reply is not JSON"),
        ("shape", "unexpected reply shape"),
    ],
)
def test_garbage_output_scores_zero_with_reason(server, mode, reason):
    reward, details = judge(server, mode)("5", P)
    assert reward == 0.0 and details["reason"].startswith(reason) and "error" in details


def test_connection_refused_is_retried_then_reported():
    fn = build_reward("judge", {"model": "m", "base_url": "http://127.0.0.1:9/v1", "backoff_s": 0.01})
    reward, details = fn("5", P)
    assert reward == 0.0 and details["attempts"] == 3 and details["reason"].startswith("connection failed")


def test_api_key_comes_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    fn = judge(server, "auth", api_key_env="JUDGE_KEY")
    assert "sekrit" not in repr(fn)  # the config holds the variable's name, never the key
    assert fn("5", P)[0] == pytest.approx(0.8)
    assert server.requests[-1][1] == "Bearer sekrit"
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(ConfigError, match="JUDGE_KEY"):
        judge(server, "auth", api_key_env="JUDGE_KEY")


def test_custom_rubric_and_bad_templates(server):
    fn = judge(server, "ok", rubric="Q={question} A={response} ref={reference} {{json}}", system="Be fair.")
    assert fn("five", P)[0] == pytest.approx(0.8)
    messages = server.requests[-1][2]["messages"]
    assert messages == [
        {"role": "system", "content": "Be fair."},
        {"role": "user", "content": "Q=What is 2+3? A=five ref=5 {json}"},
    ]
    with pytest.raises(ConfigError, match="rubric"):
        judge(server, "ok", rubric="{answer}")
    with pytest.raises(ConfigError, match="model"):
        build_reward("judge", {})


def test_length_biased_judge_shows_up_in_the_monitor(server):
    """A judge that prefers long answers, used inside compose, gives reward/judge/length_corr ~ 1."""
    length_judge = {
        "model": "judge",
        "base_url": f"http://127.0.0.1:{server.server_address[1]}/length/v1",
        "rubric": "{response}",
    }
    fn = build_reward(
        "compose",
        {
            "terms": [
                {"reward": "judge", "weight": 0.5, "params": length_judge},
                {"reward": "exact_match", "weight": 0.5},
            ]
        },
    )
    responses = [" ".join(["five"] * n) for n in (1, 2, 4, 6, 9)]
    pool = RewardPool(fn, RewardConfig(num_workers=0))
    scored = pool.score([(r, P) for r in responses])
    assert [d["components"]["judge"] for _, d in scored] == pytest.approx([0.1, 0.2, 0.4, 0.6, 0.9])
    lengths = [len(r.split()) for r in responses]
    metrics = reward_metrics([r for r, _ in scored], [d for _, d in scored], lengths)
    assert metrics["reward/judge/length_corr"] == pytest.approx(1.0)
    assert metrics["reward/judge/mean"] == pytest.approx(0.44)
    assert pool.num_errors == 0
