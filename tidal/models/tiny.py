"""Build a tiny causal LM and its character-level tokenizer locally, as real Hugging Face objects.

The model is a ``Qwen2ForCausalLM`` and the tokenizer a ``PreTrainedTokenizerFast``; both are
written with ``save_pretrained`` (safetensors), so everything downstream loads them through the
same ``AutoModelForCausalLM.from_pretrained(local_dir)`` path a real checkpoint takes. No hub.

Sizes (FACTS.md): hidden 128, 4 layers, 4 heads, intermediate 512, tied embeddings -> ~1.06M
parameters, which learns 2-digit addition from scratch in a couple of CPU minutes.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen3MoeConfig

from tidal.models import catalog, lora, prompts
from tidal.models.lora import LoraConfig

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# Digits, lowercase letters and the punctuation our synthetic tasks and chat markers use.
CHARS = string.digits + string.ascii_lowercase + " +-*/=()<>?.,:\n"


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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train LoRA adapters on the frozen base (``model.lora.rank`` >= 1; ``models/lora.py``, docs/lora.md)."""

    def prompts(self) -> prompts.PromptFormat:
        return prompts.PromptFormat(self.prompt_format, self.system_prompt)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, specials first (pad=0, bos=1, eos=2)."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    tok.padding_side = "left"
    return tok


# ChatML turns (Qwen2.5's markers) and hermes tool calls written as compact JSON: an assistant message's
# ``tool_calls`` render exactly as the model writes them, so a conversation the server continued from
# recorded ids and the same conversation rendered from scratch are the same text. The tools' schemas
# are not rendered (a 1M-parameter model learns its one tool from the warm start; real templates put
# them in a system message, which costs the tiny model's short context).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\":\"{{ c['function']['name'] }}\",\"arguments\":"
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson(separators=(',', ':')) }}{% endif %}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_CHARS = CHARS + '{}"_'
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
# Multi-character tokens a real vocabulary has for chat and tool-call text: the role names, the JSON keys
# and tool name of the calculator call, and the JSON punctuation runs between them. Qwen2.5's BPE writes
# ``{"name":"calculator","arguments":{"expression":"37*54"}}`` in about 20 tokens; one token per character
# took 52, and every extra sampled token is another chance for a temperature-1 sample to break the call.
# Digits stay one token each (as in Qwen and Llama), so arithmetic is unchanged.
CHAT_WORDS = ("user", "assistant", "tool", "system", "name", "arguments", "calculator", "expression",
              '{"', '":"', '","', '":{"', '"}}', '"}')


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a chat template (``CHAT_TEMPLATE``): pad=0, ``<|im_start|>``,
    ``<|im_end|>`` (= EOS: a turn ends there), the characters, then ``<tool_call>``, ``</tool_call>`` and
    ``CHAT_WORDS`` as single tokens that are not special (as in Qwen2.5: ``decode(skip_special_tokens=True)``
    keeps them, so the server can parse a turn's tool calls from its text). Multi-character tokens make
    re-tokenization drift possible (a sampled ``n a m e`` re-encodes as ``name``), which the server's
    exact continuation from recorded ids is built for. No BOS: the template opens every conversation."""
    vocab = {tok: i for i, tok in enumerate([PAD, IM_START, IM_END, *CHAT_CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=IM_END,
                                  additional_special_tokens=[IM_START])
    tok.add_tokens(list(TOOL_CALL_TAGS) + list(CHAT_WORDS))
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


TOKENIZERS = {"char": build_tokenizer, "chat": build_chat_tokenizer}


def tokenizer_for(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer ``cfg.tokenizer`` names (a clear error for an unknown name)."""
    if cfg.tokenizer not in TOKENIZERS:
        raise ValueError(f"model.tokenizer must be one of {sorted(TOKENIZERS)}, got {cfg.tokenizer!r}")
    return TOKENIZERS[cfg.tokenizer]()


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> torch.nn.Module:
    """The tiny model ``cfg`` describes (dense Qwen2, or Qwen3-MoE with ``num_experts``), randomly initialized."""
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


def save(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The checkpoint's tokenizer, as its ``tokenizer.json`` defines it.

    transformers 5's ``AutoTokenizer`` picks the class from the model type (qwen2 -> ``Qwen2Tokenizer``)
    and rebuilds the pre-tokenizer in code, so a generic fast tokenizer saved next to a Qwen2 model (the
    tiny model's character tokenizer) comes back with Qwen2's byte-level regex: spaces and newlines
    vanish from every prompt. A checkpoint that declares the generic class is loaded as that class;
    real checkpoints (``Qwen2Tokenizer``, ...) still go through ``AutoTokenizer``.
    """
    path = catalog.resolve(path)
    config = path / "tokenizer_config.json"
    declared = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


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
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, tokenizer
