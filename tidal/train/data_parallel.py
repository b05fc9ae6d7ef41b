"""What the training step knows of data parallelism: the rank group it is handed, and the ``trainer.*`` keys
that choose a strategy. The strategies themselves live in ``tidal/parallel/`` (FSDP2 in ``fsdp.py``, DiLoCo,
elastic replicas) and are handed to the ``Trainer`` by their launchers, so the step never imports them.

``DataParallel`` is this process's place in the group; its collectives (``part``, ``sum_``, ``sum_floats``,
``broadcast``) are what the trainer calls, a world of 1 (``LOCAL``) makes each a no-op. A strategy that shards
the model (``shards_model``) puts a root module on it (``root_of``); the trainer runs its forwards through that
root and asks it for full state dicts (``full_state_dict``, ``gather_full_state``, ``load_full_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tidal.config import ConfigError
from tidal.train.microbatch import balanced_partition

LOOPBACK = "127.0.0.1"
"""Where torchft's servers listen unless ``trainer.elastic.host`` says otherwise (``parallel/replica_group.py``)."""

SHARDED_ROOT = "_tidal_fsdp_root"
"""The attribute a sharding strategy sets on a model: its root module (not a registered submodule)."""


# ---- process group ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataParallel:
    """This process's place in the data-parallel group; a world of 1 makes every method a no-op."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    shards_model = False
    """True for FSDP (``parallel/fsdp.py``): the trainer hands its model to ``shard`` and gradients are reduced
    inside backward. False: full replicas (``parallel/elastic_dp.py``), gradients summed by ``reduce_gradients``."""

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard ``model`` over the ranks in place and return its root (a strategy with ``shards_model``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps full replicas: it does not shard a model")

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Nothing to do: FSDP's reduce-scatter summed the gradients during backward."""

    def part(self, group_index_b: Sequence[int], lengths_b: Sequence[int]) -> list[int]:
        """Positions of this rank's rows: whole groups, balanced by tokens (``split_groups``)."""
        if not self.enabled:
            return list(range(len(group_index_b)))
        return split_groups(group_index_b, lengths_b, self.world_size)[self.rank]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce ``t`` in place by sum."""
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_int(self, n: int) -> int:
        if not self.enabled:
            return n
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Key-wise sum of every rank's dict of floats (ranks may hold different keys)."""
        if not self.enabled:
            return values
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, values)
        out: dict[str, float] = {}
        for part in gathered:
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; other ranks' argument is ignored)."""
        if not self.enabled:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


LOCAL = DataParallel()



