"""LoRA: train low-rank adapters on a frozen base instead of the whole model, with PEFT (``peft``).

A LoRA layer computes ``W x + s * B (A x)`` with the base weight W [out, in] frozen, A [r, in] and
B [out, r] trained and s = alpha / r (Hu et al. 2021, arXiv 2106.09685). Defaults follow "LoRA Without
Regret" (Schulman et al., Thinking Machines 2025): adapters on every linear layer of attention *and* MLP
(attention-only LoRA underperforms), alpha = 32 for every rank (with the 1/r scale the best learning
rate barely depends on r), no dropout; in policy-gradient RL even rank 1 matches full fine-tuning,
because an episode carries about one bit of information, and LoRA's best learning rate is about 10x full
fine-tuning's.

What the rest of tidal gets from this module:

- ``wrap(model, cfg)``: the PEFT model the trainer trains (base frozen, adapters trainable). The
  reference policy is the same object with its adapters disabled (``reference_scores`` in the trainer:
  ``with model.disable_adapter()``), never a second copy of the base.
- ``adapter_update(model)``: what a weight update sends to the rollout engines: per adapted layer
  ``NAME.lora_A`` [r, in], ``NAME.lora_B`` [out, r] and ``NAME.lora_scale`` (a 0-d tensor, s), NAME
  the layer's name in the plain model. r (in + out) numbers per layer instead of in x out.
- ``engine_copy(model)`` / ``apply_update``: the local engine keeps a plain copy whose adapted weights
  are merged, W0 + s B A, and the base weights W0 of those layers; each update rewrites the merged
  weights in place (CUDA graphs keep their pointers) from W0 and the new adapters, so nothing drifts
  however many updates come.
- ``save_adapters`` / ``load_adapters``: checkpoints in PEFT's own layout (``adapter_config.json`` +
  ``adapter_model.safetensors``, ``PeftModel.from_pretrained`` loads them).

Mixture-of-experts models (``models/moe.py``): transformers 5 stores each layer's routed experts as fused 3-D
parameters (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]), not ``nn.Linear`` layers, so
``target_modules`` cannot name them. ``experts`` (default on) adapts them through PEFT's ``target_parameters``
(``ParamWrapper``): every expert gets its own A [r, in] and B [out, r] (PEFT stacks them as A [E r, in] and
B [out, E r]), merged as W0[e] + s B_e A_e. The routers stay frozen: a router is an E x H matrix, and training it
moves which experts a token meets, which routing replay (R3) pins to what the engine sampled with. tidal resolves
``all-linear`` itself on an MoE model (the attention and any dense or shared-expert ``nn.Linear``): PEFT's own
``all-linear`` adds the experts *and* the routers for some MoE families and nothing for others (Qwen2-MoE), and
its renaming of transformers-4 MLP names is kept out (``names_as_written``).
In an update an expert adapter is keyed by its parameter's name (``...mlp.experts.gate_up_proj``), a linear
layer's by its module's name.

Only the initializations that leave the base untouched are offered (``init``): PiSSA, OLoRA and LoftQ
rewrite W, so "adapters disabled" would no longer be the base the run started from.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.config import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
INITS = ("default", "gaussian")
VISION = ("frozen", "lora")
VISION_TOWERS = ("visual", "vision_tower", "vision_model")
"""Module names transformers gives a VLM's vision tower (Qwen2-VL ``visual``; LLaVA ``vision_tower``; Idefics
``vision_model``): what ``model.lora.vision=frozen`` keeps adapters out of."""
QUANTIZE = ("none", "4bit")
_A, _B, _SCALE = ".lora_A", ".lora_B", ".lora_scale"
_PREFIX = "base_model.model."


@dataclass
class LoraConfig:
    """``model.lora``: train LoRA adapters (``rank`` >= 1) instead of every weight (``rank`` 0, the default)."""

    rank: int = 0
    """r, the adapters' rank; 0 trains the whole model. LoRA Without Regret: rank 1 already matches full
    fine-tuning in policy-gradient RL; 16 leaves room for SFT-sized signals."""
    alpha: float = 32.0
    """The adapters' scale is alpha / rank. 32 for every rank, as LoRA Without Regret does: with the 1/r
    scale the best learning rate is nearly independent of the rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's ``lora_dropout``). 0, as LoRA Without Regret; anything else
    makes the trainer's own log-probs random, which decoupled PPO's proximal policy does not expect."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Which linear layers get adapters: module names (``q_proj``, ``down_proj``, ...) or ``all-linear``
    (PEFT: every linear layer except the LM head: attention and MLP, as LoRA Without Regret recommends). On a
    mixture-of-experts model these are the ``nn.Linear`` layers only (attention, dense and shared-expert MLPs);
    the routed experts are ``experts``."""
    experts: bool = True
    """Mixture-of-experts models: also adapt every routed expert's fused weights (``gate_up_proj``, ``down_proj``;
    each expert its own rank-``rank`` A and B), as LoRA Without Regret adapts the MLP. False: attention (and
    ``target_modules``) only. Ignored for a dense model."""
    init: str = "default"
    """How A and B start: ``default`` (PEFT/Hu et al.: A Kaiming-uniform, B zero, so step 0 is the base) or
    ``gaussian`` (A normal with std 1/r, B zero)."""
    quantize: str = "none"
    """``4bit``: QLoRA (Dettmers et al. 2023, arXiv 2305.14314): the frozen base stored as NF4 with double
    quantization through bitsandbytes, compute in bf16; CUDA only. ``none``: the base in full precision."""
    vision: str = "frozen"
    """Vision-language models (``models/vlm.py``): ``frozen`` puts adapters on the language model only, the vision
    tower (ViT and merger) staying the base's, as most VLM RL recipes do (the reward speaks about the answer, and a
    few hundred RL steps rarely need the tower to see differently); ``lora`` also adapts the vision tower's linear
    layers (``target_modules`` applies to both). Ignored for a text model."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def validate(cfg: LoraConfig) -> None:
    """One ConfigError naming the key for a value ``model.lora`` cannot use."""
    if not isinstance(cfg.rank, int) or cfg.rank < 0:
        raise ConfigError(f"model.lora.rank must be an integer >= 0 (0: train the whole model), got {cfg.rank!r}")
    if not cfg.enabled:
        return
    if not cfg.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {cfg.alpha!r}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {cfg.dropout!r}")
    if not cfg.target_modules or not all(isinstance(m, str) and m for m in cfg.target_modules):
        raise ConfigError(f"model.lora.target_modules must be a non-empty list of module names (or [all-linear]), "
                          f"got {cfg.target_modules!r}")
    if "all-linear" in cfg.target_modules and len(cfg.target_modules) > 1:
        raise ConfigError("model.lora.target_modules: all-linear already names every linear layer; list it alone")
    if not isinstance(cfg.experts, bool):
        raise ConfigError(f"model.lora.experts must be true or false, got {cfg.experts!r}")
    if cfg.init not in INITS:
        raise ConfigError(f"model.lora.init must be one of {', '.join(INITS)} (PiSSA, OLoRA and LoftQ rewrite the base "
                          f"weights, so the adapters-off reference would not be the base), got {cfg.init!r}")
    if cfg.quantize not in QUANTIZE:
        raise ConfigError(f"model.lora.quantize must be one of {', '.join(QUANTIZE)}, got {cfg.quantize!r}")
    if cfg.vision not in VISION:
        raise ConfigError(f"model.lora.vision must be frozen or lora (adapters on the vision tower too), "
                          f"got {cfg.vision!r}")


