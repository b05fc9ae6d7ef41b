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

**Images** (a vision-language policy: its tokenizer carries the processor, ``models/vlm.py``). An observation is
a string or a list of OpenAI content parts: ``{"type": "text", "text": ...}`` and ``{"type": "image_url",
"image_url": {"url": "data:image/png;base64,..."}}`` (or ``{"type": "image", "image": ...}``: anything
``utils/images.load_image`` reads; data URLs keep a journaled episode JSON). ``chat`` renders a prompt with
images (``Prompt.images``) as ``vlm.prompt_ids`` does (the images, then the text, as the user turn) and an
observation with image parts as a ``tool`` message whose parts the template renders as
``<|vision_start|><|image_pad|><|vision_end|>``; each appended ``<|image_pad|>`` is widened to its picture's
token count (``vlm.widen_image_pads``), exactly as a prompt's is. ``RenderState.images`` lists the pictures
behind the context's image tokens in token order (the prompt's, then each observation's), which the next
turn's request carries (``GenRequest.images``). Earlier turns' image tokens are never re-rendered: the context
only grows. ``plain`` places no images (a prompt or observation with one is an error naming
``env.renderer``); text observations, and lists of text parts only, render exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.config import ConfigError
from tidal.models import prompts, vlm
from tidal.types import Prompt

Observation = str | list[dict]
"""What an environment returns for the context: text, or OpenAI content parts (text and images)."""


class NotAppendOnly(ValueError):
    """The chat template changed already-rendered text when a message was added."""


@dataclass
class RenderState:
    """What a renderer remembers about one episode (the chat renderer: the messages so far)."""

    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    """Tool schemas passed to the template on every rendering (the OpenAI server's ``tools``)."""
    images: list[Any] = field(default_factory=list)
    """The pictures behind the context's image tokens, in token order (a vision-language policy's): the prompt's
    as ``Prompt.images`` holds them, then each observation's or message's as its part gave it."""


def is_image_part(part: Any) -> bool:
    """An image content part (``image_url`` or ``image``), as ``VLM_CHAT_TEMPLATE`` decides."""
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part
                                       or "image_url" in part)


def part_image(part: dict, where: str) -> Any:
    """The picture an image part holds (a data URL, path, bytes or PIL image, as given)."""
    value = part.get("image") if part.get("image") is not None else part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None:
        raise ValueError(f"{where}: an image part with no image in it")
    return value


def message_pictures(messages: Sequence[dict], where: str = "messages") -> list[Any]:
    """The pictures of ``messages``' image parts, in the order the template renders their placeholders."""
    out = []
    for m, message in enumerate(messages):
        content = message.get("content")
        for p, part in enumerate(content if isinstance(content, list) else []):
            if is_image_part(part):
                out.append(part_image(part, f"{where}[{m}].content[{p}]"))
    return out


def observation_content(observation: Observation) -> str | list[dict]:
    """A message's content for ``observation``: a string as it is; a list of parts as parts when one is an image,
    else its text parts joined (so a text model's template sees a string, as before)."""
    if isinstance(observation, str):
        return observation
    if any(is_image_part(p) for p in observation):
        return [dict(p) for p in observation]
    return "".join(p.get("text", "") for p in observation)


def observation_text(observation: Observation) -> str:
    """``observation`` as text, for renderers that place no images (an image part is an error)."""
    content = observation_content(observation)
    if not isinstance(content, str):
        raise ConfigError("an observation with images needs env.renderer=chat and a vision-language model "
                          "(env.renderer=plain places text only)")
    return content


