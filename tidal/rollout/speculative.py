"""Speculative decoding in the local engine, with exactly the samples of plain decoding.

A cheap drafter proposes up to k next tokens for a row; the policy (the target) reads the row's newest
token and the k drafts in one forward, which gives its logits at each of those positions, and the row
keeps the drafts the policy would have sampled itself. One target forward then yields 1 to k + 1 tokens.

Verification. The usual rule (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv
2302.01318) accepts a draft with probability min(1, p/q) and resamples from the residual: the tokens
are distributed like the target's, but they are not the tokens plain decoding would have drawn. tidal
draws a row's token at each position with Gumbel-max noise keyed by (seed, prompt, sample, position)
(``sampling.py``), so the target's token at a position is a deterministic function of its logits
there. A draft is accepted exactly when it equals that token, and at the first mismatch the row stops;
the next step samples the target's own token there from the logits already computed. So every token,
log-prob and version is what plain decoding gives (up to the float rounding of a wider forward), and
only the speed changes. The cost: an exact-match rule accepts less often than p/q acceptance would
for stochastic drafts; a greedy drafter is then the best guess of the target's sample.

Drafters (``SpeculativeConfig.method``):
- ``ngram``: prompt-lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; vLLM's
  ``ngram`` method): find the most recent earlier occurrence of the row's last n tokens (n from
  ``ngram_max`` down to ``ngram_min``) in its own context (prompt and response) and propose what followed
  it. No extra model; strong where the answer copies its context (tool results quoted in an answer,
  repetitions). A per-row index of n-grams makes a lookup O(1) per new token.
- ``draft_model``: a small causal LM sharing the tokenizer proposes k tokens greedily. It recomputes the
  row's context every step (no draft KV cache yet), so it pays off only when the target is much larger.
- ``mtp``: multi-token-prediction heads (DeepSeek-V3; Bebop, "MTP in RL post-training", reports up to 95%
  acceptance and 25% more rollout throughput). The local engine's models (the tiny model, Qwen2-style
  checkpoints) have no MTP heads, so this method is rejected here; vLLM runs MTP for models that have
  them (``vllm_speculative_config``).

Bebop also finds acceptance falling as the policy's entropy rises during RL: ``rollout/spec_acceptance``
is logged each step next to ``train/entropy`` so a run shows it (``acceptance_entropy_correlation``).

Rolling back: drafts are written to the slot cache (``slots.py``) at shared columns; the columns of a
row's rejected drafts are marked rejected (masked out of its attention from then on) and its position
counter only advances by the accepted tokens, so a rejected draft leaves no trace in what it attends to.
The slot cache later compacts those columns out (``SlotCache._compact``), so its width follows the accepted
tokens rather than k + 1 columns per verify step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from tidal.config import ConfigError
from tidal.rollout.sampling import sample_tokens
from tidal.rollout.slots import cache_kwargs

METHODS = ("off", "ngram", "draft_model", "mtp")


@dataclass
class SpeculativeConfig:
    """``rollout.speculative``: speculative decoding in the local engine (``speculative.py``)."""

    method: str = "off"
    """``off``, ``ngram`` (prompt lookup, Saxena 2023), ``draft_model`` (a small LM sharing the tokenizer)
    or ``mtp`` (MTP heads: vLLM only, for models that have them)."""
    num_draft_tokens: int = 4
    """k, tokens drafted per row and step. Saxena's prompt lookup proposes 10 and vLLM's examples 5; on a
    CPU the verify forward costs about linearly in k, and 4 was the best trade measured on
    ``tidal bench generate`` (docs/generate.md)."""
    ngram_max: int = 3
    """Longest suffix matched by ``ngram`` (Saxena's ``max_ngram_size`` = 3)."""
    ngram_min: int = 2
    """Shortest suffix matched: a single-token match proposes mostly noise on small vocabularies (vLLM's
    ``prompt_lookup_min``; measured on the quickstart, 1 cost speed and rarely matched)."""
    ngram_across_rows: bool = True
    """``ngram``: where the row's own context has no match, look the suffix up in every row's context
    (``SharedNgrams``; SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975, looks up earlier outputs of
    other requests). Measured on ``tidal bench generate`` (docs/speculative.md): acceptance on the agentic
    episodes 0.20 -> 0.39, and ``repeat`` drafts its first tokens from its group's other samples; the samples
    are the same either way."""
    draft_model: str | None = None
    """``draft_model``: a Hugging Face model directory with the policy's tokenizer (vocabulary)."""
    min_acceptance: float = 0.25
    """Below this running acceptance (an average over recent steps, halved weight per step) rows draft
    only every ``probe_every``-th step: every padded draft column costs verify compute for every row, so
    drafts that keep failing slow decoding down (measured: 0.72x on the quickstart before this rule).
    Adapting the speculation to its acceptance follows SmartSpec (Liu et al. 2024, arXiv 2406.14066);
    which steps draft never changes a sample."""
    probe_every: int = 8
    """While drafting is paused for low acceptance, draft on every this-many-th step to re-measure it."""

    @property
    def enabled(self) -> bool:
        return self.method != "off"


def check_config(cfg: SpeculativeConfig) -> None:
    """A one-line ConfigError naming the bad ``rollout.speculative`` key."""
    if cfg.method not in METHODS:
        raise ConfigError(f"rollout.speculative.method={cfg.method!r}: expected one of {', '.join(METHODS)}")
    if cfg.num_draft_tokens < 1:
        raise ConfigError(f"rollout.speculative.num_draft_tokens={cfg.num_draft_tokens}: must be >= 1")
    if not 0.0 <= cfg.min_acceptance <= 1.0 or cfg.probe_every < 1:
        raise ConfigError(f"rollout.speculative.min_acceptance={cfg.min_acceptance}, probe_every={cfg.probe_every}: "
                          "need 0 <= min_acceptance <= 1 and probe_every >= 1")
    if not 1 <= cfg.ngram_min <= cfg.ngram_max:
        raise ConfigError(f"rollout.speculative.ngram_min={cfg.ngram_min}, ngram_max={cfg.ngram_max}: "
                          "need 1 <= ngram_min <= ngram_max")
    if cfg.method == "draft_model" and not cfg.draft_model:
        raise ConfigError("rollout.speculative.draft_model: method=draft_model needs a model directory")


# ---- drafters ---------------------------------------------------------------------------------------
class SharedNgrams:
    """Per n, the latest occurrence of each n-gram in any row's context, as (that context, the n-gram's end):
    prompt lookup across rows. RL samples many rows of one task at once, and their text shares structure
    the row's own context may not hold yet (a tool call's syntax, an answer's format, the closing tag after an
    argument); a lookup over earlier outputs of other requests is SuffixDecoding's (Oliaro et al. 2024, arXiv
    2411.04975), which it finds strongest on agentic workloads. Forgotten whole past ``max_entries`` n-grams, so
    its memory stays bounded over a long run."""

    def __init__(self, sizes: range, max_entries: int = 1 << 18):
        self.tables: dict[int, dict[tuple[int, ...], tuple[list[int], int]]] = {n: {} for n in sizes}
        self.max_entries = max_entries
        self.entries = 0

    def add(self, n: int, gram: tuple[int, ...], context: list[int], end: int) -> None:
        table = self.tables[n]
        self.entries += gram not in table
        table[gram] = (context, end)
        if self.entries > self.max_entries:
            for t in self.tables.values():
                t.clear()
            self.entries = 0

    def continuation(self, n: int, gram: tuple[int, ...], k: int, own: list[int]) -> list[int]:
        """Up to k tokens that followed ``gram``'s latest occurrence in a context other than ``own``."""
        hit = self.tables[n].get(gram)
        if hit is None or hit[0] is own:
            return []
        context, end = hit
        return context[end : end + k]


class NgramIndex:
    """One row's context and, per n, the end of the latest occurrence of each n-gram (prompt lookup); with
    ``shared``, also the other rows' (``SharedNgrams``), consulted where the row's own context has no match."""

    def __init__(self, prompt: Sequence[int], sizes: range, shared: SharedNgrams | None = None):
        self.context = list(prompt)
        self.sizes = sizes
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the tables
        self.shared = shared

    def extend(self, tokens: Sequence[int]) -> None:
        self.context.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix.
        A continuation that runs into the suffix itself goes on with its own proposals (a periodic
        context is continued period by period)."""
        ctx, end = self.context, len(self.context)
        for e in range(max(self.indexed, 1), end):  # index every n-gram ending at e < end (not the suffix)
            for n in self.sizes:
                if e >= n:
                    gram = tuple(ctx[e - n : e])
                    self.tables[n][gram] = e
                    if self.shared is not None:
                        self.shared.add(n, gram, ctx, e)
        self.indexed = max(self.indexed, end)
        if k <= 0:
            return []
        for n in reversed(self.sizes):
            if end <= n:
                continue
            e = self.tables[n].get(tuple(ctx[end - n :]))
            if e is not None:
                out: list[int] = []
                for j in range(k):
                    out.append(ctx[e + j] if e + j < end else out[e + j - end])
                return out
        if self.shared is not None:
            for n in reversed(self.sizes):
                if end >= n:
                    out = self.shared.continuation(n, tuple(ctx[end - n :]), k, ctx)
                    if out:
                        return out
        return []


class NgramDrafter:
    """Prompt-lookup drafts (Saxena 2023) from each row's own context."""

    def __init__(self, cfg: SpeculativeConfig):
        self.sizes = range(cfg.ngram_min, cfg.ngram_max + 1)
        self.shared = SharedNgrams(self.sizes) if cfg.ngram_across_rows else None

    def propose(self, rows, k_n: list[int]) -> list[list[int]]:
        out = []
        for row, k in zip(rows, k_n):
            index = row.draft_state
            if index is None:
                index = row.draft_state = NgramIndex(row.request.prompt_ids, self.sizes, self.shared)
            index.extend(row.tokens[len(index.context) - len(row.request.prompt_ids) :])
            out.append(index.propose(k))
        return out


class ModelDrafter:
    """Greedy drafts from a small causal LM with the policy's vocabulary (its context recomputed each step)."""

    def __init__(self, model: torch.nn.Module, pad_id: int, target_vocab: int):
        vocab = model.config.vocab_size
        if vocab != target_vocab:
            raise ConfigError(f"rollout.speculative.draft_model: vocabulary of {vocab} tokens, the policy has "
                              f"{target_vocab} (a draft model must share the policy's tokenizer)")
        self.model = model.eval().requires_grad_(False)
        self.pad_id = pad_id

    @torch.no_grad()
    def propose(self, rows, k_n: list[int]) -> list[list[int]]:
        live = [i for i, k in enumerate(k_n) if k > 0]
        out: list[list[int]] = [[] for _ in rows]
        if not live:
            return out
        device = next(self.model.parameters()).device
        seqs = [(*rows[i].request.prompt_ids, *rows[i].tokens) for i in live]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids[r, width - len(s) :] = torch.tensor(s)
            mask[r, width - len(s) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        drafted = []
        for _ in range(max(k_n[i] for i in live)):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                **cache_kwargs(self.model, cache)).logits[:, -1]
            ids = logits.argmax(-1, keepdim=True)
            drafted.append(ids[:, 0])
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            pos = pos[:, -1:] + 1
        tokens = torch.stack(drafted, 1).tolist()
        for r, i in enumerate(live):
            out[i] = tokens[r][: k_n[i]]
        return out


def load_draft_model(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError) as e:  # ValueError: a folder transformers does not recognize as a model
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"rollout.speculative.draft_model={path!r}: not a loadable model directory ({first})") \
            from None
    return model.to(device=device, dtype=dtype)


