"""Progress bars that draw only on a terminal.

A bar redraws itself with ``\\r`` several times a second; on a terminal that is one live line, but in a
redirected log (``tidal train ... 2> log``, a cluster job) it is hundreds of lines of noise. Every bar in
tidal is made here: ``enabled`` is the caller's switch (e.g. ``log.progress``), and a bar is drawn only
if it is on and stderr is a terminal (tqdm's ``disable=None``).
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def show_progress(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: ``enabled`` and stderr is a terminal."""
    return enabled and sys.stderr.isatty()


def progress_bar(enabled: bool = True, **kwargs) -> tqdm:
    """``tqdm(**kwargs)`` on stderr, drawn only if ``show_progress(enabled)``."""
    return tqdm(disable=not show_progress(enabled), **kwargs)