class PlainRenderer:
    """BOS + prompt text; observations as their own tokens (see module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def start(self, prompt: Prompt, first: Observation | None) -> tuple[list[int], list[int], RenderState]:
        """(prompt ids, ids of ``reset``'s first observation, state)."""
        if prompt.images:
            raise ConfigError(f"prompt {prompt.uid} has images, which env.renderer=plain cannot place: use "
                              "env.renderer=chat")
        first = observation_text(first) if first else None
        first_ids = self.tokenizer(first, add_special_tokens=False).input_ids if first else []
        return prompts.plain_ids(self.tokenizer, prompt.text), list(first_ids), RenderState()

    def observation_ids(self, state: RenderState, turn_text: str, turn_ids: Sequence[int],
                        observation: Observation) -> list[int]:
        return list(self.tokenizer(observation_text(observation), add_special_tokens=False).input_ids)


class ChatRenderer:
    """The tokenizer's chat template, appended turn by turn (see module docstring)."""

    def __init__(self, tokenizer, tool_role: str = "tool"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("env.renderer=chat needs a tokenizer with a chat template (tokenizer.chat_template)")
        self.tokenizer = tokenizer
        self.tool_role = tool_role
        self.processor = vlm.processor_of(tokenizer)  # a vision-language policy's: places image parts

    def _ids(self, text: str, pictures: list[Any], where: str) -> list[int]:
        """The ids of rendered ``text`` whose image placeholders show ``pictures`` (each widened to its token
        count); text without pictures is tokenized exactly as before."""
        if pictures:
            if self.processor is None:
                raise ValueError(f"{where}: {len(pictures)} image(s), but this model reads text only (no "
                                 "vision-language processor on its tokenizer)")
            text = vlm.widen_image_pads(self.processor, text, pictures, where)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _render(self, state: RenderState, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(state.messages, tools=state.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def start(self, prompt: Prompt, first: Observation | None) -> tuple[list[int], list[int], RenderState]:
        """The user message is the prompt (and ``reset``'s first observation after it, if any); a prompt with
        images shows them first, then its text, as ``vlm.prompt_ids`` renders it."""
        first = observation_content(first) if first else None
        if not prompt.images and not isinstance(first, list):
            ids, state = self.start_messages([{"role": "user", "content": prompt.text + (f"\n{first}" if first
                                                                                          else "")}])
            return ids, [], state
        text = prompt.text + ("\n" + first if isinstance(first, str) else "\n" if first else "")
        content = [*({"type": "image", "image": image} for image in prompt.images), {"type": "text", "text": text},
                   *(first if isinstance(first, list) else [])]
        ids, state = self.start_messages([{"role": "user", "content": content}], where=f"prompt {prompt.uid}")
        return ids, [], state

    def start_messages(self, messages: list[dict], tools: list[dict] | None = None,
                       where: str = "messages") -> tuple[list[int], RenderState]:
        """A conversation's prompt ids (with the generation prompt) and its state; the one place a
        whole conversation is rendered (the first turn, or the OpenAI server's new segment)."""
        state = RenderState([dict(m) for m in messages], tools, message_pictures(messages, where))
        return self._ids(self._render(state, True), state.images, where), state

    def observation_ids(self, state: RenderState, turn_text: str, turn_ids: Sequence[int],
                        observation: Observation) -> list[int]:
        return self.append_ids(state, turn_text, turn_ids, [{"role": self.tool_role,
                                                              "content": observation_content(observation)}],
                               where="observation")

    def append_ids(self, state: RenderState, turn_text: str, turn_ids: Sequence[int],
                   messages: list[dict], where: str = "messages") -> list[int]:
        """The ids to append after a model turn (``turn_text``, sampled as ``turn_ids``) so the context
        becomes the template's rendering of the conversation plus ``messages`` and the generation
        prompt; ``state`` gains the turn, ``messages`` and their pictures. Raises ``NotAppendOnly``."""
        pictures = message_pictures(messages, where)
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
        ids = self._ids(closing + reopened[len(closed):], pictures, where)
        state.images.extend(pictures)
        return ids


RENDERERS = {"plain": PlainRenderer, "chat": ChatRenderer}


def build_renderer(name: str, tokenizer):
    if name not in RENDERERS:
        raise ValueError(f"env.renderer must be one of {sorted(RENDERERS)}, got {name!r}")
    return RENDERERS[name](tokenizer)