# ---- the decode step ----------------------------------------------------------------------------------
class Speculator:
    """The local engine's speculative decode step (``step`` replaces ``LocalEngine._sample_step``)."""

    def __init__(self, cfg: SpeculativeConfig, engine, drafter):
        self.cfg, self.engine, self.drafter = cfg, engine, drafter
        self.num_drafted = self.num_accepted = 0
        self.num_row_forwards = self.num_tokens = 0
        self._window = (0, 0)  # (drafted, accepted) when ``stats`` was last read
        self._recent = 1.0  # running acceptance (optimistic start), for ``min_acceptance``
        self._steps = 0
        self.num_verify_steps = 0  # steps with a draft to verify (the others are plain decode steps)

    def stats(self) -> dict[str, float]:
        """Acceptance since the last call (per training step: the controller reads it once a step), and
        generated tokens per row-forward of the target over the engine's life."""
        drafted, accepted = self.num_drafted - self._window[0], self.num_accepted - self._window[1]
        self._window = (self.num_drafted, self.num_accepted)
        return {"rollout/spec_acceptance": accepted / drafted if drafted else float("nan"),
                "rollout/spec_drafted_tokens": float(drafted),
                "rollout/spec_tokens_per_forward": self.num_tokens / max(self.num_row_forwards, 1)}

    def _draft_budget(self, row) -> int:
        """Drafts worth verifying for ``row``: not past its length budget, and never over a position where
        budget forcing (``thinking.py``) could replace the sample (forcing is decided one token at a time)."""
        e = self.engine
        k = min(self.cfg.num_draft_tokens, (row.request.max_new_tokens or e.cfg.max_new_tokens) - len(row.tokens))
        if row.request.thinking_budget is not None and not row.think_closed:
            k = 0 if row.forced_at else min(k, row.request.thinking_budget - len(row.tokens))
        return max(k, 0)

    @staticmethod
    def _note_close(row) -> None:
        """``LocalEngine._force_think_close``'s check that the model closed its thinking itself, run after
        every accepted token (plain decoding runs it before each sample)."""
        close = row.request.thinking_close
        if (row.request.thinking_budget is not None and not row.think_closed and not row.forced_at
                and tuple(row.tokens[len(row.tokens) - len(close):]) == close):
            row.think_closed = True

    @torch.no_grad()
    def step(self, rows: list, slots, temperature: float, on_done) -> list:
        e = self.engine
        rows, tokens = e._sample_next(rows, slots, temperature, on_done)  # the target's token from held logits
        if not rows:
            return rows
        for row in rows:
            self._note_close(row)
        self._steps += 1
        paused = self._recent < self.cfg.min_acceptance and self._steps % self.cfg.probe_every
        drafts = [] if paused else self.drafter.propose(rows, [self._draft_budget(r) for r in rows])
        n = len(rows)
        if not any(drafts):  # nothing to verify: the plain decode step, at its cost (a CUDA graph where it has one)
            self.num_row_forwards += e._decode(rows, slots, tokens)
            self.num_tokens += n
            return rows
        w = 1 + max(map(len, drafts))
        self.num_verify_steps += 1
        fed = [[tok, *d] for tok, d in zip(tokens.tolist(), drafts)]
        wide, narrow = self._split(drafts, w)
        slots.open_columns(w)
        logits_wwv = self._run_group(rows, fed, wide, w, slots)
        logits_nv = self._run_group(rows, fed, narrow, 1, slots)[:, 0] if narrow else None
        # the target's own token at each drafted position, with that position's noise
        flat = [(r, j) for r, i in enumerate(wide) for j in range(len(drafts[i]))]
        rr = torch.tensor([r for r, _ in flat], device=e.device)
        jj = torch.tensor([j for _, j in flat], device=e.device)
        keys = torch.tensor([rows[wide[r]].key for r, _ in flat], dtype=torch.int64, device=e.device)
        pos = torch.tensor([len(rows[wide[r]].tokens) + j for r, j in flat], dtype=torch.int64, device=e.device)
        target, logps = sample_tokens(logits_wwv[rr, jj], keys, pos, temperature, e.cfg.top_p)
        target, logps = target.tolist(), logps.tolist()
        drafted_before, accepted_before = self.num_drafted, self.num_accepted
        keep = torch.ones(n, dtype=torch.bool)
        kept = torch.ones(n, dtype=torch.long)  # columns whose keys and values stay: the newest token's ...
        at = 0
        for i, (row, d) in enumerate(zip(rows, drafts)):
            self.num_drafted += len(d)
            matched = 0
            while matched < len(d) and target[at + matched] == d[matched]:
                matched += 1
            self.num_accepted += matched
            for j in range(matched):  # ... and each accepted draft's, unless the row finishes on it
                if e._append(row, d[j], logps[at + j]):
                    keep[i] = False
                    break
                self._note_close(row)
                kept[i] += 1
            at += len(d)
        if self.num_drafted > drafted_before:
            rate = (self.num_accepted - accepted_before) / (self.num_drafted - drafted_before)
            self._recent = 0.5 * self._recent + 0.5 * rate
        self.num_tokens += int(kept.sum()) + int((~keep).sum())
        e.num_generated_tokens += int(kept.sum()) - n + int((~keep).sum())
        next_logits = logits_wwv.new_empty((n, logits_wwv.shape[-1]))
        next_logits[torch.tensor(wide, device=e.device)] = logits_wwv[torch.arange(len(wide), device=e.device),
                                                                      (kept[wide] - 1).to(e.device)]
        if narrow:
            next_logits[torch.tensor(narrow, device=e.device)] = logits_nv
        slots.accept(kept.to(e.device), next_logits, w)
        self._renode(rows, fed, kept)
        rows, _ = e._retire(rows, keep, slots, on_done)
        return rows

    @staticmethod
    def _split(drafts: list[list[int]], w: int) -> tuple[list[int], list[int]]:
        """The rows verified ``w`` wide and the rows run one column wide. Rows without drafts run apart, in their
        own one-column forward, when padding them would waste more columns than the drafting rows fill
        ((n - d)(w - 1) > d w): then a draft costs only its own row (a forward costs about linearly in rows x
        width on the tiny model). Otherwise one padded forward is cheaper than a second forward and the
        gathers two row subsets need (measured on ``tidal bench generate``: the ``repeat`` task, where most rows
        draft, lost a fifth of its speedup to always splitting)."""
        drafting = [i for i, d in enumerate(drafts) if d]
        idle = [i for i, d in enumerate(drafts) if not d]
        if len(idle) * (w - 1) > len(drafting) * w:
            return drafting, idle
        return list(range(len(drafts))), []

    def _run_group(self, rows: list, fed: list[list[int]], group: list[int], width: int, slots) -> torch.Tensor:
        """Run the rows at indices ``group`` (ascending), each fed its tokens padded to ``width``; return their
        logits [len(group), width, vocab]. Rows holding the same context and fed the same tokens run once
        (``share_identical_rows``; not with static decode steps, which keep no context nodes)."""
        e = self.engine
        padded = [fed[i] + [e.pad_id] * (width - len(fed[i])) for i in group]
        first, inverse = self._distinct([rows[i] for i in group], padded)
        at = torch.tensor(group, device=e.device)
        if first is None:  # every row runs; all of them: the cache's own prefix (a view, not a gather)
            run = slice(0, slots.n) if len(group) == slots.n else at
            logits = slots.run(e.model, torch.tensor(padded, dtype=torch.long, device=e.device), run)
        else:
            run = at[torch.tensor(first, device=e.device)]
            tokens = torch.tensor([padded[f] for f in first], dtype=torch.long, device=e.device)
            logits = slots.run(e.model, tokens, run)
            inverse_t = torch.tensor(inverse, device=e.device)
            source = run[inverse_t]
            copies = source != at  # the rows that did not run
            slots.copy_columns(at[copies], source[copies], width)
            logits = logits[inverse_t]
        self.num_row_forwards += len(group) if first is None else len(first)
        return logits

    def _distinct(self, rows: list, fed: list[list[int]]) -> tuple[list[int] | None, list[int] | None]:
        """(The first of each set of identical rows, each row's set), or (None, None) when all are distinct or
        sharing is off."""
        if not self.engine.cfg.share_identical_rows or self.engine._static_decode:
            return None, None
        index: dict[tuple, int] = {}
        first: list[int] = []
        inverse = []
        for slot, (row, toks) in enumerate(zip(rows, fed)):
            j = index.setdefault((row.node, *toks), len(first))
            if j == len(first):
                first.append(slot)
            inverse.append(j)
        if len(first) == len(rows):
            return None, None
        self.engine.num_shared_decodes += len(rows) - len(first)
        return first, inverse

    def _renode(self, rows: list, fed: list[list[int]], kept: torch.Tensor) -> None:
        """A row's new context node: rows of one node that kept the same tokens still share a context."""
        e = self.engine
        index: dict[tuple, int] = {}
        for row, toks, m in zip(rows, fed, kept.tolist()):
            row.node = e._next_node + index.setdefault((row.node, *toks[:m]), len(index))
        e._next_node += len(index)