def check_device(cfg: LoraConfig, device: torch.device) -> None:
    """QLoRA's 4-bit base needs bitsandbytes' CUDA kernels: one line anywhere else."""
    if cfg.enabled and cfg.quantize == "4bit" and device.type != "cuda":
        raise ConfigError(f"model.lora.quantize=4bit (QLoRA) needs a CUDA device (bitsandbytes 4-bit kernels); "
                          f"system.device resolves to {device.type}: use model.lora.quantize=none")


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ConfigError(f"model.lora.rank > 0 needs peft: pip install 'tidal[lora]' ({e})") from None
    return peft


def is_peft(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (LoRA adapters on a frozen base)."""
    return type(model).__module__.startswith("peft.")


def wrap(model: torch.nn.Module, cfg: LoraConfig, base_path: str | Path | None = None,
         task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """``model`` with LoRA adapters (``get_peft_model``): base frozen, adapters trainable. ``base_path``:
    recorded in the adapter config (``base_model_name_or_path``), where ``tidal export`` and
    ``PeftModel.from_pretrained`` users find the base. A mixture-of-experts model gets its targets from
    ``moe_targets`` (the module docstring).``task_type`` ``SEQ_CLS`` (a reward model): PEFT
    trains the new ``score`` head whole beside the adapters (``modules_to_save``): a frozen random head could not
    learn."""
    peft = _peft()
    targets = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    parameters = None
    experts = expert_parameters(model)
    if experts:
        targets, parameters = moe_targets(model, cfg, experts)
    init = True if cfg.init == "default" else cfg.init
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                             target_parameters=parameters, init_lora_weights=init, bias="none", task_type=task_type,
                             exclude_modules=vision_exclusion(model) if cfg.vision == "frozen" else None,
                             modules_to_save=["score"] if task_type == "SEQ_CLS" else None)
    try:
        with names_as_written(model):
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # no module matched target_modules
        raise ConfigError(f"model.lora.target_modules={cfg.target_modules}: {' '.join(str(e).split())}") from None
    if base_path is not None:
        wrapped.peft_config["default"].base_model_name_or_path = str(Path(base_path).resolve())
    return wrapped


def vision_exclusion(model: torch.nn.Module) -> str | None:
    """PEFT's ``exclude_modules`` (a regex over module names) keeping adapters out of a VLM's vision tower
    (``model.lora.vision=frozen``; PEFT's ``all-linear`` would adapt its linear layers too); None without one."""
    towers = [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_TOWERS]
    return f"({'|'.join(re.escape(name) for name in towers)})\\..*" if towers else None


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """The full names of the routed experts' fused 3-D weights (``...mlp.experts.gate_up_proj``): the 3-D
    parameters of modules whose class is named ``*Experts`` (how transformers 5 writes Qwen-MoE, Mixtral, OLMoE,
    GPT-OSS); empty for a dense model."""
    return [f"{name}.{p_name}" for name, module in model.named_modules() if type(module).__name__.endswith("Experts")
            for p_name, p in module.named_parameters(recurse=False) if p.dim() == 3]


def moe_targets(model: torch.nn.Module, cfg: LoraConfig, experts: list[str]) -> tuple[list[str], list[str] | None]:
    """PEFT's ``target_modules`` and ``target_parameters`` for an MoE model: ``all-linear`` resolved here to the
    leaf names of its ``nn.Linear`` layers but the LM head (PEFT's own resolution differs per MoE family: the
    module docstring), and the experts' parameters named by their last two parts (``experts.gate_up_proj``:
    PEFT matches suffixes, and a saved adapter config then fits every layer count)."""
    if cfg.target_modules == ["all-linear"]:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                          if isinstance(m, torch.nn.Linear) and m is not head})
    else:
        targets = list(cfg.target_modules)
    parameters = sorted({".".join(name.split(".")[-2:]) for name in experts}) if cfg.experts else None
    return targets, parameters


