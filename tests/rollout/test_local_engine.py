import pytest

from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.types import Prompt


def _requests(tokenizer, n_prompts=6, group=4):
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=", str(4 * i)) for i in range(n_prompts)]
    return group_requests(tokenizer, prompts, group)


def test_generation_is_deterministic_and_independent_of_batch(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=10))
    reqs = _requests(tokenizer)
    a = engine.generate(reqs)
    b = engine.generate(reqs[5:11])
    c = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=10, max_batch_size=3)).generate(reqs)
    assert [t.token_ids for t in a[5:11]] == [t.token_ids for t in b]
    assert [t.token_ids for t in a] == [t.token_ids for t in c]
    assert len({tuple(t.token_ids) for t in a[:4]}) > 1, "samples of one group should differ"


def test_interrupted_generation_resumes_with_the_same_tokens(small_model, tokenizer):
    """A weight update with unchanged weights mid-generation must not change a single token."""
    reqs = _requests(tokenizer)
    plain = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)).generate(reqs)

    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12))
    same_weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    apply, calls = engine._apply_pending_update, []

    def interrupt_at_third_step():
        calls.append(1)
        if len(calls) in (3, 6):  # two interruptions, mid-sequence
            engine.request_weight_update(same_weights, version=len(calls))
        return apply()

    engine._apply_pending_update = interrupt_at_third_step
    resumed = engine.generate(reqs)
    assert engine.num_interruptions == 2
    for x, y in zip(plain, resumed):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
    long = [t for t in resumed if t.num_tokens >= 6]
    assert long and all(t.versions[0] == 0 and 3 in t.versions and t.versions[-1] == 6 for t in long)
    assert all(t.versions == sorted(t.versions) for t in resumed)


def test_interruption_with_new_weights_tags_new_version(small_model, tokenizer):
    import torch

    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12))
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    apply, calls = engine._apply_pending_update, []

    def interrupt():
        calls.append(1)
        if len(calls) == 4:  # a few tokens in
            engine.request_weight_update(new, version=7)
        return apply()

    engine._apply_pending_update = interrupt
    trajs = engine.generate(_requests(tokenizer))
    assert engine.version == 7
    assert all(v in (0, 7) for t in trajs for v in t.versions)
    assert any(len(set(t.versions)) == 2 for t in trajs)
    assert all(t.versions == sorted(t.versions) for t in trajs)


def test_stop_reasons_and_length_cap(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=5))
    for t in engine.generate(_requests(tokenizer)):
        assert t.num_tokens <= 5
        if t.finish_reason == "stop":
            assert t.token_ids[-1] == tokenizer.eos_token_id
        else:
            assert t.finish_reason == "length" and t.num_tokens == 5


def test_stop_string_ends_generation(small_model, tokenizer):
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=30, temperature=1.0))
    free = engine.generate(_requests(tokenizer))
    # pick a character that appears in some sample and use it as a stop string
    char = next(c for t in free for c in t.text if c.strip())
    stopped = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=30, stop=[char])).generate(
        _requests(tokenizer))
    hit = [t for t in stopped if char in t.text]
    assert hit and all(t.finish_reason == "stop" and t.text.endswith(char) for t in hit)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_match_a_full_forward(small_model, tokenizer, greedy):
    import torch

    from tidal.models.logprobs import token_logprobs

    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=8))
    for t in engine.generate(_requests(tokenizer, 2, 2), greedy=greedy):
        ids = torch.tensor([t.prompt_ids + t.token_ids])
        logp, _ = token_logprobs(small_model, ids, torch.ones_like(ids))
        assert torch.allclose(logp[0, len(t.prompt_ids):], torch.tensor(t.logprobs), atol=1e-4)


def test_stream_joins_new_requests_mid_flight_with_identical_tokens(small_model, tokenizer):
    """Continuous batching: requests that join a running batch get exactly their standalone tokens,
    and trajectories come out as they finish."""
    reqs = _requests(tokenizer, n_prompts=6, group=4)
    alone = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)).generate(reqs)
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12, max_batch_size=10))
    queue, got, asks = list(reqs), {}, []

    def source(n, block):
        asks.append(n)
        if not queue:
            return None
        k = min(n, 4)  # one group at a time, whenever there is room
        taken, queue[:] = queue[:k], queue[k:]
        return taken

    engine.stream(source, lambda r, t: got.__setitem__((r.prompt.uid, r.sample_index), t))
    assert len(got) == len(reqs)
    for r, t in zip(reqs, alone):
        assert got[(r.prompt.uid, r.sample_index)].token_ids == t.token_ids
    assert len(asks) > len(reqs) // 4, "new groups should have joined while others were still running"


