"""Speculative decoding in the local engine: drafts change the speed, never a token, log-prob or version."""

import copy

import pytest
import torch

from tidal.api import GenRequest
from tidal.config import ConfigError
from tidal.models import tiny
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.rollout.slots import SlotCache
from tidal.rollout.speculative import NgramIndex, SharedNgrams, SpeculativeConfig, acceptance_entropy_correlation
from tidal.rollout.thinking import ThinkingConfig, close_ids, with_budgets
from tidal.types import Prompt

NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1)


@pytest.fixture(scope="module")
def peaked(small_model):
    """The small random model with sharper output distributions (final norm x6): at temperature 1 its
    samples repeat often enough that about half the prompt-lookup drafts match, and some end in EOS."""
    model = copy.deepcopy(small_model)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    return model


def _requests(tokenizer, n_prompts=4, group=3):
    prompts = [Prompt(f"p{i}", f"{i}+{3 * i}=", str(4 * i)) for i in range(n_prompts)]
    return group_requests(tokenizer, prompts, group)


def _same(plain, spec):
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids, (a.text, b.text)
        assert a.versions == b.versions and a.finish_reason == b.finish_reason and a.loss_mask == b.loss_mask
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5


def _pair(model, tokenizer, reqs, spec=NGRAM, **kw):
    plain = LocalEngine(model, tokenizer, SamplingConfig(**kw)).generate(reqs)
    engine = LocalEngine(model, tokenizer, SamplingConfig(speculative=spec, **kw))
    return plain, engine.generate(reqs), engine


# ---- prompt lookup ---------------------------------------------------------------------------------
def test_ngram_index_proposes_what_followed_the_latest_match():
    idx = NgramIndex([1, 2, 3, 9, 1, 2, 3], range(1, 4))
    assert idx.propose(5) == [9, 1, 2, 3, 9]  # (1,2,3) ended at 3; past the context it continues itself
    idx = NgramIndex([1, 2, 7, 1, 2, 8, 1, 2], range(2, 3))
    assert idx.propose(2) == [8, 1]  # the latest earlier (1,2), not the first
    idx.extend([4])
    assert idx.propose(3) == []  # (2,4) never occurred before
    idx = NgramIndex([5, 6, 5, 6], range(2, 3))
    assert idx.propose(4) == [5, 6, 5, 6]
    assert NgramIndex([3], range(1, 2)).propose(2) == []  # nothing before the suffix


# ---- identity with plain decoding ------------------------------------------------------------------
@pytest.mark.parametrize("temperature,share", [(1.0, True), (1.0, False), (0.0, True)])
def test_samples_logprobs_versions_identical(peaked, tokenizer, temperature, share):
    reqs = _requests(tokenizer)
    plain, spec, engine = _pair(peaked, tokenizer, reqs, max_new_tokens=21, temperature=temperature,
                                share_identical_rows=share)
    _same(plain, spec)
    acc = engine._spec.num_accepted / engine._spec.num_drafted
    assert 0.2 < acc < 1.0 or temperature == 0.0, f"drafts should be both accepted and rejected, acceptance {acc}"
    assert engine._spec.num_accepted > 20
    if temperature:
        assert {t.finish_reason for t in spec} == {"stop", "length"}  # EOS and the cap both land mid-draft
    stats = engine.stats()
    assert stats["rollout/spec_acceptance"] == pytest.approx(acc)
    assert stats["rollout/spec_tokens_per_forward"] > 1.0
    assert engine.stats()["rollout/spec_drafted_tokens"] == 0.0  # a window per read: nothing drafted since


def test_stop_strings_and_per_request_lengths_mid_draft(peaked, tokenizer):
    reqs = [GenRequest(r.prompt, r.prompt_ids, r.sample_index, max_new_tokens=3 + i % 7)
            for i, r in enumerate(_requests(tokenizer))]
    plain, spec, _ = _pair(peaked, tokenizer, reqs, max_new_tokens=20, stop=["44", ">>", "::"])
    _same(plain, spec)
    assert {t.finish_reason for t in spec} >= {"stop", "length"}


def test_early_truncation_runs_count_accepted_drafts(peaked, tokenizer):
    plain, spec, _ = _pair(peaked, tokenizer, _requests(tokenizer), max_new_tokens=24, early_stop_run=4,
                           early_stop_prob=0.5)
    _same(plain, spec)
    assert "repetition" in {t.finish_reason for t in spec}


