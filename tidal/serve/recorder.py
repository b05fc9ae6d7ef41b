"""Episode records for the OpenAI-compatible server: exact token ids across an agent's turns.

An agent written against the ``openai`` client resends its whole conversation each turn, as text.
Re-tokenizing that text would train on ids the engine never sampled (a BPE merge across a turn's
boundary changes them: ``docs/agentic.md``). So the server keeps, per episode, the token context it
built, and continues it:

**The exactness rule.** A request *continues* a recorded segment when the segment's conversation is
a prefix of the request's: for chat, the recorded messages (the assistant messages as the server
returned them: content and tool calls, call ids ignored) equal the request's first messages; for
completions, the recorded text (or token ids, when the prompt is a list of ids) is a prefix of the
prompt. The new context is then the segment's recorded ids plus the ids of what the request adds
(tool results, user messages: the chat template's text between the model's turn and the next
generation prompt, ``ChatRenderer.append_ids``), masked as observations. A request that continues
no segment (the agent edited, dropped or reordered history, or branched from an earlier turn)
starts a **new segment** rendered from scratch and is counted in ``history_edits``; the old
segment is kept intact. So a sampled token's log-prob is never attributed to a context it was not
sampled in. A chat template that re-renders earlier turns (``NotAppendOnly``) also starts a new
segment, counted in ``not_append_only``.

**Pictures** (a vision-language model: its tokenizer carries the processor). ``image_url`` parts render through
the chat template and are widened to their image tokens (``ChatRenderer``); a segment keeps its pictures in token
order (``RenderState.images``), every turn's request carries them (``GenRequest.images``: the task's prompt is not
what the agent rendered) and so does the segment's trajectory (``Trajectory.images``, possibly empty). For the
exactness rule a picture matches by its URL's hash, so a follow-up that repeats the conversation continues from
the recorded ids, earlier pictures and all. A turn that sampled a vision marker is not continued (its ids would
make the next context's image tokens disagree with its pictures): the follow-up starts a new segment, counted in
``vision_tokens``.

Each segment with sampled tokens becomes one ``Trajectory`` exactly as ``EpisodeEngine`` builds
them: ``prompt_ids`` the segment's first context, ``token_ids`` everything after it up to the last
sampled token, ``loss_mask`` 1 on sampled tokens (behaviour log-prob, version) and 0 on
observations (log-prob 0.0, version -1). Every segment of an episode gets the episode's reward.

Not thread-safe per episode: the server serializes one episode's requests (an asyncio lock), and
only ``open``, ``finish``, ``drop`` and ``reap`` take the recorder's lock.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tidal.api import GenRequest
from tidal.models import vlm
from tidal.rollout.render import ChatRenderer, NotAppendOnly, RenderState, is_image_part, part_image
from tidal.types import Prompt, Trajectory


class TooManyEpisodes(RuntimeError):
    """The server's concurrent-episode limit is reached."""


class ContextTooLong(ValueError):
    """The request's context leaves no room for one generated token."""


class EpisodeClosed(RuntimeError):
    """The episode was finished or dropped while a request of it was running."""


@dataclass
class Segment:
    """One contiguous token context of an episode (see module docstring)."""

    index: int
    kind: str  # "chat" or "completion"
    context: list[int]
    num_prompt: int
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    sampled_end: int = 0  # len(context) after the last sampled token
    render: RenderState | None = None  # chat: the template's view of the conversation
    seen: list[Any] = field(default_factory=list)  # chat: normalized messages covered
    text: str = ""  # completion: the exact prompt text covered
    last_turn_text: str = ""
    last_turn_ids: list[int] = field(default_factory=list)
    last_answer: str = ""  # the last turn's answer as the client got it: message content, or completion text
    turns: int = 0


@dataclass
class Episode:
    id: str
    prompt: Prompt
    segments: list[Segment] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    turns: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"history_edits": 0, "not_append_only": 0,
                                                            "tool_calls": 0, "malformed_tool_calls": 0,
                                                            "vision_tokens": 0})
    closed: bool = False
    lock: Any = None  # the server's asyncio.Lock serializing this episode's requests


