"""bf16 compute weights with fp32 master weights and fp32 optimizer state (``trainer.weights=bf16_master``).

Why: with ``trainer.weights=fp32`` (the default) the policy's parameters are float32 and every forward runs
under bf16 autocast, so on a GPU the residual stream, the norms and RoPE stay float32 and every linear casts
its float32 weight (and often its input) to bf16 again on each call: the H200 bench measured trainer MFU
0.065-0.12 (issue 51). Here the parameters themselves are bf16, the forward and backward run without
autocast, and the update still happens in float32, the classic mixed-precision recipe (Micikevicius et al.
2018, arXiv 1710.03740, sec. 3.1: "an FP32 master copy of weights is updated with the gradients"):

1. *Masters*: each trainable parameter keeps a float32 master (the storage the model had: nothing is copied
   at start). The optimizer is built over the float32 model first, as always, so its parameter groups (AdamW's
   decay groups, Muon's hidden matrices) are the usual ones, and then each group's parameters are replaced by
   their masters: the optimizer steps the masters and its state (AdamW's moments) is float32. Frozen parameters
   (LoRA's base) and the reference model are bf16 without a master: nothing updates them.
2. *Gradients accumulate in float32*: a post-accumulate-grad hook on each bf16 parameter adds its gradient into
   the master's float32 ``.grad`` as soon as backward produces it and frees the bf16 one, Megatron-LM's
   ``main_grad`` scheme (``megatron/core/distributed/distributed_data_parallel.py``, ``_make_backward_post_hook``:
   ``param.main_grad.add_(param.grad.data); param.grad = None``). Summing many micro-batches' gradients in bf16
   would round the running sum to 8 significant bits at every micro-batch; here each micro-batch's gradient is
   rounded to bf16 once (autograd's own output for a bf16 parameter) and the sum is float32. Megatron goes one
   step further with ``gradient_accumulation_fusion`` (the weight-gradient GEMM writes into the fp32 buffer
   directly, no bf16 rounding at all), which needs its own linear kernels; torchtitan gets the same fp32
   accumulation from FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 sharded
   parameters. nanochat, for contrast, keeps only its embedding in bf16 and steps it with no master at all
   (``nanochat/gpt.py``: "optim can tolerate it"); an RL update is a small step on a trained model, where
   bf16's 3 significant digits would swallow it, so here every trained parameter has a master.
3. *After each optimizer step* the masters are cast (round to nearest even) into the bf16 parameters.
   Gradient clipping reads the masters' float32 gradients, so the norm is float32.

The LM head: ``models/logprobs.py`` casts the head's weight and the last hidden state to float32 once per
pass (``chunked_head_logprobs``) and runs the matmul and the log-softmax in float32 inside its chunks, so with
a bf16 head weight the log-probs are the float32 head applied to exactly the bf16 values (the cast is exact)
and its gradient reaches the bf16 weight through that one cast. A model whose logits do not come from a plain
linear head (soft-capping, ``logit_scale``: the full-logits path) would get bf16 logits, so it is refused.

What reads the weights: the rollout engine is sent the bf16 parameters (``state_dict_for_engine``), the values
the trainer computes its log-probs with, cast to the engine's dtype (a bf16 engine gets the masters' bf16
rounding, bit for bit). Checkpoints hold the float32 masters: ``masters_in_model`` points each parameter at its
master while a checkpoint is captured or loaded, so ``model.safetensors`` and ``trainer_state.pt`` carry the
exact float32 state and a resume continues bit for bit. (A background checkpoint's ``config.json`` names
``bfloat16``: Hugging Face's ``save_pretrained`` takes it from the live model when the writer thread runs, after the
parameters are bf16 again, so ``from_pretrained``'s default ``dtype="auto"`` would load the masters rounded;
tidal's loaders ask for float32 and read them exactly.)

Memory per trained parameter (AdamW): bf16 parameter 2 + fp32 master 4 + fp32 gradient 4 + two fp32 moments 8
= 18 bytes, against 16 for fp32 weights (4 + 4 + 8): the saving is in activations (bf16 residual stream, norms
and attention inputs instead of float32 ones), not in the weights (docs/memory.md). Not supported yet: FSDP
(its own ``MixedPrecisionPolicy`` is the way there), full-replica data parallel and DiLoCo, which read and
write the model's parameters directly, and SDC recording and replay (``sdc.record``), which fingerprint the
model's gradients and restore its parameters; refused with a ConfigError naming the keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from tidal.config import ConfigError
from tidal.models.logprobs import _linear_head
from tidal.utils.device import resolve_dtype

WEIGHTS = ("fp32", "bf16_master")
"""Values of ``trainer.weights``."""


def autocast_dtype(cfg, device: torch.device) -> torch.dtype:
    """The autocast dtype of the policy's and reference's forwards: ``trainer.precision``'s, or float32 (autocast
    off) under ``bf16_master``, whose parameters are bf16 already."""
    dtype = resolve_dtype(cfg.precision, device, "trainer.precision")
    return torch.float32 if cfg.weights == "bf16_master" else dtype


class Fp32Weights:
    """``trainer.weights=fp32``: the model's own float32 parameters are what the optimizer steps (no-ops)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def grad_tensors(self) -> Iterable[torch.Tensor]:
        """The tensors whose gradients are clipped and stepped."""
        return self.model.parameters()

    def after_step(self) -> None:
        pass

    def masters_in_model(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class MasterWeights:
    """bf16 parameters in ``model``, float32 masters in ``optimizer`` (the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 ref_model: torch.nn.Module | None = None):
        """``optimizer``: built over ``model`` while it is still float32, with no state yet."""
        assert not optimizer.state, "a fresh optimizer: its state would be keyed by the bf16 parameters"
        if _linear_head(model) is None:
            raise ConfigError("trainer.weights=bf16_master needs a model whose LM head is a plain linear layer, which "
                              "models/logprobs.py runs in float32; this model's logits come out of its own forward "
                              "(soft-capping or a logit scale) and would be bf16: use trainer.weights=fp32")
        self.params: list[torch.nn.Parameter] = []
        self.masters: list[torch.nn.Parameter] = []
        master_of: dict[int, torch.nn.Parameter] = {}
        for group in optimizer.param_groups:  # Muon's CombinedOptimizer shares these dicts with its children
            for p in group["params"]:
                if id(p) not in master_of:
                    master_of[id(p)] = torch.nn.Parameter(p.detach(), requires_grad=True)  # the fp32 storage itself
                    self.params.append(p)
                    self.masters.append(master_of[id(p)])
            group["params"] = [master_of[id(p)] for p in group["params"]]
        for module in (model, ref_model):
            for p in module.parameters() if module is not None else ():
                if p.is_floating_point():  # buffers (RoPE's inv_freq) stay float32
                    p.data = p.data.to(torch.bfloat16)
        self._master = master_of
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]

    def _accumulate(self, p: torch.Tensor) -> None:
        """Fold the bf16 gradient backward just produced into the master's float32 one, and free it."""
        master = self._master[id(p)]
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.masters

    @torch.no_grad()
    def after_step(self) -> None:
        """Cast the masters the optimizer just stepped into the bf16 parameters."""
        torch._foreach_copy_(self.params, self.masters)

    @contextlib.contextmanager
    def masters_in_model(self) -> Iterator[None]:
        """Inside the block each trained parameter is its float32 master (the same memory), so a checkpoint
        captured there holds the masters and one loaded there writes into them; on the way out the parameters
        are bf16 again, recast from the masters."""
        compute = [p.data for p in self.params]
        for p, master in zip(self.params, self.masters):
            p.data = master.data
        try:
            yield
        finally:
            for p, data in zip(self.params, compute):
                p.data = data
            self.after_step()


def compute_weights(cfg, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    ref_model: torch.nn.Module | None, data_parallel: bool) -> Fp32Weights | MasterWeights:
    """``trainer.weights``' handler for a trainer's freshly built model and optimizer."""
    if cfg.weights == "fp32":
        return Fp32Weights(model)
    if data_parallel:
        raise ConfigError(f"trainer.weights=bf16_master with data parallel (trainer.data_parallel={cfg.data_parallel} "
                          "under torchrun or elastic): FSDP and the replicas read and write the float32 parameters "
                          "directly, not the masters; run it in one process, or use trainer.weights=fp32")
    return MasterWeights(model, optimizer, ref_model)
