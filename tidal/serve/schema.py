"""The OpenAI wire format: request validation, error bodies, hermes tool calls, response objects.

Requests are validated with pydantic, messages to the field: an assistant's ``tool_calls`` need a
``function`` object with a ``name`` (the chat template reads them), content parts must be text or
``image_url`` (``{"type": "image_url", "image_url": {"url": <data URL>}}``: a vision-language model's pictures;
a part the policy cannot read is refused, not dropped from the context; the server refuses image parts for a
text model, and the picture itself is decoded when the turn is planned, a bad one or a remote URL a 400, since
tidal never downloads), ``tools`` entries need a ``function``.
Anything that would make the recorded behaviour log-probs wrong is refused with a 400 naming the
parameter rather than silently ignored: the sampling
temperature and top-p are the engine's (the trainer scores tokens at the same temperature), ``n``
is 1 (one sample per turn; a group is several episodes), and ``stop`` is not served yet. Unknown
fields are ignored, as OpenAI-compatible servers commonly do. ``stream=true`` is answered with
server-sent events (``stream_chunks``) once the turn is complete: the engine's continuous batch
returns whole turns, so a streaming client works unchanged but gets no earlier first token.

Tool calls follow the hermes format of Qwen2.5/Hermes templates (``tidal/envs/tool_calls.py``):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the model's text become the
message's ``tool_calls``; text before the first block is its ``content``. A turn with a block that
does not parse is returned as plain content (the agent sees what the model wrote) and counted.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.envs.tool_calls import CallFormat, Malformed, ToolCall


class APIError(Exception):
    """An error answered with OpenAI's body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(BaseModel):
    """An assistant message's tool call, as OpenAI sends it (the chat template reads ``function``)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: Function


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """A tool in the request's ``tools``, as OpenAI's schema has it (templates read ``function.name``)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: ToolFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        """Content parts are text, or pictures as ``image_url`` parts (for a vision-language model: the server
        checks the model); anything else is refused, never silently dropped from the context the turn is
        sampled after."""
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    continue
                url = part.get("image_url")
                if part.get("type") == "image_url" and isinstance(url, dict) and isinstance(url.get("url"), str):
                    continue
                raise ValueError("content parts must be {\"type\": \"text\", \"text\": <string>} or "
                                 "{\"type\": \"image_url\", \"image_url\": {\"url\": <data URL>}}")
        return content


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[int]


def parse_request(cls: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body into ``cls``; a 400 naming the first bad field otherwise."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{loc}: {err['msg']}", param=loc) from None


def check_sampling(req: _Sampling, temperature: float, top_p: float) -> None:
    """Refuse parameters that would make the recorded log-probs differ from what was asked for."""
    if req.n != 1:
        raise APIError(400, "n must be 1: each turn is one sample (run several episodes for a group)", param="n")
    if req.stop:
        raise APIError(400, "per-request stop strings are not supported: set rollout.stop on the engine",
                       param="stop")
    if req.temperature is not None and abs(req.temperature - temperature) > 1e-6:
        raise APIError(400, f"temperature must be the engine's ({temperature}): the trainer scores tokens at the "
                            "sampling temperature; omit it or set rollout.temperature", param="temperature")
    if req.top_p is not None and abs(req.top_p - top_p) > 1e-6:
        raise APIError(400, f"top_p must be the engine's ({top_p}); omit it or set rollout.top_p", param="top_p")


HERMES = CallFormat.hermes("", "")


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """``(content, calls)`` if ``text`` holds hermes tool-call blocks that all parse, else None."""
    calls, rest, content = [], text, None
    while (start := rest.find(HERMES.open)) >= 0:
        if content is None:
            content = rest[:start].strip() or None
        end = rest.find(HERMES.close, start)
        if end < 0:
            return None
        parsed = HERMES.parse(rest[start : end + len(HERMES.close)])
        if isinstance(parsed, Malformed) or not isinstance(parsed, ToolCall):
            return None
        calls.append(parsed)
        rest = rest[end + len(HERMES.close):]
    return (content, calls) if calls else None


def assistant_message(text: str, with_tools: bool, call_id_prefix: str) -> tuple[dict, bool]:
    """The OpenAI assistant message for a model turn, and whether its tool calls were malformed."""
    parsed = parse_tool_calls(text) if with_tools else None
    if parsed is None:
        malformed = with_tools and HERMES.open in text
        return {"role": "assistant", "content": text}, malformed
    content, calls = parsed
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"{call_id_prefix}_{i}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(calls)]}, False


def finish_reason(engine_reason: str, message: dict | None = None) -> str:
    if message is not None and message.get("tool_calls"):
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def response(kind: str, rid: str, model: str, choice: dict, num_prompt: int, num_completion: int,
             extra: dict) -> dict:
    """A ``chat.completion`` or ``text_completion`` object; ``extra`` goes under ``tidal`` (token ids,
    versions, segment: what a harness author may want to inspect; clients ignore unknown keys)."""
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                      "total_tokens": num_prompt + num_completion}, "tidal": extra}


def stream_chunks(full: dict, include_usage: bool = False) -> list[dict]:
    """A finished ``chat.completion`` / ``text_completion`` object as the chunks OpenAI streams: for chat,
    a delta with the role and content, one delta per tool call (with its ``index``), then an empty delta
    with the finish reason; for completions, the text then the finish reason. The last chunk carries
    ``tidal`` (token ids, versions); with ``stream_options.include_usage`` a final chunk has the usage and
    no choices, as OpenAI sends it."""
    chat = full["object"] == "chat.completion"
    head = {"id": full["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": full["created"], "model": full["model"]}
    choice = full["choices"][0]
    chunks = []
    if chat:
        message = choice["message"]
        chunks.append({"index": 0, "delta": {"role": "assistant", "content": message.get("content") or ""},
                       "finish_reason": None})
        for i, call in enumerate(message.get("tool_calls") or []):
            chunks.append({"index": 0, "delta": {"tool_calls": [{"index": i, **call}]}, "finish_reason": None})
        chunks.append({"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]})
    else:
        chunks.append({"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": None})
        chunks.append({"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None})
    out = [{**head, "choices": [c]} for c in chunks]
    out[-1]["tidal"] = full["tidal"]
    if include_usage:
        out.append({**head, "choices": [], "usage": full["usage"]})
    return out