def split_groups(group_index_b: Sequence[int], lengths_b: Sequence[int], num_parts: int) -> list[list[int]]:
    """Row positions of ``num_parts`` parts made of whole groups (rows sharing a group id), balanced by
    the groups' token counts (LPT, ``balanced_partition``). Deterministic: every rank computes the same
    split. A part may be empty when there are fewer groups than parts."""
    assert len(group_index_b) == len(lengths_b), f"{len(group_index_b)} group ids, {len(lengths_b)} lengths"
    members: dict[int, list[int]] = {}  # insertion order: groups in order of first appearance
    for pos, g in enumerate(group_index_b):
        members.setdefault(int(g), []).append(pos)
    groups = list(members.values())
    parts = balanced_partition([sum(lengths_b[i] for i in rows) for rows in groups], num_parts)
    return [sorted(i for gi in part for i in groups[gi]) for part in parts]


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (e.g. the grad norm of sharded parameters), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def root_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The FSDP root ``shard`` put around ``model``; None for a model that is not sharded. For the image view of a
    sharded model (``train/vision.py``'s ``with_images``): the root bound to that view's images, which the
    trainer calls as it calls the root."""
    return model.__dict__.get(SHARDED_ROOT)


def state_dict_bytes(sd: dict[str, torch.Tensor]) -> int:
    """Bytes a state dict ships (every entry counted, as a receiver copies every entry)."""
    return sum(v.numel() * v.element_size() for v in sd.values())



# ---- the strategies' keys (trainer.diloco, trainer.elastic) ---------------------------------------
@dataclass
class DiLoCoConfig:
    """Outer loop of DiLoCo / Streaming DiLoCo. Defaults are the DiLoCo paper's (arXiv 2311.08105, Sec. 3)."""

    sync_every: int = 500
    """H, inner steps per round. DiLoCo: 500 (communication 500x lower than per-step data parallel)."""
    outer_lr: float = 0.7
    """Outer Nesterov learning rate. DiLoCo: 0.7 (their sweep's best)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum. DiLoCo: 0.9."""
    num_fragments: int = 1
    """Streaming DiLoCo's F (arXiv 2501.18512): the model's decoder layers are split into F contiguous
    fragments synced at staggered steps (embeddings/head go with the first and last). 1 = plain DiLoCo.
    ``sync_every`` must be a multiple of F."""
    fragment_sync_delay: int = 0
    """Streaming DiLoCo's tau: inner steps a fragment's all-reduce may overlap before it is needed."""
    fragment_update_alpha: float = 0.0
    """Streaming DiLoCo's alpha: mix of local (alpha) and new global (1 - alpha) parameters after a sync."""
    min_replicas: int = 1
    """Fewest live workers a round needs; 1 lets a lone survivor keep training while others are away."""
    timeout_s: float = 30.0
    """All-reduce / recovery timeout (torchft ``Manager(timeout=...)``)."""
    quorum_timeout_s: float = 600.0
    """How long a sync waits for a quorum; must exceed the time of H inner steps (torchft's advice)."""

    def __post_init__(self):
        for key in ("sync_every", "num_fragments", "min_replicas"):
            if getattr(self, key) < 1:
                raise ValueError(f"diloco.{key} must be >= 1, got {getattr(self, key)}")
        if self.sync_every % self.num_fragments:
            raise ValueError(f"diloco.sync_every ({self.sync_every}) must be a multiple of "
                             f"diloco.num_fragments ({self.num_fragments})")
        if not 0 <= self.fragment_sync_delay < self.sync_every // self.num_fragments:
            raise ValueError(f"diloco.fragment_sync_delay must be in [0, sync_every/num_fragments), "
                             f"got {self.fragment_sync_delay}")
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise ValueError(f"diloco.fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}")


@dataclass
class AdaptiveBatchConfig:
    """AdLoCo's adaptive local batch (arXiv 2508.18182, Sec. 3.2) and switch to accumulation (Sec. 3.3)."""

    initial_batch: int = 8
    """Batch the first step uses; the norm test grows it from there."""
    max_batch: int = 512
    """Cap on the batch the norm test may ask for."""
    max_micro_batch: int = 64
    """Largest batch one forward/backward holds; beyond it the step accumulates ("switch mode")."""
    eta: float = 1.0
    """Norm-test tolerance: the batch grows until the mean gradient's standard error is below eta ||g||.
    Smaller eta, bigger batches. AdAdaGrad's experiments use values around 0.1-1; 1.0 is the mildest."""

    def __post_init__(self):
        if not 1 <= self.initial_batch <= self.max_batch:
            raise ValueError(f"adaptive.initial_batch must be in [1, max_batch={self.max_batch}], "
                             f"got {self.initial_batch}")
        if self.max_micro_batch < 1 or self.eta <= 0:
            raise ValueError(f"adaptive.max_micro_batch must be >= 1 and adaptive.eta > 0, "
                             f"got {self.max_micro_batch} and {self.eta}")


@dataclass
class ElasticConfig:
    """``trainer.data_parallel=elastic``: the run's process leads ``replicas - 1`` replica processes it
    starts and restarts itself (``parallel/elastic_leader.py``, docs/faults.md)."""

    replicas: int = 2
    """Trainer replicas, the leader included (each a full copy of the policy and its optimizer; the
    batch's groups are split over the live ones and their gradients summed, so the update does not
    depend on how many are alive)."""
    timeout_s: float = 10.0
    """A collective with a dead peer fails after at most this many seconds (gloo usually sees the closed
    socket at once); also the limit on a heal's state transfer."""
    join_timeout_s: float = 60.0
    """How long a quorum waits for a replica of the previous quorum that still heartbeats but has not
    asked to join (a dead one stops heartbeating and is dropped after ``HEARTBEAT_TIMEOUT_MS``)."""
    wait_ready_s: float = 120.0
    """Before each step the leader waits up to this long for replica processes that are starting (at
    launch, or restarted after a crash) to be ready, so they join this step rather than a later one.
    0: never wait; training goes on with the live replicas and a new one joins whenever it is ready."""
    max_restarts: int = 10
    """Replica processes the leader restarts over the launch; past this a replica that dies stays dead
    and the run goes on with the others."""
    check_replicas: bool = True
    """Compare the replicas' weights and optimizer state after every step (``ElasticTrainer``; the
    elastic run's SDC check in place of ``sdc.*``, whose replay needs one process)."""
    fault_step: int | None = None
    """Fault injection (tests, measurements): replica 1's first process exits (``os._exit``) inside the
    forward of this training step (numbered as in metrics.jsonl; if that step trains nothing, of the next one that
    does); its restarted process does not."""
    host: str = LOOPBACK
    """The address torchft's servers listen on: the lighthouse, and each replica's manager server, TCP store,
    gloo connections and checkpoint server (from which a healing replica fetches a live one's weights and
    optimizer state). Loopback by default: the replicas are this machine's processes. Another address
    (``0.0.0.0``: every interface) lets anything that reaches those ports, unauthenticated, join the quorum or
    read the policy; the leader logs a warning (docs/faults.md)."""


def validate_elastic(cfg: ElasticConfig) -> None:
    """A ConfigError naming the ``trainer.elastic`` key that cannot run (overrides bypass ``__init__``)."""
    rules = [("replicas", lambda v: isinstance(v, int) and v >= 2, "an integer >= 2 (the leader and at least one "
              "replica; one replica is a 1-process run: leave trainer.data_parallel unset)"),
             ("timeout_s", lambda v: isinstance(v, (int, float)) and v > 0, "> 0 seconds"),
             ("join_timeout_s", lambda v: isinstance(v, (int, float)) and v > 0, "> 0 seconds"),
             ("wait_ready_s", lambda v: isinstance(v, (int, float)) and v >= 0, ">= 0 seconds"),
             ("max_restarts", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
             ("fault_step", lambda v: v is None or (isinstance(v, int) and v >= 1), "an integer >= 1 (or null)"),
             ("host", lambda v: isinstance(v, str) and v.strip() == v != "", "an address to listen on (127.0.0.1: "
              "loopback; 0.0.0.0: every interface)")]
    for key, ok, requirement in rules:
        value = getattr(cfg, key)
        if isinstance(value, bool) or not ok(value):
            raise ConfigError(f"trainer.elastic.{key} must be {requirement}, got {value!r}")
