"""Agent turns' kept keys and values (``SamplingConfig.reuse_turn_kv``): the local engine keeps a finished turn's
cache so that the episode's next turn, whose context extends it, computes only its new tokens."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class TurnKV:
    """A finished turn's sequence and its keys and values per layer ([heads, len, head_dim] each)."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    version: int
    routes: torch.Tensor | None = None  # MoE: the sequence's expert ids, CPU uint8 [len, layers, k]


class TurnStore:
    """Kept turns by (prompt uid, sample index), oldest dropped first past ``max_turns`` entries or
    ``max_tokens`` kept positions (so a large model's kept keys and values stay within about what the
    running batch's own cache holds)."""

    def __init__(self):
        self._turns: OrderedDict[tuple[str, int], TurnKV] = OrderedDict()
        self.tokens = 0

    def __bool__(self) -> bool:
        return bool(self._turns)

    def put(self, key: tuple[str, int], kv: TurnKV, max_turns: int, max_tokens: int) -> None:
        self.take(key)
        self._turns[key] = kv
        self.tokens += len(kv.tokens)
        while self._turns and (len(self._turns) > max_turns or self.tokens > max_tokens):
            _, old = self._turns.popitem(last=False)
            self.tokens -= len(old.tokens)

    def take(self, key: tuple[str, int]) -> TurnKV | None:
        kv = self._turns.pop(key, None)
        if kv is not None:
            self.tokens -= len(kv.tokens)
        return kv

    def clear(self) -> None:
        self._turns.clear()
        self.tokens = 0
