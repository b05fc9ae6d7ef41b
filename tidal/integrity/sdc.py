"""Silent-data-corruption (SDC) recording: a few exact checksums per layer and phase of every step.

A faulty chip can return a wrong result without raising anything (silent data corruption). Gemini 2.5
(Google, 2025 tech report, "split-phase SDC detection") finds such faults by *deterministic replay*:
recompute a step on the same inputs and compare per-device intermediate checksums. This module is the
cheap half, on by default: while a step runs it records, per layer, a fingerprint of

- ``weights``: the parameters and optimizer state at the start of the step (state at rest);
- ``forward``: each tracked module's output (forward hooks on the embeddings, every decoder layer and
  the final norm), summed over every forward pass of the step;
- ``backward``: each layer's gradients right after backward (before clipping);
- ``optimizer``: each layer's parameters and optimizer state right after the optimizer step.

With ``trainer.num_minibatches`` > 1 there is one ``forward``/``backward``/``optimizer`` entry per
minibatch ("segment", in the order they ran). A fingerprint is three numbers:

- ``bits``: the tensor's bytes read as 64-bit words and summed with wrap-around (mod 2^64). Any single
  flipped bit changes it (by +-2^b mod 2^64, never 0), so it is an exact identity check at the cost of
  one integer reduction (~0.07 ms per million floats on one core; a float64 sum costs 4 ms);
- ``sum`` and ``sumsq`` (float32, torch's own reductions): readable magnitudes, and the numbers a
  tolerance comparison uses when a replay cannot be bit-identical (``first_mismatch``'s ``rtol``).

What is and is not bit-deterministic on CPU: the same process, the same torch thread count and the same
shapes give bit-identical forward, backward and AdamW results (oneDNN/MKL pick one kernel and one
reduction order per shape and thread count; tests pin it). A different thread count, a different CPU
kind (FACTS.md: AMD vs Intel differ) or a different micro-batch split changes the reduction order and
so the low bits: replay there needs ``rtol`` > 0 (on the float sums; ``bits`` is then ignored).

Layers are named like parameters minus the last part, decoder layers cut at their index:
``model.embed_tokens``, ``model.layers.3``, ``model.norm``; optimizer state goes under ``<layer>#state``.
``first_mismatch`` walks two records in computation order (segment by segment: weights, forward in
layer order, backward in *reverse* layer order as backpropagation runs, optimizer) and returns the
first entry that differs, which is where the corruption entered.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

MASK64 = (1 << 64) - 1
PHASES = ("weights", "forward", "backward", "optimizer")
STATE = "#state"
"""Suffix of a layer's optimizer-state entry (``model.layers.0#state``)."""

Checksum = list  # [bits (int, mod 2^64), sum (float), sumsq (float)]


# ---- fingerprints ---------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def checksum(t: torch.Tensor) -> Checksum:
    """[bits, sum, sumsq] of ``t`` (see the module docstring). ``bits`` is exact: any single flipped bit
    changes it. Works on any dtype whose bytes are contiguous."""
    t = _local(t).detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    bits = int(raw[:whole].view(torch.int64).sum()) if whole else 0
    if whole < raw.numel():  # a tail shorter than one word: add its bytes, shifted into place
        bits += sum(int(b) << (8 * i) for i, b in enumerate(raw[whole:].tolist()))
    if t.is_floating_point():
        f = t.float()
        return [bits & MASK64, float(f.sum()), float(torch.dot(f.reshape(-1), f.reshape(-1)))]
    return [bits & MASK64, float(t.sum()), 0.0]


def combine(a: Checksum | None, b: Checksum) -> Checksum:
    """The fingerprint of two tensors together (bits add mod 2^64, sums add)."""
    if a is None:
        return list(b)
    return [(a[0] + b[0]) & MASK64, a[1] + b[1], a[2] + b[2]]


