"""Data-parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``): same loss, same update.

One process per device (``torchrun --nproc_per_node N``); gloo on CPU, NCCL on CUDA. Every rank holds
the whole TrainBatch and runs ``Trainer.step`` on it (SPMD); what differs per rank is only which rows it
runs forward and backward on:

- *Split by whole groups, balanced by tokens.* Each minibatch's groups are dealt to the ranks
  longest-processing-time first on their token counts (``balanced_partition``), so group-level
  quantities never straddle ranks and the slowest rank waits least.
- *Global denominators, local sums.* The aggregation weights (``algo/aggregation.py``: w_bt =
  mask_bt c_b / D with D the minibatch's token, sequence or group count) and the advantages (including
  the ``batch`` and ``minibatch`` scopes of REINFORCE++ and Magistral) are computed from the whole
  minibatch on every rank, before the split. Each rank then sums loss_bt w_bt over its own rows only,
  so the ranks' losses add up to the 1-process loss exactly, and the full gradient is the *sum* of the
  ranks' gradients: FSDP's reduce-scatter is set to sum (gradient divide factor 1), not average.
- *Collectives stay in step.* FSDP2 all-gathers each layer's parameters in every forward and
  reduce-scatters its gradients in every backward, so every rank must run the same number of passes.
  A rank with fewer micro-batches (or no group at all, e.g. 3 groups on 2 ranks with micro-batching)
  runs zero-weight passes on one row: zero gradient, same collectives.
- Per-token results (log-probs, entropies, proximal and reference log-probs) are summed across ranks
  into the whole batch's [B, T] layout (each row is non-zero on exactly one rank), so every metric,
  VCPO's ESS and the engine-mismatch statistics are computed as in one process.

Gradient clipping uses the global norm (``clip_grad_norm_`` reduces over DTensor shards). The rollout
engine gets a full, unsharded state dict gathered on rank 0 (``full_state_dict``, timed and counted in
``perf/weight_gather_s`` and ``perf/weight_sync_bytes``). Checkpoints are written by rank 0 in the
1-process layout (full weights, optimizer state numbered as ``optimizer.state_dict()`` numbers it), so
a run can resume with a different number of processes.

How a run uses it (``launch/torchrun.py``): rank 0 runs the controller (generation, rewards, eval, logging)
and holds a ``LeaderTrainer``, which announces every call that touches the sharded model to the other
ranks before running it; the other ranks sit in ``follow``, running the same calls with the same
arguments (the TrainBatch travels by ``broadcast_object_list``).

Like torchtitan's FSDP2 recipe, each decoder layer is one FSDP unit and the root unit holds the
embeddings, final norm and LM head. The root is a small module whose forward is ``token_logprobs``:
FSDP2 unshards the root's parameters in its forward, and the trainer reaches the decoder and the head
directly (chunked FP32 head), not through the causal LM's own forward.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tidal.models.logprobs import token_logprobs
from tidal.train.data_parallel import (  # noqa: F401 (the trainer's side, re-exported for this module's callers)
    LOCAL,
    SHARDED_ROOT,
    DataParallel,
    local_value,
    root_of,
    split_groups,
    state_dict_bytes,
)

DEFAULT_TIMEOUT_S = 7200.0
"""Collective timeout. The other ranks wait in a broadcast while rank 0 generates and evaluates, which
can take long on a real run; a crashed rank still ends the run (torchrun tears the others down)."""


@dataclass(frozen=True)
class FSDP(DataParallel):
    """The FSDP2 strategy: the trainer hands it its model (``shard``), gradients are reduced in backward."""

    shards_model = True

    def shard(self, model: torch.nn.Module) -> LogprobModule:
        return shard(model, self)


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> FSDP:
    """Join the process group torchrun describes (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). gloo on CPU; on CUDA NCCL for tensors on the GPU plus gloo for the CPU-side objects
    and metrics (``cpu:gloo,cuda:nccl``). Only the gloo path is tested: the trainer keeps batches and
    losses on the CPU today, so a CUDA run needs device placement in ``Trainer`` first."""
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return FSDP(dist.get_rank(), dist.get_world_size(), device)


def rank() -> int:
    """This process's global rank (0 outside a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the split ----------------------------------------------------------------------------------
