"""Reward model: packed training rewards equal the scorer's padded ones; ``reward.name=rm`` scores in a worker."""

import pytest
import torch

from tidal.config import ConfigError, apply_overrides
from tidal.models import tiny
from tidal.models.reward_model import RewardModelScorer, from_policy, last_token_rewards
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.stages import reward_model, synthetic
from tidal.stages.chat_data import encode_pair
from tidal.stages.sft import padded
from tidal.types import Prompt

from .conftest import SMALL


def test_packed_rewards_equal_padded(chat_tok):
    rm = from_policy(tiny.build_model(tiny.ModelConfig(**SMALL), chat_tok)).eval()
    torch.nn.init.normal_(rm.score.weight)
    pairs = [encode_pair(chat_tok, {"prompt": p, "chosen": c, "rejected": r}, 64)
             for p, c, r in (("what is 1+2?", "3", "4"), ("hi", "hello", "no"), ("x", "yy", "zzz"))]
    with torch.no_grad():
        rc, rr = reward_model.pair_rewards(rm, pairs, pack_length=64)
        seqs = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
        ids, lengths = padded(seqs)
        want = last_token_rewards(rm, ids, lengths)
    assert torch.allclose(torch.cat([rc, rr]), want, atol=1e-5), (rc, rr, want)
    assert float(want.std()) > 0  # the check could fail: rewards differ by sequence


def test_from_policy_keeps_the_backbone(chat_tok):
    policy = tiny.build_model(tiny.ModelConfig(**SMALL), chat_tok)
    rm = from_policy(policy)
    assert torch.equal(rm.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert rm.score.weight.shape == (1, SMALL["hidden_size"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    files = synthetic.build(root / "dom", num_sft=20, num_pairs=60, num_eval=10)
    sets = [f"data.path={files['pairs']}", "run.steps=2", "run.eval_every=2", "run.save_every=2", "optim.lr=1e-3",
            "run.threads=1", "data.max_length=40", "model.tokenizer=chat"]
    sets += [f"model.{k}={v}" for k, v in SMALL.items()]
    last = reward_model.train(apply_overrides(reward_model.RMStageConfig(), sets), str(root / "run"),
                              log=lambda s: None)
    return root / "run" / "model", last


def test_rm_run_exports_a_scorable_model(trained):
    path, last = trained
    assert 0 <= last["eval/accuracy"] <= 1
    scorer = RewardModelScorer(path, batch_size=2)
    one = scorer.score([("what is 2+3?", "5")])
    many = scorer.score([("what is 2+3?", "5"), ("what is 2+3?", "a much longer answer"), ("q", "7")])
    assert abs(one[0] - many[0]) < 1e-5  # batching (padding) does not change a score


def test_reward_rm_scores_in_a_worker(trained):
    path, _ = trained
    items = [("5", Prompt("a", "what is 2+3?", "5")), ("6", Prompt("b", "what is 2+3?", "5")),
             ("12", Prompt("c", "what is 9+3?", "12"))]
    fn = build_reward("rm", {"path": str(path), "scale": 2.0, "shift": 1.0})
    want = RewardModelScorer(path).score([(p.text, r) for r, p in items])
    pool = RewardPool(fn, RewardConfig(name="rm", num_workers=1, timeout_s=60))
    try:
        got = pool.score(items)
    finally:
        pool.close()
    assert [d["rm_score"] for _, d in got] == pytest.approx(want, abs=1e-5)
    assert [r for r, _ in got] == pytest.approx([2 * w + 1 for w in want], abs=1e-5)


def test_rm_without_a_path_is_one_line():
    with pytest.raises(ConfigError, match="needs params.path"):
        build_reward("rm", {})


def test_rm_with_lora_trains_adapters_and_the_head_then_resumes_and_exports(tmp_path):
    """Issue 53 (was refused, issue 50 item 10): model.lora on the reward model trains the backbone's adapters and
    the new score head whole (PEFT's modules_to_save; a frozen random head could not learn), nothing else; a resume
    loads both back; model/ is a merged classifier the ``rm`` reward scores with, equal to the trained one."""
    pytest.importorskip("peft")
    from tidal.stages import sft
    from tidal.train.checkpoint import latest_checkpoint

    files = synthetic.build(tmp_path / "dom", num_sft=8, num_pairs=30, num_eval=4)
    small = [*[f"model.{k}={v}" for k, v in SMALL.items()], "model.tokenizer=chat", "run.threads=1",
             "data.max_length=40"]
    sft.train(apply_overrides(sft.SFTStageConfig(), [f"data.path={files['sft']}", "run.steps=1", *small]),
              str(tmp_path / "base"), log=lambda s: None)
    sets = [f"data.path={files['pairs']}", f"model.path={tmp_path / 'base' / 'model'}", "model.lora.rank=2",
            "optim.lr=1e-2", "run.save_every=2", "run.async_checkpoint=false", *small]
    lines = []
    reward_model.train(apply_overrides(reward_model.RMStageConfig(), [*sets, "run.steps=2"]), str(tmp_path / "r"),
                       log=lines.append)
    assert any("rm: LoRA rank 2" in line for line in lines), lines
    ckpt = latest_checkpoint(tmp_path / "r" / "checkpoints")
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    base = from_policy(tiny.load(tmp_path / "base" / "model")[0], seed=0).state_dict()
    from transformers import AutoModelForSequenceClassification

    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "r" / "model").state_dict()
    assert set(merged) == set(base)
    assert not torch.equal(merged["score.weight"], base["score.weight"]), "the head was not trained"
    frozen = [k for k in base if "proj" not in k and k != "score.weight"]
    assert frozen and all(torch.equal(merged[k], base[k]) for k in frozen)  # embeddings, norms: untouched
    moved = [k for k in base if k.endswith("q_proj.weight") and not torch.equal(merged[k], base[k])]
    assert moved, "the adapters moved nothing"
    reward_model.train(apply_overrides(reward_model.RMStageConfig(), [*sets, "run.steps=3"]), str(tmp_path / "r"),
                       resume=True, log=lambda s: None)  # the adapters and the head load back, strictly
    scorer = RewardModelScorer(tmp_path / "r" / "model", threads=1)
    assert len(scorer.score([("what is 1+2?", "3"), ("what is 1+2?", "4")])) == 2


def test_the_head_is_drawn_from_run_seed(tmp_path):
    """Issue 53: the new score head was drawn from torch's global RNG, so an rm run depended on whatever had used
    it before in the process (the stage chain runs every stage in one process) and ``run.seed`` did not move
    it. Same seed: the same head whatever ran before; another seed: another head."""
    files = synthetic.build(tmp_path / "dom", num_sft=4, num_pairs=30, num_eval=4)
    sets = [f"data.path={files['pairs']}", "run.steps=1", "run.threads=1", "data.max_length=40",
            "model.tokenizer=chat", "run.async_checkpoint=false", *[f"model.{k}={v}" for k, v in SMALL.items()]]

    def head(name, *extra):
        torch.rand(7)  # something else drew from the global RNG first
        cfg = apply_overrides(reward_model.RMStageConfig(), [*sets, *extra])
        reward_model.train(cfg, str(tmp_path / name), log=lambda s: None)
        return RewardModelScorer(tmp_path / name / "model").model.score.weight

    a, b, c = head("a"), head("b"), head("c", "run.seed=1")
    assert torch.equal(a, b) and not torch.equal(a, c)
