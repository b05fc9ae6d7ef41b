"""A chat tokenizer (one token per character, ChatML markers as specials) and tiny models for the
server tests: an untrained one, and one trained in the fixture to call the calculator in hermes
format and then answer, so a tool-call round trip happens with the real engine and weights."""

from __future__ import annotations

import pytest
import torch

from tidal.models import tiny

from ..rollout.chat_fixture import PRINTABLE_CHARS, chat_tokenizer

TINY = tiny.ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
QUESTION = "add 2 and 3"


@pytest.fixture(scope="session")
def chat_tok():
    return chat_tokenizer(chars=PRINTABLE_CHARS)


@pytest.fixture(scope="session")
def random_model(chat_tok):
    torch.manual_seed(0)
    return tiny.build_model(TINY, chat_tok)


CONVERGED = 2.5e-4
"""Mean per-token loss the fixture trains down to: 4x below the 1e-3 its tests need, so float rounding on another
CPU cannot leave it on the wrong side (a fixed 300 steps ended at 0.00102 on one AMD machine, 0.00099 here)."""


@pytest.fixture(scope="session")
def tool_model(chat_tok):
    """Trained to convergence on one conversation: the hermes call, then the answer after the result. Trains
    until the loss is under ``CONVERGED`` (about 650 steps), capped at 3,000."""
    torch.manual_seed(0)
    model = tiny.build_model(TINY, chat_tok)
    text = chat_tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": TOOL_CALL},
         {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}], tokenize=False)
    ids = torch.tensor([chat_tok(text, add_special_tokens=False).input_ids])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3000):
        loss = model(input_ids=ids, labels=ids).loss
        if loss.item() < CONVERGED:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 1e-3, f"the tool-calling fixture did not converge (loss {loss.item():.4f})"
    return model.eval()
