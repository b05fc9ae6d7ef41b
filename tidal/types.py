"""Plain data that flows through tidal: prompts, trajectories, groups and train batches.

Every generated token carries two facts from the moment it was sampled: the behaviour
log-probability the engine sampled it with, and the policy version whose weights produced it.
All off-policy corrections (staleness, interrupted generations, engine/trainer mismatch) are
computed from those two facts in ``tidal.algo``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # reward workers unpickle Prompts; they should not pay for importing torch
    import torch

DEMONSTRATION = -2
"""The version of a demonstration's trained tokens: no policy sampled them (``train/guidance.py``); the
trainer takes their behaviour log-probs from the policy it updates."""


@dataclass(frozen=True)
class Prompt:
    """One task instance: the text shown to the model and what a verifier needs to score it."""

    uid: str
    text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def images(self) -> list[Any]:
        """The images shown with the prompt, in the order their placeholders render (``meta["images"]``: data
        URLs, paths, bytes or PIL images, whatever ``utils/images.load_image`` reads); empty for a text prompt.
        They live here, once per prompt, not on each sample: a group's samples share them, so the engine and
        the trainer process each distinct image once (``train/vision.py``)."""
        return list(self.meta.get("images") or ())


@dataclass
class Trajectory:
    """One sampled response to a prompt, token by token.

    ``logprobs[i]`` is the engine's log-probability of ``token_ids[i]`` under the sampling
    distribution, and ``versions[i]`` the policy version that sampled it. A generation interrupted
    by a weight update has mixed versions.

    A multi-turn agent episode (``rollout/episodes.py``) is one Trajectory whose ``token_ids``
    interleave what the policy sampled with what the environment returned. ``loss_mask[i]`` is 1 for
    a sampled token and 0 for an observation token, which has log-prob 0.0 and version -1 (no policy
    sampled it); ``episode`` holds the episode's counters (turns, tool calls, errors, latency).
    Single-turn samples leave both None (every token sampled).
    """

    prompt_uid: str
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" (hit its cap) or "repetition" (early stop)
    text: str = ""
    reward: float = 0.0
    reward_details: dict[str, Any] = field(default_factory=dict)
    loss_mask: list[int] | None = None
    episode: dict[str, Any] | None = None
    worker: int | None = None
    """Which rollout worker sampled it (the Ray backend's seat); None: the run's one engine. The SDC
    guard's rollout-side check compares workers by it (``integrity/guard.py``)."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's log-probability of each token (``distill/teacher.py`` fills it
    in the scorer, off the trainer's path); None when no teacher scored this sample."""
    routes: torch.Tensor | None = None
    """MoE models: the experts the engine chose for each token, CPU uint8 [len(prompt_ids) + len(token_ids),
    layers, k] (``models/moe.py``; ``NO_ROUTE`` where it has none, e.g. the last sampled token, never fed),
    replayed by the trainer (routing replay, ``train/routing.py``); None for dense models."""
    images: list[Any] | None = None
    """The pictures behind the image tokens of ``prompt_ids`` + ``token_ids``, in token order, when they are not
    just the prompt's (``Prompt.images``): an agent episode whose observations showed pictures
    (``rollout/episodes.py``), or an endpoint segment rendered from the agent's own messages
    (``serve/recorder.py``). None: the prompt's, and only ``prompt_ids`` shows them (every single-turn sample).
    Image tokens the policy sampled (``loss_mask`` 1) are text, never pictures (``train/vision.py``)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.logprobs) == n and len(self.versions) == n, (
            f"trajectory {self.prompt_uid}/{self.sample_index}: {n} tokens but "
            f"{len(self.logprobs)} logprobs and {len(self.versions)} versions"
        )
        assert self.teacher_logprobs is None or len(self.teacher_logprobs) == n, (
            f"trajectory {self.prompt_uid}/{self.sample_index}: {n} tokens but {len(self.teacher_logprobs)} "
            "teacher log-probs")
        assert self.routes is None or len(self.routes) == len(self.prompt_ids) + n, (
            f"trajectory {self.prompt_uid}/{self.sample_index}: {len(self.prompt_ids) + n} tokens but routes for "
            f"{len(self.routes)}")
        assert self.loss_mask is None or len(self.loss_mask) == n, (
            f"trajectory {self.prompt_uid}/{self.sample_index}: {n} tokens but {len(self.loss_mask)} mask entries")

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens the policy sampled (all of them unless this is an agent episode)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def infra_failed(self) -> bool:
        """An agent episode whose environment itself failed: kept out of its group's baseline."""
        return bool(self.episode and self.episode.get("infra_failure"))

    @property
    def failure(self) -> str | None:
        """Why this sample has nothing to learn from, or None: its episode's environment or agent failed
        (``infra_failed``), or its reward raised or timed out (``reward_details["error"]``: ``rewards/pool.py``
        scores it 0). A run stops when every group of several steps in a row failed (``system/failures.py``)."""
        if self.infra_failed:
            return str(self.episode["infra_failure"])
        error = self.reward_details.get("error") if isinstance(self.reward_details, dict) else None
        return None if error is None else f"the reward failed: {error}"

    @property
    def score_text(self) -> str | None:
        """The text the run's reward scores: the response of a single-turn sample; for an agent episode,
        only the final answer of a harness run with ``harness.reward=task`` (``episode["final_answer"]``);
        None for episodes their environment or agent already rewarded, and for failed ones."""
        if self.episode is None:
            return self.text
        return None if self.infra_failed else self.episode.get("final_answer")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def oldest_version(self) -> int:
        """Version of the first sampled token: staleness is measured from it (AReaL). Observation
        tokens (version -1) are not sampled and do not count."""
        return min((v for v in self.versions if v >= 0), default=-1)


@dataclass
class Group:
    """All samples for one prompt: GRPO-family advantages are computed within a group."""

    prompt: Prompt
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def oldest_version(self) -> int:
        """The oldest sampled token's version; a demonstration (``train/guidance.py``) has none and no age."""
        return min((v for v in (t.oldest_version for t in self.trajectories) if v >= 0), default=-1)


@dataclass
class BatchImages:
    """A TrainBatch's images (``train/vision.py`` builds and reads it), kept on the host: each distinct image
    once (a group's samples share their prompt's; two prompts with the same picture share it too), and for
    every token what the trainer needs to place it. Built once per batch, so no micro-batch, packed row or
    trie recounts image tokens."""

    pixel_values: torch.Tensor
    """float [patches of all distinct images, channels x 2 x patch^2]: the image processor's output."""
    image_grid_thw_n3: torch.Tensor
    """long [N, 3]: each distinct image's (t, h, w) patch grid."""
    row_images: list[list[int]]
    """Per row, the distinct images (indices into ``image_grid_thw_n3``) its image tokens show, in order."""
    feature_index_bt: torch.Tensor
    """long [B, T]: for a prompt's image token, its merged feature's index in the distinct images' features
    concatenated in order; -1 for every other token (text, padding, and any image-pad id a policy sampled)."""
    position_ids_3bt: torch.Tensor
    """long [3, B, T]: M-RoPE positions (temporal, height, width; ``models/vlm.py``), 0 at padding."""

    def rows(self, index: torch.Tensor) -> BatchImages:
        """The images of rows ``index`` (positions, in order): every distinct image is kept (a pass embeds only
        those its rows show), each row keeps its own."""
        return BatchImages(self.pixel_values, self.image_grid_thw_n3, [self.row_images[i] for i in index.tolist()],
                           self.feature_index_bt[index], self.position_ids_3bt[:, index])


@dataclass
class TrainBatch:
    """A right-padded batch of B sequences of length T (prompt + response) ready for the trainer.

    Tensors are named with their shape: ``_bt`` is [B, T]. Position t of the ``_bt`` tensors that
    describe tokens (``loss_mask_bt``, ``behav_logp_bt``, ``versions_bt``) refers to the token at
    ``input_ids_bt[:, t]``, predicted from positions < t. Advantages are not here: the trainer
    computes them from ``rewards_b``, because some estimators need its own log-probs (VCPO) or a
    KL penalty, or are normalized per minibatch (Magistral).
    """

    input_ids_bt: torch.Tensor  # long
    attention_mask_bt: torch.Tensor  # long, 1 for real tokens
    loss_mask_bt: torch.Tensor  # float, 1 for response tokens
    behav_logp_bt: torch.Tensor  # float, engine log-prob of each response token
    versions_bt: torch.Tensor  # long, policy version of each response token (-1 elsewhere)
    group_index_b: torch.Tensor  # long, which group each row came from
    rewards_b: torch.Tensor  # float, each sequence's scalar reward
    teacher_logp_bt: torch.Tensor | None = None  # float, a teacher's log-prob of each response token (distillation)
    routes_btlk: torch.Tensor | None = None
    """uint8 [B, T, layers, k]: the engine's expert choices per token (``Trajectory.routes``; ``NO_ROUTE`` for
    padding and tokens without one), for routing replay (``trainer.moe``); None for dense models."""
    images: BatchImages | None = None
    """The prompts' images for a vision-language policy (``train/vision.py``); None for text (the text path
    never looks further)."""

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids_bt.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask_bt.sum().item())