def test_thinking_budget_forcing_is_unchanged(peaked, tokenizer):
    close = close_ids(tokenizer, ThinkingConfig())
    reqs = with_budgets(_requests(tokenizer), lambda p: 5 + len(p.uid), close)
    plain, spec, engine = _pair(peaked, tokenizer, reqs, max_new_tokens=24)
    _same(plain, spec)
    assert sum(t.loss_mask is not None for t in spec) >= 6 and engine._spec.num_accepted > 0


def test_inflight_weight_update_keeps_versions_and_tokens(peaked, tokenizer):
    """New weights arrive mid-generation: each row switches where speculation happened to be, so each row is
    checked against a plain single-row run whose update lands at that row's switch position."""
    new = {k: v + 0.05 * torch.randn_like(v, generator=torch.Generator().manual_seed(1))
           for k, v in peaked.state_dict().items()}
    reqs = _requests(tokenizer, n_prompts=2)
    engine = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=20, speculative=NGRAM))
    apply, calls = engine._apply_pending_update, []

    def interrupt():
        calls.append(1)
        if len(calls) == 4:
            engine.request_weight_update(new, version=7)
        return apply()

    engine._apply_pending_update = interrupt
    spec = engine.generate(reqs)
    assert engine.num_interruptions == 1
    switched = 0
    for req, s in zip(reqs, spec):
        at = s.versions.index(7) if 7 in s.versions else None
        switched += at is not None and at > 0
        ref = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=20))
        if at is not None:
            n_tokens, apply_ref, append = [0], ref._apply_pending_update, ref._append

            def count(row, tok, lp, append=append, n_tokens=n_tokens):
                n_tokens[0] += 1
                return append(row, tok, lp)

            def update_at(apply_ref=apply_ref, ref=ref, at=at, n_tokens=n_tokens):
                if n_tokens[0] == at and ref.version == 0:
                    ref.request_weight_update(new, version=7)
                return apply_ref()

            ref._append, ref._apply_pending_update = count, update_at
        _same(ref.generate([req]), [s])
    assert switched >= 3, "the update should land mid-row for several rows"


def test_turn_kv_kept_across_an_episode(peaked, tokenizer):
    """Multi-turn: the kept keys and values of a finished turn (rolled-back drafts excluded) extend into the
    next turn exactly as without speculation."""
    first = [GenRequest(r.prompt, r.prompt_ids, r.sample_index, max_new_tokens=7, episode=True)
             for r in _requests(tokenizer, n_prompts=2, group=2)]
    obs = tuple(tokenizer("=5;", add_special_tokens=False).input_ids)
    runs = []
    for spec in (SpeculativeConfig(), NGRAM):
        engine = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=7, speculative=spec))
        one = engine.generate(first)
        second = [GenRequest(r.prompt, (*r.prompt_ids, *t.token_ids, *obs), r.sample_index, max_new_tokens=9,
                             turn=1, episode=True) for r, t in zip(first, one)]
        runs.append((one + engine.generate(second), engine))
    (plain, e_plain), (spec, e_spec) = runs
    _same(plain, spec)
    assert e_spec.num_reused_tokens == e_plain.num_reused_tokens > 0


def test_draft_model_drafts_and_target_as_its_own_draft(peaked, small_model, tokenizer):
    reqs = _requests(tokenizer)
    draft = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                              intermediate_size=64), tokenizer)
    spec = SpeculativeConfig(method="draft_model", draft_model="unused: passed as a model")
    plain = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=16)).generate(reqs)
    small = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=16, speculative=spec), draft_model=draft)
    _same(plain, small.generate(reqs))
    # greedy, the target drafting for itself: every draft is the target's own argmax, so all are accepted
    plain0 = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=16, temperature=0.0)).generate(reqs)
    itself = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=16, temperature=0.0, speculative=spec),
                         draft_model=copy.deepcopy(peaked))
    _same(plain0, itself.generate(reqs))
    assert itself._spec.num_drafted > 0 and itself._spec.num_accepted == itself._spec.num_drafted


# ---- config and metrics ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec,match", [
    (SpeculativeConfig(method="eagle"), "rollout.speculative.method='eagle'"),
    (SpeculativeConfig(method="mtp"), "no multi-token-prediction heads"),
    (SpeculativeConfig(method="ngram", num_draft_tokens=0), "num_draft_tokens=0"),
    (SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2), "ngram_min=3"),
    (SpeculativeConfig(method="draft_model"), "needs a model directory"),
    (SpeculativeConfig(method="draft_model", draft_model="/nonexistent/x"), "not a loadable model directory"),
])
def test_bad_config_names_the_key(small_model, tokenizer, spec, match):
    with pytest.raises(ConfigError, match=match):
        LocalEngine(small_model, tokenizer, SamplingConfig(speculative=spec))


