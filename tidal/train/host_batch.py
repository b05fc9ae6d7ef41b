"""What the trainer reads of a batch on the host, read once per step.

Laying out a pass (micro-batch splits, packing, prefix tries, which tokens the LM head scores) needs token
ids, lengths, group ids and the loss mask as Python values. Read from a batch on the GPU, each read
blocks until the device catches up: issue 51 found a synchronization in every micro-batch, and
``pack()`` copying each sequence to the host one at a time. ``HostBatch.of`` makes one copy at the start of
the step; every pass lays itself out from it and the device runs ahead meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.types import TrainBatch


@dataclass
class HostBatch:
    source: TrainBatch
    """The batch this was read from (a later step's batch is read again)."""
    input_ids_bt: torch.Tensor  # long [B, T], on the host
    loss_mask_bt: torch.Tensor  # bool [B, T], on the host
    lengths_b: list[int]
    group_ids_b: list[int]

    @classmethod
    def of(cls, batch: TrainBatch) -> HostBatch:
        ids, attn, loss, groups = (t.cpu() for t in (batch.input_ids_bt, batch.attention_mask_bt,
                                                     batch.loss_mask_bt, batch.group_index_b))
        return cls(batch, ids, loss.bool(), attn.sum(-1).tolist(), groups.tolist())

    def lengths(self, rows: torch.Tensor) -> list[int]:
        return [self.lengths_b[i] for i in rows.tolist()]

    def groups(self, rows: torch.Tensor) -> list[int]:
        return [self.group_ids_b[i] for i in rows.tolist()]


def read_metrics(metrics: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """``metrics`` as floats, with every tensor among them read in one transfer (the step's one read)."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return dict(metrics)
    values = torch.stack([metrics[k].detach().reshape(()).double() for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, values))}
