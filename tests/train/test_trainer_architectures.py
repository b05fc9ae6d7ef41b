"""The trainer's log-probs on each architecture family tidal claims (``tests/models/architectures.py``) equal
transformers' own forward in every layout the trainer uses: padded, packed and prefix tries, with the dense
mask and the block mask; sequences run far past the sliding window, rows of different lengths. A model the
trainer would compute wrongly is refused in one line."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tidal.algo import AlgoConfig
from tidal.models.architecture import UnsupportedArchitecture
from tidal.optim.config import OptimConfig
from tidal.train.config import TrainerConfig
from tidal.train.trainer import Trainer
from tidal.types import TrainBatch
from tidal.utils.device import tensors_to

from ..models.architectures import ATOL, FAMILIES, WINDOW, WINDOWED, build, reference_logprobs, windowed_matters

LAYOUTS = {
    "padded": dict(),
    "packed-dense": dict(packing=True, pack_tokens=320, packed_attention="dense"),
    "packed-block": dict(packing=True, pack_tokens=320, packed_attention="block"),
    "trie-dense": dict(share_prefixes=True, pack_tokens=320, packed_attention="dense"),
    "trie-block": dict(share_prefixes=True, pack_tokens=320, packed_attention="block"),
}


def _batch(vocab: int) -> TrainBatch:
    """Three groups of four: a 20-token prompt per group and responses over three symbols (tries share response
    prefixes too), 24 to 150 tokens long (the window is 5); packed rows span more than one 128-token block."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([24, 150, 60, 31, 90, 45, 24, 120, 33, 70, 100, 28])
    width = int(lengths.max())
    ids = torch.randint(3, 6, (12, width), generator=g)
    group = torch.arange(12) // 4
    ids[:, :20] = torch.randint(3, vocab, (3, 20), generator=g)[group]
    ids[5, :40] = ids[4, :40]  # a long shared response prefix
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    loss_mask = attn.float()
    loss_mask[:, :20] = 0
    return TrainBatch(ids * attn, attn, loss_mask, torch.zeros(12, width), torch.where(loss_mask > 0, 0, -1), group,
                      torch.zeros(12))


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logprobs_equal_transformers_forward_in_every_layout(tokenizer, family):
    model = build(family, tokenizer)
    batch = _batch(len(tokenizer))
    lengths = batch.attention_mask_bt.sum(-1).tolist()
    seqs = [batch.input_ids_bt[i, :n].tolist() for i, n in enumerate(lengths)]
    refs = [reference_logprobs(model, s) for s in seqs]
    if family in WINDOWED:
        assert windowed_matters(model, seqs[1]) > 100 * ATOL
    for name, layout in LAYOUTS.items():
        trainer = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(), TrainerConfig(**layout))
        logp_bt = trainer._scores(trainer.model, batch)
        worst = max(float((logp_bt[i, 1:n] - ref).abs().max()) for i, (n, ref) in enumerate(zip(lengths, refs)))
        assert worst < ATOL, (name, worst)
        if name.endswith("block"):
            assert trainer.model.config._attn_implementation == "tidal_packed"
    assert max(lengths) > 20 * WINDOW


def test_trainer_refuses_an_unsupported_model_in_one_line(tokenizer):
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedArchitecture, match=r"^LlamaForCausalLM: RoPE scaling that depends on the seq"):
        Trainer(model, AlgoConfig(), OptimConfig(), TrainerConfig())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize("layout", ["packed-block", "trie-block"])
def test_flex_attention_keeps_the_windows_on_cuda(tokenizer, family, layout):
    """FlexAttention (compiled) runs the windowed block masks, tiles behind the window skipped."""
    model = build(family, tokenizer)
    batch = _batch(len(tokenizer))
    lengths = batch.attention_mask_bt.sum(-1).tolist()
    trainer = Trainer(copy.deepcopy(model), AlgoConfig(), OptimConfig(),
                      TrainerConfig(precision="fp32", **LAYOUTS[layout]), device="cuda")
    logp_bt = trainer._scores(trainer.model, tensors_to(batch, trainer.device)).cpu()
    for i, n in enumerate(lengths):
        ref = reference_logprobs(model, batch.input_ids_bt[i, :n].tolist())
        torch.testing.assert_close(logp_bt[i, 1:n], ref, atol=2e-3, rtol=1e-3)
