"""A chat tokenizer for tests: one token per character plus ChatML's two markers as special tokens
(eos = <|im_end|>), with a ChatML template (the renderer and server tests share it)."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ARITHMETIC_CHARS = string.digits + string.ascii_letters + " +-*/=()<>?.,:\n"
PRINTABLE_CHARS = "".join(set(string.printable) - set("\t\r\x0b\x0c"))


def chat_tokenizer(template: str = CHATML, chars: str = ARITHMETIC_CHARS) -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(chars)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = template
    return tok
