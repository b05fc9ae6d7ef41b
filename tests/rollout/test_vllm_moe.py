"""The vLLM engine with a mixture-of-experts model (issue 52), on a fake ``vllm`` module (vLLM is not installed
here): it asks for routed experts (``enable_return_routed_experts``) when ``return_routes`` is set and fills
``Trajectory.routes`` from ``CompletionOutput.routed_experts``; a vLLM without that argument is one line naming
its version; the servers refuse; weight updates reach vLLM in the Hub's per-expert layout.

The fake engine follows vLLM's contract (``vllm/outputs.py``, ``v1/core/sched/scheduler.py``): one token per
step and request, ``routed_experts`` only on the finishing output, int32 [prompt + output - 1, num_hidden_layers,
k] (the last sampled token is never fed), every decoder layer."""

from __future__ import annotations

import dataclasses
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tidal.config import ConfigError
from tidal.models import tiny
from tidal.models.moe import NO_ROUTE
from tidal.rollout.local import SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.vllm_engine import VllmDriver, VllmEngine, driver_for
from tidal.rollout.vllm_options import VllmOptions, moe_layer_indices, routes_of
from tidal.types import Prompt

NUM_NEW = 5  # tokens the fake samples per request (unless max_tokens is smaller)


def fake_route(position: int, layer: int, k: int, num_experts: int = 4) -> int:
    """The expert the fake routes token ``position`` of a sequence to, at ``layer``, choice ``k``."""
    return (position + 2 * layer + k) % num_experts


class FakeEngine:
    """``LLM.llm_engine``: add_request / step / abort_request, as ``VllmDriver`` drives it."""

    def __init__(self, num_layers: int, top_k: int, routes: bool):
        self.requests, self.aborted = {}, []
        self.num_layers, self.top_k, self.routes = num_layers, top_k, routes

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), params, [])

    def abort_request(self, ids):
        for i in ids:
            self.aborted.append(i)
            self.requests.pop(i, None)

    def step(self):
        outputs = []
        for rid, (prompt, params, out) in list(self.requests.items()):
            out.append(3 + (len(prompt) + len(out)) % 7)
            done = len(out) >= min(NUM_NEW, params["max_tokens"])
            routed = None
            if done and self.routes:
                fed = len(prompt) + len(out) - 1
                routed = np.array([[[fake_route(p, layer, j) for j in range(self.top_k)]
                                    for layer in range(self.num_layers)] for p in range(fed)], dtype=np.int32)
            comp = SimpleNamespace(token_ids=list(out), logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in out],
                                   finish_reason="length" if done else None, routed_experts=routed)
            outputs.append(SimpleNamespace(request_id=rid, outputs=[comp], finished=done))
            if done:
                del self.requests[rid]
        return outputs


def fake_vllm(with_routes: bool = True, version: str = "0.99.0", num_layers: int = 2, top_k: int = 2):
    """A ``vllm`` module: ``LLM`` records its engine arguments, ``EngineArgs`` has ``enable_return_routed_experts``
    only when ``with_routes``."""
    fields = [("model", str, "")] + ([("enable_return_routed_experts", bool, False)] if with_routes else [])
    module = types.ModuleType("vllm")
    module.__version__ = version
    module.EngineArgs = dataclasses.make_dataclass("EngineArgs", fields)
    module.SamplingParams = dict
    module.made = []

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            self.llm_engine = FakeEngine(num_layers, top_k, kwargs.get("enable_return_routed_experts", False))
            self.loaded = []
            module.made.append(self)

        def collective_rpc(self, method, kwargs):
            self.loaded.append(dict(kwargs["weights_iterator"]))

        def reset_prefix_cache(self):
            pass

    module.LLM = LLM
    return module


@pytest.fixture
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture
def moe(tokenizer):
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4,
                           expert_intermediate_size=16)
    return tiny.build_model(cfg, tokenizer).eval()


@pytest.fixture
def moe_dir(moe, tokenizer, tmp_path):
    tiny.save(moe, tokenizer, tmp_path / "moe")
    return tmp_path / "moe"


def _use(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "vllm", module)


def _generate(driver, tokenizer, n=3, **cfg):
    engine = VllmEngine(driver, tokenizer, SamplingConfig(max_new_tokens=8, max_batch_size=8, **cfg))
    prompts = [Prompt(f"q{i}", f"{i}+{i}=", "0") for i in range(n)]
    return engine.generate(group_requests(tokenizer, prompts, 1))


