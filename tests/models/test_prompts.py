"""``models/prompts.py``: a single-turn prompt's ids under each format, identical to ``apply_chat_template``."""

import pytest

from tidal.models import prompts, tiny
from tidal.rollout.requests import check_prompts_fit, group_requests, prompt_ids
from tidal.tasks.supervised import sft_batch
from tidal.types import Prompt


def test_plain_is_bos_then_text(tokenizer):
    assert tokenizer.chat_template is None
    ids = prompts.prompt_ids(tokenizer, "12+34=")
    assert ids == [tokenizer.bos_token_id, *tokenizer("12+34=", add_special_tokens=False).input_ids]
    assert not prompts.uses_chat(tokenizer)  # auto: no template, plain


def test_chat_tokenizer_renders_its_template():
    tok = tiny.build_chat_tokenizer()
    ids = prompts.prompt_ids(tok, "what is 2+3?")
    assert ids == tok.apply_chat_template([{"role": "user", "content": "what is 2+3?"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\nwhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


def test_system_prompt_and_plain_override():
    tok = prompts.attach(tiny.build_chat_tokenizer(), prompts.PromptFormat("auto", "be brief"))
    assert tok.decode(prompts.prompt_ids(tok, "hi")) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    prompts.attach(tok, prompts.PromptFormat("plain"))
    assert tok.decode(prompts.prompt_ids(tok, "hi")) == "hi"  # no BOS in this vocabulary: the text alone


def test_bad_format_and_chat_without_template(tokenizer):
    with pytest.raises(ValueError, match="model.prompt_format must be one of"):
        prompts.PromptFormat("chatml")
    with pytest.raises(ValueError, match="no chat template"):
        prompts.attach(tiny.build_tokenizer(), prompts.PromptFormat("chat"))


def test_real_template_ids_equal_apply_chat_template(smollm2_tokenizer):
    """SmolLM2's ChatML with its default system prompt, token for token, and with a system prompt of ours."""
    tok = smollm2_tokenizer
    for system in (None, "Answer with just the number."):
        prompts.attach(tok, prompts.PromptFormat("auto", system))
        for text in ("What is 37+48?", "Compute 12 - 7.\nThink step by step.", " leading space", ""):
            want = tok.apply_chat_template(prompts.messages(text, prompts.format_of(tok)), add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
            assert prompt_ids(tok, Prompt("u", text, "")) == tuple(want)
    prompts.attach(tok, prompts.PromptFormat())
    text = tok.decode(prompts.prompt_ids(tok, "What is 37+48?"))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 37+48?<|im_end|>\n<|im_start|>assistant\n")


def test_rollouts_and_warm_start_share_the_rendering():
    """The engine's requests and the warm start's supervised rows start with the same prompt ids."""
    tok = prompts.attach(tiny.build_chat_tokenizer(), prompts.PromptFormat("chat", "sys"))
    p = Prompt("u", "what is 2+3?", "5")
    want = prompts.prompt_ids(tok, p.text)
    assert list(group_requests(tok, [p], 2)[1].prompt_ids) == want

    class Task:
        def sft_example(self, prompt):
            return prompt.answer

    ids, _, labels = sft_batch(tok, Task(), [p])
    assert ids[0, : len(want)].tolist() == want
    assert labels[0, : len(want)].eq(-100).all() and labels[0, len(want)].item() != -100


def test_fit_check_counts_the_template():
    """A prompt that fits as plain text but not with the chat template's markers is refused, naming it."""
    from tidal.config import ConfigError

    tok = tiny.build_chat_tokenizer()
    overhead = prompts.template_overhead(tok)
    assert overhead == len(prompts.prompt_ids(tok, ""))
    text = "1" * 20
    assert check_prompts_fit(tok, [("row 0", Prompt("u", text, ""))], 20 + overhead + 4, 4) == 1
    with pytest.raises(ConfigError, match="row 0: the prompt is 20 tokens"):
        check_prompts_fit(tok, [("row 0", Prompt("u", text, ""))], 20 + overhead + 3, 4)
