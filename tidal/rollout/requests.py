"""Build generation requests from prompts (shared by training rollouts and evaluation)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from tidal.api import GenRequest
from tidal.config import ConfigError
from tidal.models import vlm
from tidal.models.prompts import format_of, template_overhead
from tidal.models.prompts import prompt_ids as rendered_ids
from tidal.types import Prompt, Trajectory
from tidal.utils.seeding import stable_hash


def prompt_ids(tokenizer, prompt: Prompt) -> tuple[int, ...]:
    """The ids of a single-turn prompt: its chat-template rendering, or BOS + text (``models/prompts.py``); a prompt
    with images through the vision-language model's processor attached to ``tokenizer`` (``models/vlm.py``), each
    image's placeholder widened to its token count."""
    if not prompt.images:
        return tuple(rendered_ids(tokenizer, prompt.text))
    processor = vlm.processor_of(tokenizer)
    if processor is None:
        raise ConfigError(f"prompt {prompt.uid} has {len(prompt.images)} image(s) but the model reads text only: "
                          "train a vision-language model (model.vision=true, or a Qwen2-VL model.path)")
    fmt = format_of(tokenizer)
    if fmt.format == "plain":
        raise ConfigError(f"prompt {prompt.uid} has images, which only a chat rendering places "
                          "(model.prompt_format=plain): use auto or chat")
    return tuple(vlm.prompt_ids(processor, prompt.text, prompt.images, fmt.system_prompt, f"prompt {prompt.uid}"))


def sampling_key(seed: int, request: GenRequest) -> int:
    """The key of a request's sampling noise: (run seed, prompt uid, sample index), and the turn for an
    agent episode's later turns (whose positions restart at 0 and must not replay turn 0's noise)."""
    if request.turn == 0:
        return stable_hash(seed, request.prompt.uid, request.sample_index)
    return stable_hash(seed, request.prompt.uid, request.sample_index, request.turn)


def unknown_ids(tokenizer) -> set[int]:
    """The ids a character outside the vocabulary encodes to: the unknown token, and the pad token when it
    is not EOS (the tiny tokenizer's unknown token is <pad>)."""
    unknown = {tokenizer.unk_token_id} if tokenizer.unk_token_id is not None else set()
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        unknown.add(tokenizer.pad_token_id)
    return unknown


def check_prompts_fit(tokenizer, prompts: Iterable[tuple[str, Prompt]], context: int, max_new_tokens: int,
                      chunk: int = 1024) -> int:
    """Raise a ConfigError naming the first prompt the model cannot answer, before any work is done.

    ``prompts`` yields ``(where, prompt)``, ``where`` naming the row for the message (``train row 17``).
    A prompt fails when its tokens plus ``max_new_tokens`` exceed ``context`` (the model's
    ``max_position_embeddings``: such a prompt would crash generation or, in the warm start, allocate
    for its whole length), or when it holds characters the tokenizer cannot encode (a word-level or
    character tokenizer maps them to its unknown token; the tiny model's maps them to <pad>, silently
    changing the prompt). Returns the number of prompts checked."""
    unknown = unknown_ids(tokenizer)
    budget = context - max_new_tokens - template_overhead(tokenizer)  # BOS, or the chat template's markers
    if budget < 1:
        raise ConfigError(f"rollout.max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                          f"context of {context} tokens (model.max_position_embeddings)")
    prompts, checked = iter(prompts), 0
    while batch := list(islice(prompts, chunk)):
        encoded = tokenizer([p.text for _, p in batch], add_special_tokens=False).input_ids
        for (where, p), ids in zip(batch, encoded):
            if p.images:  # rendered whole: its pictures' tokens count (and a text model is refused, naming the row)
                _check_image_prompt(tokenizer, where, p, context, max_new_tokens)
            elif len(ids) > budget:
                raise ConfigError(
                    f"{where}: the prompt is {len(ids):,} tokens, and with rollout.max_new_tokens={max_new_tokens} "
                    f"it does not fit the model's context of {context} (model.max_position_embeddings): shorten or "
                    "drop it")
            if unknown.intersection(ids):
                encode = lambda c: tokenizer(c, add_special_tokens=False).input_ids  # noqa: E731
                bad = sorted({c for c in p.text if unknown.intersection(encode(c))})
                raise ConfigError(f"{where}: the prompt has characters the tokenizer cannot encode: {bad[:10]} "
                                  f"(the model would see {tokenizer.convert_ids_to_tokens(min(unknown))} instead)")
        checked += len(batch)
    return checked


def _check_image_prompt(tokenizer, where: str, prompt: Prompt, context: int, max_new_tokens: int) -> None:
    """A prompt with pictures fits when its whole rendering (pictures widened to their tokens) plus
    ``max_new_tokens`` does."""
    try:
        ids = prompt_ids(tokenizer, prompt)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if len(ids) + max_new_tokens > context:
        raise ConfigError(f"{where}: the prompt is {len(ids):,} tokens with its {len(prompt.images)} image(s), and "
                          f"with rollout.max_new_tokens={max_new_tokens} it does not fit the model's context of "
                          f"{context} (model.max_position_embeddings): fewer or smaller images, or a longer context")


def group_requests(
    tokenizer, prompts: list[Prompt], group_size: int, max_new_tokens: int | None = None
) -> list[GenRequest]:
    """``group_size`` adjacent requests per prompt (adjacency lets the engine share the prefill); each
    prompt is tokenized once, not once per sample."""
    return [GenRequest(p, ids, j, max_new_tokens) for p in prompts
            for ids in (prompt_ids(tokenizer, p),) for j in range(group_size)]


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
