"""The shell blocks of docs/rewards.md run as written, and the audit output the page shows is real."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def test_rewards_doc_commands_run_and_show_real_output(tmp_path):
    text = DOC.read_text()
    script = "".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S))
    assert "tidal score --reward my_reward.py:Exact" in script and script.count("tidal audit-reward") == 2
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads(proc.stdout.splitlines()[0])
    assert scored["reward"] == 1.0 and scored["details"] == {"reason": "exact"}
    assert json.loads((tmp_path / "audit.json").read_text())["passed"]
    assert "audit failed: exit 1" in proc.stdout
    excerpt = re.search(r"The second audit ends \(excerpt\):\n\n```\n(.*?)```", text, flags=re.S).group(1)
    for line in excerpt.splitlines():
        assert line in proc.stdout, line