# ---- sharding -----------------------------------------------------------------------------------
class LogprobModule(torch.nn.Module):
    """The root FSDP unit: its forward is ``token_logprobs`` of the wrapped causal LM, so FSDP2's root
    hooks unshard the embeddings, norm and head (a vision-language model's vision tower too) around the
    trainer's own forward. ``images`` (``train/vision.py``'s ``ImageInputs``, handed in by the view
    ``with_images`` returns for a sharded model): the forward scores the LM as that view, built here, inside
    the hooks, so the image path reads unsharded weights."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids_bt, attention_mask_bt, temperature=1.0, with_entropy=False, *,
                position_ids=None, parents_bt=None, chunk_size=1024, entropy_grad=False, score_mask_bt=None,
                tf32=False, head_kernel="chunked", images=None):
        lm = self.lm if images is None else images.over(self.lm)
        return token_logprobs(lm, input_ids_bt, attention_mask_bt, temperature, with_entropy,
                              position_ids=position_ids, parents_bt=parents_bt, chunk_size=chunk_size,
                              entropy_grad=entropy_grad, score_mask_bt=score_mask_bt, tf32=tf32,
                              head_kernel=head_kernel)

    # what the trainer and checkpoint.py ask of a sharded model's root (train/data_parallel.py)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self)

    def gather_full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return gather_full_state(self.lm, optimizer)

    def load_full_checkpoint(self, path, optimizer, scheduler):
        return load_full_checkpoint(path, self.lm, optimizer, scheduler)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM (Llama/Qwen2/Mistral layout: ``model.layers``; a Qwen2-VL's
    text decoder's, ``model.language_model.layers``, its vision tower staying in the root unit)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layers at get_decoder().layers to shard one by one")
    return layers


def shard(model: torch.nn.Module, dp: DataParallel, reshard_after_forward: bool = True) -> LogprobModule:
    """Apply FSDP2 in place: each decoder layer, then a ``LogprobModule`` root around ``model``. Returns
    the root; ``model`` keeps its class and names, its parameters become DTensor shards. Gradients are
    summed across ranks, not averaged (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model.to(dp.device)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    root = LogprobModule(model)
    fully_shard(root, reshard_after_forward=reshard_after_forward)
    model.__dict__[SHARDED_ROOT] = root  # not a registered submodule: the root contains the model
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if dp.device.type == "cpu":  # gloo has no PREMUL_SUM: reduce with a plain sum
                module.set_force_sum_reduction_for_comms(True)
    return root


# ---- full state dicts ---------------------------------------------------------------------------
_PREFIX = "lm."  # LogprobModule's name for the wrapped model


def full_state_dict(root: LogprobModule) -> dict[str, torch.Tensor]:
    """The unsharded weights on rank 0, on CPU, under the causal LM's own names (tied weights under both
    names, as ``model.state_dict()``); an empty dict on the other ranks. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix(_PREFIX): v for k, v in sd.items()}


def _optimizer_fqns(root: LogprobModule, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order: position i is what ``optimizer.state_dict()`` calls i."""
    names = {id(p): n for n, p in root.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(root: LogprobModule, optimizer: torch.optim.Optimizer) -> dict:
    """The unsharded optimizer state on rank 0, numbered as the 1-process ``optimizer.state_dict()``
    (so a checkpoint moves between world sizes); an empty dict elsewhere. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(root, optimizer,
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    index = {name: i for i, name in enumerate(_optimizer_fqns(root, optimizer))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    return {"state": {index[n]: s for n, s in osd["state"].items()}, "param_groups": groups}


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(full weights, full optimizer state) of a sharded model on rank 0, empty dicts elsewhere, for a
    checkpoint. Collective; called on rank 0 alone under a ``LeaderTrainer``, it brings the other ranks
    in (so ``checkpoint.save_checkpoint(trainer.model, ...)`` works unchanged on rank 0). A tied alias is left
    out, as ``save_pretrained`` leaves it out of a 1-process checkpoint (the gathered copies share no storage it
    could recognize): the same files either way."""
    from tidal.models.tied import tied_names, untie

    _announce("gather_full_state")
    root = root_of(model)
    return untie(full_state_dict(root), tied_names(model)), full_optimizer_state(root, optimizer)


def load_full_state(root: LogprobModule, optimizer: torch.optim.Optimizer | None,
                    model_sd: dict[str, torch.Tensor], optim_sd: dict | None, strict: bool = True) -> None:
    """Load full (1-process layout) weights and optimizer state given on rank 0 into the shards of every
    rank (broadcast from rank 0; other ranks pass empty dicts). Collective. ``strict=False``: ``model_sd``
    may hold a subset of the weights (a LoRA checkpoint's adapters; the frozen base is already there)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    rank0 = dist.get_rank() == 0
    if rank0:
        model_sd = _with_tied(root.lm, model_sd)
    set_model_state_dict(root, {_PREFIX + k: v for k, v in model_sd.items()} if rank0 else {}, options=options)
    if optimizer is None:
        return
    if rank0:
        names = _optimizer_fqns(root, optimizer)
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]]
        optim_sd = {"state": {names[i]: s for i, s in optim_sd["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(root, optimizer, optim_sd if rank0 else {}, options=options)


def _with_tied(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill in the names a checkpoint leaves out because they share a parameter with another (tied input
    and output embeddings are saved once)."""
    sd = dict(sd)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        saved = next((n for n in names if n in sd), None)
        for n in names:
            if saved is not None and n not in sd:
                sd[n] = sd[saved]
    return sd


def load_full_checkpoint(path, model: torch.nn.Module, optimizer, scheduler):
    """``checkpoint.load_checkpoint`` for a sharded model: rank 0 reads the files, every rank gets its
    shards, the scheduler state and the counters; rank 0 restores its RNG state. Collective (every rank
    calls it)."""
    from tidal.train.checkpoint import TrainingState, read_checkpoint
    from tidal.utils.seeding import set_rng_state

    rank0 = dist.get_rank() == 0
    weights, blob = read_checkpoint(path) if rank0 else ({}, {})
    from tidal.models.lora import is_peft

    load_full_state(root_of(model), optimizer, weights, blob.get("optimizer"), strict=not is_peft(model))
    box = [(blob.get("scheduler"), blob.get("state")) if rank0 else None]
    dist.broadcast_object_list(box, src=0)
    scheduler_state, counters = box[0]
    scheduler.load_state_dict(scheduler_state)
    if rank0:
        set_rng_state(blob["rng"])
    return TrainingState(**counters)


# ---- rank 0 leads, the others follow ------------------------------------------------------------
COLLECTIVE = ("step", "skip_step", "state_dict_for_engine", "gather_full_state")
"""Trainer calls every rank must make together (each runs FSDP collectives)."""

_leading: list[DataParallel] = []  # rank 0's group while a LeaderTrainer is open
_busy = [False]  # inside an announced call: its nested collectives are already everyone's


def _announce(name: str, *args, **kwargs) -> None:
    """Under a LeaderTrainer on rank 0, tell the followers to make the call ``name`` too."""
    if _leading and not _busy[0]:
        _leading[-1].broadcast((name, args, kwargs))


class LeaderTrainer:
    """Rank 0's handle on an SPMD trainer: each call in ``COLLECTIVE`` is first announced to the other
    ranks (which run it too, in ``follow``); everything else is the trainer's own, on rank 0 alone."""

    def __init__(self, trainer):
        assert trainer.dp.rank == 0, "the leader is rank 0"
        self.trainer = trainer
        _leading.append(trainer.dp)

    def __getattr__(self, name: str):
        attr = getattr(self.trainer, name)
        if name not in COLLECTIVE:
            return attr

        def call(*args, **kwargs):
            _announce(name, *args, **kwargs)
            _busy[0] = True
            try:
                return attr(*args, **kwargs)
            finally:
                _busy[0] = False

        return call

    def close(self) -> None:
        """Release the followers (they return from ``follow``). Idempotent."""
        if self.trainer.dp in _leading:
            _announce("stop")
            _leading.remove(self.trainer.dp)


def follow(trainer) -> int:
    """The loop of ranks other than 0: run each announced call until rank 0 closes. Returns the calls run."""
    calls = 0
    while True:
        name, args, kwargs = trainer.dp.broadcast(None)
        if name == "stop":
            return calls
        assert name in COLLECTIVE, f"unknown call {name!r} from rank 0"
        getattr(trainer, name)(*args, **kwargs)
        calls += 1
