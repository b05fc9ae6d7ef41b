"""Renderers: the one place where an agent episode's text becomes tokens.

An episode's context only ever grows by appending token ids: the prompt's ids, then each turn's
sampled ids, then each observation's ids. A renderer decides what those prompt and observation ids
are; it never re-renders what is already in the context (re-tokenizing decoded text drifts:
``docs/agentic.md``).

- ``plain``: the prompt is BOS + its text's tokens (as single-turn RL), an observation its own text's
  tokens. For base models and the tiny model.
- ``chat``: the tokenizer's chat template (an instruct model's roles and markers). The prompt is
  the template applied to ``[user: prompt]`` with the generation prompt. An observation is the text
  the template puts between the end of the assistant's turn and the start of the next one, with the
  observation as a ``tool`` message: rendered once for [..., assistant, tool] + generation prompt,
  minus the rendering of [..., assistant], plus whatever of the assistant's closing marker the model
  did not sample (a turn cut by a stop string did not sample the end-of-turn token).

Some templates are not append-only: rendering the conversation with one more message changes text
already rendered (Qwen3's drops earlier turns' thinking). Appending the observation would then train
on a context the template would never produce, and re-rendering would change tokens already sampled;
``ChatRenderer`` detects it (the longer rendering does not start with the shorter one) and raises
``NotAppendOnly``, which ends the episode with finish reason ``not_append_only`` (counted), never
silently re-rendering history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.models import prompts
from tidal.types import Prompt


class NotAppendOnly(ValueError):
    """The chat template changed already-rendered text when a message was added."""


@dataclass
class RenderState:
    """What a renderer remembers about one episode (the chat renderer: the messages so far)."""

    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    """Tool schemas passed to the template on every rendering (the OpenAI server's ``tools``)."""


class PlainRenderer:
    """BOS + prompt text; observations as their own tokens (see module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, prompt: Prompt, first: str | None) -> tuple[list[int], list[int], RenderState]:
        """(prompt ids, ids of ``reset``'s first observation, state)."""
        first_ids = self.tokenizer(first, add_special_tokens=False).input_ids if first else []
        return prompts.plain_ids(self.tokenizer, prompt.text), list(first_ids), RenderState()

    def observation_ids(self, state: RenderState, turn_text: str, turn_ids: Sequence[int], text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


class ChatRenderer:
    """The tokenizer's chat template, appended turn by turn (see module docstring)."""

    def __init__(self, tokenizer, tool_role: str = "tool"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("env.renderer=chat needs a tokenizer with a chat template (tokenizer.chat_template)")
        self.tokenizer = tokenizer
        self.tool_role = tool_role

    def _render(self, state: RenderState, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(state.messages, tools=state.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def start(self, prompt: Prompt, first: str | None) -> tuple[list[int], list[int], RenderState]:
        """The user message is the prompt (and ``reset``'s first observation after it, if any)."""
        ids, state = self.start_messages([{"role": "user", "content": prompt.text + (f"\n{first}" if first else "")}])
        return ids, [], state

    def start_messages(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], RenderState]:
        """A conversation's prompt ids (with the generation prompt) and its state; the one place a
        whole conversation is rendered (the first turn, or the OpenAI server's new segment)."""
        state = RenderState([dict(m) for m in messages], tools)
        return list(self.tokenizer(self._render(state, True), add_special_tokens=False).input_ids), state

    def observation_ids(self, state: RenderState, turn_text: str, turn_ids: Sequence[int], text: str) -> list[int]:
        return self.append_ids(state, turn_text, turn_ids, [{"role": self.tool_role, "content": text}])

    def append_ids(self, state: RenderState, turn_text: str, turn_ids: Sequence[int],
                   messages: list[dict]) -> list[int]:
        """The ids to append after a model turn (``turn_text``, sampled as ``turn_ids``) so the context
        becomes the template's rendering of the conversation plus ``messages`` and the generation
        prompt; ``state`` gains the turn and ``messages``. Raises ``NotAppendOnly``."""
        before = self._render(state, generation_prompt=True)
        state.messages.append({"role": "assistant", "content": turn_text})
        closed = self._render(state, generation_prompt=False)
        state.messages.extend(dict(m) for m in messages)
        reopened = self._render(state, generation_prompt=True)
        if not (closed.startswith(before + turn_text) and reopened.startswith(closed)):
            raise NotAppendOnly("the chat template re-renders earlier messages")
        closing = closed[len(before) + len(turn_text):]  # e.g. "<|im_end|>\n" after the assistant's content
        eos = self.tokenizer.eos_token or ""
        if turn_ids and turn_ids[-1] == self.tokenizer.eos_token_id and closing.startswith(eos):
            closing = closing[len(eos):]  # the model sampled the end-of-turn token itself
        return list(self.tokenizer(closing + reopened[len(closed):], add_special_tokens=False).input_ids)


RENDERERS = {"plain": PlainRenderer, "chat": ChatRenderer}


def build_renderer(name: str, tokenizer):
    if name not in RENDERERS:
        raise ValueError(f"env.renderer must be one of {sorted(RENDERERS)}, got {name!r}")
    return RENDERERS[name](tokenizer)
