"""The experts an MoE policy chose for each token, recorded by the local engine with the sample (issue 52).

Why: the trainer replays the engine's expert choices (Rollout Routing Replay, ``models/moe.py``), so every
token must carry the experts that the engine's forward chose for it when it fed that token. The engine
records them where it computes them, with no per-token work: a router hook hands each forward's ids
[N, k] per layer to a sink (``moe.Routing.recording``), and the ids go where the token's keys and values go.

- A prefill (left-padded [rows, width] on a ``DynamicCache``) keeps them in a ``ForwardRoutes``; the slot
  cache copies them to the admitted rows' columns exactly as it copies the prefill's keys.
- A decode or verify step writes them straight into the slot cache's ``routes`` buffer ([layers, slots,
  columns, k], beside ``kv``), and every move of a row's columns moves its routes too (``slots.py``).
- A finished row's routes are its live columns (rejected drafts dropped), one device-to-host copy for all the
  rows that finish in a step; the sampled last token was never fed, so it has ``NO_ROUTE``.

Dense models have no routers: no buffer, no sink, ``Trajectory.routes`` stays None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from tidal.models.moe import NO_ROUTE, ROUTE_DTYPE, Routing


def recording(routing: Routing | None, sink: Callable[[int, torch.Tensor], None]):
    """``routing.recording(sink)``, or nothing to do for a dense model (``routing`` None)."""
    return contextlib.nullcontext() if routing is None else routing.recording(sink)


class ForwardRoutes:
    """A sink keeping one forward's expert ids per layer (a prefill's, whose layout is [rows, width])."""

    def __init__(self, routing: Routing):
        self.top_k = routing.top_k
        self.ids: list[torch.Tensor | None] = [None] * routing.num_layers

    def __call__(self, layer: int, ids_nk: torch.Tensor) -> None:
        self.ids[layer] = ids_nk

    def stacked(self, rows: int, width: int) -> torch.Tensor:
        """uint8 [layers, rows, width, k]: the forward's N = rows x width tokens, row-major as it flattened them."""
        assert all(ids is not None for ids in self.ids), "a router did not run in the recorded forward"
        return torch.stack(self.ids).to(ROUTE_DTYPE).view(len(self.ids), rows, width, self.top_k)


def unfed_last(routes_tlk: torch.Tensor) -> torch.Tensor:
    """A finished row's routes (its fed tokens [T, layers, k]) with ``NO_ROUTE`` appended for its last sampled
    token, which no forward read: [T + 1, layers, k], one per token of prompt + response."""
    return torch.cat([routes_tlk, routes_tlk.new_full((1, *routes_tlk.shape[1:]), NO_ROUTE)])


def merge_turn(known: torch.Tensor | None, turn: torch.Tensor) -> torch.Tensor:
    """An agent episode's routes after a turn: ``turn`` covers the turn's whole context (the episode so far)
    and its tokens; where ``known`` (the routes up to the previous turn) has a route it stays, the route the
    tokens sampled then were computed with; the rest (the previous turn's last token, the observation) comes
    from this turn's read of them."""
    if known is None:
        return turn
    assert len(turn) >= len(known), "a later turn's context extends the earlier one"
    merged = turn.clone()
    head = merged[: len(known)]
    merged[: len(known)] = torch.where(known != NO_ROUTE, known, head)
    return merged


def padded(routes_tlk: torch.Tensor, length: int) -> torch.Tensor:
    """``routes_tlk`` extended with ``NO_ROUTE`` to ``length`` tokens (tokens no forward has read yet)."""
    missing = length - len(routes_tlk)
    assert missing >= 0, f"routes for {len(routes_tlk)} tokens, the sequence has {length}"
    return routes_tlk if not missing else torch.cat(
        [routes_tlk, routes_tlk.new_full((missing, *routes_tlk.shape[1:]), NO_ROUTE)])
