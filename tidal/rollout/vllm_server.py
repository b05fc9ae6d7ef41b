"""The vLLM rollout engine in server mode: a client for several OpenAI-compatible vLLM servers.

Each sample is one streamed ``POST /v1/completions`` (prompt as token ids, ``logprobs=0``,
``return_tokens_as_token_ids``), sent to the server with the fewest requests in flight (or in turn,
``segments.LoadBalancer``). Tokens and their log-probs arrive as they are sampled, so:

- **Interruption for a weight update** is done from the client (PipelineRL/AReaL style): close every
  stream (vLLM aborts a request whose client disconnected), keep what each produced, update the
  servers, and continue each sample as a new request for prompt + tokens so far (``segments.py``).
  Later tokens carry the new version.
- **Weight updates** go through a checkpoint directory: the client writes the trainer's state dict to
  ``rollout.vllm.weights_dir`` (safetensors; a filesystem the servers share) and asks each server to
  reload from it in place via vLLM's dev-mode ``POST /collective_rpc`` (``reload_weights`` with
  ``weights_path``), then ``POST /reset_prefix_cache``. ``serve_command`` gives the command line a
  server needs for that (``--logprobs-mode processed_logprobs``, and ``VLLM_SERVER_DEV_MODE=1`` in
  its environment).

Log-probs follow the server's ``--logprobs-mode``; start servers with ``processed_logprobs`` so they
match the trainer's temperature-scaled ones (``vllm_engine.py`` explains why). Stdlib HTTP only.
"""

from __future__ import annotations

import json
import queue
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tidal.api import GenRequest
from tidal.config import ConfigError
from tidal.models.tied import retie
from tidal.rollout.segments import LoadBalancer, SegmentedRow, new_row
from tidal.rollout.vllm_options import VllmOptions, read_checkpoint_dir
from tidal.types import Trajectory


