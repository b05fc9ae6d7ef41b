"""Low-communication data parallelism (DiLoCo family): workers sync every H steps, not every step.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every worker starts a round from the same global
parameters theta, takes H inner AdamW steps on its own data, and sends its *pseudo-gradient*
delta_w = theta - theta_w (how far it moved, sign chosen so it points like a gradient). The average
delta = (1/|live|) sum_w delta_w over the workers alive this round is fed to an outer Nesterov SGD
(lr 0.7, momentum 0.9):

    m <- mu m + delta            (m = delta on the first round, as torch's SGD does)
    theta <- theta - lr (delta + mu m)

Communication is one all-reduce of the parameters every H steps instead of one of the gradients
every step: H times fewer bytes (the paper's 500x at H = 500). Streaming DiLoCo (arXiv 2501.18512)
splits the model into F fragments and syncs fragment f at step f*H/F of the round, so the peak
bandwidth drops F-fold and the exchange can overlap compute.

The transport and fault tolerance are torchft's (``torchft.Manager`` + ``torchft.local_sgd.DiLoCo``,
gloo on CPU): each worker is its own replica group; a lighthouse forms a quorum of the live workers at
every sync. A worker that dies makes that round's all-reduce fail on the others, who discard the round
(back to the last global parameters) and go on with whoever is left; a worker that (re)joins is behind
the quorum's step, so torchft sends it the current global parameters, outer-optimizer state and a
peer's inner state before it contributes. ``init_sync=False``: all workers build the same initial
weights from a seed (torchft's default ``init_sync=True`` overwrites one replica's first round).

AdLoCo (Kutuzov et al. 2025, arXiv 2508.18182) adds per-worker adaptive batch sizes: the next batch
is the one the *norm test* (Byrd et al. 2012, as in AdAdaGrad, which AdLoCo builds on) asks for,

    b_next = ceil( sigma^2 / (eta^2 ||g||^2) ),   sigma^2 = per-example gradient variance,

so the batch grows as the gradient's signal ||g||^2 shrinks relative to its noise. When b exceeds what
one pass can hold (``max_micro_batch``) the step switches to gradient accumulation ("switch mode").
sigma^2 is estimated from the micro-batch gradients g_j of sizes s_j (a step always makes at least two):
sigma^2 = sum_j s_j ||g_j - g||^2 / (m - 1), an unbiased estimate for equal s_j.

``outer_step_reference`` is the outer update written out; the tests check torchft's run against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tidal.parallel.replica_group import LOOPBACK, Lighthouse, quiet_torchft, replica_group
from tidal.train.data_parallel import AdaptiveBatchConfig, DiLoCoConfig  # noqa: F401 (the keys live beside the trainer)


# ---- pure math ------------------------------------------------------------------------------------
def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """delta_w = theta_global - theta_w: the worker's round, signed like a gradient."""
    return [g - w for g, w in zip(global_params, local_params, strict=True)]


