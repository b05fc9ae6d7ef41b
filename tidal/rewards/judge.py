"""LLM judge: a generative reward model behind an OpenAI-compatible chat endpoint scores responses.

For tasks without a verifier (open-ended answers, proofs, writing) a judge model reads a rubric,
the question, the reference answer (if any) and the response, and writes a verdict ending in
``Score: X``; the last such score, divided by ``score_max``, is the reward in [0, 1]. In practice
the endpoint is a local vLLM server (``vllm serve MODEL --served-model-name judge``).

HTTP contract: ``POST {base_url}/chat/completions`` with JSON ``{"model", "messages": [system?,
{"role": "user", "content": rubric}], "temperature", "max_tokens"}``; the verdict is read from
``choices[0].message.content``. ``Authorization: Bearer $KEY`` is sent when ``api_key_env`` names
an environment variable (the key itself never enters a config). Only the standard library is used.

Failure handling (every failure scores 0, with ``details["error"]`` so the pool counts it and
``details["reason"]`` saying why): HTTP 429/5xx and connection errors are retried ``max_retries``
times with exponential backoff (``backoff_s``, 2x, 4x ...); other HTTP errors are not; a socket
operation slower than ``timeout_s`` is a timeout, not retried (a slow judge stays slow, and the
reward pool's per-item limit must cover the worst case: set ``reward.timeout_s`` above
``timeout_s * (max_retries + 1)`` plus backoff); a reply without a parseable score in
``[0, score_max]`` is a parse failure.

Length bias: MiniMax-M1 (arXiv 2506.13585, sec. 4.2) found that generative rewards drift toward
preferring longer answers, which the policy then exploits. The default rubric tells the judge not
to reward length, and the judge sees only the answer after ``</think>`` (``strip_think``); used
inside ``compose`` its score is logged as ``reward/<name>/length_corr`` every step
(``tidal.rewards.monitor``) so the drift is visible.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError
from tidal.rewards import REWARDS
from tidal.types import Prompt

DEFAULT_RUBRIC = """You are grading a response to a question.

Question:
{question}

Reference answer (may be empty):
{reference}

Response to grade:
{response}

Grade the response for correctness first, then completeness and clarity. Length is not a merit: a \
short correct response deserves the same score as a long one. Explain briefly, then end with a \
line "Score: X" where X is an integer from 0 (wrong or worthless) to 10 (fully correct)."""

DEFAULT_SCORE_PATTERN = r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class _Timeout(Exception):
    pass


def _is_timeout(e: BaseException) -> bool:
    reason = getattr(e, "reason", None)
    return isinstance(e, (TimeoutError, socket.timeout)) or isinstance(reason, (TimeoutError, socket.timeout))


def post_json(url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """POST ``body`` as JSON and decode the JSON reply; raises urllib errors or ``_Timeout``."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError) as e:
        if _is_timeout(e):
            raise _Timeout(str(e)) from e
        raise


def parse_score(text: str, pattern: str, score_max: float) -> tuple[float | None, str]:
    """``(normalized score, reason)`` from the judge's text: the last match of ``pattern``,
    divided by ``score_max``; score None when there is none or it lies outside [0, score_max]."""
    matches = re.findall(pattern, text, flags=re.I)
    if not matches:
        return None, "no score in the judge output"
    raw = float(matches[-1])
    if not 0 <= raw <= score_max:
        return None, f"score {raw:g} outside [0, {score_max:g}]"
    return raw / score_max, "ok"


@dataclass
class JudgeReward:
    """``judge``: an LLM judge's score in [0, 1] (see the module docstring)."""

    model: str
    """The served model name the endpoint expects (vLLM: ``--served-model-name``)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible API root; ``/chat/completions`` is appended."""
    rubric: str = DEFAULT_RUBRIC
    """User-message template with ``{question}``, ``{reference}`` and ``{response}``; write other
    literal braces doubled (``{{``), as in ``str.format``."""
    system: str | None = None
    """Optional system message."""
    score_pattern: str = DEFAULT_SCORE_PATTERN
    """Regex whose first group is the score; the last match in the judge's output counts."""
    score_max: float = 10.0
    """The rubric's top score; the reward is score / score_max."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (sent as a Bearer token)."""
    timeout_s: float = 60.0
    """Per socket operation (connect, each read) of one attempt."""
    max_retries: int = 2
    """Further attempts after an HTTP 429/5xx or connection error."""
    backoff_s: float = 1.0
    """Sleep before retry k (k = 0, 1, ...): backoff_s * 2**k."""
    temperature: float = 0.0
    """Greedy judging: the same response gets the same score."""
    max_tokens: int = 512
    """Room for a short explanation before the score."""
    strip_think: bool = True
    """Send the judge only the text after ``</think>`` (the answer, not the reasoning)."""

    def __post_init__(self) -> None:
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ConfigError(f"judge: environment variable {self.api_key_env!r} (api_key_env) is not set")
        if self.score_max <= 0 or self.max_retries < 0 or self.timeout_s <= 0:
            raise ConfigError("judge: need score_max > 0, max_retries >= 0 and timeout_s > 0")
        try:
            self.rubric.format(question="", reference="", response="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"judge: rubric is not a valid template ({type(e).__name__}: {e})") from None

    def messages(self, response: str, prompt: Prompt) -> list[dict[str, str]]:
        if self.strip_think and "</think>" in response:
            response = response.rsplit("</think>", 1)[1].strip()
        user = self.rubric.format(question=prompt.text, reference=prompt.answer, response=response)
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": user}
        ]

    def __call__(self, response: str, prompt: Prompt) -> tuple[float, dict[str, Any]]:
        body = {
            "model": self.model,
            "messages": self.messages(response, prompt),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        headers = {"Authorization": f"Bearer {os.environ[self.api_key_env]}"} if self.api_key_env else {}
        url = self.base_url.rstrip("/") + "/chat/completions"
        details: dict[str, Any] = {"attempts": 0}

        def fail(reason: str) -> tuple[float, dict[str, Any]]:
            return 0.0, {**details, "error": reason, "reason": reason}

        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            details["attempts"] = attempt + 1
            try:
                reply = post_json(url, body, headers, self.timeout_s)
                break
            except _Timeout:
                return fail(f"timeout after {self.timeout_s:g}s")
            except urllib.error.HTTPError as e:
                if e.code not in RETRY_STATUS or attempt == self.max_retries:
                    return fail(f"HTTP {e.code} {e.reason}")
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                if attempt == self.max_retries:
                    return fail(f"connection failed: {getattr(e, 'reason', e)}")
            except ValueError as e:  # the body was not JSON
                return fail(f"reply is not JSON: {e}")
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            return fail(f"unexpected reply shape: {str(reply)[:200]}")
        details["judge_output"] = text[-1000:]
        score, reason = parse_score(text, self.score_pattern, self.score_max)
        if score is None:
            return fail(reason)
        return score, {**details, "reason": reason}


REWARDS.register("judge")(JudgeReward)
