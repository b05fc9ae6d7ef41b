"""Several optimizers over disjoint parameters, seen by the trainer as one.

Muon trains the hidden matrices and AdamW the rest, but the trainer, the LR scheduler and checkpoints
expect a single ``torch.optim.Optimizer``: one ``param_groups`` list whose ``lr`` a scheduler (and the
trainer's one-step lr scaling) can rewrite, one ``step``/``zero_grad``, one ``state_dict``. This class is
that optimizer. Its ``param_groups`` are the children's group dicts themselves (so writing ``lr`` on one
is seen by the child that owns it) and all children share its ``state`` table, so the inherited
``state_dict``/``load_state_dict`` save and restore every child at once, each group with its own keys.
"""

from __future__ import annotations

import torch


class CombinedOptimizer(torch.optim.Optimizer):
    """``CombinedOptimizer(muon, adamw)``: step each child; groups and state are shared, not copied."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        assert optimizers, "CombinedOptimizer needs at least one optimizer"
        self.optimizers = list(optimizers)
        # add_param_group keeps each dict (it only re-lists "params") and rejects a parameter seen twice.
        super().__init__([group for opt in self.optimizers for group in opt.param_groups], defaults={})
        for opt in self.optimizers:  # keep whatever state a child already had (normally none)
            self.state.update(opt.state)
        self._link_children()

    def _link_children(self) -> None:
        """Point each child at its slice of ``param_groups`` (in construction order) and at the shared state."""
        start = 0
        for opt in self.optimizers:
            opt.param_groups = self.param_groups[start : start + len(opt.param_groups)]
            opt.state = self.state
            start += len(opt.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def load_state_dict(self, state_dict) -> None:
        # The base class rebuilds param_groups and state as new objects; re-share them with the children.
        super().load_state_dict(state_dict)
        self._link_children()