@contextlib.contextmanager
def names_as_written(model: torch.nn.Module) -> Iterator[None]:
    """PEFT (with transformers 5) rewrites the LoRA targets of the MoE families whose layout changed since
    transformers 4: ``gate_proj``/``up_proj``/``down_proj`` (Mixtral's ``w1``-``w3``) become the fused experts and
    ``gate`` the router (``peft/utils/transformers_weight_conversion.py``), so the linear layers of those names a
    model also has (dense MLP layers, shared experts: GLM-4.5's, DeepSeek's) were silently left out. With the
    model type hidden from that mapping (it is looked up by ``config.model_type``) a target means the modules it
    names, and the experts are what ``target_parameters`` names. Used wherever PEFT reads a config (wrapping and
    loading adapters), for MoE models only: other models keep PEFT's conversions as they are."""
    config = getattr(model, "config", None)
    if config is None or not expert_parameters(model):
        yield
        return
    own = "model_type" in vars(config)
    previous = config.model_type
    config.model_type = "tidal-targets-as-written"
    try:
        yield
    finally:
        if own:
            config.model_type = previous
        else:
            del config.model_type


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _plain(name: str) -> str:
    """A PEFT module name as the plain model names it (no ``base_model.model.`` prefix, no ``.base_layer``)."""
    name = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    return name.replace(".base_layer", "")


