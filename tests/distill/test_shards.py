"""k-sparse logit shards: exact round trip, compact dtypes, streaming by shard, clear errors."""

import json

import pytest
import torch

from tidal.algo.distill import topk_sparsify
from tidal.config import ConfigError
from tidal.distill.shards import LogitShards, LogitShardWriter


def _seq(gen, n, vocab=51, k=4):
    logp = torch.randn(n, vocab, generator=gen).log_softmax(-1)
    return logp, topk_sparsify(logp, k)


def test_round_trip_across_shards(tmp_path):
    gen = torch.Generator().manual_seed(0)
    writer = LogitShardWriter(tmp_path / "s", k=4, num_vocab=51, positions_per_shard=5)
    written = []
    for i in range(4):
        _, (ids, logp, r) = _seq(gen, 3)
        prompt, response = [1, 10 + i], [20 + i, 21, 2]
        writer.add(prompt, response, ids, logp, r)
        written.append((prompt, response, ids, logp, r))
    meta = writer.close()
    assert meta["num_sequences"] == 4 and meta["num_positions"] == 12
    assert [s["positions"] for s in meta["shards"]] == [6, 6]  # a shard closes once it holds >= 5 positions
    assert meta["bytes_per_position"] == 4 * (2 + 2) + 4 and meta["id_dtype"] == "uint16"
    store = LogitShards(tmp_path / "s")
    assert store.num_shards == 2 and len(store) == 4
    for got, (prompt, response, ids, logp, r) in zip(store, written, strict=True):
        assert got.prompt_ids == prompt and got.response_ids == response
        assert torch.equal(got.topk_ids, ids)
        assert torch.allclose(got.topk_logp, logp, atol=2e-3)  # fp16: ~3 significant digits
        assert torch.equal(got.residual, r.float())


def test_file_bytes_track_the_formula(tmp_path):
    gen = torch.Generator().manual_seed(1)
    writer = LogitShardWriter(tmp_path / "s", k=32, num_vocab=51)
    for _ in range(200):
        _, (ids, logp, r) = _seq(gen, 4, k=32)
        writer.add([1, 5], [6, 7, 8, 2], ids, logp, r)
    meta = writer.close()
    # payload per position = 132 bytes of distribution + the token ids and offsets (a few bytes) + header
    assert 132 <= meta["file_bytes_per_position"] < 132 + 16, meta["file_bytes_per_position"]


def test_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no meta.json"):
        LogitShards(tmp_path)
    gen = torch.Generator().manual_seed(2)
    writer = LogitShardWriter(tmp_path / "s", k=2, num_vocab=51)
    _, (ids, logp, r) = _seq(gen, 2, k=2)
    with pytest.raises(AssertionError, match="sequence 0: 3 response tokens but top-k tensors"):
        writer.add([1], [5, 2, 3], ids, logp, r)
    writer.add([1], [5, 2], ids, logp, r)
    writer.close()
    shard = tmp_path / "s" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    with pytest.raises(ConfigError, match="shard-00000.safetensors: unreadable"):
        list(LogitShards(tmp_path / "s"))
    with pytest.raises(FileExistsError, match="already holds logit shards"):
        LogitShardWriter(tmp_path / "s", k=2, num_vocab=51)
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    meta["format"] = "other"
    (tmp_path / "s" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="expected 'tidal-ksparse-v1'"):
        LogitShards(tmp_path / "s")