def test_draft_model_must_share_the_vocabulary(small_model, tokenizer):
    other = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                              intermediate_size=64), tokenizer)
    other.resize_token_embeddings(tokenizer.vocab_size + 7)
    spec = SpeculativeConfig(method="draft_model", draft_model="x")
    with pytest.raises(ConfigError, match="must share the policy's tokenizer"):
        LocalEngine(small_model, tokenizer, SamplingConfig(speculative=spec), draft_model=other)


def test_acceptance_entropy_correlation():
    rows = [{"train/entropy": 1.0, "rollout/spec_acceptance": 0.9}, {"train/entropy": 2.0},
            {"train/entropy": 2.0, "rollout/spec_acceptance": 0.7},
            {"train/entropy": 3.0, "rollout/spec_acceptance": float("nan")},
            {"train/entropy": 4.0, "rollout/spec_acceptance": 0.3}]
    r, n = acceptance_entropy_correlation(rows)
    assert n == 3 and r == pytest.approx(-1.0)  # (1, .9), (2, .7), (4, .3) lie on one falling line
    assert acceptance_entropy_correlation(rows[:2])[1] == 1


def test_low_acceptance_pauses_drafting_not_samples(peaked, tokenizer):
    """``min_acceptance``: while recent drafts mostly fail, rows draft only on probe steps; which steps
    draft never changes a sample."""
    reqs = _requests(tokenizer)
    eager = SpeculativeConfig(method="ngram", ngram_min=1, min_acceptance=0.0)
    picky = SpeculativeConfig(method="ngram", ngram_min=1, min_acceptance=0.99, probe_every=4)
    _, a, e_eager = _pair(peaked, tokenizer, reqs, spec=eager, max_new_tokens=21)
    plain, b, e_picky = _pair(peaked, tokenizer, reqs, spec=picky, max_new_tokens=21)
    _same(plain, a)
    _same(plain, b)
    assert 0 < e_picky._spec.num_drafted < 0.6 * e_eager._spec.num_drafted  # 139 vs 260 drafted here


def test_steps_without_drafts_are_plain_decode_steps(peaked, tokenizer):
    """A step where no row drafted runs the plain one-column decode (no verify forward): here drafting pauses
    after the first rejection (min_acceptance=1, no probes within the run), so nearly every step is plain."""
    reqs = _requests(tokenizer)
    picky = SpeculativeConfig(method="ngram", ngram_min=1, min_acceptance=1.0, probe_every=10_000)
    plain, spec, engine = _pair(peaked, tokenizer, reqs, spec=picky, max_new_tokens=21)
    _same(plain, spec)
    s = engine._spec
    assert 1 <= s.num_verify_steps <= 3 < s._steps - 10  # verified until the first rejected draft, then plain
    assert s.num_accepted < s.num_drafted


@pytest.mark.parametrize("share", [True, False])
def test_static_decode_steps_between_verify_steps(peaked, tokenizer, share):
    """With static decode steps (``cuda_graphs=on``: CUDA graphs on a GPU, the same static step eagerly here),
    a step without drafts is the static step, which masks the columns of rejected drafts like the verify does."""
    reqs = _requests(tokenizer)
    probing = SpeculativeConfig(method="ngram", ngram_min=1, min_acceptance=0.99, probe_every=3)
    plain, spec, engine = _pair(peaked, tokenizer, reqs, spec=probing, max_new_tokens=21, cuda_graphs="on",
                                share_identical_rows=share)
    _same(plain, spec)
    s = engine._spec
    assert engine._slots.static is not None and engine._slots.has_rejected
    assert 0 < s.num_verify_steps < s._steps and 0 < s.num_accepted < s.num_drafted


