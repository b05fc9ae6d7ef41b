"""Build generation requests from prompts (shared by training rollouts and evaluation)."""

from __future__ import annotations

from tidal.api import GenRequest
from tidal.types import Prompt


def prompt_ids(tokenizer, prompt: Prompt) -> tuple[int, ...]:
    return (tokenizer.bos_token_id, *tokenizer(prompt.text, add_special_tokens=False).input_ids)


def group_requests(
    tokenizer, prompts: list[Prompt], group_size: int, max_new_tokens: int | None = None
) -> list[GenRequest]:
    """``group_size`` adjacent requests per prompt (adjacency lets the engine share the prefill)."""
    return [GenRequest(p, prompt_ids(tokenizer, p), j, max_new_tokens) for p in prompts for j in range(group_size)]
