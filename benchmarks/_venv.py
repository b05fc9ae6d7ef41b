"""A benchmark's own virtual environment: tidal's packages plus the competitor's, created once.

``venv --system-site-packages`` would expose the base interpreter's packages, not tidal's venv, so
tidal's site directory is added by a ``.pth`` line instead (``site.addsitedir`` also runs tidal's own
.pth files); pip then installs only what the competitor adds. A stamp file records what was
installed, so a changed pin rebuilds the environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path


def bench_venv(path: str | Path, requirements: list[str], label: str) -> Path:
    """The python of a venv at ``path`` with tidal's packages and ``requirements`` installed."""
    path = Path(path).absolute()
    python = path / "bin" / "python"
    parent = sysconfig.get_paths()["purelib"]
    stamp = path / "tidal-bench.json"
    want = {"requirements": requirements, "parent": parent}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return python
    print(f"bench {label}: creating {path} ({', '.join(requirements)}; once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "tidal-parent-env.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
                    *requirements], check=True)
    stamp.write_text(json.dumps(want))
    return python
