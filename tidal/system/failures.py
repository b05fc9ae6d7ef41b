"""Stop a run that cannot make progress, instead of idling to a false success.

A group *failed* when every one of its samples failed (``Trajectory.failure``): its episode's environment or
agent crashed (such episodes are left out of the group, so the group is empty), or its reward raised or timed
out (scored 0 with ``details["error"]``). A failed group has nothing to learn from, and guidance's
demonstrations added to it would train the policy on demonstrations alone. Before this check, a verifiers
environment whose reward always raised trained nothing at every step, printed "reached max_steps", and
exited 0, after idling through the recipe's ``max_time_s`` (25 minutes) (issue 50, item 7).

One step whose every group failed can be a transient (a tool server restarting under load, a network blip
that fails a batch of episodes at once); ``max_failed_steps`` such steps in a row (3 by default) cannot: the
run stops with ``AllFailed``, a failed engine's path (checkpointed, one line naming the last failure, exit 1).
Why 3: if a healthy environment fails each episode independently with probability p, a whole step of P
groups of G episodes fails with probability p^(P G), three in a row with p^(3 P G): for the verifiers recipe
(P G = 512 episodes a step) that is 0.9^1536 ~ 1e-70 even at p = 0.9, so only a broken environment or reward
stops a run, after three steps (about 1.5 minutes of that recipe's ~30 s steps). The held-out evaluation
catches a broken environment sooner, at step 0 (``check_evaluation`` in ``rollout/evaluate.py``).
"""

from __future__ import annotations

from tidal.api import AllFailed
from tidal.rollout.evaluate import one_line
from tidal.types import Group, Trajectory


def group_failed(group: Group) -> bool:
    """Every sample of ``group`` failed (its failed episodes already left out: then it is empty)."""
    return all(t.failure for t in group.trajectories)


class FailedSteps:
    """Counts consecutive steps whose every drawn group failed; ``check`` raises ``AllFailed`` at ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.streak = 0
        self.groups = 0  # groups drawn over the streak
        self.last: str | None = None  # the latest failure seen (``note``)

    def note(self, trajs: list[Trajectory]) -> None:
        """Remember the latest failure among freshly scored samples (failed episodes are dropped from their
        group after scoring, so their reason is kept here)."""
        for t in trajs:
            if t.failure:
                self.last = t.failure

    def observe(self, drawn: list[Group]) -> int:
        """Count the step that drew ``drawn``; return how many of its groups failed."""
        failed = sum(map(group_failed, drawn))
        if drawn and failed == len(drawn):
            self.streak, self.groups = self.streak + 1, self.groups + len(drawn)
        else:
            self.streak, self.groups = 0, 0
        return failed

    def check(self, step: int) -> None:
        """``AllFailed`` once ``limit`` steps in a row, the last ``step``, trained on nothing but failures."""
        if self.streak >= self.limit:
            raise AllFailed(
                f"every group of the last {self.streak} steps failed (steps {step - self.streak + 1}-{step}, "
                f"{self.groups} groups: every episode crashed or its reward failed; last: "
                f"{one_line(self.last or 'no reason recorded')}), so nothing was trained (max_failed_steps="
                f"{self.limit}); fix the environment or reward")
