"""Compact on-disk storage of k-sparse teacher distributions: safetensors shards, read one at a time.

A store is a directory::

    meta.json                  k, vocabulary size, dtypes, counts, bytes per position, the shard list
    shard-00000.safetensors    one shard: a few thousand sequences and their teacher distributions
    ...

Each shard holds, for S sequences with P response positions in all:

    tokens       int32   [sum of sequence lengths]   prompt + response token ids, concatenated
    seq_offsets  int64   [S + 1]                     where each sequence starts in ``tokens``
    prompt_lens  int32   [S]                         its prompt's length (the rest is the response)
    topk_ids     uint16  [P, k]  (int32 when the vocabulary exceeds 65,536)
    topk_logp    float16 [P, k]  the teacher's log-probs of those ids, descending
    residual     float32 [P]     1 - the top-k probabilities' sum (the tail bucket's mass)

Row j of a sequence's positions is the teacher's distribution over the token at response position j
(given the prompt and the response before it). Bytes per position: k x (2 + 2) + 4, so 132 at
k = 32 against 4 x V for the full fp32 distribution (216 bytes at the tiny vocabulary of 54,
607,744 at Qwen2's 151,936). fp16 log-probs keep about 3 significant digits; the residual is kept
in fp32 because it is 1 minus a sum and loses the most to rounding. safetensors was chosen over
Parquet because every array is a fixed-width tensor that ``safe_open`` reads without a copy and a
shard is validated against its own header (a truncated file fails to open, naming the shard).

Readers stream: ``LogitShards`` opens one shard at a time, so memory stays bounded by the shard
size however large the store grows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tidal.algo.distill import bytes_per_position
from tidal.config import ConfigError

META = "meta.json"
FORMAT = "tidal-ksparse-v1"


@dataclass
class SparseSequence:
    """One stored sequence and the teacher's k-sparse distribution at each of its response positions."""

    prompt_ids: list[int]
    response_ids: list[int]
    topk_ids: torch.Tensor  # long [len(response_ids), k]
    topk_logp: torch.Tensor  # float32 [len(response_ids), k]
    residual: torch.Tensor  # float32 [len(response_ids)]


class LogitShardWriter:
    """Append sequences with their top-k teacher distributions; ``close()`` writes the last shard and meta."""

    def __init__(self, out_dir: str | Path, k: int, num_vocab: int, positions_per_shard: int = 65_536,
                 extra_meta: dict | None = None):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if any(self.out.glob("shard-*.safetensors")):
            raise FileExistsError(f"{self.out} already holds logit shards; choose an empty --out directory")
        self.k, self.num_vocab = k, num_vocab
        self.id_dtype = torch.uint16 if num_vocab <= 2**16 else torch.int32
        self.positions_per_shard = positions_per_shard
        self.extra_meta = extra_meta or {}
        self.shards: list[dict] = []
        self._reset()

    def _reset(self) -> None:
        self._tokens: list[int] = []
        self._offsets = [0]
        self._prompt_lens: list[int] = []
        self._ids: list[torch.Tensor] = []
        self._logp: list[torch.Tensor] = []
        self._residual: list[torch.Tensor] = []
        self._positions = 0

    def add(self, prompt_ids: list[int], response_ids: list[int], ids_nk: torch.Tensor, logp_nk: torch.Tensor,
            residual_n: torch.Tensor) -> None:
        n = len(response_ids)
        assert ids_nk.shape == (n, self.k) and logp_nk.shape == (n, self.k) and residual_n.shape == (n,), (
            f"sequence {len(self._prompt_lens)}: {n} response tokens but top-k tensors of shapes "
            f"{tuple(ids_nk.shape)}, {tuple(logp_nk.shape)}, {tuple(residual_n.shape)} (k={self.k})")
        self._tokens += [*prompt_ids, *response_ids]
        self._offsets.append(len(self._tokens))
        self._prompt_lens.append(len(prompt_ids))
        self._ids.append(ids_nk.to(self.id_dtype))
        self._logp.append(logp_nk.to(torch.float16))
        self._residual.append(residual_n.to(torch.float32))
        self._positions += n
        if self._positions >= self.positions_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._prompt_lens:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        tensors = {
            "tokens": torch.tensor(self._tokens, dtype=torch.int32),
            "seq_offsets": torch.tensor(self._offsets, dtype=torch.int64),
            "prompt_lens": torch.tensor(self._prompt_lens, dtype=torch.int32),
            "topk_ids": torch.cat(self._ids).contiguous(),
            "topk_logp": torch.cat(self._logp).contiguous(),
            "residual": torch.cat(self._residual).contiguous(),
        }
        tmp = self.out / f".{name}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, self.out / name)  # a crash never leaves a half-written shard under its real name
        self.shards.append({"file": name, "sequences": len(self._prompt_lens), "positions": self._positions})
        self._reset()

    def close(self) -> dict:
        self._flush()
        id_bytes = torch.empty(0, dtype=self.id_dtype).element_size()
        positions = sum(s["positions"] for s in self.shards)
        payload = sum((self.out / s["file"]).stat().st_size for s in self.shards)
        meta = {
            "format": FORMAT, "k": self.k, "num_vocab": self.num_vocab,
            "id_dtype": str(self.id_dtype).removeprefix("torch."), "logp_dtype": "float16", "residual_dtype": "float32",
            "num_sequences": sum(s["sequences"] for s in self.shards), "num_positions": positions,
            "bytes_per_position": bytes_per_position(self.k, self.num_vocab, id_bytes=id_bytes),
            "file_bytes_per_position": payload / max(positions, 1),
            "shards": self.shards, **self.extra_meta,
        }
        (self.out / META).write_text(json.dumps(meta, indent=1) + "\n")
        return meta


class LogitShards:
    """A k-sparse store, read shard by shard. ``iter(store)`` yields ``SparseSequence``s in order;
    ``shard(i)`` loads one shard's sequences (what a shuffling trainer draws from)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / META
        if not meta_path.exists():
            raise ConfigError(f"{self.path}: not a logit store (no {META}; write one with `tidal distill logits`)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ConfigError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.k: int = self.meta["k"]
        self.num_vocab: int = self.meta["num_vocab"]

    @property
    def num_shards(self) -> int:
        return len(self.meta["shards"])

    def __len__(self) -> int:
        return self.meta["num_sequences"]

    def shard(self, index: int) -> list[SparseSequence]:
        name = self.meta["shards"][index]["file"]
        try:
            with safe_open(str(self.path / name), "pt") as f:
                t = {key: f.get_tensor(key) for key in f.keys()}
        except Exception as e:  # a truncated or foreign file: say which one
            raise ConfigError(f"{self.path / name}: unreadable logit shard ({e})") from None
        tokens, offsets, plens = t["tokens"].tolist(), t["seq_offsets"].tolist(), t["prompt_lens"].tolist()
        ids, logp, residual = t["topk_ids"].to(torch.long), t["topk_logp"].float(), t["residual"].float()
        out, pos = [], 0
        for s, plen in enumerate(plens):
            seq = tokens[offsets[s] : offsets[s + 1]]
            n = len(seq) - plen
            out.append(SparseSequence(seq[:plen], seq[plen:], ids[pos : pos + n], logp[pos : pos + n],
                                      residual[pos : pos + n]))
            pos += n
        assert pos == len(residual), f"{self.path / name}: {pos} response positions but {len(residual)} rows"
        return out

    def __iter__(self) -> Iterator[SparseSequence]:
        for i in range(self.num_shards):
            yield from self.shard(i)