def _lora_layers(model: torch.nn.Module):
    """(name in the plain model, layer) of every adapted layer of a PEFT model: a linear layer by its module's
    name, a targeted parameter (``ParamWrapper``: the MoE experts' fused weights) by the parameter's name."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            if isinstance(module, ParamWrapper):
                yield f"{_plain(name)}.{module.parameter_name}", module
            else:
                yield _plain(name), module


def _is_param(layer: torch.nn.Module) -> bool:
    return type(layer).__name__ == "ParamWrapper"


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from an FSDP2 shard (a DTensor: collective, every rank must call it), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def adapter_update(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A detached copy of the adapters (the module docstring's layout), ``dtype`` the engine's. Sharded with
    FSDP2, each adapter is gathered whole (collective: every rank calls it, in the same order)."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in _lora_layers(model):
        a, b = _full(layer.lora_A["default"].weight), _full(layer.lora_B["default"].weight)
        out[name + _A] = a.detach().to(dtype=dtype or a.dtype, copy=True)
        out[name + _B] = b.detach().to(dtype=dtype or b.dtype, copy=True)
        out[name + _SCALE] = torch.tensor(float(layer.scaling["default"]), dtype=torch.float32)
    return out


def is_adapter_update(state_dict) -> bool:
    return any(k.endswith(_SCALE) for k in state_dict)


def engine_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.Tensor] | None]:
    """For a rollout engine: a plain copy of ``model`` and, if it is a PEFT model, the base weights W0 of
    its adapted layers and parameters (the copy's are merged: W0 + s B A), by their names in the update."""
    import copy

    if not is_peft(model):
        return copy.deepcopy(model), None
    clone = copy.deepcopy(model)
    base = {name: (layer.get_param() if _is_param(layer) else _dense_weight(layer.base_layer)).detach().clone()
            for name, layer in _lora_layers(clone)}
    if any(_is_4bit(m) for m in clone.modules()):
        _dequantize_bases(clone)  # the engine samples from a bf16 base (QLoRA: the trainer's base is NF4)
    plain = _merged(clone)
    if getattr(plain, "hf_quantizer", None) is not None:  # transformers refuses .to(dtype) on a 4-bit loaded model
        plain.hf_quantizer.remove_quantization_config(plain)
    return plain, base


def _merged(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model of a PEFT model, each adapted weight plus its delta (s B A). Done here rather than by peft's
    ``merge_and_unload``: for QLoRA that dequantizes through bitsandbytes' ``quant_state``, which the bf16 base
    ``_dequantize_bases`` put in place has not (the first H200 run failed on it). A ``ParamWrapper`` (nested, one
    per targeted parameter of a module) is replaced by the module it wraps once all its deltas are in."""
    layers = list(_lora_layers(model))
    for _, layer in layers:
        weight = layer.get_param() if _is_param(layer) else layer.base_layer.weight
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                weight.data += layer.get_delta_weight(adapter).to(weight.dtype)
    plain = model.get_base_model()
    for name, module in list(plain.named_modules()):
        if ".base_layer" not in name and any(module is layer for _, layer in layers):
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent), child, module.get_base_layer())
    return plain


def _is_4bit(layer: torch.nn.Module) -> bool:
    return type(layer).__name__ == "Linear4bit"


def _dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as a dense tensor (a bitsandbytes 4-bit one dequantized)."""
    if _is_4bit(layer):
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(torch.bfloat16)
    return layer.weight


def _dequantize_bases(model: torch.nn.Module) -> None:
    """Replace every 4-bit linear layer of a model (adapted bases and any layer the adapters left alone) by a plain
    bf16 ``nn.Linear`` with the same values."""
    for name, base in [(n, m) for n, m in model.named_modules() if _is_4bit(m)]:
        dense = torch.nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                                dtype=torch.bfloat16, device=base.weight.device)
        dense.weight.data.copy_(_dense_weight(base))
        if base.bias is not None:
            dense.bias.data.copy_(base.bias.data)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, dense)


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float, shape: torch.Size,
               transposed: bool = False) -> torch.Tensor:
    """s B A in the layout of the weight it adds to (``shape``). A linear layer: B [out, r] @ A [r, in]. Fused
    experts [E, out, in] (PEFT's ``ParamWrapper``): A [E r, in] holds expert e's A_e in rows e r .. e r + r - 1 and
    B [out, r E] its B_e in the columns e, e + E, ... (``ParamWrapper.get_delta_weight``), delta[e] = s B_e A_e;
    ``transposed``: the experts store [E, in, out] (``is_transposed``, GPT-OSS)."""
    if len(shape) == 2:
        return scale * (b @ a)
    num_experts = shape[0]
    a_eri = a.reshape(num_experts, -1, a.shape[-1])
    b_ore = b.reshape(b.shape[0], -1, num_experts)
    delta = torch.einsum("ore,eri->eoi", b_ore, a_eri) * scale
    return delta.transpose(1, 2) if transposed else delta


