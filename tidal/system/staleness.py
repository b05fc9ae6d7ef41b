"""Admission control with a staleness bound (AReaL, arXiv 2505.24298, sec. 5.2).

Training step k consumes the k-th batch of B groups (groups k*B .. k*B+B-1, in order) and turns
policy version k into k+1. A group admitted for generation while the policy is at version v is
sampled with versions >= v, so if group g (consumed at step floor(g / B)) is admitted only when

    g < (v + eta + 1) * B                                            (the capacity rule)

then at training time its staleness, step - oldest token version, is at most eta. The generator
asks for capacity before starting a group and waits when there is none; nothing is ever thrown
away. eta = 0 is synchronous RL (batch k is generated only with the policy that trains on it).

A ceiling (``set_ceiling``) also caps the group *indices* that may start. With dynamic sampling a
dropped group gives its slot back (``release``) and the slot admits the next index; at the draw limit
of a step that next index belongs to the following step, so without a cap async eta = 0 would draw it
(and, with online difficulty, choose its prompt) with the counts and weights before that step's
update, sooner or later depending on thread timing, where sync draws it after. The controller sets
the ceiling at eta = 0 to the end of the current step's draw limit, so every group is drawn in the
step that sync draws it in.
"""

from __future__ import annotations

import threading


def capacity(version: int, num_admitted: int, groups_per_step: int, max_staleness: int) -> int:
    """How many more groups may start now under the rule above (never negative)."""
    return max(0, (version + max_staleness + 1) * groups_per_step - num_admitted)


class StalenessManager:
    """Thread-safe counter of admitted groups and the current policy version."""

    def __init__(self, groups_per_step: int, max_staleness: int, version: int = 0, num_admitted: int | None = None,
                 next_index: int = 0):
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.version = version
        self.num_admitted = version * groups_per_step if num_admitted is None else num_admitted
        self.next_index = next_index
        """The index of the next group admitted (admissions count up; releases do not give indices back)."""
        self.ceiling: int | None = None
        """No group with index >= this starts (None: no cap)."""
        self._cond = threading.Condition()
        self._closed = False

    def admit(self, want: int, timeout: float | None = None) -> int:
        """Block until at least one group may start; admit up to ``want``; return how many (0 if closed)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or self._room() > 0, timeout=timeout)
            if self._closed or not ok:
                return 0
            n = min(want, self._room())
            self.num_admitted += n
            self.next_index += n
            return n

    def _room(self) -> int:
        room = capacity(self.version, self.num_admitted, self.groups_per_step, self.max_staleness)
        return room if self.ceiling is None else max(0, min(room, self.ceiling - self.next_index))

    def set_ceiling(self, index: int) -> None:
        """Let no group with index >= ``index`` start until the ceiling is raised (module docstring)."""
        with self._cond:
            self.ceiling = index
            self._cond.notify_all()

    def release(self, n: int = 1) -> None:
        """``n`` admitted groups will not be trained (dropped): give their slots back."""
        self._adjust(-n)

    def charge(self, n: int) -> None:
        """A step trained ``n`` groups fewer than a full batch: later groups shift to later steps,
        so count the missing ones as admitted to keep the bound (see ``batching.py``)."""
        self._adjust(n)

    def _adjust(self, n: int) -> None:
        with self._cond:
            self.num_admitted += n
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def set_version(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
