"""Build generation requests from prompts (shared by training rollouts and evaluation)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tidal.api import GenRequest
from tidal.types import Prompt, Trajectory


def prompt_ids(tokenizer, prompt: Prompt) -> tuple[int, ...]:
    return (tokenizer.bos_token_id, *tokenizer(prompt.text, add_special_tokens=False).input_ids)


def group_requests(
    tokenizer, prompts: list[Prompt], group_size: int, max_new_tokens: int | None = None
) -> list[GenRequest]:
    """``group_size`` adjacent requests per prompt (adjacency lets the engine share the prefill)."""
    return [GenRequest(p, prompt_ids(tokenizer, p), j, max_new_tokens) for p in prompts for j in range(group_size)]


def generate_by_stream(stream: Callable, requests: Sequence[GenRequest], greedy: bool = False) -> list[Trajectory]:
    """An engine's ``generate`` through its ``stream``: every request is offered as slots free up, and
    the trajectories come back in request order (one implementation for every engine)."""
    pending = list(requests)
    done: dict[int, Trajectory] = {}
    order = {id(r): i for i, r in enumerate(requests)}
    assert len(order) == len(requests), "pass distinct request objects (one per sample)"

    def source(n: int, block: bool) -> list[GenRequest] | None:
        if not pending:
            return None
        taken, pending[:] = pending[:n], pending[n:]
        return taken

    stream(source, lambda r, t: done.__setitem__(order[id(r)], t), greedy=greedy)
    return [done[i] for i in range(len(requests))]


def finished_trajectory(request: GenRequest, tokens: list[int], logprobs: list[float], versions: list[int],
                        finish_reason: str | None, tokenizer) -> Trajectory:
    """A finished sample as a Trajectory (every engine builds them the same way; no reason: ``length``)."""
    return Trajectory(
        prompt_uid=request.prompt.uid,
        sample_index=request.sample_index,
        prompt_ids=list(request.prompt_ids),
        token_ids=tokens,
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish_reason or "length",
        text=tokenizer.decode(tokens, skip_special_tokens=True),
    )
