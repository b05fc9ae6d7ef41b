"""Progress bars draw on a terminal only: a redirected log gets no ``\\r`` redraws."""

import io
import os
import pty
import sys

from tidal.utils.progress import progress_bar, show_progress


def test_no_bar_when_stderr_is_redirected(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    assert not show_progress(True)
    with progress_bar(True, total=3, desc="RL") as bar:
        for _ in range(3):
            bar.update(1)
    assert log.getvalue() == ""


def test_a_bar_on_a_terminal_unless_switched_off(monkeypatch):
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            assert show_progress(True) and not show_progress(False)
            with progress_bar(True, total=3) as on, progress_bar(False, total=3) as off:
                assert not on.disable and off.disable
    finally:
        os.close(leader)
        os.close(follower)
