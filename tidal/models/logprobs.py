"""Per-token log-probabilities and entropies of given sequences under a causal LM.

``logp_bt[:, t]`` is log p(input_ids[:, t] | input_ids[:, :t]); position 0 (nothing predicts it) is
0. Logits are divided by the sampling temperature so trainer and engine score the same
distribution, and the log-softmax runs in float32 whatever the model's dtype (MiniMax-M1's
precision fix for the LM head, arXiv 2506.13585 sec. 3.3).
"""

from __future__ import annotations

import torch


def token_logprobs(
    model: torch.nn.Module,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(input_ids=input_ids_bt, attention_mask=attention_mask_bt).logits[:, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids_bt[:, 1:, None]).squeeze(-1)
    logp_bt = torch.nn.functional.pad(logp, (1, 0))
    entropy_bt = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
        entropy_bt = torch.nn.functional.pad(ent, (1, 0))
    return logp_bt, entropy_bt
