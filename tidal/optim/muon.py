"""Muon for the 2-D hidden weights of a transformer, and the split that decides which weights those are.

Muon (Keller Jordan, 2024) runs SGD-momentum on a weight matrix and replaces the momentum M by an
approximation of its orthogonal factor U V^T (from M = U S V^T), computed with a few Newton-Schulz
iterations. Every direction of the update then has about the same size, so rare directions are not drowned
out by the dominant one. An orthogonal A x B matrix has RMS 1 / sqrt(max(A, B)); Moonlight (Liu et al.,
arXiv 2502.16982, "consistent update RMS") multiplies it by 0.2 * sqrt(max(A, B)) so the update RMS is
~0.2 lr, the size of a typical AdamW update, and Muon can reuse AdamW's learning rate and weight decay.

Muon is only defined for matrices, and only meant for hidden ones: embeddings and the LM head are
look-up tables / classifiers whose rows see very different gradient scales (AdamW's per-coordinate scaling
suits them), and norms and biases are vectors. ``split_hidden_matrices`` sends those to AdamW.

The update rule is ``torch.optim.Muon``'s (PyTorch 2.13): same hyper-parameters, same momentum form,
decoupled weight decay ``theta <- theta * (1 - lr * wd)`` with the unadjusted lr, same group keys and state
(``momentum_buffer``), so checkpoints are interchangeable. We do not use torch's class directly for two
reasons: it always runs Newton-Schulz in bfloat16, which is right on a GPU but emulated on CPUs without
bf16 units (measured here, one thread: 40 ms vs 3.7 ms in float32 for one 128 x 128 orthogonalization;
1.3 s vs 0.1 s for a Muon step over the tiny model's 28 matrices); and it only exists in recent PyTorch.
``Muon`` below runs the iteration in bfloat16 on CUDA and float32 elsewhere.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic: it maximizes the slope at zero, so small singular values grow fast; the
result has singular values roughly in [0.7, 1.2] rather than exactly 1, which training does not mind."""


def newton_schulz(g_ab: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate the orthogonal factor U V^T of a matrix by ``steps`` quintic Newton-Schulz iterations.

    Each iteration maps X to a X + b (X X^T) X + c (X X^T)^2 X, i.e. applies p(s) = a s + b s^3 + c s^5 to
    every singular value s. Dividing by the Frobenius norm first puts all singular values in [0, 1], where
    the iteration pushes them towards 1. The Gram matrix is taken on the short side (transposing tall
    matrices) because it is the smaller product.
    """
    assert g_ab.ndim == 2, f"Newton-Schulz orthogonalizes matrices, got shape {tuple(g_ab.shape)}"
    a, b, c = coefficients
    tall = g_ab.size(0) > g_ab.size(1)
    x = (g_ab.mT if tall else g_ab).to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.mT if tall else x


def update_scale(shape: torch.Size, adjust_lr: str | None) -> float:
    """The factor on lr for an orthogonalized update of a matrix of ``shape`` (torch.optim.Muon's two rules)."""
    rows, cols = shape[:2]
    if adjust_lr == "match_rms_adamw":  # Moonlight: update RMS 0.2 lr, like AdamW's
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))  # Keller Jordan's original: only tall matrices are scaled up


class Muon(torch.optim.Optimizer):
    """Muon with ``torch.optim.Muon``'s arguments, defaults, group keys and state, and the Newton-Schulz
    iteration in ``ns_dtype`` (default: bfloat16 on CUDA, float32 elsewhere).

    Written against torch's class rather than subclassing it, because ``torch.optim.Muon`` only exists in
    recent PyTorch (this package accepts torch>=2.4); tests/optim/test_muon.py checks that the bfloat16 path
    gives bit-identical parameters to ``torch.optim.Muon``.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 ns_dtype: torch.dtype | None = None):
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn must be 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon needs lr, momentum and weight_decay >= 0, got {lr}, {momentum}, {weight_decay}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon trains 2-D parameters only, got one of shape {tuple(p.shape)}")
        self.ns_dtype = ns_dtype  # a property of the device, not of the run: kept out of the state dict

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                # EMA form, (1 - momentum) times Moonlight's M <- momentum M + g: normalization erases the factor.
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                dtype = self.ns_dtype or (torch.bfloat16 if p.is_cuda else torch.float32)
                ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                p.mul_(1 - lr * group["weight_decay"])  # decoupled, with the unadjusted lr (as torch, Moonlight)
                p.add_(ortho, alpha=-lr * update_scale(p.shape, group["adjust_lr_fn"]))
        return loss


def split_hidden_matrices(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Return ``(muon_params, adamw_params)``: 2-D weights of hidden layers vs everything else.

    Embeddings are found by type (every ``nn.Embedding``) and the head through Hugging Face's
    ``get_output_embeddings()``; the names ``embed``/``lm_head`` catch models that register them otherwise.
    A tied head is the embedding tensor itself, listed once (``named_parameters`` de-duplicates).
    """
    not_hidden = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        not_hidden.add(id(head.weight))
    muon, adamw = [], []
    for name, p in model.named_parameters():
        is_hidden_matrix = p.ndim == 2 and id(p) not in not_hidden and "embed" not in name and "lm_head" not in name
        (muon if is_hidden_matrix else adamw).append(p)
    return muon, adamw
