"""The local engine on a real pretrained chat model (SmolLM2-135M-Instruct from its PyPI wheel): chat-rendered
prompts of different lengths, sampled log-probs equal to the trainer's full forward, answers ending at the
template's end-of-turn token."""

import pytest
import torch

from tidal.models import prompts, tiny
from tidal.models.logprobs import token_logprobs
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.types import Prompt


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model, tokenizer = tiny.load(smollm2_dir)
    return model.eval(), prompts.attach(tokenizer, prompts.PromptFormat())


def test_engine_logprobs_equal_the_trainer_forward_on_smollm2(smollm2):
    model, tokenizer = smollm2
    questions = [Prompt("a", "What is 37+48?", "85"), Prompt("b", "Add 5 and 9. Answer with just the number.", "14")]
    requests = group_requests(tokenizer, questions, 2)
    assert len({len(r.prompt_ids) for r in requests}) == 2, "rows of different lengths share the batch"
    engine = LocalEngine(model, tokenizer, SamplingConfig(temperature=0.7, max_new_tokens=12))
    with torch.no_grad():
        trajs = engine.generate(requests)
        worst = 0.0
        for t in trajs:
            ids = torch.tensor([t.prompt_ids + t.token_ids])
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)
            worst = max(worst, (logp[0, len(t.prompt_ids):] - torch.tensor(t.logprobs)).abs().max().item())
    assert worst < 1e-4, worst
    for t in trajs:
        assert tokenizer.decode(t.prompt_ids).endswith("<|im_start|>assistant\n")
        if t.finish_reason == "stop":
            assert t.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
