"""Configs of the OpenAI-compatible endpoint (``ServeConfig``) and of training an agent harness through
it (``HarnessConfig``, the ``harness`` section of a run config). Plain dataclasses with no web-stack
imports, so a run config can name them without the ``harness`` extra installed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServeConfig:
    """How the endpoint is exposed and bounded."""

    host: str = "127.0.0.1"
    """Bind address. Anything but loopback turns authentication on (a key is generated if none is set)."""
    port: int = 0
    """0 picks a free port (``server.port`` after ``start``)."""
    api_key: str | None = None
    """Required as ``Authorization: Bearer KEY`` when set. Without one the server answers only requests
    whose ``Host`` is loopback (``localhost``, ``127.0.0.1``, ``[::1]``): a web page cannot reach it by DNS
    rebinding. A harness run generates one when none is set (``HarnessConfig.serve``)."""
    max_request_bytes: int = 4 << 20
    """Largest request body (413 beyond it): a conversation is text; 4 MiB is ~1M tokens."""
    max_episodes: int | None = 1024
    """Episodes open at once (429 beyond it); bounds the recorder's memory."""
    episode_timeout_s: float | None = 600.0
    """An episode idle this long (its agent crashed or hung) is dropped and counted."""
    keep_alive_s: float = 75.0
    """Seconds an idle client connection stays open. Longer than the clients' own pool expiry (httpx,
    under the ``openai`` SDK: 5 s), so the client always closes first: at uvicorn's default of 5 s, a
    request reusing a connection just as the server closed it failed as ``APIConnectionError`` (6 of
    15,872 episodes in one harness_quickstart run, whose agents idle while a step trains)."""
    max_tokens: int = 256
    """Completion length when a request sets no ``max_tokens``."""
    max_closed_ids: int = 65536
    """Finished and dropped episode ids remembered, so a late request of one gets 409 ``episode_closed``
    instead of reopening it; the oldest are forgotten beyond this (a long run's memory stays bounded).
    A request for a forgotten id opens a new, empty episode, which nobody finishes: the idle timeout
    drops it (counted in ``harness/timed_out``) and it never reaches training."""
    model_name: str = "policy"
    """The one model served: a request naming another gets 404 ``model_not_found``, as from OpenAI. An agent
    with a model name of its own is served by setting this to that name."""


@dataclass
class HarnessConfig:
    """Train an agent harness (docs/harness.md): the run's episodes come from the user's function
    ``run_episode(client, task) -> reward``, run against the policy's OpenAI-compatible endpoint."""

    function: str | None = None
    """The agent: ``path/to/file.py:run_episode`` (a relative path is looked up from the working
    directory, then from tidal's source checkout) or ``package.module:run_episode``. It gets a real
    ``openai.OpenAI`` client whose base URL carries the episode id, and the task (``tidal.types.Prompt``:
    ``text``, ``answer``, ``meta``); it returns the episode's reward (a number). ``async def`` agents get an
    ``openai.AsyncOpenAI`` client. null (and no ``command``): no harness."""
    command: str | None = None
    """The agent as a separate program, run once per episode (``serve/process.py``): e.g.
    ``python my_agent.py``; it gets ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` for its episode and the task
    in ``TIDAL_TASK`` (JSON), and prints its reward as its last stdout line (or nothing, with
    ``harness.reward=task``). Exclusive with ``function``."""
    reward: str = "agent"
    """Who rewards an episode: ``agent`` (the number ``run_episode`` returns) or ``task`` (the run's task
    reward, ``reward.*``, scored on the episode's final answer: the content of the last reply the agent
    got; ``run_episode`` may then return None, and any number it returns is ignored). ``task`` lets an
    agent that only talks (no grading code) train on tidal's verifiers: math-verify, unit tests, judges."""
    max_concurrent_episodes: int = 256
    """Agents running at once (one thread each; their HTTP calls share the engine's continuous batch).
    At least ``rollout.group_size``: groups are admitted whole."""
    episode_timeout_s: float = 120.0
    """Seconds an agent may take for one episode; past it the episode is dropped (an infrastructure
    failure, left out of its group's baseline, counted in ``harness/hung``) and its thread abandoned."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """The endpoint the agents talk to: loopback, with a key generated for the run unless ``api_key`` is
    set (the agents' clients carry it; episode ids are predictable, so without one any local process could
    add turns to a live episode). Its ``max_tokens`` (a turn's length when the agent sets none) is replaced
    by ``rollout.max_new_tokens``."""

    @property
    def enabled(self) -> bool:
        """Whether the run's episodes come from an agent (a function or a command)."""
        return self.function is not None or self.command is not None
