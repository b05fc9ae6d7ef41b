import pytest

from tidal.cli import main
from tidal.models import tiny
from tidal.stages import synthetic
from tidal.stages.chat_data import GENERATION_CHAT_TEMPLATE

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
MODEL = [x for k, v in SMALL.items() for x in ("--set", f"model.{k}={v}")]
"""``SMALL`` as the command line's ``--set model.KEY=VALUE`` flags."""


def run_cli(capsys, *argv):
    """``tidal ARGV`` in-process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def domain(tmp_path_factory):
    """A small synthetic chat domain (40 SFT rows, 40 pairs, 10 held out), built once per test module."""
    return synthetic.build(tmp_path_factory.mktemp("dom"), num_sft=40, num_pairs=40, num_eval=10)


@pytest.fixture
def chat_tok():
    tok = tiny.build_chat_tokenizer()
    tok.chat_template = GENERATION_CHAT_TEMPLATE
    return tok