def test_routes_fill_every_fed_token_and_no_route_for_the_last(monkeypatch, moe, moe_dir, tokenizer):
    vllm = fake_vllm()
    _use(monkeypatch, vllm)
    driver = VllmDriver(moe_dir, SamplingConfig(max_batch_size=8), options=VllmOptions(return_routes=True),
                        moe_layers=[0, 1])
    assert vllm.made[0].kwargs["enable_return_routed_experts"] is True
    trajs = _generate(driver, tokenizer)
    assert trajs and all(t.num_tokens == NUM_NEW for t in trajs)
    for t in trajs:
        n = len(t.prompt_ids) + t.num_tokens
        assert t.routes.dtype == torch.uint8 and t.routes.shape == (n, 2, 2)
        want = torch.tensor([[[fake_route(p, layer, j) for j in range(2)] for layer in range(2)] for p in range(n - 1)])
        assert torch.equal(t.routes[:-1].long(), want)
        assert (t.routes[-1] == NO_ROUTE).all()  # the last sampled token was never fed
    assert driver.stats()["rollout/missing_routes"] == 0.0


def test_without_return_routes_nothing_is_asked_or_filled(monkeypatch, moe_dir, tokenizer):
    vllm = fake_vllm()
    _use(monkeypatch, vllm)
    driver = VllmDriver(moe_dir, SamplingConfig(max_batch_size=8), options=VllmOptions())
    assert "enable_return_routed_experts" not in vllm.made[0].kwargs
    assert all(t.routes is None for t in _generate(driver, tokenizer))
    assert "rollout/missing_routes" not in driver.stats()


def test_a_vllm_without_routed_experts_is_one_line_naming_its_version(monkeypatch, moe_dir):
    _use(monkeypatch, fake_vllm(with_routes=False, version="0.8.5"))
    with pytest.raises(ConfigError) as e:  # a ValueError: ``tidal train`` prints it as one ``error:`` line
        VllmDriver(moe_dir, SamplingConfig(), options=VllmOptions(return_routes=True))
    message = str(e.value)
    assert "\n" not in message and "0.8.5" in message and "enable_return_routed_experts" in message
    assert "trainer.moe.routing_replay=r3" in message


def test_the_servers_refuse_return_routes():
    from tidal.rollout.vllm_server import VllmServerEngine

    with pytest.raises(ConfigError, match="OpenAI server does not return routed experts"):
        VllmServerEngine(["http://127.0.0.1:1"], None, SamplingConfig(),
                         options=VllmOptions(servers=["http://127.0.0.1:1"], return_routes=True))


def test_driver_for_picks_the_moe_layers_and_sends_hub_layout_weights(monkeypatch, moe, tokenizer):
    """Through ``driver_for`` (as the run builds it): the router layers of the trainer's model select vLLM's layer
    columns, and a trainer state dict (experts fused) reaches vLLM under the Hub's per-expert names."""
    vllm = fake_vllm(num_layers=2)
    _use(monkeypatch, vllm)
    driver = driver_for(moe, tokenizer, SamplingConfig(max_batch_size=8), seed=0, version=0,
                        options=VllmOptions(return_routes=True))
    assert driver.moe_layers == [0, 1] and driver.routes_shape == (2, 2)
    driver.request_weight_update(moe.state_dict(), version=1)
    trajs = _generate(driver, tokenizer)
    assert all(t.versions == [1] * t.num_tokens for t in trajs)
    sent = vllm.made[0].loaded[0]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in sent
    assert "model.layers.0.mlp.experts.gate_up_proj" not in sent
    torch.testing.assert_close(sent["model.layers.1.mlp.experts.2.down_proj.weight"],
                               moe.model.layers[1].mlp.experts.down_proj[2], rtol=0, atol=0)


def test_routes_of_selects_moe_layers_and_fills_missing_rows():
    """A model whose layer 0 is dense: vLLM reports 3 layers (zeros for layer 0), the routes keep layers 1 and 2;
    an aborted request (no routed_experts) is all NO_ROUTE."""
    got = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2) % 8
    routes = routes_of(got, 5, [1, 2], (2, 2))
    assert routes.shape == (5, 2, 2) and torch.equal(routes[:4].long(), torch.as_tensor(got[:, 1:]).long())
    assert (routes[4] == NO_ROUTE).all()
    assert (routes_of(None, 3, [1, 2], (2, 2)) == NO_ROUTE).all()
    with pytest.raises(AssertionError, match="routed experts are"):
        routes_of(got, 5, None, (2, 2))


