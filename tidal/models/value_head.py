"""A value model for PPO: a causal LM's decoder with a scalar head, V(s_t) for every prefix.

The critic is a separate copy of the policy's decoder (the transformer without its LM head) plus a
linear head to one number, initialized from the policy's weights, as verl and OpenRLHF initialize
their critic from the actor (or from a reward model). Why a copy and not a second head on the
policy's backbone: the value regression's gradients would otherwise flow into the policy's weights
(PPO's shared-network variant needs a tuned value-loss weight for that reason, Schulman et al. 2017
sec. 5), the policy the rollout engine receives would carry an extra head, and each model keeps its
own optimizer and learning rate. The price is a second model's memory, nothing at the tiny model's
size; a shared head would be the cheaper choice for large models, and is not offered.

The head is zero-initialized, so V = 0 at the start: the first advantages are the plain returns
(with gamma = lam = 1, the reward on every token) instead of the returns minus a random baseline.
It runs in float32 whatever the decoder's dtype, like the LM head in ``logprobs.py``.
"""

from __future__ import annotations

import copy

import torch


class ValueModel(torch.nn.Module):
    """``forward(input_ids_bt, attention_mask_bt) -> values_bt`` [B, T] float32, where
    ``values_bt[:, t]`` is the value of the state before the token at column t (the head on column
    t - 1's hidden state, the alignment of ``token_logprobs``); column 0 (no state before it) is 0.
    ``position_ids`` and ``parents_bt`` serve the packed layouts exactly as in ``token_logprobs``:
    with ``parents_bt`` (a prefix trie) the state before a token is its parent's column, and a
    token without a parent (-1) gets 0."""

    def __init__(self, decoder: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.autocast_dtype = torch.float32
        """The decoder's autocast dtype (the trainer sets bf16 for ``trainer.precision=bf16``; the head stays fp32)."""

    @classmethod
    def from_policy(cls, policy: torch.nn.Module) -> ValueModel:
        """A critic whose decoder is a copy of ``policy``'s (a Hugging Face causal LM)."""
        get_decoder = getattr(policy, "get_decoder", None)
        if get_decoder is None or get_decoder() is policy:
            raise TypeError(f"{type(policy).__name__} has no separate decoder (get_decoder()): the critic copies "
                            "a Hugging Face causal LM's transformer without its LM head")
        return cls(copy.deepcopy(get_decoder()), policy.config.hidden_size).to(next(policy.parameters()).device)

    def forward(self, input_ids_bt: torch.Tensor, attention_mask_bt: torch.Tensor | None, *,
                position_ids: torch.Tensor | None = None, parents_bt: torch.Tensor | None = None) -> torch.Tensor:
        device = self.head.weight.device  # inputs built on the host (packing, tries) go where the weights are
        input_ids_bt, attention_mask_bt, position_ids, parents_bt = (
            None if x is None else x.to(device) for x in (input_ids_bt, attention_mask_bt, position_ids, parents_bt))
        bf16 = self.autocast_dtype != torch.float32
        with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=bf16):
            out = self.decoder(input_ids=input_ids_bt, attention_mask=attention_mask_bt, position_ids=position_ids,
                               use_cache=False)
        hidden_bth = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        with torch.autocast(hidden_bth.device.type, enabled=False):
            v_bt = self.head(hidden_bth.float()).squeeze(-1)  # v_bt[:, t]: the state after token t
        if parents_bt is None:
            return torch.nn.functional.pad(v_bt[:, :-1], (1, 0))
        return v_bt.gather(1, parents_bt.clamp(min=0)).masked_fill(parents_bt < 0, 0.0)
