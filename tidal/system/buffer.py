"""The rollout buffer: scored groups keyed by their position in the prompt stream.

The trainer takes batch k as the contiguous range of groups [k*B, (k+1)*B), whatever order they
finished in, so the staleness accounting (see ``staleness.py``) and exact resumption (the data
position is a single integer) both hold.
"""

from __future__ import annotations

import threading

from tidal.api import EngineFailed
from tidal.config import ConfigError
from tidal.types import Group


class BufferClosed(RuntimeError):
    """The producer side failed or was shut down; carries the producer's exception as cause."""


class RolloutBuffer:
    def __init__(self) -> None:
        self._groups: dict[int, Group] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False

    def put(self, index: int, group: Group) -> None:
        with self._cond:
            assert index not in self._groups, f"group {index} produced twice"
            self._groups[index] = group
            self._cond.notify_all()

    def take(self, start: int, count: int, timeout: float | None = None) -> list[Group]:
        """Block until groups start..start+count-1 are all present, remove and return them in order."""
        wanted = range(start, start + count)
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._error is not None or self._closed or all(i in self._groups for i in wanted),
                timeout=timeout,
            )
            if self._error is not None:
                raise BufferClosed("rollout producer failed") from self._error
            if self._closed and not all(i in self._groups for i in wanted):
                raise BufferClosed("rollout buffer closed")
            if not ready:
                raise TimeoutError(f"groups {start}..{start + count - 1} not ready after {timeout}s")
            return [self._groups.pop(i) for i in wanted]

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)


def take_one(buffer: RolloutBuffer, index: int) -> Group:
    """Group ``index`` from the buffer; a config error or failed engine met by the generator or scorer
    thread is raised as itself (one line at the command line), not wrapped in BufferClosed."""
    try:
        return buffer.take(index, 1)[0]
    except BufferClosed as e:
        if isinstance(e.__cause__, (ConfigError, EngineFailed)):
            raise e.__cause__ from None
        raise
