"""What a stopped run leaves behind reads as one run after --resume: each step logged once (metrics.jsonl
and TensorBoard), the base accuracy in the result, and checkpoints that are whole or absent."""

import json
import resource
import signal
import time

import pytest
import torch

from tidal.system.run import close, prepare
from tidal.train.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint

from .test_controller import tiny_cfg


def _run(cfg, out, resume=False):
    controller = prepare(cfg, out, resume=resume)
    try:
        return controller, controller.run()
    finally:
        close(controller)


def _steps(out):
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_after_a_crash_logs_each_step_once_and_reports_the_base_accuracy(tmp_path):
    """A crash (kill -9) after step 3 was logged but before its checkpoint: the resumed run logs steps
    3 and 4 again; TensorBoard must hide the first run's step 3 (purge_step) and the result must still
    carry the base accuracy measured at step 0 by the first run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    opts = ("system.mode=sync", "log.tensorboard=true", "checkpoint_every=2", "eval_every=1")
    _, first = _run(tiny_cfg(tmp_path, *opts, "max_steps=3"), out)
    ckpts = out / "checkpoints"
    for p in (ckpts / "step_3").iterdir():  # as if killed before step 3's checkpoint
        p.unlink()
    (ckpts / "step_3").rmdir()
    (ckpts / "latest").write_text("step_2")
    # TensorBoard orders event files by name, ``events.out.tfevents.<second>.<host>.<pid>.<n>`` with ``n`` a
    # process-wide counter: two runs in one second of one pytest process could sort ``...99`` after ``...100``,
    # the resumed file first, and its purge then misses the first run's step 3 (a flake seen in a full run)
    time.sleep(1.0 - time.time() % 1.0 + 0.01)

    _, resumed = _run(tiny_cfg(tmp_path, *opts, "max_steps=4"), out, resume=True)
    assert _steps(out) == [0, 1, 2, 3, 4]
    assert resumed.base_accuracy == first.base_accuracy is not None
    assert [h["step"] for h in resumed.history] == [0, 1, 2, 3, 4]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 1, 2, 3, 4]


def test_a_failed_save_leaves_no_partial_checkpoint_and_keeps_the_previous_one(tmp_path, small_model, tokenizer):
    """A full disk (writes past 20 kB fail with EFBIG) mid-save: one CheckpointError naming the step and the
    intact previous checkpoint, no partial directory; a .tmp leftover of a killed save is never a checkpoint."""
    from tidal.train.checkpoint import TrainingState

    root = tmp_path / "checkpoints"
    optimizer = torch.optim.AdamW(small_model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = TrainingState(step=2, version=2, next_group=8, extra={})
    save_checkpoint(root, small_model, tokenizer, optimizer, scheduler, state)
    (root / ".tmp_step_50").mkdir()  # a process killed mid-save
    (root / ".tmp_step_50" / "model.safetensors").write_bytes(b"torn")
    assert latest_checkpoint(root).name == "step_2"
    state.step = 4
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        with pytest.raises(CheckpointError, match=r"could not write checkpoint \S*step_4 .*File too large.*"
                                                  r"previous checkpoint \S*step_2 is intact"):
            save_checkpoint(root, small_model, tokenizer, optimizer, scheduler, state)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
    assert save_checkpoint(root, small_model, tokenizer, optimizer, scheduler, state).name == "step_4"
    assert latest_checkpoint(root).name == "step_4"


def test_a_full_disk_raises_the_checkpoint_error_not_a_later_one_from_closing(tmp_path):
    """Async mode on a full disk: the journal fails first (warned, best effort), then the checkpoint. The
    run must raise the checkpoint's error; the journal's close used to raise its own OSError instead."""
    from tidal.system.run import train

    cfg = tiny_cfg(tmp_path, "system.mode=async", "max_steps=2")
    close(prepare(cfg, tmp_path / "warm"))  # builds the cached base while the disk still has room
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        with pytest.raises(CheckpointError, match="step_2"):
            train(tiny_cfg(tmp_path, "system.mode=async", "max_steps=2", "rollout.prompts_per_step=32"),
                  tmp_path / "run")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
