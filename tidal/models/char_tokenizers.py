"""The tiny models' character tokenizers (plain and chat), and the one way tidal reads a checkpoint's tokenizer.

Kept apart from ``tiny.py`` (the models) so that ``vlm.py``, whose tokenizer is the chat one plus Qwen2-VL's
vision markers, builds on the tokenizers without importing the module that dispatches to it.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tidal.models import catalog

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# Digits, lowercase letters and the punctuation our synthetic tasks and chat markers use.
CHARS = string.digits + string.ascii_lowercase + " +-*/=()<>?.,:\n"


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


PROCESSOR_ATTR = "tidal_processor"
"""The attribute a vision-language model's processor rides on its tokenizer under (``vlm.attach_processor``)."""


def save_tokenizer(tokenizer, path) -> None:
    """Write ``tokenizer``'s files into ``path``: its attached processor's when it has one (a vision-language
    model's: tokenizer, image processor and chat template), so a checkpoint or a saved base loads with it."""
    (getattr(tokenizer, PROCESSOR_ATTR, None) or tokenizer).save_pretrained(path)


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
