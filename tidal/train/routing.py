"""The trainer's side of mixture-of-experts routing: replay (R2/R3), agreement, auxiliary router losses.

``models/moe.py`` hooks a model's routers; this module decides, for each of the trainer's forwards, which
experts each token must use and lays them out as the forward lays out its tokens:

- ``trainer.moe.routing_replay=r3`` (Rollout Routing Replay, Ma et al., arXiv 2510.11370): the experts the
  engine chose when it computed each token (``TrainBatch.routes_btlk``, recorded with the sample).
- ``r2`` (GSPO's Routing Replay, Zheng et al., arXiv 2507.18071, sec. 4.3): the experts the trainer's own
  forward chose before this step's first update (recorded in a no-grad pass at the start of the step, the
  proximal pass when one runs anyway). With one minibatch and no proximal pass every forward of the step
  runs before the update, so its own choices are already those: nothing is recorded or replayed.
- ``off``: the model's own choices; with the engine's routes in the batch they are only compared.

Routes live in the batch's right-padded [B, T, layers, k] layout. A pass that packs sequences or shares
prefixes (``train/packing.py``, ``train/prefix_tree.py``) gets them at its own (row, column) of every token,
position 0 included; a trie node shared by several samples takes any of theirs (they computed the same
context). Padding gets ``NO_ROUTE`` (the model's own choice, not counted).

Agreement (``moe/routing_agreement``): the share of token-layer choices where the trainer's own top-k (as
a set) equals the engine's, over sequences the trainer's current weights sampled (a stale sequence differs
because the policy moved), in the step's first pass before any update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tidal.algo import mismatch_metrics
from tidal.config import ConfigError
from tidal.models.moe import NO_ROUTE, REPLAY_MODES, expert_load, load_balance_loss, router_z_loss, routing_of
from tidal.train.host_batch import read_metrics


@dataclass
class MoeConfig:
    """Mixture-of-experts training (``trainer.moe.*``; docs/moe.md). Ignored for dense models."""

    routing_replay: str = "off"
    """``off`` (each forward routes itself), ``r2`` (replay the trainer's own routes from before the step's first
    update: GSPO, arXiv 2507.18071) or ``r3`` (replay the engine's routes recorded with each sample: arXiv
    2510.11370). Replay fixes which experts run; gate weights are recomputed from the trainer's router logits,
    so the router keeps its gradient."""
    load_balance: bool = False
    """Add Switch Transformer's load-balancing loss (arXiv 2101.03961, eq. 4) to the policy loss."""
    load_balance_coef: float = 0.01
    """Its weight: the paper's alpha = 1e-2 (sec. 2.2)."""
    z_loss: bool = False
    """Add ST-MoE's router z-loss (arXiv 2202.08906, eq. 5), which keeps router logits small."""
    z_loss_coef: float = 0.001
    """Its weight: the paper's c_z = 1e-3 (sec. 3.2)."""
    mismatch_unreplayed: bool = False
    """With replay on: also score the step's first minibatch without replay (one extra no-grad forward) and log
    its engine/trainer gap as ``moe/logp_mismatch_unreplayed``, beside ``train/logp_mismatch_mean`` (replayed)."""


def validate_moe(cfg: MoeConfig) -> None:
    if cfg.routing_replay not in REPLAY_MODES:
        raise ConfigError(f"trainer.moe.routing_replay must be one of {', '.join(REPLAY_MODES)}, "
                          f"got {cfg.routing_replay!r}")
    for key in ("load_balance_coef", "z_loss_coef"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"trainer.moe.{key} must be >= 0, got {getattr(cfg, key)}")


def token_positions(layout) -> tuple[torch.Tensor, ...]:
    """(row, column) in ``layout`` and (sequence, position) in the padded batch of every token, position 0
    included (``layout.source_*``/``dest_*`` cover positions >= 1: position 0 is each position-1 token's parent,
    the column before in a packed row, the ``parents_rl`` entry in a trie)."""
    first = layout.dest_t == 1
    rows, cols = layout.source_rows[first], layout.source_cols[first]
    parents = getattr(layout, "parents_rl", None)
    root_cols = cols - 1 if parents is None else parents[rows, cols]
    return (torch.cat([layout.source_rows, rows]), torch.cat([layout.source_cols, root_cols]),
            torch.cat([layout.dest_b, layout.dest_b[first]]), torch.cat([layout.dest_t, torch.zeros_like(rows)]))


def layout_routes(routes_btlk: torch.Tensor, layout, width_rl: tuple[int, int]) -> torch.Tensor:
    """The batch's routes [B, T, L, k] (B = the layout's sequences) at ``layout``'s columns: [R * Lw, L, k]
    flattened as the model flattens its tokens; ``NO_ROUTE`` on padding."""
    r, c, b, t = (x.to(routes_btlk.device) for x in token_positions(layout))
    out = routes_btlk.new_full((*width_rl, *routes_btlk.shape[2:]), NO_ROUTE)
    out[r, c] = routes_btlk[b, t]
    return out.flatten(0, 1)