def test_moe_layer_indices_of_dense_and_moe_models(moe, tokenizer):
    assert moe_layer_indices(moe) == [0, 1]
    dense = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    assert moe_layer_indices(tiny.build_model(dense, tokenizer)) is None


def test_an_interrupted_sample_takes_its_last_segments_routes(monkeypatch, moe_dir, tokenizer):
    """A weight update mid-generation: the continuation re-reads prompt + tokens so far, and its routes (every
    fed token) become the sample's."""
    vllm = fake_vllm()
    _use(monkeypatch, vllm)
    driver = VllmDriver(moe_dir, SamplingConfig(max_batch_size=8), options=VllmOptions(return_routes=True),
                        moe_layers=[0, 1])
    step, calls = driver.step, []

    def update_after_two_steps():
        calls.append(1)
        if len(calls) == 3:
            driver.request_weight_update_from_dir(moe_dir, version=7)
        step()

    driver.step = update_after_two_steps
    trajs = _generate(driver, tokenizer, n=2, temperature=1.0)
    assert driver.num_interruptions == 1
    for t in trajs:
        assert set(t.versions) == {0, 7} and t.num_tokens == 2 + NUM_NEW
        n = len(t.prompt_ids) + t.num_tokens
        assert t.routes.shape == (n, 2, 2) and (t.routes[:-1] != NO_ROUTE).all() and (t.routes[-1] == NO_ROUTE).all()


def test_an_early_truncated_sample_has_no_routes_and_is_counted(monkeypatch, moe_dir, tokenizer):
    """MiniMax-M1's early truncation aborts the request: vLLM returns no routes for it."""
    _use(monkeypatch, fake_vllm())
    driver = VllmDriver(moe_dir, SamplingConfig(max_batch_size=8), options=VllmOptions(return_routes=True),
                        moe_layers=[0, 1])
    trajs = _generate(driver, tokenizer, n=2, early_stop_run=2, early_stop_prob=0.5)
    assert all(t.finish_reason == "repetition" and t.num_tokens == 2 for t in trajs)
    assert all((t.routes == NO_ROUTE).all() and len(t.routes) == len(t.prompt_ids) + 2 for t in trajs)
    assert driver.stats()["rollout/missing_routes"] == 2.0


def test_the_servers_get_an_moe_update_in_hub_layout(monkeypatch, moe, tokenizer, tmp_path):
    """Server mode writes each update for the servers to reload from: under the Hub's per-expert names."""
    from safetensors.torch import load_file

    from tidal.rollout import vllm_server
    from tidal.rollout.vllm import build_engine

    monkeypatch.setattr(vllm_server, "_get", lambda url: {"data": [{"id": "m"}]})
    posted = []
    monkeypatch.setattr(vllm_server, "_post", lambda url, body=None: posted.append(url))
    cfg = SamplingConfig()
    cfg.vllm = VllmOptions(servers=["http://127.0.0.1:1"], weights_dir=str(tmp_path / "w"))
    engine = build_engine(moe, tokenizer, cfg)
    engine.request_weight_update(moe.state_dict(), version=1)
    engine._apply_pending()
    written = load_file(tmp_path / "w" / "v1" / "model.safetensors")
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in written
    assert not any(k.endswith("experts.gate_up_proj") for k in written)
    assert engine.version == 1 and any(u.endswith("/collective_rpc") for u in posted)


def test_return_routes_on_a_dense_model_asks_nothing(monkeypatch, tokenizer, tmp_path):
    """``trainer.moe.*`` is ignored for dense models: so is ``return_routes`` (no routes, no vLLM check)."""
    vllm = fake_vllm(with_routes=False)
    _use(monkeypatch, vllm)
    dense = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                              intermediate_size=64), tokenizer)
    tiny.save(dense, tokenizer, tmp_path / "dense")
    driver = VllmDriver(tmp_path / "dense", SamplingConfig(max_batch_size=8), options=VllmOptions(return_routes=True))
    assert "enable_return_routed_experts" not in vllm.made[0].kwargs and driver.to_hub is None
    assert all(t.routes is None for t in _generate(driver, tokenizer))
