import pytest

from tidal.models import tiny
from tidal.stages.chat_data import GENERATION_CHAT_TEMPLATE

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)


@pytest.fixture
def chat_tok():
    tok = tiny.build_chat_tokenizer()
    tok.chat_template = GENERATION_CHAT_TEMPLATE
    return tok