def batch_routes(routes_nlk: torch.Tensor, layout, width_rl: tuple[int, int], num_seq: int, width: int) -> torch.Tensor:
    """The inverse: a forward's routes [R * Lw, L, k] back to the padded [num_seq, width, L, k] layout."""
    r, c, b, t = (x.to(routes_nlk.device) for x in token_positions(layout))
    out = routes_nlk.new_full((num_seq, width, *routes_nlk.shape[1:]), NO_ROUTE)
    out[b, t] = routes_nlk.view(*width_rl, *routes_nlk.shape[1:])[r, c]
    return out


class TrainerRouting:
    """Per step: the routes each forward replays or compares with, and what the router logged (module doc)."""

    def __init__(self, model: torch.nn.Module, cfg: MoeConfig):
        validate_moe(cfg)
        self.cfg = cfg
        self.routing = routing_of(model)
        self.replay = cfg.routing_replay if self.routing is not None else "off"
        self.routes_btlk: torch.Tensor | None = None  # what this step's passes replay (batch layout)
        self.compare_btlk: torch.Tensor | None = None  # the engine's routes of fresh sequences (agreement)
        self.recording: torch.Tensor | None = None  # r2's recording pass fills it (batch layout)

    @property
    def active(self) -> bool:
        return self.routing is not None

    def begin_step(self, batch, version: int) -> None:
        """Take the batch's engine routes (r3's plan; agreement's reference, fresh sequences only)."""
        self.routes_btlk = self.compare_btlk = self.recording = None
        if not self.active:
            return
        self.routing.take_agreement()  # drop anything an earlier pass left
        engine = batch.routes_btlk
        if self.replay == "r3" and engine is None:
            raise ConfigError("trainer.moe.routing_replay=r3 needs the engine's routes with every sample, and this "
                              "batch has none (an engine that returns no routes: use the local engine, or a vLLM "
                              "that supports enable_return_routed_experts; docs/moe.md)")
        if engine is None:
            return
        sampled = batch.versions_bt >= 0
        fresh_b = ((batch.versions_bt == version) | ~sampled).all(-1) & sampled.any(-1)
        self.compare_btlk = torch.where(fresh_b[:, None, None, None], engine, NO_ROUTE)
        if self.replay == "r3":
            self.routes_btlk = engine

    def before_updates(self, batch, chunks: list[torch.Tensor], needs_prox: bool, score: Callable,
                       version: int) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The step's no-grad passes before its first update: the proximal log-probs when ``needs_prox`` (``score()``,
        the whole batch), and for MoE models r2's recording (the proximal pass itself when one runs, else a pass of
        its own; with one minibatch and no proximal pass every forward runs before the update: nothing recorded) and
        ``mismatch_unreplayed``'s pass over the first minibatch (``score(rows)``). Returns (proximal log-probs or
        None, their metrics: agreement, the unreplayed gap)."""
        metrics: dict[str, float] = {}
        if not self.active:
            return (score() if needs_prox else None), metrics
        if self.cfg.mismatch_unreplayed and self.replay != "off":
            idx = chunks[0]
            with self.unreplayed():
                unreplayed = score(idx)[idx]
            gap = mismatch_metrics(unreplayed, batch.behav_logp_bt[idx], batch.versions_bt[idx],
                                   batch.loss_mask_bt[idx], version)
            for key, value in read_metrics(gap).items():
                metrics[key.replace("train/logp_mismatch", "moe/logp_mismatch_unreplayed")
                        .replace("train/extreme", "moe/unreplayed_extreme")] = value
        if self.replay == "r2" and (needs_prox or len(chunks) > 1):
            with self.recording_pass(batch):
                recorded = score()  # its own routes: the log-probs replaying them gives, so also the proximal ones
            metrics.update(self.agreement())
            return (recorded if needs_prox else None), metrics
        return (score() if needs_prox else None), metrics

    @contextlib.contextmanager
    def recording_pass(self, batch) -> Iterator[None]:
        """r2: the block's forwards (the whole batch, no gradient) record the trainer's own routes, and compare
        them with the engine's; afterwards they are what the step's passes replay."""
        self.recording = torch.full((*batch.input_ids_bt.shape, self.routing.num_layers, self.routing.top_k),
                                    NO_ROUTE, dtype=torch.uint8, device=batch.input_ids_bt.device)
        try:
            yield
        finally:
            self.routes_btlk, self.recording = self.recording, None

    @contextlib.contextmanager
    def unreplayed(self) -> Iterator[None]:
        """The block's forwards route themselves and compare nothing (``trainer.moe.mismatch_unreplayed``)."""
        kept = self.routes_btlk, self.compare_btlk
        self.routes_btlk = self.compare_btlk = None
        try:
            yield
        finally:
            self.routes_btlk, self.compare_btlk = kept

    def before_forward(self, model: torch.nn.Module, rows: torch.Tensor, layout, width_rl: tuple[int, int],
                       padded_attention_bt: torch.Tensor | None) -> None:
        """Set ``model``'s plan for a forward over ``rows`` laid out as ``layout`` (None: padded [rows, width])."""
        routing = routing_of(model)
        if routing is None:
            return
        routing.keep_logits = True
        source, replace = (self.routes_btlk, True) if self.recording is None else (None, False)
        if source is None and self.compare_btlk is not None:
            source, replace = self.compare_btlk, False
        if source is None:
            routing.set_plan(None)
        else:
            plan, count = self._lay(source, rows, layout, width_rl), None
            if replace:  # the agreement counts the tokens the engine's fresh routes cover (none without them)
                compare = self.compare_btlk
                count = (torch.zeros(len(plan), dtype=torch.bool, device=plan.device) if compare is None
                         else self._lay(compare, rows, layout, width_rl)[:, 0, 0] != NO_ROUTE)
            routing.set_plan(plan, replace, count)
        self._pass = (routing, rows, layout, width_rl, padded_attention_bt)

    @staticmethod
    def _lay(source_btlk, rows, layout, width_rl) -> torch.Tensor:
        if layout is None:
            return source_btlk[rows, : width_rl[1]].flatten(0, 1)
        return layout_routes(source_btlk[rows], layout, width_rl)

    def after_forward(self, batch) -> None:
        """After a recording pass's forward: its routes into ``recording``."""
        if self.recording is None or getattr(self, "_pass", None) is None:
            return
        routing, rows, layout, width_rl, attention_bt = self._pass
        chosen = torch.stack(routing.chosen, dim=1).to(torch.uint8)  # [N, L, k]
        if layout is None:
            real = attention_bt.reshape(-1, 1, 1).to(chosen.device) > 0
            chosen = torch.where(real, chosen, NO_ROUTE)
            self.recording[rows, : width_rl[1]] = chosen.view(*width_rl, *chosen.shape[1:])
        else:
            self.recording[rows] = batch_routes(chosen, layout, width_rl, len(rows), self.recording.shape[1])

    def aux_loss(self, metrics: dict) -> torch.Tensor | None:
        """The last forward's router losses (weighted, when on) and their values as metrics (always)."""
        pass_ = getattr(self, "_pass", None)
        if pass_ is None or pass_[0].logits[0] is None:
            return None
        routing, rows, layout, width_rl, padded_attention_bt = pass_
        valid = self._valid(layout, width_rl, padded_attention_bt, routing.logits[0].device)
        balance = load_balance_loss(routing.logits, routing.chosen, routing.num_experts, valid)
        z = router_z_loss(routing.logits, valid)
        load = expert_load([c.detach() for c in routing.chosen], routing.num_experts, valid)
        metrics["moe/load_balance_loss"] = balance.detach()
        metrics["moe/z_loss"] = z.detach()
        load = load * routing.num_experts  # 1.0 each: perfectly balanced
        metrics["moe/expert_load_max"], metrics["moe/expert_load_min"] = load.max(), load.min()
        for expert, share in enumerate(load.unbind()):
            metrics[f"moe/expert_load/{expert}"] = share
        loss = None
        if self.cfg.load_balance:
            loss = self.cfg.load_balance_coef * balance
        if self.cfg.z_loss:
            loss = self.cfg.z_loss_coef * z if loss is None else loss + self.cfg.z_loss_coef * z
        return loss

    @staticmethod
    def _valid(layout, width_rl, padded_attention_bt, device) -> torch.Tensor:
        if layout is None:
            return padded_attention_bt.reshape(-1).to(device) > 0
        r, c, _, _ = token_positions(layout)
        valid = torch.zeros(width_rl, dtype=torch.bool)
        valid[r, c] = True
        return valid.reshape(-1).to(device)

    def end_pass(self) -> None:
        """After a pass's backward (or its no-grad forward): drop the plan and the kept logits."""
        pass_ = getattr(self, "_pass", None)
        if pass_ is not None:
            pass_[0].clear_plan()
            pass_[0].drop_logits()
        self._pass = None

    def agreement(self) -> dict[str, float]:
        """``moe/routing_agreement`` and ``moe/routing_compared`` over the passes since ``begin_step`` (or the last
        call), read in one transfer; {} when nothing was compared (an async step whose samples are all a version
        old: an agreement of 0/0 is no measurement)."""
        if not self.active or self.compare_btlk is None:
            return {}
        matched, compared = self.routing.take_agreement()
        share = matched / compared.clamp(min=1)
        read = read_metrics({"moe/routing_agreement": share, "moe/routing_compared": compared})
        return read if read["moe/routing_compared"] > 0 else {}