def test_early_truncation_stops_confident_runs(small_model, tokenizer):
    """MiniMax-M1's rule: N consecutive tokens each above probability p end the sample."""
    import math

    reqs = _requests(tokenizer, n_prompts=3, group=2)
    cold = SamplingConfig(temperature=0.02, max_new_tokens=20, early_stop_run=3)  # near-greedy: p ~ 1
    trajs = LocalEngine(small_model, tokenizer, cold).generate(reqs)
    cut = [t for t in trajs if t.finish_reason == "repetition"]
    assert cut, "a near-greedy random model should produce confident runs"
    for t in cut:
        assert len(t.token_ids) < 20 and all(lp > math.log(0.99) for lp in t.logprobs[-3:])
        assert not all(lp > math.log(0.99) for lp in t.logprobs[-4:-1]) or len(t.token_ids) == 3  # first run of 3
    off = LocalEngine(small_model, tokenizer, SamplingConfig(temperature=0.02, max_new_tokens=20)).generate(reqs)
    assert all(t.finish_reason != "repetition" for t in off)


def test_per_request_length_budget(small_model, tokenizer):
    prompts = [Prompt("a", "1+2=", "3")]
    engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=9, stop=[]))
    short = engine.generate(group_requests(tokenizer, prompts, 4, max_new_tokens=3))
    default = engine.generate(group_requests(tokenizer, prompts, 4))
    assert max(len(t.token_ids) for t in short) <= 3 and any(t.finish_reason == "length" for t in short)
    assert max(len(t.token_ids) for t in default) <= 9
    assert [t.token_ids for t in short] == [t.token_ids[:3] if len(t.token_ids) >= 3 else t.token_ids for t in default]


@pytest.mark.parametrize("interrupt", [False, True])
def test_identical_rows_share_compute_not_samples(small_model, tokenizer, interrupt):
    """At a low temperature (a random model is nearly uniform, so very low) a group's samples mostly
    agree, so most rows are computed once and copied.
    Every sample must still get the tokens and log-probs it gets when each row runs on its own
    (including across a weight update, where identical rows are re-read once), and those log-probs
    must equal a full forward of the sample's own sequence."""
    import torch

    from tidal.models.logprobs import token_logprobs

    reqs = _requests(tokenizer, n_prompts=5, group=6)
    out = {}
    for share in (False, True):
        engine = LocalEngine(small_model, tokenizer,
                             SamplingConfig(max_new_tokens=10, temperature=0.05, max_batch_size=16,
                                            share_identical_rows=share))
        if interrupt:
            same = {k: v.clone() for k, v in engine.model.state_dict().items()}
            apply, calls = engine._apply_pending_update, []

            def at_fourth_call(engine=engine, apply=apply, calls=calls, same=same):
                calls.append(1)
                if len(calls) == 4:
                    engine.request_weight_update(same, version=1)
                return apply()

            engine._apply_pending_update = at_fourth_call
        out[share] = (engine.generate(reqs), engine.stats()["rollout/shared_decode_frac"], engine)
    (alone, frac_off, _), (shared, frac_on, engine) = out[False], out[True]
    assert frac_off == 0 and frac_on > 0.3, "the test needs groups whose samples agree"
    assert not interrupt or engine.num_interruptions == 1
    assert len({tuple(t.token_ids) for t in shared}) > len(reqs) // 6, "samples should still differ"
    for x, y in zip(alone, shared):
        assert x.token_ids == y.token_ids and x.versions == y.versions
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
        ids = torch.tensor([y.prompt_ids + y.token_ids])
        logp, _ = token_logprobs(small_model, ids, torch.ones_like(ids), temperature=0.05)
        assert torch.allclose(logp[0, len(y.prompt_ids):], torch.tensor(y.logprobs), atol=1e-4)


def test_generation_config_end_of_turn_ids_stop_a_row(small_model, tokenizer):
    """A chat model whose turn ends with a token other than the tokenizer's EOS (Gemma's <end_of_turn>) lists it
    in its generation config: the engine stops there too."""
    import copy

    plain = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=12)).generate(_requests(tokenizer, 2, 2))
    long = next(t for t in plain if len(t.token_ids) >= 4 and tokenizer.eos_token_id not in t.token_ids[:3])
    stop = long.token_ids[2]
    model = copy.deepcopy(small_model)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    again = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=12)).generate(_requests(tokenizer, 2, 2))
    for x, y in zip(plain, again):
        cut = next((i for i, t in enumerate(x.token_ids) if t == stop), None)
        assert y.token_ids == (x.token_ids if cut is None else x.token_ids[: cut + 1])
        assert y.finish_reason == ("stop" if cut is not None else x.finish_reason)


def test_engine_counts_decode_steps_removals_and_recordings(small_model, tokenizer):
    """The engine's counters (issue 51) in ``stats``: every decode step timed, every finished row removed once,
    and with static decode the recorded buckets (recorded only on CUDA: 0 here)."""
    requests = group_requests(tokenizer, [Prompt(f"p{i}", f"{i}+{i}=", "") for i in range(3)], 2)
    for graphs in ("off", "on"):
        engine = LocalEngine(small_model, tokenizer, SamplingConfig(max_new_tokens=5, cuda_graphs=graphs))
        out = engine.generate(requests)
        stats = engine.stats()
        longest = max(len(t.token_ids) for t in out)
        assert stats["rollout/decode_steps"] >= longest  # each step samples one token per row
        assert stats["rollout/decode_step_host_ms"] > 0
        assert stats["rollout/removed_rows"] == len(requests)
        assert stats["rollout/graph_recordings"] == 0 and stats["rollout/graph_record_s"] == 0.0
