"""Off-policy guidance (``train/guidance.py``): which groups get a demonstration, its tokens, and that the
trainer trains it at importance ratio 1."""

import copy

import pytest
import torch

from tidal.algo.config import AlgoConfig
from tidal.config import ConfigError
from tidal.models.tiny import build_chat_tokenizer
from tidal.optim import OptimConfig
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.system.batching import too_stale
from tidal.tasks.supervised import _encode
from tidal.train.batch import build_train_batch
from tidal.train.config import TrainerConfig
from tidal.train.guidance import Guidance, conversation_tokens, is_demonstration, sampled
from tidal.train.trainer import Trainer
from tidal.types import DEMONSTRATION, Group, Prompt, Trajectory

CALL = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*54"}}}
CONVERSATION = [{"role": "system", "content": "use the calculator."}, {"role": "user", "content": "37*54="},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_0", "content": "1998"},
                {"role": "assistant", "content": "1998"}]


class TextTask:
    name = "sums"
    num_train = 2

    def train_prompt(self, index):
        return Prompt(f"p{index}", f"{index}+1=", str(index + 1))

    def sft_example(self, prompt):
        return prompt.answer


class ChatTask(TextTask):
    name = "chat"

    def sft_example(self, prompt):
        return CONVERSATION


def _traj(index, reward, versions=(3, 3)):
    return Trajectory(prompt_uid="p1", sample_index=index, prompt_ids=[1, 7, 8], token_ids=[9, 2],
                      logprobs=[-0.5, -0.1], versions=list(versions), finish_reason="stop", reward=reward)


def test_conversation_trains_the_assistant_turns_and_masks_the_tool_result():
    tok = build_chat_tokenizer()
    ids, mask = conversation_tokens(tok, CONVERSATION)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    observed = tok.decode([i for i, m in zip(ids, mask) if not m])
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"37*54"}}</tool_call><|im_end|>'
    assert trained == call + "1998<|im_end|>"
    assert observed == "\n<|im_start|>tool\n1998<|im_end|>\n<|im_start|>assistant\n"
    # the same tokens the warm start trains on after the prompt (there, the tool's result too)
    full, start = _encode(tok, "", CONVERSATION)
    assert ids == full[start:]


def test_an_all_fail_group_gets_the_demonstration_and_others_are_unchanged():
    tok = build_chat_tokenizer()
    guidance = Guidance(TextTask(), tok, reward=1.0)
    failed = Group(TextTask().train_prompt(1), [_traj(0, 0.0), _traj(1, 0.5)])
    guided = guidance.guide(failed)
    assert guided.trajectories[:2] == failed.trajectories and len(guided.trajectories) == 3
    demo = guided.trajectories[2]
    assert is_demonstration(demo) and demo.reward == 1.0 and demo.sample_index == 2
    assert demo.prompt_ids == [1, 7, 8]  # the context the policy saw for this prompt
    assert demo.token_ids == [*tok("2", add_special_tokens=False).input_ids, tok.eos_token_id]
    assert demo.loss_mask is None and demo.versions == [DEMONSTRATION] * 2
    solved = Group(failed.prompt, [_traj(0, 0.0), _traj(1, 1.0)])
    assert guidance.guide(solved) is solved
    empty = Group(failed.prompt, [])  # every episode an infrastructure failure: nothing to continue
    assert guidance.guide(empty) is empty
    assert sampled([guided, solved]) == [failed, solved]


def test_a_demonstration_has_no_age_and_its_group_stays_fresh():
    guided = Guidance(TextTask(), build_chat_tokenizer()).guide(Group(TextTask().train_prompt(1), [_traj(0, 0.0)]))
    assert guided.oldest_version == 3
    assert not too_stale(guided, step=4, max_staleness=1)


def test_a_conversation_demonstration_is_masked_and_versioned_per_token():
    tok = build_chat_tokenizer()
    demo = Guidance(ChatTask(), tok, agentic=True).guide(Group(ChatTask().train_prompt(1), [_traj(0, 0.0)]))
    demo = demo.trajectories[-1]
    assert demo.loss_mask == conversation_tokens(tok, CONVERSATION)[1]
    assert demo.versions == [DEMONSTRATION if m else -1 for m in demo.loss_mask]