def serve_command(model_dir: str | Path, port: int, host: str = "127.0.0.1", python: str = sys.executable,
                  dtype: str | None = None, extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that start a vLLM server tidal can drive, for ``subprocess.Popen``.
    ``dtype`` None: float32 on a machine without CUDA (as ``VllmOptions.dtype``), else vLLM's auto."""
    dtype = dtype or ("auto" if torch.cuda.is_available() else "float32")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", host, "--port", str(port), "--dtype", dtype, "--logprobs-mode", "processed_logprobs", *extra]
    return argv, {"VLLM_SERVER_DEV_MODE": "1"}


def _post(url: str, payload: dict | None = None, timeout: float = 600.0):
    data = json.dumps(payload or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body.strip() else None


def _get(url: str, timeout: float = 30.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_ready(base_url: str, timeout_s: float = 300.0, proc=None) -> None:
    """Poll ``/health`` until the server answers (raise if ``proc`` exits or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM server {base_url} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"vLLM server {base_url} not ready after {timeout_s:.0f}s")


def parse_completion_chunk(chunk: dict) -> tuple[list[int], list[float], str | None]:
    """(token ids, their log-probs, finish reason) of one streamed completion chunk."""
    choice = chunk["choices"][0]
    lp = choice.get("logprobs") or {}
    tokens = [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []]
    logps = [float(x) for x in lp.get("token_logprobs") or []]
    assert len(tokens) == len(logps), f"chunk has {len(tokens)} tokens and {len(logps)} log-probs"
    return tokens, logps, choice.get("finish_reason")


class VllmServerEngine:
    """``RolloutEngine`` over OpenAI-compatible vLLM servers (see module docstring)."""

    def __init__(self, servers: Sequence[str], tokenizer, cfg, seed: int = 0, version: int = 0, options=None,
                 tied: Mapping[str, str] | None = None, to_hub=None):
        """``tied``: the policy's tied names (``models/tied.py``), filled back into each state dict sent.
        ``to_hub``: an MoE policy's state dict -> the Hub's per-expert layout the servers load
        (``vllm_options.hub_layout_of``)."""
        self.options = options or VllmOptions(servers=list(servers))
        self.to_hub = to_hub
        if self.options.return_routes:  # R3 needs each token's experts, which the completions API does not carry
            raise ConfigError("trainer.moe.routing_replay=r3 with rollout.vllm.servers: vLLM's OpenAI server does not "
                             "return routed experts; use the in-process vLLM engine (no rollout.vllm.servers), "
                             "rollout.engine=local, or routing_replay=r2")
        self.tied = dict(tied or {})
        self.servers = [s.rstrip("/") for s in servers]
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.seed = seed
        self.version = version
        self.balancer = LoadBalancer(len(self.servers), self.options.load_balance)
        self.models = [_get(s + "/v1/models")["data"][0]["id"] for s in self.servers]
        self._pending: tuple[object, int] | None = None
        self._pending_lock = threading.Lock()
        self._interrupt = threading.Event()
        self._idle = threading.Condition()
        self._active = 0  # segments streaming, over all concurrent stream() calls
        self._apply_lock = threading.Lock()
        self.num_generated_tokens = 0
        self.generate_seconds = 0.0
        self.num_interruptions = 0
        self.num_weight_updates = 0
        self.weight_update_seconds = 0.0
        self.last_weight_update_s = 0.0
        self._last_weights_path: Path | None = None

    # ---- weights ---------------------------------------------------------------------------
    def request_weight_update(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Stage new weights: running streams are interrupted, the servers updated, samples resumed."""
        if version == self.version:
            return  # a version names one set of weights (the eval engine is sent the same one)
        with self._pending_lock:
            self._pending = (dict(state_dict), version)
        self._interrupt.set()

    def request_weight_update_from_dir(self, path: str | Path, version: int) -> None:
        """Stage the weights of a checkpoint directory (copied into ``weights_dir`` for the servers)."""
        with self._pending_lock:
            self._pending = (Path(path), version)
        self._interrupt.set()

    def _apply_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
            self._interrupt.clear()
        if pending is None:
            return
        payload, version = pending
        if version == self.version:
            return
        t0 = time.perf_counter()
        assert self.options.weights_dir, "server mode needs rollout.vllm.weights_dir for weight updates"
        from safetensors.torch import save_file

        # A checkpoint directory, or a state dict that sends a tied head once, is written with the head spelled
        # out (read_checkpoint_dir says why); safetensors stores each tensor once, so tensors sharing storage
        # are copied.
        state = read_checkpoint_dir(payload) if isinstance(payload, Path) else retie(payload, self.tied)
        if not isinstance(payload, Path) and self.to_hub is not None:
            state = self.to_hub(state)
        path = Path(self.options.weights_dir) / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        seen: set[int] = set()
        flat = {}
        for k, v in state.items():
            v = v.detach().cpu()
            ptr = v.untyped_storage().data_ptr()
            flat[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
            seen.add(ptr)
        save_file(flat, str(path / "model.safetensors"))
        for s in self.servers:  # vLLM's in-place reload from a directory (Worker.reload_weights)
            _post(s + "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            _post(s + "/reset_prefix_cache")
        if self._last_weights_path is not None:  # every server has moved on: keep one copy on disk
            shutil.rmtree(self._last_weights_path, ignore_errors=True)
        self._last_weights_path = path
        self.version = version
        self.num_weight_updates += 1
        self.last_weight_update_s = time.perf_counter() - t0
        self.weight_update_seconds += self.last_weight_update_s

    def stats(self) -> dict[str, float]:
        return {
            "perf/gen_tokens_per_s": self.num_generated_tokens / max(self.generate_seconds, 1e-9),
            "rollout/interruptions": float(self.num_interruptions),
            "rollout/weight_updates": float(self.num_weight_updates),
            "perf/weight_load_s": self.last_weight_update_s,
        }

    # ---- one segment over HTTP ---------------------------------------------------------------
    def _run_segment(self, row: SegmentedRow, greedy: bool) -> bool:
        """Stream one (continuation) request; returns True when the row finished, False when it was
        interrupted for a weight update (its tokens so far are kept in ``row``)."""
        i = self.balancer.acquire()
        version = self.version
        with self._idle:
            self._active += 1
        try:
            prompt, max_tokens = row.start_segment(f"srv{i}")
            body = {"model": self.models[i], "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "temperature": 0.0 if greedy else self.cfg.temperature,
                    "top_p": 1.0 if greedy else self.cfg.top_p, "logprobs": 0,
                    "return_tokens_as_token_ids": True, "skip_special_tokens": False}
            if self.cfg.stop:
                body["stop"] = list(self.cfg.stop)
            req = urllib.request.Request(self.servers[i] + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=600) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    toks, lps, reason = parse_completion_chunk(json.loads(data))
                    if row.extend(toks, lps, version, self.cfg.early_stop_run, self.cfg.early_stop_prob):
                        return True  # closing the stream aborts the request on the server
                    if reason is not None:
                        row.finish(reason)
                        return True
                    if self._interrupt.is_set():
                        return False
            row.finish("length" if row.remaining <= 0 else "stop")
            return True
        finally:
            self.balancer.release(i)
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def _apply_when_idle(self) -> None:
        """Wait until no segment streams (they stop at their next token), then update the servers."""
        with self._idle:
            self._idle.wait_for(lambda: self._active == 0)
        with self._apply_lock:
            self._apply_pending()

    # ---- the protocol ------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
        pending = list(requests)
        done: dict[int, Trajectory] = {}
        order = {id(r): i for i, r in enumerate(requests)}

        def source(n: int, block: bool) -> list[GenRequest] | None:
            if not pending:
                return None
            taken, pending[:] = pending[:n], pending[n:]
            return taken

        self.stream(source, lambda r, t: done.__setitem__(order[id(r)], t), greedy=greedy)
        return [done[i] for i in range(len(requests))]

    def stream(self, source: Callable[[int, bool], list[GenRequest] | None],
               on_done: Callable[[GenRequest, Trajectory], None], greedy: bool = False) -> None:
        """Continuous batching across servers: up to ``max_batch_size`` streams in flight; a weight
        update waits for every stream to stop at its next token, then resumes them all."""
        results: queue.Queue = queue.Queue()
        parked: list[SegmentedRow] = []
        in_flight = 0
        exhausted = False
        start = time.perf_counter()

        def run(row: SegmentedRow) -> None:
            try:
                results.put((row, self._run_segment(row, greedy), None))
            except BaseException as e:  # surfaced in the stream's thread
                results.put((row, False, e))

        with ThreadPoolExecutor(max_workers=self.cfg.max_batch_size, thread_name_prefix="tidal-vllm-http") as pool:
            while True:
                if in_flight == 0:
                    if self._interrupt.is_set():
                        self._apply_when_idle()
                    if parked:  # resume interrupted samples as continuation requests
                        self.num_interruptions += 1
                        for row in parked:
                            pool.submit(run, row)
                        in_flight, parked = len(parked), []
                free = self.cfg.max_batch_size - in_flight
                if free > 0 and not exhausted and not self._interrupt.is_set():
                    self.generate_seconds += time.perf_counter() - start
                    new = source(free, in_flight == 0)
                    start = time.perf_counter()
                    if new is None:
                        exhausted = True
                    elif new:
                        for r in new:
                            pool.submit(run, new_row(r, self.seed, self.cfg.max_new_tokens))
                        in_flight += len(new)
                if in_flight == 0:
                    if exhausted:
                        break
                    continue
                row, finished, error = results.get()
                in_flight -= 1
                if error is not None:
                    raise error
                if finished:
                    self.num_generated_tokens += len(row.tokens)
                    on_done(row.request, row.to_trajectory(self.tokenizer))
                else:
                    parked.append(row)
        self.generate_seconds += time.perf_counter() - start
