"""Rejection sampling of teacher traces: which responses are kept, and the written rows."""

import json

import pytest

from tidal.config import ConfigError
from tidal.distill.traces import TracesConfig, generate_traces, read_traces, select
from tidal.models import tiny
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.tasks import TASKS
from tidal.types import Trajectory


def traj(i, reward, n):
    return Trajectory("p", i, [1], [5] * n, [0.0] * n, [0] * n, "stop", reward=reward)


def test_select_keeps_all_verified_or_the_best():
    group = [traj(0, 0.0, 2), traj(1, 1.0, 4), traj(2, 1.0, 3), traj(3, 1.0, 3), traj(4, 0.5, 1)]
    assert [t.sample_index for t in select(group, "all", 1.0)] == [1, 2, 3]
    assert [t.sample_index for t in select(group, "best", 1.0)] == [2]  # shortest, then first sampled
    assert [t.sample_index for t in select(group, "best", 0.5)] == [2]  # reward before length: not the 1-token 0.5
    assert select(group[:1], "best", 1.0) == []


def test_generate_traces_counts_and_rows(tmp_path, teacher_dir, cfg_for):
    cfg = cfg_for()
    teacher, tok = tiny.load(teacher_dir)
    task = TASKS.get(cfg.task.name)(cfg.task)
    pool = RewardPool(build_reward("digit_match", {}), RewardConfig(num_workers=0))
    tcfg = TracesConfig(num_prompts=10, samples_per_prompt=3, keep="all", min_reward=0.0, chunk_prompts=4)
    counts = generate_traces(teacher, tok, task, cfg, tcfg, pool, tmp_path / "t.jsonl", progress=False)
    assert counts["prompts"] == 10 and counts["samples"] == 30
    assert counts["kept"] == counts["verified"] == 30  # min_reward 0: every sample is verified
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and rows[0]["prompt"] == task.train_prompt(0).text
    assert read_traces(tmp_path / "t.jsonl")[0] == (rows[0]["prompt_ids"], rows[0]["token_ids"])
    best = generate_traces(teacher, tok, task, cfg, TracesConfig(num_prompts=10, samples_per_prompt=3, keep="best",
                           min_reward=0.0), pool, tmp_path / "b.jsonl", progress=False)
    assert best["kept"] == 10


def test_bad_input_is_named(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"prompt_ids": [1], "token_ids": [2]}\n{"prompt_ids": [1]}\n')
    with pytest.raises(ConfigError, match="line 2: not a trace row"):
        read_traces(tmp_path / "t.jsonl")
    with pytest.raises(ConfigError, match="traces.keep must be all or best"):
        TracesConfig(keep="most")
    with pytest.raises(ConfigError, match="traces.samples_per_prompt must be >= 1"):
        TracesConfig(samples_per_prompt=0)