@dataclass
class Plan:
    """A turn about to be generated: the request and what committing it changes."""

    episode: Episode
    segment: Segment  # an existing segment, or a new one not yet in ``episode.segments``
    is_new: bool
    context: list[int]  # the full context the turn is sampled after
    request: GenRequest
    render: RenderState | None = None
    seen: list[Any] = field(default_factory=list)
    text: str = ""


def normalize_message(m: dict) -> tuple:
    """What of an OpenAI message must match for a request to continue a recorded conversation:
    role, text content (parts joined) and tool calls as (name, parsed arguments); ids are ignored
    (a client may rewrite them), and None content equals ''."""
    content = m.get("content") or ""
    if isinstance(content, list) and any(is_image_part(p) for p in content):  # pictures match by their URL's hash
        content = tuple(("image", hashlib.sha256(str(part_image(p, "message")).encode()).hexdigest())
                        if is_image_part(p) else ("text", p.get("text", "")) for p in content)
    elif isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments", "")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return (m.get("role"), content, tuple(calls))


def template_message(m: dict) -> dict:
    """The message as the chat template sees it: text content (or text and image parts, when it shows pictures),
    the OpenAI fields templates read."""
    out = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id", "tool_calls") and v is not None}
    content = m.get("content") or ""
    if isinstance(content, list) and any(is_image_part(p) for p in content):
        content = [dict(p) for p in content if isinstance(p, dict)]
    elif isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out["content"] = content
    return out