def outer_step_reference(global_params: Sequence[torch.Tensor], deltas_by_worker: Sequence[Sequence[torch.Tensor]],
                         momentum: Sequence[torch.Tensor] | None, lr: float = 0.7, mu: float = 0.9
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One outer Nesterov step on the live workers' average pseudo-gradient; returns (theta, momentum).

    ``momentum`` None is the first round (torch SGD seeds the buffer with the first gradient)."""
    assert deltas_by_worker, "a round needs at least one live worker"
    avg = [torch.stack(ds).mean(0) for ds in zip(*deltas_by_worker, strict=True)]
    new_m = list(avg) if momentum is None else [mu * m + d for m, d in zip(momentum, avg, strict=True)]
    new_theta = [t - lr * (d + mu * m) for t, d, m in zip(global_params, avg, new_m, strict=True)]
    return new_theta, new_m


def norm_test_batch_size(micro_grads: Sequence[torch.Tensor], micro_sizes: Sequence[int], cfg: AdaptiveBatchConfig,
                         current: int) -> int:
    """AdLoCo's next local batch from this step's micro-batch gradients (flattened, each a mean over s_j
    examples): ceil(sigma^2 / (eta^2 ||g||^2)), never below ``current`` (batches only grow), at most
    ``cfg.max_batch``. g is the size-weighted mean; sigma^2 = sum_j s_j ||g_j - g||^2 / (m - 1)."""
    m = len(micro_grads)
    assert m >= 2 and m == len(micro_sizes), f"the norm test needs >= 2 micro-batch gradients, got {m}"
    sizes = torch.tensor(micro_sizes, dtype=torch.float64)
    g_mj = torch.stack([g.double() for g in micro_grads])
    mean = (sizes[:, None] * g_mj).sum(0) / sizes.sum()
    var = float((sizes * ((g_mj - mean) ** 2).sum(1)).sum()) / (m - 1)
    signal = float(mean.pow(2).sum())
    wanted = cfg.max_batch if signal == 0.0 else math.ceil(var / (cfg.eta**2 * signal))
    return max(current, min(cfg.max_batch, wanted))


def micro_batch_sizes(batch: int, max_micro_batch: int, min_splits: int = 2) -> list[int]:
    """Split ``batch`` examples into the fewest near-equal micro-batches of at most ``max_micro_batch``
    (AdLoCo's switch mode: accumulate once the batch outgrows one pass), and at least ``min_splits`` so
    the norm test has a variance to measure."""
    n = min(batch, max(min_splits, math.ceil(batch / max_micro_batch)))
    return [batch // n + (i < batch % n) for i in range(n)]


def accumulate_gradients(model: torch.nn.Module, loss_of: Callable[[int, int], torch.Tensor],
                         sizes: Sequence[int]) -> tuple[float, list[torch.Tensor]]:
    """Backward over micro-batches ``sizes`` (``loss_of(start, stop)`` is the mean loss of those examples),
    leaving the whole batch's mean gradient in ``.grad``. Returns (mean loss, each micro-batch's own
    flattened mean gradient) for the norm test."""
    total = sum(sizes)
    params = [p for p in model.parameters() if p.requires_grad]
    prev = torch.zeros(sum(p.numel() for p in params))
    loss_sum, micro_grads, start = 0.0, [], 0
    for s in sizes:
        loss = loss_of(start, start + s)
        (loss * (s / total)).backward()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        micro_grads.append((flat - prev) * (total / s))
        prev, start, loss_sum = flat, start + s, loss_sum + float(loss.detach()) * s
    return loss_sum / total, micro_grads


def fragments(model: torch.nn.Module, num_fragments: int) -> list[torch.nn.Module]:
    """Streaming DiLoCo's fragments: contiguous runs of decoder layers (a Hugging Face causal LM's
    ``model.layers``); the first fragment also holds the embeddings, the last the final norm (and an
    untied head). One fragment is the whole model."""
    if num_fragments == 1:
        return [model]
    layers = model.model.layers
    if len(layers) < num_fragments:
        raise ValueError(f"diloco.num_fragments ({num_fragments}) exceeds the model's {len(layers)} layers")
    bounds = [round(i * len(layers) / num_fragments) for i in range(num_fragments + 1)]
    parts = [torch.nn.ModuleList(layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    covered = {id(p) for part in parts for p in part.parameters()}
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in covered]
    head = [p for n, p in rest if not n.startswith("model.embed_tokens")]
    parts[0].append(model.model.embed_tokens)
    parts[-1].append(_ParamBag(head))
    return parts


class _ParamBag(torch.nn.Module):
    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.params = torch.nn.ParameterList(params)


# ---- torchft runtime -------------------------------------------------------------------------------
def start_lighthouse(min_replicas: int = 1, join_timeout_ms: int = 60_000, heartbeat_timeout_ms: int = 5000,
                     host: str = LOOPBACK) -> Lighthouse:
    """A torchft lighthouse in this process, listening on ``host`` (``torchft_lighthouse`` is the standalone
    binary; the defaults are its own). A quorum waits up to ``join_timeout_ms`` for every worker that still
    heartbeats, so a worker a few steps behind is not left out of a round; a dead one stops heartbeating and
    is dropped after ``heartbeat_timeout_ms``."""
    quiet_torchft()
    return Lighthouse(host, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                      heartbeat_timeout_ms=heartbeat_timeout_ms)


@dataclass
class SyncStats:
    """What this worker sent: payload bytes handed to all-reduce and the number of all-reduce calls."""

    bytes_sent: int = 0
    num_allreduce: int = 0


@contextmanager
def diloco_worker(model: torch.nn.Module, inner_opt: torch.optim.Optimizer, cfg: DiLoCoConfig,
                  lighthouse_addr: str, replica_id: str) -> Iterator[tuple[object, SyncStats]]:
    """Run ``inner_opt.step()`` calls inside this block as one DiLoCo worker (its own torchft replica
    group of one process). Every ``sync_every`` steps the optimizer's post-step hook syncs (one fragment
    every H/F steps with Streaming DiLoCo). Yields (torchft Manager, SyncStats)."""
    from torchft.local_sgd import DiLoCo

    parts = fragments(model, cfg.num_fragments)
    # momentum 0 is plain SGD (outer_lr 1: model averaging); torch refuses nesterov=True without momentum
    outer = [torch.optim.SGD(p.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                             nesterov=cfg.outer_momentum > 0) for p in parts]
    with replica_group(lambda: {"model": model.state_dict(), "opt": inner_opt.state_dict()},
                       lambda sd: (model.load_state_dict(sd["model"]), inner_opt.load_state_dict(sd["opt"])),
                       lighthouse_addr, replica_id, cfg.timeout_s, cfg.quorum_timeout_s, cfg.min_replicas,
                       init_sync=False) as manager:
        stats = SyncStats()
        allreduce = manager.allreduce

        def counted(tensor, *args, **kwargs):
            stats.bytes_sent += tensor.numel() * tensor.element_size()
            stats.num_allreduce += 1
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = counted
        with DiLoCo(manager, parts, inner_opt, outer, sync_every=cfg.sync_every,
                    fragment_sync_delay=cfg.fragment_sync_delay, fragment_update_alpha=cfg.fragment_update_alpha,
                    use_bucketization=True):
            yield manager, stats
