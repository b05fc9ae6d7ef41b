"""Off-policy guidance: a task's demonstration joins every group in which all samples failed.

GRPO learns nothing from a prompt whose samples all fail: their rewards are equal, so every advantage
is 0. LUFFY (Yan et al. 2025, arXiv 2504.14945) mixes off-policy demonstrations into the groups, so
the advantages are computed over the policy's samples and the demonstration together: the
demonstration is pushed up and the failed samples down. ReLIFT (Ma et al. 2025, arXiv 2506.07527)
spends demonstrations only on the questions the policy fails. tidal combines the two. With
``algo.guidance=all_fail``, a group in which no sample reached ``algo.guidance_reward`` gets one more
member: the task's demonstration (``Task.sft_example``, what the warm start trains on), with reward
``guidance_reward``.

**Behaviour log-probs.** No policy sampled a demonstration, so it has none. Its trained tokens carry
the version ``DEMONSTRATION``, and the trainer fills their behaviour log-probs from the policy it is
about to update (``demonstration_rows``). Their importance ratio starts at 1, so the loss's gradient on
them is A * grad log pi, as for a fresh sample. LUFFY goes further: it reshapes the off-policy
ratio to pi / (pi + 0.1), which weighs tokens the policy finds unlikely more, and it drops clipping
on those tokens. tidal keeps the configured loss unchanged.

**Tokens.** The demonstration continues the context the policy saw for the prompt: the prompt ids of
the group's first sample. A text demonstration is its answer's tokens, then EOS, all trained. A
conversation (a tool-using agent's trace, as OpenAI messages) is rendered by the tokenizer's chat
template one message at a time. An assistant message is trained up to and including its
end-of-turn token. Everything else is an observation (mask 0, as a harness episode records it): a
tool's result, the template's markers between turns, the next generation prompt.

**Where.** Demonstrations are added where the controller draws a group for a step, after the group
was journaled, so a resumed run derives the same ones. They never count in the sampled reward,
staleness or length metrics (``sampled``), and the count is logged as ``algo/guided_groups``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tidal.api import Task
from tidal.config import ConfigError
from tidal.types import DEMONSTRATION, Group, TrainBatch, Trajectory

FINISH_REASON = "demonstration"


def is_demonstration(traj: Trajectory) -> bool:
    return traj.finish_reason == FINISH_REASON


def sampled(groups: list[Group]) -> list[Group]:
    """The groups as the policy sampled them: demonstrations left out."""
    return [g if not any(map(is_demonstration, g.trajectories))
            else replace(g, trajectories=[t for t in g.trajectories if not is_demonstration(t)]) for g in groups]


def num_guided(groups: list[Group]) -> int:
    """Groups that hold a demonstration."""
    return sum(any(map(is_demonstration, g.trajectories)) for g in groups)


class Guidance:
    """Appends the task's demonstration to groups in which every sample failed (module docstring)."""

    def __init__(self, task: Task, tokenizer, reward: float = 1.0, agentic: bool = False):
        self.task, self.tokenizer, self.reward = task, tokenizer, reward
        self.agentic = agentic
        if task.num_train:  # fail now, not at the first all-fail group: the task must have demonstrations
            self._continuation(task.train_prompt(0))

    def guide(self, group: Group) -> Group:
        """``group``, with the demonstration appended if no sample reached ``reward`` (else unchanged)."""
        if not group.trajectories or any(t.reward >= self.reward for t in group.trajectories):
            return group
        ids, mask = self._continuation(group.prompt)
        first = group.trajectories[0]
        demo = Trajectory(
            prompt_uid=first.prompt_uid, sample_index=max(t.sample_index for t in group.trajectories) + 1,
            prompt_ids=list(first.prompt_ids), token_ids=ids, logprobs=[0.0] * len(ids),
            versions=[DEMONSTRATION if m else -1 for m in (mask or [1] * len(ids))], finish_reason=FINISH_REASON,
            reward=self.reward, reward_details={"demonstration": 1.0}, loss_mask=mask)
        return Group(group.prompt, [*group.trajectories, demo])

    def _continuation(self, prompt) -> tuple[list[int], list[int] | None]:
        """(token ids after the prompt, loss mask: None when every token is trained)."""
        try:
            example = self.task.sft_example(prompt)
        except (NotImplementedError, ConfigError) as e:  # e.g. a verifiers environment without env.verifiers.demos
            raise ConfigError(f"algo.guidance=all_fail needs the task's demonstrations, and task {self.task.name!r} "
                              f"has none ({e}); set algo.guidance=none") from None
        if example is None:
            raise ConfigError(f"algo.guidance: task {self.task.name!r} has no demonstrations (its sft_example "
                              "gives none); set algo.guidance=none")
        if isinstance(example, list):
            return conversation_tokens(self.tokenizer, example)
        if self.agentic:
            raise ConfigError(f"algo.guidance with an agent environment needs demonstrations as conversations (OpenAI "
                              f"messages), so that the tools' results are not trained on; task {self.task.name!r} "
                              "gives text")
        return [*self.tokenizer(example, add_special_tokens=False).input_ids, self.tokenizer.eos_token_id], None


def conversation_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a conversation after its first assistant turn's generation prompt, rendered by
    the chat template message by message: each assistant message trained through its end-of-turn token,
    everything between them masked (module docstring). The trailing text after the last assistant turn's
    end-of-turn token (a newline) is dropped: an episode ends at its last sampled token."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("algo.guidance: the task's demonstration is a conversation, but the tokenizer has no chat "
                          "template (set model.tokenizer=chat)")
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ConfigError("algo.guidance: a demonstration conversation has no assistant message")

    def render(upto: int) -> str:
        follows = upto < len(messages) and messages[upto].get("role") == "assistant"
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=follows)

    eos = tokenizer.eos_token or ""
    done, pending = render(first), ""  # pending: observation text not yet tokenized
    ids: list[int] = []
    mask: list[int] = []

    def emit(text: str, trained: int) -> None:
        piece = tokenizer(text, add_special_tokens=False).input_ids if text else []
        ids.extend(piece)
        mask.extend([trained] * len(piece))

    for k in range(first, len(messages)):
        text = render(k + 1)
        if not text.startswith(done):
            raise ConfigError("algo.guidance: the chat template re-renders earlier messages, so a demonstration "
                              "cannot be appended turn by turn")
        delta, done = text[len(done):], text
        if messages[k].get("role") != "assistant":
            pending += delta
            continue
        cut = delta.find(eos) + len(eos) if eos and eos in delta else len(delta)
        emit(pending, 0)
        emit(delta[:cut], 1)
        pending = delta[cut:]
    return ids, mask


def demonstration_rows(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows holding a demonstration, [B, T] mask of its trained tokens), or None without one. The trainer
    computes the policy's log-probs of those rows and takes them as their behaviour log-probs."""
    demo_bt = batch.versions_bt == DEMONSTRATION
    rows = demo_bt.any(-1).nonzero().flatten()
    return (rows, demo_bt) if rows.numel() else None