class EpisodeRecorder:
    """Every episode's segments, the exactness rule and the counters (see module docstring)."""

    def __init__(self, tokenizer, context_len: int, default_max_tokens: int, max_episodes: int | None = None,
                 episode_timeout_s: float | None = None, max_closed_ids: int = 65536):
        self.tokenizer = tokenizer
        self.chat = ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        self.vision = vlm.processor_of(tokenizer) is not None  # a vision-language model: segments carry pictures
        self.vision_ids = vlm.vision_token_ids(tokenizer)
        self.context_len = context_len
        self.default_max_tokens = default_max_tokens
        self.max_episodes = max_episodes
        self.episode_timeout_s = episode_timeout_s
        self.episodes: dict[str, Episode] = {}
        # a late request of a finished or dropped episode must not reopen it: the newest ``max_closed_ids``
        # ids are remembered (insertion-ordered dict as a FIFO set), so memory stays bounded on a long run
        self.closed_ids: dict[str, None] = {}
        self.max_closed_ids = max_closed_ids
        self.lock = threading.Lock()
        self.totals = {"episodes": 0, "finished": 0, "dropped": 0, "timed_out": 0, "history_edits": 0,
                       "not_append_only": 0, "undelivered": 0, "vision_tokens": 0}

    # ---- episode lifecycle ----------------------------------------------------------------------
    def open(self, episode_id: str, prompt: Prompt | None = None) -> Episode:
        """The live episode ``episode_id``, opened on first use (``TooManyEpisodes`` past the limit)."""
        self.reap()
        with self.lock:
            ep = self.episodes.get(episode_id)
            if ep is None and episode_id in self.closed_ids:
                raise EpisodeClosed(f"episode {episode_id!r} was finished, dropped or timed out")
            if ep is None:
                if self.max_episodes is not None and len(self.episodes) >= self.max_episodes:
                    raise TooManyEpisodes(f"{len(self.episodes)} episodes are open, the server's limit "
                                          f"(max_episodes={self.max_episodes}); finish one first")
                ep = Episode(episode_id, prompt or Prompt(episode_id, "", ""))
                self.episodes[episode_id] = ep
                self.totals["episodes"] += 1
            ep.last_active = time.monotonic()
            return ep

    def finish(self, episode_id: str, reward: float) -> list[Trajectory]:
        """Close the episode: one Trajectory per segment that sampled tokens, each with ``reward``."""
        with self.lock:
            ep = self.episodes.pop(episode_id, None)
            if ep is None:
                raise KeyError(f"no open episode {episode_id!r} (finished, dropped, timed out or never used)")
            ep.closed = True
            self._remember_closed(episode_id)
            self.totals["finished"] += 1
        return [self._trajectory(ep, s, reward) for s in ep.segments if s.sampled_end > s.num_prompt]

    def drop(self, episode_id: str, why: str = "dropped") -> bool:
        """Forget an episode without training on it (its agent crashed or hung); counted."""
        with self.lock:
            ep = self.episodes.pop(episode_id, None)
            if ep is None:
                return False
            ep.closed = True
            self._remember_closed(episode_id)
            self.totals["timed_out" if why == "timeout" else "dropped"] += 1
            return True

    def _remember_closed(self, episode_id: str) -> None:
        """Remember a closed id (under ``self.lock``), forgetting the oldest beyond ``max_closed_ids``."""
        self.closed_ids[episode_id] = None
        while len(self.closed_ids) > self.max_closed_ids:
            del self.closed_ids[next(iter(self.closed_ids))]

    def known(self, episode_id: str) -> bool:
        """Whether ``episode_id`` is open or remembered as closed (a new episode must pick another id)."""
        with self.lock:
            return episode_id in self.episodes or episode_id in self.closed_ids

    def reap(self) -> list[str]:
        """Drop the episodes idle for longer than ``episode_timeout_s`` (an agent that never finished)."""
        if self.episode_timeout_s is None:
            return []
        now = time.monotonic()
        with self.lock:
            stale = [e.id for e in self.episodes.values()
                     if now - e.last_active > self.episode_timeout_s and not (e.lock and e.lock.locked())]
        return [i for i in stale if self.drop(i, "timeout")]

    # ---- planning a turn ------------------------------------------------------------------------
    def plan_chat(self, ep: Episode, messages: list[dict], tools: list[dict] | None,
                  max_tokens: int | None) -> Plan:
        if self.chat is None:
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        seen = [normalize_message(m) for m in messages]
        for seg in reversed(ep.segments):  # the most recent segment that the request continues
            n = len(seg.seen)
            if seg.kind != "chat" or n > len(seen) or seg.seen != seen[:n] or seg.render.tools != tools:
                continue
            if not self.vision_ids.isdisjoint(seg.last_turn_ids):  # its image tokens would not match its pictures
                ep.counts["vision_tokens"] += 1
                self._count("vision_tokens")
                break
            render = copy.deepcopy(seg.render)
            try:
                ids = self.chat.append_ids(render, seg.last_turn_text, seg.last_turn_ids,
                                           [template_message(m) for m in messages[n:]], f"messages[{n}:]")
            except NotAppendOnly:
                ep.counts["not_append_only"] += 1
                self._count("not_append_only")
                break
            return self._plan(ep, seg, False, seg.context + ids, max_tokens, render=render, seen=seen)
        else:
            self._count_edit(ep)
        ids, render = self.chat.start_messages([template_message(m) for m in messages], tools, "messages")
        seg = Segment(len(ep.segments), "chat", ids, len(ids))
        return self._plan(ep, seg, True, ids, max_tokens, render=render, seen=seen)

    def plan_completion(self, ep: Episode, prompt: str | list[int], max_tokens: int | None) -> Plan:
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            bad = next((i for i in prompt if not 0 <= i < vocab), None)
            if bad is not None:  # the engine would index its embedding with it
                raise ValueError(f"token id {bad} is not in the model's vocabulary (0 <= id < {vocab})")
        for seg in reversed(ep.segments):
            if seg.kind != "completion" or seg.turns == 0:
                continue
            if isinstance(prompt, list) and prompt[: len(seg.context)] == seg.context:
                return self._plan(ep, seg, False, list(prompt), max_tokens)
            if isinstance(prompt, str) and prompt.startswith(seg.text):
                suffix = prompt[len(seg.text):]
                ids = self.tokenizer(suffix, add_special_tokens=False).input_ids if suffix else []
                return self._plan(ep, seg, False, seg.context + list(ids), max_tokens, text=prompt)
        self._count_edit(ep)
        if isinstance(prompt, list):
            ids = list(prompt)
        else:
            bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
            ids = bos + list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        seg = Segment(len(ep.segments), "completion", ids, len(ids))
        return self._plan(ep, seg, True, ids, max_tokens, text=prompt if isinstance(prompt, str) else "")

    def _count_edit(self, ep: Episode) -> None:
        if ep.segments:  # the first segment of an episode is not an edit
            ep.counts["history_edits"] += 1
            self._count("history_edits")

    def _count(self, key: str) -> None:
        """One more in ``totals`` (turns of different episodes are planned on different threads)."""
        with self.lock:
            self.totals[key] += 1

    def _plan(self, ep: Episode, seg: Segment, is_new: bool, context: list[int], max_tokens: int | None,
              **kw: Any) -> Plan:
        if not context:
            raise ValueError("the prompt is empty: a turn is sampled after at least one token")
        budget = self.context_len - len(context)
        if budget < 1:
            raise ContextTooLong(f"the conversation is {len(context)} tokens, the model's context is "
                                 f"{self.context_len}: no room for a completion")
        want = max_tokens or self.default_max_tokens
        # sampling noise is keyed by the episode id (not the task: a group's episodes share one task)
        render = kw.get("render")
        images = tuple(render.images) if render is not None and render.images else None  # the engine's pictures
        request = GenRequest(Prompt(ep.id, "", ""), tuple(context), 0, min(want, budget), turn=ep.turns,
                             episode=True, images=images)  # the next request of the episode extends this context
        return Plan(ep, seg, is_new, context, request, **kw)

    # ---- recording a turn -----------------------------------------------------------------------
    def commit(self, plan: Plan, traj: Trajectory, returned: dict | None = None, completion_text: str = "") -> None:
        """Record a finished turn: the observation ids the plan added (masked) and the sampled ones.
        ``returned``: the assistant message as sent to the client (chat)."""
        ep, seg = plan.episode, plan.segment
        if ep.closed:
            raise EpisodeClosed(f"episode {ep.id!r} was finished or dropped while this request ran")
        added = plan.context[len(seg.context):]
        assert plan.context[: len(seg.context)] == seg.context, "a continuation must extend its segment's ids"
        seg.context = plan.context + list(traj.token_ids)
        seg.logprobs += [0.0] * len(added) + list(traj.logprobs)
        seg.versions += [-1] * len(added) + list(traj.versions)
        seg.mask += [0] * len(added) + [1] * len(traj.token_ids)
        seg.sampled_end = len(seg.context)
        seg.last_turn_ids, seg.last_turn_text = list(traj.token_ids), traj.text
        seg.turns += 1
        seg.last_answer = (returned.get("content") or "") if returned is not None else completion_text
        if plan.render is not None:
            seg.render = plan.render
            seg.seen = [*plan.seen, normalize_message(returned or {"role": "assistant", "content": traj.text})]
        if seg.kind == "completion":
            seg.text = plan.text + completion_text
        if plan.is_new:
            ep.segments.append(seg)
        ep.turns += 1
        ep.last_active = time.monotonic()

    def discard(self) -> None:
        """A generated turn whose client went away before receiving it: not recorded (the agent never saw
        it, so it neither shaped the episode's reward nor is in the agent's next request), counted."""
        self._count("undelivered")

    def _trajectory(self, ep: Episode, seg: Segment, reward: float) -> Trajectory:
        n = seg.sampled_end - seg.num_prompt
        ids = seg.context[seg.num_prompt : seg.sampled_end]
        info = {"turns": seg.turns, "segment": seg.index, "num_segments": len(ep.segments), **ep.counts,
                "infra_failure": None, "num_versions": len({v for v in seg.versions[:n] if v >= 0}),
                "last_answer": seg.last_answer}
        return Trajectory(
            prompt_uid=ep.prompt.uid, sample_index=seg.index, prompt_ids=seg.context[: seg.num_prompt],
            token_ids=ids, logprobs=seg.logprobs[:n], versions=seg.versions[:n], finish_reason="stop",
            text=self.tokenizer.decode(ids, skip_special_tokens=True), reward=reward,
            reward_details={"harness_reward": reward}, loss_mask=seg.mask[:n], episode=info,
            images=list(seg.render.images if seg.render is not None else []) if self.vision else None)