def build_speculator(cfg: SpeculativeConfig, engine, draft_model: torch.nn.Module | None = None) -> Speculator | None:
    """The engine's speculator, or None when ``cfg.method`` is ``off``."""
    check_config(cfg)
    if not cfg.enabled:
        return None
    if cfg.method == "mtp":
        raise ConfigError("rollout.speculative.method=mtp: this model has no multi-token-prediction heads (the "
                          "local engine's models have none); use ngram or draft_model, or rollout.engine=vllm "
                          "with a model that has MTP heads")
    if cfg.method == "ngram":
        drafter = NgramDrafter(cfg)
    else:
        model = draft_model or load_draft_model(cfg.draft_model, engine.dtype, engine.device)
        drafter = ModelDrafter(model.to(device=engine.device, dtype=engine.dtype), engine.pad_id,
                               engine.model.config.vocab_size)
    return Speculator(cfg, engine, drafter)


def acceptance_entropy_correlation(metrics: Sequence[dict]) -> tuple[float, int]:
    """Pearson correlation of ``rollout/spec_acceptance`` with ``train/entropy`` over a run's metric rows
    (steps that have both and drafted anything), and the number of such steps. Bebop reports acceptance
    falling linearly as entropy rises: a negative correlation."""
    pairs = [(m["train/entropy"], m["rollout/spec_acceptance"]) for m in metrics
             if "train/entropy" in m and not math.isnan(m.get("rollout/spec_acceptance", math.nan))]
    if len(pairs) < 3:
        return math.nan, len(pairs)
    xs, ys = zip(*pairs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return (sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan), len(pairs)