def _weight_of(model: torch.nn.Module, name: str) -> tuple[torch.Tensor, bool]:
    """The plain model's tensor an update's ``name`` adapts: a linear layer's weight or a named parameter (fused
    experts), and whether that parameter is stored transposed ([E, in, out])."""
    try:
        return model.get_submodule(name).weight, False
    except AttributeError:
        parent, _, _ = name.rpartition(".")
        return model.get_parameter(name), bool(getattr(model.get_submodule(parent), "is_transposed", False))


@torch.no_grad()
def apply_update(model: torch.nn.Module, base: dict[str, torch.Tensor], update) -> None:
    """Write W0 + s B A (computed in float32, stored in the weight's dtype) into each adapted layer or expert
    parameter of the engine's plain ``model``, in place. Every adapted name must be in ``update`` and nothing else."""
    names = {k[: -len(_SCALE)] for k in update if k.endswith(_SCALE)}
    if names != set(base):
        missing, extra = sorted(set(base) - names)[:3], sorted(names - set(base))[:3]
        raise RuntimeError(f"adapter update does not match the engine's adapted layers: missing {missing}, "
                           f"unexpected {extra}")
    for name, w0 in base.items():
        weight, transposed = _weight_of(model, name)
        a, b = update[name + _A].to(weight.device, torch.float32), update[name + _B].to(weight.device, torch.float32)
        delta = lora_delta(a, b, float(update[name + _SCALE]), w0.shape, transposed)
        weight.copy_((w0.float() + delta).to(weight.dtype))


