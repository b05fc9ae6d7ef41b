"""A reward model: the policy's architecture with a scalar head, read at each sequence's last token.

The model is a Hugging Face ``*ForSequenceClassification`` with ``num_labels=1`` built from a causal LM's
config (``from_policy``: the backbone's weights copied, the head new), as TRL's RewardTrainer and
OpenRLHF build theirs; saved with ``save_pretrained`` it loads back with ``AutoModelForSequenceClassification``.
The reward of a sequence is the head applied to the last token's final hidden state (InstructGPT's
reward model reads the end-of-sequence token; Ouyang et al. 2022, sec. 3.5).

``RewardModelScorer`` scores (prompt, response) texts in batches, rendering each as the chat the model
was trained on (one user turn, one assistant turn, the tokenizer's template): ``reward.name=rm``
(``rewards/rm.py``) runs it inside a reward worker.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from tidal.models import tiny


def from_policy(policy: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A sequence-classification model (one output) on ``policy``'s architecture and backbone weights. The new
    head (Hugging Face's init: normal, std ``initializer_range``) is drawn from ``seed``, not from torch's global
    RNG: otherwise a reward model depends on whatever drew from it earlier in the process."""
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.architectures = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    body = getattr(rm, rm.base_model_prefix)
    body.load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
    return rm


def backbone(rm: torch.nn.Module) -> torch.nn.Module:
    """The reward model's transformer (what the ``score`` head reads), through a PEFT wrapper too: on a
    ``PeftModel`` ``getattr(rm, rm.base_model_prefix)`` is the whole classifier (PEFT's own ``model``)."""
    inner = rm.get_base_model() if hasattr(rm, "get_base_model") else rm
    return getattr(inner, inner.base_model_prefix)


def last_token_rewards(rm: torch.nn.Module, input_ids_bt: torch.Tensor, lengths_b: list[int]) -> torch.Tensor:
    """[B] rewards of right-padded sequences: the head at each sequence's last real token."""
    device = next(rm.parameters()).device
    ids = input_ids_bt.to(device)
    attn = (torch.arange(ids.shape[1], device=device)[None] < torch.tensor(lengths_b, device=device)[:, None]).long()
    hidden_bth = backbone(rm)(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    last = hidden_bth[torch.arange(len(lengths_b), device=device), torch.tensor(lengths_b, device=device) - 1]
    return rm.score(last).squeeze(-1).float()


class RewardModelScorer:
    """Scores (prompt, response) pairs with a saved reward model, ``batch_size`` at a time, on CPU."""

    def __init__(self, path: str | Path, batch_size: int = 32, max_length: int = 1024, threads: int = 0):
        path = Path(path)
        if threads:
            torch.set_num_threads(threads)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"no reward model at {path} (config.json missing)")
        self.tokenizer = tiny.load_tokenizer(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True,
                                                                        dtype=torch.float32).eval()
        self.batch_size, self.max_length = batch_size, max_length

    def encode(self, prompt: str, response: str) -> list[int]:
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        ids = self.tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        return list(ids)[: self.max_length]

    @torch.no_grad()
    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(pairs), self.batch_size):
            seqs = [self.encode(p, r) for p, r in pairs[start: start + self.batch_size]]
            lengths = [len(s) for s in seqs]
            ids = torch.zeros((len(seqs), max(lengths)), dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
            out += last_token_rewards(self.model, ids, lengths).tolist()
        return out