def test_bad_demonstrations_fail_at_start_with_one_line():
    class NoDemos(TextTask):
        def sft_example(self, prompt):
            return None

    class Raises(TextTask):
        def sft_example(self, prompt):
            raise ConfigError("no reference responses")

    with pytest.raises(ConfigError, match="has no demonstrations"):
        Guidance(NoDemos(), build_chat_tokenizer())
    with pytest.raises(ConfigError, match=r"needs the task's demonstrations.*no reference responses.*guidance=none"):
        Guidance(Raises(), build_chat_tokenizer())
    with pytest.raises(ConfigError, match="needs demonstrations as conversations"):
        Guidance(TextTask(), build_chat_tokenizer(), agentic=True)
    with pytest.raises(ConfigError, match="no assistant message"):
        conversation_tokens(build_chat_tokenizer(), CONVERSATION[:2])


def _batch_with_demo(model, tokenizer):
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=4))
    prompts = [Prompt(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(2)]
    trajs = engine.generate(group_requests(tokenizer, prompts, 3))
    guidance = Guidance(TextTask(), tokenizer)
    groups = [guidance.guide(Group(p, trajs[i * 3 : (i + 1) * 3])) for i, p in enumerate(prompts)]
    assert all(len(g.trajectories) == 4 for g in groups)  # rewards are 0: every group failed
    return build_train_batch(groups, AlgoConfig(), tokenizer.pad_token_id)[0]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_trainer_trains_a_demonstration_at_ratio_one(small_model, tokenizer, minibatches):
    """A step on a batch with demonstrations equals a step on the same batch whose demonstration tokens carry
    the policy's own log-probs as behaviour log-probs (and a version the trainer has): ratio 1."""
    batch = _batch_with_demo(small_model, tokenizer)
    demo_bt = batch.versions_bt == DEMONSTRATION
    assert demo_bt.any()
    cfg = TrainerConfig(num_minibatches=minibatches)

    def stepped(b):
        model = copy.deepcopy(small_model)
        # eps=1: Adam's first steps are ~lr * gradient, not its sign, so equal gradients give equal weights
        trainer = Trainer(model, AlgoConfig(), OptimConfig(lr=1.0, eps=1.0), cfg)
        trainer.step(b)
        return [p.detach().clone() for p in model.parameters()], trainer

    guided, trainer = stepped(copy.deepcopy(batch))
    reference = copy.deepcopy(batch)
    with torch.no_grad():
        now = Trainer(copy.deepcopy(small_model), AlgoConfig(), OptimConfig(), cfg)._scores(small_model, reference)
    reference.behav_logp_bt = torch.where(demo_bt, now, reference.behav_logp_bt)
    reference.versions_bt = torch.where(demo_bt, torch.zeros_like(reference.versions_bt), reference.versions_bt)
    by_hand, _ = stepped(reference)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(guided, by_hand))
    placeholder = copy.deepcopy(batch)  # the demonstration's placeholder log-probs (0.0) taken as they are
    placeholder.versions_bt = reference.versions_bt
    unfilled, _ = stepped(placeholder)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(guided, unfilled))


def test_a_run_guides_its_all_fail_groups_and_reports_only_samples(tmp_path):
    """Every group misses a bar of 2 (digit_match scores at most 1), so each gets its demonstration; the
    sampled metrics stay the samples' (a demonstration would add reward 2), and async staleness holds."""
    from tests.system.test_controller import run, tiny_cfg

    cfg = tiny_cfg(tmp_path, "algo.guidance=all_fail", "algo.guidance_reward=2.0", "system.mode=async",
                   "rollout.max_staleness=1", "max_steps=3")
    _, result = run(cfg, tmp_path / "run")
    rows = [r for r in result.history if "algo/guided_groups" in r]
    assert len(rows) == 3 and all(r["algo/guided_groups"] == 4.0 for r in rows)
    assert all(r["reward/mean"] <= 1.0 and r["algo/zero_adv_groups"] == 0.0 for r in rows)
    assert all(r["train/grad_norm"] > 0 for r in rows)


def test_a_resumed_guided_run_equals_an_uninterrupted_one(tmp_path):
    """Demonstrations are derived from the journaled groups, so a resume adds the same ones."""
    from tests.system.test_controller import comparable, params, run, tiny_cfg

    guided = ("system.mode=sync", "algo.guidance=all_fail", "algo.guidance_reward=2.0")
    full_c, full_r = run(tiny_cfg(tmp_path, *guided), tmp_path / "full")
    run(tiny_cfg(tmp_path, *guided, "max_steps=2"), tmp_path / "split")
    resumed_c, resumed_r = run(tiny_cfg(tmp_path, *guided), tmp_path / "split", resume=True)
    assert comparable(resumed_r.history)[-2:] == comparable(full_r.history)[-2:]
    a, b = params(full_c), params(resumed_c)
    assert all(torch.equal(a[k], b[k]) for k in a)
