"""Renderers: the chat renderer appends exactly what the chat template would render, or refuses."""


import pytest

from tidal.api import EnvStep
from tidal.envs.config import EnvConfig
from tidal.models import tiny
from tidal.rollout.episodes import EpisodeEngine
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.render import ChatRenderer, NotAppendOnly, PlainRenderer, build_renderer
from tidal.rollout.requests import group_requests
from tidal.types import Prompt

from .chat_fixture import CHATML, chat_tokenizer

# Renders only the last assistant message's content: earlier turns change when a message is added.
FORGETFUL = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' or loop.last %}"
             "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_chat_context_equals_the_template_rendering_of_the_conversation():
    tok = chat_tokenizer()
    r = ChatRenderer(tok)
    context, first, state = r.start(Prompt("p", "12+34+56=", "102"), None)
    assert first == [] and context == ids(tok, "<|im_start|>user\n12+34+56=<|im_end|>\n<|im_start|>assistant\n")
    # turn 1 ends at a stop string (no EOS sampled): the observation carries the closing marker
    turn1 = ids(tok, "<c>12+34</c>")
    context += turn1
    obs1 = r.observation_ids(state, "<c>12+34</c>", turn1, "46")
    assert obs1[0] == tok.eos_token_id
    context += obs1
    # turn 2 ends with the EOS the model sampled: the observation does not repeat it
    turn2 = ids(tok, "<c>46+56</c>") + [tok.eos_token_id]
    context += turn2
    context += r.observation_ids(state, "<c>46+56</c>", turn2, "102")
    conversation = [{"role": "user", "content": "12+34+56="}, {"role": "assistant", "content": "<c>12+34</c>"},
                    {"role": "tool", "content": "46"}, {"role": "assistant", "content": "<c>46+56</c>"},
                    {"role": "tool", "content": "102"}]
    rendered = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert context == ids(tok, rendered)


def test_a_template_that_rewrites_history_is_refused_not_re_rendered():
    tok = chat_tokenizer(FORGETFUL)
    r = ChatRenderer(tok)
    _, _, state = r.start(Prompt("p", "1+2=", "3"), None)
    with pytest.raises(NotAppendOnly):
        r.observation_ids(state, "<c>1+2</c>", ids(tok, "<c>1+2</c>"), "3")


def test_renderer_choice_and_a_tokenizer_without_a_template():
    assert isinstance(build_renderer("plain", tiny.build_tokenizer()), PlainRenderer)
    with pytest.raises(ValueError, match="chat template"):
        build_renderer("chat", tiny.build_tokenizer())
    with pytest.raises(ValueError, match="env.renderer"):
        build_renderer("jinja", tiny.build_tokenizer())


class Twice:
    stop: list[str] = []

    def reset(self, prompt):
        self.n = 0

    def step(self, turn_text):
        self.n += 1
        return EnvStep(None, 1.0, done=True) if self.n == 2 else EnvStep("ok")


@pytest.mark.parametrize("template, reason", [(CHATML, "stop"), (FORGETFUL, "not_append_only")])
def test_episodes_with_a_chat_template(template, reason):
    tok = chat_tokenizer(template)
    cfg = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    engine = EpisodeEngine(LocalEngine(tiny.build_model(cfg, tok), tok, SamplingConfig(max_new_tokens=4)), tok,
                           Twice, EnvConfig(renderer="chat", max_turns=4), context_len=128)
    prompt = Prompt("p0", "2+2=", "4")
    episodes = engine.generate(group_requests(tok, [prompt], 3))
    start = ids(tok, "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n")
    for ep in episodes:
        assert ep.prompt_ids == start and ep.finish_reason == reason
        if reason == "stop":
            tool_open = ids(tok, "<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n")
            observed = [t for t, m in zip(ep.token_ids, ep.loss_mask) if not m]
            assert observed[-len(tool_open):] == tool_open
        else:
            assert ep.episode["not_append_only"] == 1 and sum(ep.loss_mask) == len(ep.token_ids)