def save_adapters(model: torch.nn.Module, directory: str | Path, state_dict: dict | None = None) -> None:
    """PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors`` (embeddings never saved:
    they are not adapted, and PEFT's ``auto`` would look the base up on the Hub). ``state_dict``: the
    model's full state dict when it is sharded (gathered on rank 0), as ``model.state_dict()`` names it."""
    model.save_pretrained(directory, safe_serialization=True, save_embedding_layers=False, state_dict=state_dict)
    readme = Path(directory) / "README.md"  # PEFT's model-card stub: not part of the adapters
    readme.unlink(missing_ok=True)


def read_adapters(directory: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's adapters under the PEFT model's own parameter names (PEFT saves them without the
    adapter's name: ``...q_proj.lora_A.weight`` is the model's ``...q_proj.lora_A.default.weight``)."""
    from safetensors.torch import load_file

    return {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): v
            for k, v in load_file(Path(directory) / ADAPTER_WEIGHTS).items()}


class AdapterMismatch(ConfigError):
    """A checkpoint's adapters were trained with other ``model.lora`` settings than the run that loads them."""


def _targets(value) -> set[str]:
    return {value} if isinstance(value, str) else set(value or ())


def check_adapters(model: torch.nn.Module, directory: str | Path) -> None:
    """The checkpoint's rank, alpha and adapted layers (its ``adapter_config.json``) against ``model``'s, before
    any weight is read: with another rank PEFT's loader fails with a ~100-line size-mismatch traceback per
    layer, and another alpha would load without complaint and train at another scale (s = alpha / r)."""
    import json

    path = Path(directory) / ADAPTER_CONFIG
    if not path.exists():  # a checkpoint without it fails below, on its weights
        return
    saved, mine = json.loads(path.read_text()), model.peft_config["default"]
    differ = []
    if saved.get("r") != mine.r:
        differ.append(f"model.lora.rank={saved.get('r')} (this run: {mine.r})")
    if saved.get("lora_alpha") is not None and float(saved["lora_alpha"]) != float(mine.lora_alpha):
        differ.append(f"model.lora.alpha={saved['lora_alpha']} (this run: {mine.lora_alpha})")
    if _targets(saved.get("target_modules")) != _targets(mine.target_modules):
        differ.append(f"adapters on {sorted(_targets(saved.get('target_modules')))} "
                      f"(this run: {sorted(_targets(mine.target_modules))}, model.lora.target_modules)")
    if _targets(saved.get("target_parameters")) != _targets(mine.target_parameters):
        differ.append(f"adapters on the expert weights {sorted(_targets(saved.get('target_parameters')))} "
                      f"(this run: {sorted(_targets(mine.target_parameters))}, model.lora.experts)")
    if differ:
        raise AdapterMismatch(f"checkpoint {directory} was trained with {'; '.join(differ)}: resume with the "
                              "model.lora settings it was written with (drop the --set that changes them)")


def load_adapters(model: torch.nn.Module, directory: str | Path) -> None:
    """Load a checkpoint's adapters into ``model`` (a PEFT model with the same adapted layers), strictly; settings
    that differ (``check_adapters``) are one line before anything is read."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    check_adapters(model, directory)
    weights = load_file(Path(directory) / ADAPTER_WEIGHTS)
    with names_as_written(model):
        result = set_peft_model_state_dict(model, weights)
    unexpected = list(getattr(result, "unexpected_keys", []))
    loaded = {k.replace(".weight", ".default.weight") for k in weights}  # PEFT saves without the adapter name
    loaded |= set(weights)  # a head trained whole (modules_to_save) is saved under the base module's name

    def saved_as(name: str) -> str:
        return name.replace(".modules_to_save.default.", ".")
    missing = sorted(n for n, p in model.named_parameters() if p.requires_grad and saved_as(n) not in loaded)
    if unexpected or missing:
        raise RuntimeError(f"checkpoint {directory} does not match the model's adapters (model.lora): "
                           f"missing {missing[:3]}, unexpected {unexpected[:3]}")


def base_of(directory: str | Path) -> Path:
    """The base model directory an adapter directory was trained on (its ``base_model_name_or_path``): a model
    directory, or what ``model.path`` also takes and ``tidal export`` writes there for a base it imported (a
    catalog name, a ``.gguf`` or a ``.whl``: ``models/catalog.py``), imported again if the cache was cleared."""
    import json

    from tidal.models import catalog

    base = json.loads((Path(directory) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if base and not Path(base).is_dir() and (base in catalog.CATALOG or Path(base).suffix in (".gguf", ".whl")):
        base = str(catalog.resolve(base))
    if not base or not (Path(base) / "config.json").exists():
        raise FileNotFoundError(f"{directory}: its base model {base!r} (adapter_config.json's base_model_name_or_path) "
                                "is not a local model directory")
    return Path(base)


def is_adapter_dir(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).exists() and not (Path(directory) / "config.json").exists()


def load_merged(directory: str | Path, base: str | Path | None = None) -> torch.nn.Module:
    """A plain Hugging Face model: the adapters in ``directory`` merged into their base (float32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = Path(base) if base is not None else base_of(directory)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    with names_as_written(model):
        return PeftModel.from_pretrained(model, str(directory), local_files_only=True).merge_and_unload()



def check_run(cfg) -> None:
    """The run-config combinations LoRA cannot serve yet, each one ConfigError naming the keys (``cfg`` a
    ``RunConfig``; called by ``system/validate.py``)."""
    lc = cfg.model.lora
    validate(lc)
    if not lc.enabled:
        return
    if cfg.rollout.engine != "local":
        raise ConfigError(f"model.lora with rollout.engine={cfg.rollout.engine}: tidal's vLLM engine does not load "
                          "LoRA adapters yet (vLLM itself can, with enable_lora and a LoRARequest per version); "
                          "use rollout.engine=local")
    if cfg.rollout.weight_quant != "none":
        raise ConfigError(f"model.lora with rollout.weight_quant={cfg.rollout.weight_quant}: the adapters are sent "
                          "unquantized (a few MB); use rollout.weight_quant=none")
    if cfg.system.backend != "local":
        raise ConfigError(f"model.lora with system.backend={cfg.system.backend}: Ray rollout workers take full weights "
                          "only for now; use system.backend=local")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.trainer.data_parallel == "elastic" or (world > 1 and cfg.trainer.data_parallel != "fsdp"):
        raise ConfigError(f"model.lora with trainer.data_parallel={cfg.trainer.data_parallel}: DiLoCo and elastic "
                          "replicas do not sync PEFT adapters yet; use trainer.data_parallel=fsdp under torchrun "
                          "(FSDP2: base frozen and sharded, adapters trained) or one process")
    if cfg.optim.name == "muon":
        raise ConfigError("model.lora with optim.name=muon: Muon orthogonalizes whole hidden matrices, and LoRA's A "
                          "and B are rank-r factors; use optim.name=adamw or ademamix")


def policy(model: torch.nn.Module, cfg: LoraConfig, base_path: str | Path, device: str) -> torch.nn.Module:
    """The trainer's LoRA policy on the base at ``base_path`` (``model``, already loaded in float32), or with
    ``quantize=4bit`` the base reloaded as NF4 on ``device`` (QLoRA; ``check_device`` ran first)."""
    if cfg.quantize == "4bit":
        model = _load_4bit(base_path, device)
    return wrap(model, cfg, base_path)


def _load_4bit(base_path: str | Path, device: str) -> torch.nn.Module:
    """QLoRA's base: NF4 weights with double quantization, bf16 compute (Dettmers et al. 2023, sec. 3)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"model.lora.quantize=4bit needs bitsandbytes: pip install 'tidal[qlora]' ({e})") from None
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    from tidal.utils.device import resolve_device

    model = AutoModelForCausalLM.from_pretrained(base_path, local_files_only=True, quantization_config=quant,
                                                 device_map={"": resolve_device(device)}, dtype=torch.bfloat16)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
