"""Fault injection: flip one bit of a weight, an activation, a gradient or an optimizer state at a step.

Used by the tests and by ``tidal bench faults`` to check that silent data corruption is detected and
localised (``integrity/sdc.py``, ``integrity/guard.py``). Each fault fires once (a rolled-back run that
trains the step again does not meet it again: a transient fault, as a cosmic-ray flip or a marginal
core under load is) and models one place a real fault corrupts:

- ``weight``: a parameter element flipped *at rest*, just before step ``step`` starts (memory
  corruption between steps). Expected: phase ``weights`` of that step, the parameter's layer.
- ``activation``: an element of layer ``layer``'s output flipped in the first forward pass of step
  ``step`` that reaches the layer (a wrong multiply). Expected: phase ``forward``, that layer.
- ``gradient``: a gradient element flipped after backward, before it is used (a wrong reduction).
  Expected: phase ``backward``, the parameter's layer.
- ``optimizer_state``: an element of a parameter's AdamW state (``exp_avg_sq`` by default) flipped as
  the optimizer step writes it. Expected: phase ``optimizer``, ``<layer>#state``.

Steps are numbered as the controller numbers them: step k trains policy version k-1 into version k.
A fault planned for a step that trains nothing (every group filtered out: no batch, no computation to
corrupt) fires at the next step that trains; ``fired_step`` says where it landed, and that is the step a
correct detection names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.integrity.sdc import STATE, layer_of

KINDS = ("weight", "activation", "gradient", "optimizer_state")
EXPECTED_PHASE = {"weight": "weights", "activation": "forward", "gradient": "backward",
                  "optimizer_state": "optimizer"}


@torch.no_grad()
def flip_bit(t: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` (0 = least significant mantissa bit, 31 = sign of a float32) of element ``index``
    of the flattened ``t``, in place. Returns (value before, value after)."""
    assert t.dtype == torch.float32, f"flip_bit works on float32, got {t.dtype}"
    assert 0 <= bit < 32, f"bit must be in [0, 32), got {bit}"
    flat = t.view(-1)  # a view: the flip lands in t (t must be contiguous)
    words = flat.view(torch.int32)
    index = index % flat.numel()
    before = float(flat[index])
    words[index] ^= -(1 << 31) if bit == 31 else (1 << bit)
    return before, float(flat[index])


@dataclass
class Fault:
    """One bit flip. ``target``: a parameter name (weight, gradient, optimizer_state) or a tracked
    module's name from ``sdc.tracked_modules`` (activation)."""

    kind: str
    step: int
    target: str
    index: int = 0
    bit: int = 30  # float32 exponent's top bit: x becomes huge (or tiny): always changes the result
    state_key: str = "exp_avg_sq"
    fired: bool = False
    fired_step: int | None = None
    """The step it actually fired in (>= ``step``: the first step from ``step`` on that trained)."""
    before: float | None = None
    after: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def expected_phase(self) -> str:
        return EXPECTED_PHASE[self.kind]

    @property
    def expected_layer(self) -> str:
        """The layer a correct localisation names (``<layer>#state`` for optimizer state)."""
        if self.kind == "activation":
            return self.target
        return layer_of(self.target) + (STATE if self.kind == "optimizer_state" else "")


class FaultInjector:
    """Arms a list of faults on a trainer with an attached ``StepRecorder``; call ``before_step(step)``
    before the recorder's ``begin_step`` so a ``weight`` fault is in memory when the state is checked.
    ``before_step`` is called only for steps that train, so a fault whose step trained nothing is still
    pending at the next one and fires there."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self._step = -1
        self._recorder = None

    def attach(self, recorder) -> None:
        """Hook into ``recorder`` (and its trainer): activation taps, after-backward and after-optimizer."""
        self._recorder = recorder
        recorder.hooks_after_backward.append(lambda trainer: self._fire("gradient", trainer))
        recorder.hooks_after_optimizer.append(lambda trainer: self._fire("optimizer_state", trainer))
        for f in self.faults:
            if f.kind == "activation":
                recorder.forward_taps.setdefault(f.target, []).append(self._activation_tap(f))

    def _pending(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.step <= self._step and not f.fired]

    def before_step(self, step: int, trainer) -> None:
        self._step = step
        for f in self._pending("weight"):
            f.before, f.after = flip_bit(_param(trainer.model, f.target), f.index, f.bit)
            f.fired, f.fired_step = True, step

    def _fire(self, kind: str, trainer) -> None:
        for f in self._pending(kind):
            p = _param(trainer.model, f.target)
            if kind == "gradient":
                assert p.grad is not None, f"fault {f}: {f.target} has no gradient at step {f.step}"
                f.before, f.after = flip_bit(p.grad, f.index, f.bit)
            else:
                state = trainer.optimizer.state.get(p, {})
                assert f.state_key in state, f"fault {f}: no optimizer state {f.state_key!r} for {f.target}"
                f.before, f.after = flip_bit(state[f.state_key], f.index, f.bit)
            f.fired, f.fired_step = True, self._step

    def _activation_tap(self, fault: Fault):
        def tap(output: torch.Tensor) -> None:
            if fault.step <= self._step and not fault.fired:
                fault.before, fault.after = flip_bit(output.detach(), fault.index, fault.bit)
                fault.fired, fault.fired_step = True, self._step
        return tap


def _param(model: torch.nn.Module, name: str) -> torch.Tensor:
    params = dict(model.named_parameters())
    if name not in params:
        raise KeyError(f"no parameter {name!r} in the model (have e.g. {list(params)[:3]})")
    return params[name]
