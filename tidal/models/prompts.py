"""How a single-turn task's prompt text becomes the token ids the model reads: the one rule every path shares
(RL rollouts, evaluation, the warm start, distillation, difficulty curation).

- ``chat``: the tokenizer's own chat template applied to ``[system?, user: text]`` with the generation
  prompt, tokenized exactly as ``tokenizer.apply_chat_template(..., tokenize=True)`` tokenizes it (a test
  pins the ids). An instruct model is prompted the way it was tuned: SmolLM2's ChatML with its default
  system prompt, Qwen2.5's, Llama 3's. The model's answer ends with the template's end-of-turn token.
- ``plain``: BOS + the text's tokens (no BOS token: the text alone). Base models and the tiny
  character model, which has no chat template.
- ``auto`` (default): ``chat`` when the tokenizer has a chat template, else ``plain``.

``model.prompt_format`` picks the rule and ``model.system_prompt`` adds a system message (None leaves the
template's own default: SmolLM2's template writes "You are a helpful AI assistant named SmolLM..." when no
system message is given). The run attaches its choice to the tokenizer object (``attach``) where it loads
it, so every consumer of that tokenizer renders the same ids without the setting being threaded through
each call; a tokenizer with nothing attached uses ``auto``.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("auto", "chat", "plain")
_ATTR = "tidal_prompt_format"


@dataclass(frozen=True)
class PromptFormat:
    format: str = "auto"
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"model.prompt_format must be one of {FORMATS}, got {self.format!r}")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def attach(tokenizer, fmt: PromptFormat):
    """Make ``fmt`` the rule for prompts rendered with ``tokenizer`` (returns the tokenizer). A ``chat``
    format on a tokenizer without a template is a clear error here, not at the first prompt."""
    if fmt.format == "chat" and not has_chat_template(tokenizer):
        raise ValueError("model.prompt_format=chat, but the tokenizer has no chat template (use auto or plain)")
    setattr(tokenizer, _ATTR, fmt)
    return tokenizer


def format_of(tokenizer) -> PromptFormat:
    return getattr(tokenizer, _ATTR, None) or PromptFormat()


def uses_chat(tokenizer) -> bool:
    fmt = format_of(tokenizer)
    return fmt.format == "chat" or (fmt.format == "auto" and has_chat_template(tokenizer))


def messages(text: str, fmt: PromptFormat) -> list[dict]:
    """The conversation a chat-rendered prompt is: an optional system message, then the user's text."""
    system = [] if fmt.system_prompt is None else [{"role": "system", "content": fmt.system_prompt}]
    return [*system, {"role": "user", "content": text}]


def plain_ids(tokenizer, text: str) -> list[int]:
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return [*bos, *tokenizer(text, add_special_tokens=False).input_ids]


def chat_ids(tokenizer, text: str, system_prompt: str | None = None) -> list[int]:
    """``text`` as a user turn (after ``system_prompt``, if any) in the chat template, with the generation
    prompt: the ids ``apply_chat_template`` gives."""
    if not has_chat_template(tokenizer):
        raise ValueError("a chat prompt needs a tokenizer with a chat template")
    return list(tokenizer.apply_chat_template(messages(text, PromptFormat("chat", system_prompt)),
                                              add_generation_prompt=True, tokenize=True, return_dict=False))


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids the model reads for prompt ``text`` under the tokenizer's attached format."""
    if not uses_chat(tokenizer):
        return plain_ids(tokenizer, text)
    return chat_ids(tokenizer, text, format_of(tokenizer).system_prompt)


def template_overhead(tokenizer) -> int:
    """Tokens the format adds around a prompt's own (the chat markers and default system prompt, or BOS):
    what a context-fit check adds to ``len(tokenizer(text))`` without rendering every prompt."""
    return len(prompt_ids(tokenizer, ""))


def end_of_turn_ids(tokenizer, model=None) -> frozenset[int]:
    """The ids that end an answer: the tokenizer's EOS and every ``eos_token_id`` of the model's generation
    config. Chat models often end a turn with a token that is not the tokenizer's EOS (Gemma's
    ``<end_of_turn>``, Llama 3's ``<|eot_id|>`` next to ``<|end_of_text|>``): their generation configs list it."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([extra] if isinstance(extra, int) else (extra or []))
    return frozenset(ids)