_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def layer_of(param_name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``; ``model.norm.weight`` -> ``model.norm``."""
    m = _LAYER.match(param_name)
    return m.group(1) if m else param_name.rsplit(".", 1)[0]


def tracked_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose outputs ``forward`` records, in computation order: the input embeddings, every
    decoder layer, the final norm (a Hugging Face causal LM; anything else: its direct children)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    names = {id(m): n for n, m in model.named_modules()}
    layers = getattr(decoder, "layers", None)
    if decoder is None or not isinstance(layers, torch.nn.ModuleList):
        return list(model.named_children())
    out = [m for m in (getattr(decoder, "embed_tokens", None),) if m is not None]
    out += list(layers)
    out += [m for m in (getattr(decoder, "norm", None),) if m is not None]
    return [(names[id(m)], m) for m in out]


def layer_order(model: torch.nn.Module) -> list[str]:
    """Every layer name in computation order (tracked modules, then any other parameter's layer)."""
    order = [n for n, _ in tracked_modules(model)]
    for name, _ in model.named_parameters():
        if layer_of(name) not in order:
            order.append(layer_of(name))
    return order


def param_checksums(model: torch.nn.Module, grads: bool = False) -> dict[str, Checksum]:
    """Per-layer fingerprint of the parameters (or of their gradients; a parameter without one is skipped)."""
    out: dict[str, Checksum] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is not None:
            out[layer_of(name)] = combine(out.get(layer_of(name)), checksum(t))
    return out


def state_checksums(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Checksum]:
    """Per-layer fingerprint of the parameters plus, under ``<layer>#state``, of their optimizer state
    (every tensor in it: AdamW's exp_avg, exp_avg_sq and step)."""
    out = param_checksums(model)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        key = layer_of(names[id(p)]) + STATE if id(p) in names else "other" + STATE
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out[key] = combine(out.get(key), checksum(v))
    return out


# ---- recording ------------------------------------------------------------------------------------
class StepRecorder:
    """Records one fingerprint record per training step of a ``Trainer`` (forward hooks plus the
    trainer's ``after_backward`` / ``after_optimizer`` notifications). Only forwards run by the thread
    that began the step count (an async run's engine may share modules through copies; eval forwards
    between steps are outside any step)."""

    def __init__(self, trainer, rank: int = 0):
        self.trainer = trainer
        self.rank = rank
        self._record: dict[str, Any] | None = None
        self._thread: int | None = None
        self._segment = 0
        self.hooks_after_backward: list = []  # fault injection: run before the gradients are recorded
        self.hooks_after_optimizer: list = []
        self._handles = [m.register_forward_hook(self._forward_hook(n)) for n, m in tracked_modules(trainer.model)]
        self.forward_taps: dict[str, list] = {}  # layer -> callables(output) run before it is recorded
        self.seconds = 0.0
        """Time spent fingerprinting (all steps): the recording overhead, measured where it is spent."""
        trainer.observers.append(self)

    # segments: one per minibatch, each {"forward": {}, "backward": {}, "optimizer": {}}
    def _seg(self) -> dict[str, dict[str, Checksum]]:
        segs = self._record["segments"]
        while len(segs) <= self._segment:
            segs.append({"forward": {}, "backward": {}, "optimizer": {}})
        return segs[self._segment]

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            if self._record is None or threading.get_ident() != self._thread:
                return None
            out = output[0] if isinstance(output, tuple) else output
            for tap in self.forward_taps.get(name, ()):
                tap(out)
            t0 = time.perf_counter()
            fwd = self._seg()["forward"]
            fwd[name] = combine(fwd.get(name), checksum(out))
            self.seconds += time.perf_counter() - t0
            return None
        return hook

    def begin_step(self, step: int) -> dict[str, Checksum]:
        """Start recording step ``step``; returns (and records) the state-at-rest fingerprint."""
        t0 = time.perf_counter()
        weights = state_checksums(self.trainer.model, self.trainer.optimizer)
        self.seconds += time.perf_counter() - t0
        self._record = {"step": step, "rank": self.rank, "weights": weights, "segments": []}
        self._thread = threading.get_ident()
        self._segment = 0
        return weights

    def after_backward(self) -> None:
        if self._record is None:
            return
        for hook in self.hooks_after_backward:
            hook(self.trainer)
        t0 = time.perf_counter()
        self._seg()["backward"] = param_checksums(self.trainer.model, grads=True)
        self.seconds += time.perf_counter() - t0

    def after_optimizer(self) -> None:
        if self._record is None:
            return
        for hook in self.hooks_after_optimizer:
            hook(self.trainer)
        t0 = time.perf_counter()
        self._seg()["optimizer"] = state_checksums(self.trainer.model, self.trainer.optimizer)
        self.seconds += time.perf_counter() - t0
        self._segment += 1

    def end_step(self) -> dict[str, Any] | None:
        """The finished record (None if no step was begun)."""
        record, self._record = self._record, None
        return record

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self in self.trainer.observers:
            self.trainer.observers.remove(self)


def last_state(record: dict[str, Any]) -> dict[str, Checksum]:
    """The state a step left behind: its last optimizer entry (or its start state if it trained nothing)."""
    segs = [s for s in record["segments"] if s["optimizer"]]
    return segs[-1]["optimizer"] if segs else record["weights"]


# ---- comparison -----------------------------------------------------------------------------------
@dataclass
class Mismatch:
    """Where two records of the same step first differ."""

    step: int
    rank: int
    phase: str  # weights | forward | backward | optimizer
    layer: str  # e.g. model.layers.2 (optimizer state: model.layers.2#state)
    segment: int  # minibatch index (0 for weights)
    original: Checksum | None
    replayed: Checksum | None
    result_changed: bool = True
    """Whether the state the step left (its last ``optimizer`` entry) differs too. False: the corruption
    was absorbed within the step (e.g. a flipped activation of a padded position, or a low gradient bit
    the update rounds away), so the run's weights are what they would have been without it."""

    @property
    def layer_name(self) -> str:
        """The layer without the ``#state`` suffix."""
        return self.layer.removesuffix(STATE)

    def describe(self) -> str:
        what = "optimizer state of " if self.layer.endswith(STATE) else ""
        return (f"step {self.step}, rank {self.rank}: first difference in phase {self.phase} "
                f"(minibatch {self.segment}) at {what}{self.layer_name}: recorded {self.original}, "
                f"recomputed {self.replayed}")


def _differs(a: Checksum | None, b: Checksum | None, rtol: float) -> bool:
    if a is None or b is None:
        return a is not b
    if rtol == 0.0:
        return a[0] != b[0]
    return any(not _close(x, y, rtol) for x, y in zip(a[1:], b[1:]))


def _close(x: float, y: float, rtol: float) -> bool:
    if x != x or y != y:  # NaN on either side: equal only if both
        return (x != x) and (y != y)
    return abs(x - y) <= rtol * max(abs(x), abs(y), 1e-30)


def _ordered(keys, order: list[str], reverse: bool = False) -> list[str]:
    rank = {k: i for i, k in enumerate(order)}
    base = sorted(keys, key=lambda k: (rank.get(k.removesuffix(STATE), len(rank)), k.endswith(STATE), k))
    if reverse:  # backward: the last layer's gradients are computed first
        base = sorted(keys, key=lambda k: (-rank.get(k.removesuffix(STATE), -1), k))
    return base


def compare_entries(a: dict[str, Checksum], b: dict[str, Checksum], order: list[str], rtol: float = 0.0,
                    reverse: bool = False) -> str | None:
    """The first key (in ``order``) whose fingerprints differ, or None."""
    for key in _ordered(set(a) | set(b), order, reverse):
        if _differs(a.get(key), b.get(key), rtol):
            return key
    return None


def first_mismatch(original: dict[str, Any], replayed: dict[str, Any], order: list[str],
                   rtol: float = 0.0) -> Mismatch | None:
    """The first (phase, layer) where ``replayed`` differs from ``original`` (computation order, see the
    module docstring), or None when they agree. ``rtol`` 0: exact (``bits``); else relative tolerance on
    the float sums."""
    step, rank = original["step"], original.get("rank", 0)
    key = compare_entries(original["weights"], replayed["weights"], order, rtol)
    if key is not None:
        return Mismatch(step, rank, "weights", key, 0, original["weights"].get(key), replayed["weights"].get(key))
    changed = compare_entries(last_state(original), last_state(replayed), order, rtol) is not None
    empty = {"forward": {}, "backward": {}, "optimizer": {}}
    segs_a, segs_b = original["segments"], replayed["segments"]
    for i in range(max(len(segs_a), len(segs_b))):
        sa = segs_a[i] if i < len(segs_a) else empty
        sb = segs_b[i] if i < len(segs_b) else empty
        for phase in ("forward", "backward", "optimizer"):
            key = compare_entries(sa[phase], sb[phase], order, rtol, reverse=phase == "backward")
            if key is not None:
                return Mismatch(step, rank, phase, key, i, sa[phase].get(key), sb[phase].get(key), changed)
    return None