def test_rows_without_drafts_run_one_column_wide_when_most_rows_have_none(peaked, tokenizer):
    """A verify step runs the rows that drafted k + 1 wide and, when padding the others would waste more columns
    than the drafts fill ((n - d)(w - 1) > d w), the others in their own one-column forward: then a draft costs
    only its own row. Otherwise all rows run in one padded forward."""
    reqs = _requests(tokenizer)
    engine = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=21, share_identical_rows=False,
                                                           speculative=SpeculativeConfig(method="ngram")))
    widths, steps = [], []
    propose = engine._spec.drafter.propose

    def record(rows, k_n):
        out = propose(rows, k_n)
        steps.append((sum(map(bool, out)), len(rows), 1 + max(map(len, out))))
        return out

    def shape(module, args, kw, out):
        if isinstance(kw.get("cache", kw.get("past_key_values")), SlotCache):  # decode steps, not prefills
            widths.append(tuple(kw["input_ids"].shape))

    engine._spec.drafter.propose = record
    hook = engine.model.register_forward_hook(shape, with_kwargs=True)
    try:
        _same(LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=21)).generate(reqs), engine.generate(reqs))
    finally:
        hook.remove()
    wide = [rows for rows, w in widths if w > 1]
    expected = [d if (n - d) * (w - 1) > d * w else n for d, n, w in steps if d]
    assert wide == expected
    assert any(rows < n for rows, (d, n, w) in zip(wide, [s for s in steps if s[0]])), "some steps must split"
    assert any(rows == n for rows, (d, n, w) in zip(wide, [s for s in steps if s[0]])), "and some pad"


def test_rejected_columns_are_reclaimed(peaked, tokenizer, monkeypatch):
    """Every verify step writes k + 1 columns per row and rolls back the rejected ones. Those columns are compacted
    out, so attention never reads a span over twice the longest row's live columns (plus the step's new ones) and
    the cache grows no wider than plain decoding's (before: about 5 times as wide at 512 rows, mostly holes)."""
    spans = []
    run = SlotCache.run

    def spy(self, model, tokens_uw, slots_u):
        spans.append((self.t - self.lo, int(self.last_pos[: self.n].max()) + 1))
        return run(self, model, tokens_uw, slots_u)

    monkeypatch.setattr(SlotCache, "run", spy)
    reqs = _requests(tokenizer, n_prompts=6)
    eager = SpeculativeConfig(method="ngram", ngram_min=1, min_acceptance=0.0)
    plain = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=60, share_identical_rows=False))
    engine = LocalEngine(peaked, tokenizer, SamplingConfig(max_new_tokens=60, share_identical_rows=False,
                                                           speculative=eager))
    columns = {}
    for name, e in (("plain", plain), ("spec", engine)):
        make = e._slot_cache
        e._slot_cache = lambda make=make, name=name: columns.setdefault(name, make())
    _same(plain.generate(reqs), engine.generate(reqs))
    assert engine._spec.num_accepted < engine._spec.num_drafted and len(spans) > 20
    assert all(span <= 2 * live for span, live in spans)
    assert columns["spec"].columns <= columns["plain"].columns + 2 * eager.num_draft_tokens  # room for a verify step
    assert columns["spec"].num_compactions > 0


def test_ngram_lookup_across_rows():
    """Where a row's own context has no match, the suffix is looked up in the other rows' contexts (the latest
    occurrence); the row's own match wins, and a full table is forgotten rather than grown."""
    shared = SharedNgrams(range(2, 4))
    a = NgramIndex([1, 5, 6, 7, 8, 9], range(2, 4), shared)
    assert a.propose(3) == []  # indexes a's n-grams; (8, 9) occurs nowhere earlier
    b = NgramIndex([2, 5, 6], range(2, 4), shared)
    assert b.propose(3) == [7, 8, 9]  # b has no earlier (5, 6); a has, followed by 7 8 9
    c = NgramIndex([3, 6, 7, 4, 6, 7], range(2, 4), shared)
    assert c.propose(2) == [4, 6]  # c's own (6, 7) wins over a's
    d = NgramIndex([0, 9, 5, 6, 7], range(2, 4), shared)
    assert d.propose(4) == [8, 9]  # the longest suffix first: (5, 6, 7), in a, which has only 2 tokens after it
    assert NgramIndex([4, 8, 9], range(2, 4)).propose(2) == []  # without the shared table: nothing
    small = SharedNgrams(range(2, 3), max_entries=3)
    NgramIndex([1, 2, 3, 4], range(2, 3), small).propose(1)  # (1,2), (2,3) indexed: 2 entries
    assert small.entries == 2
    NgramIndex([7, 8, 9, 1], range(2, 3), small).propose(1)  # (7,8), (8,9): 4 > 3, forgotten
    assert small.entries == 0 and not small.tables[2]
