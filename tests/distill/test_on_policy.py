"""On-policy distillation in the RL loop: the teacher scores in the scorer, the loss is per-token reverse KL."""

import json

import pytest
import torch

from tidal.algo.distill import distill_advantage
from tidal.config import ConfigError
from tidal.models import tiny
from tidal.models.logprobs import token_logprobs
from tidal.system.run import base_model_path, prepare
from tidal.system.validate import validate_run_config
from tidal.tasks import TASKS
from tidal.train.batch import build_train_batch
from tidal.types import Group, Prompt, Trajectory

DISTILL = ["algo.skip_zero_adv_groups=false"]


def run(cfg, out):
    controller = prepare(cfg, out)
    try:
        return controller, controller.run()
    finally:
        controller.tracker.close()
        controller.reward_pool.close()
        if controller.journal is not None:
            controller.journal.close()


def test_async_run_scores_every_token_with_the_teacher_and_respects_staleness(tmp_path, teacher_dir, cfg_for):
    cfg = cfg_for("system.mode=async", "rollout.max_staleness=1", f"distill.teacher={teacher_dir}", *DISTILL)
    _, result = run(cfg, tmp_path / "run")
    rows = [r for r in result.history if "distill/reverse_kl" in r]
    assert len(rows) == cfg.max_steps
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert all(r["distill/teacher_tokens"] > 0 for r in rows)
    # The journaled teacher log-probs are the teacher's own log-probs of the sampled tokens, exactly.
    teacher, _ = tiny.load(teacher_dir)
    line = json.loads((tmp_path / "run" / "journal.jsonl").read_text().splitlines()[0])
    t = line["group"]["trajectories"][0]
    ids = torch.tensor([t["prompt_ids"] + t["token_ids"]])
    logp, _ = token_logprobs(teacher.eval(), ids, torch.ones_like(ids))
    assert t["teacher_logprobs"] == pytest.approx(logp[0, len(t["prompt_ids"]):].tolist(), abs=1e-5)
    # and the logged reverse KL is their mean gap to the behaviour log-probs (all groups of a step)
    assert rows[0]["distill/reverse_kl"] != 0.0


def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl(tmp_path, cfg_for):
    cfg = cfg_for("system.mode=sync", "rollout.max_staleness=0", "max_steps=1", *DISTILL)
    base = base_model_path(cfg, TASKS.get(cfg.task.name)(cfg.task), progress=False)
    cfg.distill.teacher = str(base)
    _, result = run(cfg, tmp_path / "run")
    row = next(r for r in result.history if "distill/reverse_kl" in r)
    assert abs(row["distill/reverse_kl"]) < 1e-4  # engine and teacher compute the same model's log-probs


def test_trainer_advantages_are_the_distillation_advantage():
    from tidal.algo.config import AlgoConfig
    from tidal.optim import OptimConfig
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                              intermediate_size=64), tok)
    trajs = [Trajectory("p", i, [1, 5], [6, 7, 2], [-1.0, -2.0, -0.5], [0, 0, 0], "stop", reward=float(i),
                        teacher_logprobs=[-1.5, -1.0, -0.5]) for i in range(2)]
    algo = AlgoConfig(skip_zero_adv_groups=False, distill_reward_coef=0.5)
    batch, _ = build_train_batch([Group(Prompt("p", "1+1=", "2"), trajs)], algo, tok.pad_token_id)
    assert batch.teacher_logp_bt[0].tolist() == [0.0, 0.0, -1.5, -1.0, -0.5]
    trainer = Trainer(model, algo, OptimConfig(), TrainerConfig())
    adv = trainer._advantages(batch, torch.arange(2), batch.rewards_b, None)
    # grpo: rewards (0, 1) -> (-0.7071, 0.7071); reverse KL per token (0.5, -1, 0) -> advantages (-0.5, 1, 0)
    g = 1 / 2**0.5
    expect = torch.tensor([[0, 0, -0.5 - 0.5 * g, 1 - 0.5 * g, -0.5 * g], [0, 0, -0.5 + 0.5 * g, 1 + 0.5 * g, 0.5 * g]])
    assert torch.allclose(adv, expect, atol=1e-5)
    assert torch.allclose(adv, distill_advantage(torch.tensor([-g, g]), batch.teacher_logp_bt, batch.behav_logp_bt,
                                                 batch.loss_mask_bt, distill_reward_coef=0.5), atol=1e-6)
    trainer.step(batch)  # the whole step runs with per-token advantages


def test_bad_distill_settings_name_the_key(tmp_path, teacher_dir, cfg_for):
    with pytest.raises(ConfigError, match="distill.teacher='/nope'"):
        validate_run_config(cfg_for("distill.teacher=/nope", *DISTILL))
    with pytest.raises(ConfigError, match="skip_zero_adv_groups=false"):
        validate_run_config(cfg_for(f"distill.teacher={teacher_dir}", "algo.skip_zero_adv_groups=true"))
    with pytest.raises(ConfigError, match="algo.advantage=gae"):
        validate_run_config(cfg_for(f"distill.teacher={teacher_dir}", "algo.advantage=gae", *DISTILL))


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, cfg_for):
    from tidal.distill.teacher import TeacherScorer

    tok = tiny.build_tokenizer()
    other = tiny.build_tokenizer()
    other.add_tokens(["@"])
    with pytest.raises(ConfigError, match="no model there"):
        TeacherScorer(tmp_path / "missing", tok)
    path = tmp_path / "t"
    tiny.save(tiny.build_model(tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                                intermediate_size=64), other), other, path)
    with pytest.raises(ConfigError, match="vocabulary differs"):
        TeacherScorer(path, tok)


def test_the_teacher_scores_each_distinct_sample_once(teacher_dir):
    from tidal.distill.teacher import TeacherScorer

    tok = tiny.build_tokenizer()
    scorer = TeacherScorer(teacher_dir, tok, micro_batch=2)
    prompts = [[1, 13, 14], [1, 13, 14], [1, 20], [1, 13, 14], [1, 20]]
    responses = [[16, 2], [16, 2], [21, 22, 2], [17, 2], [21, 22, 2]]  # 3 distinct pairs among 5 samples
    got = scorer.logprobs(prompts, responses)
    assert (scorer.rows, scorer.unique_rows) == (5, 3)
    teacher, _ = tiny.load(teacher_dir)
    for p, r, lp in zip(prompts, responses, got, strict=True):
        ids = torch.tensor([p + r])
        ref, _ = token_logprobs(teacher.eval(), ids, torch.ones_like(ids))
        assert lp == pytest.approx(ref[0, len(p):].tolist(), abs=1e-5)
    assert got[0] == got[1] and got[0] is not got[1]  # copies: a caller may edit one trajectory's list
