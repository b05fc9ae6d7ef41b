"""docs/distill.md: every command on the page runs, in order, on tiny models (teacher, student and data
shrunk with extra ``--set``s; ``quickstart`` / ``path/to/teacher`` teachers replaced by a tiny one)."""

import re
import shlex
from pathlib import Path

from tidal.bench import load
from tidal.cli import main
from tidal.config import apply_overrides

from ..system.test_controller import TINY_OVERRIDES

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "distill.md"
SMALL = ["traces.num_prompts=12", "traces.min_reward=0", "logits.num_prompts=12", "student.steps=2",
         "student.eval_every=1",
         "student.batch_size=8", "teacher.model.hidden_size=32", "teacher.model.num_layers=1",
         "teacher.model.num_heads=2", "teacher.model.num_kv_heads=2", "teacher.model.intermediate_size=64",
         "teacher.accuracy_band=[0.0,1.0]", "teacher.check_every=1"]


def commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    lines = [line.split(" #", 1)[0].strip() for line in "\n".join(blocks).splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("tidal ")]


def localize(argv: list[str], tmp_path: Path, teacher: str) -> list[str]:
    out = []
    for a in argv:
        a = a.replace("runs/", f"{tmp_path}/runs/")
        a = a.replace("distill.teacher=quickstart", f"distill.teacher={teacher}")
        out.append(a.replace("distill.teacher=path/to/teacher", f"distill.teacher={teacher}"))
    return out


def test_every_command_on_the_page_runs(tmp_path, teacher_dir):
    cmds = commands()
    assert len(cmds) >= 8, cmds
    tiny = [x for s in [*TINY_OVERRIDES(tmp_path), *SMALL] for x in ("--set", s)]
    for argv in cmds:
        argv = localize(argv, tmp_path, str(teacher_dir))
        if argv[1] == "bench":
            sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
            module = load(argv[2])  # the keys exist (the benchmark runs in its own test); distill's also take run keys
            module.resolve(sets) if hasattr(module, "resolve") else apply_overrides(module.Settings(), sets)
            continue
        if argv[1] == "train":  # one RL step of the tiny student
            argv = [*argv, *(x for s in [*TINY_OVERRIDES(tmp_path), "max_steps=1"] for x in ("--set", s))]
            if "--out" not in argv:
                argv += ["--out", str(tmp_path / "runs" / "opd2")]
        else:
            argv = [*argv, *tiny]
        assert main(argv[1:]) == 0, argv
    assert (tmp_path / "runs" / "logits8" / "logits" / "meta.json").exists()  # the --traces store was written
    assert (tmp_path / "runs" / "opd" / "metrics.jsonl").exists()
