"""``rollout.speculative`` checked with the run config, before any work (issue 50, item 13): the engine checked
it only when it was built, after the warm start, and a draft model path the hub client could not parse came
back in the library's words, without the key."""

import re

import pytest

from tidal.config import ConfigError, apply_overrides
from tidal.recipes import RECIPES
from tidal.system.validate import validate_run_config


@pytest.mark.parametrize("sets, message", [
    (["rollout.speculative.method=draft_model", "rollout.speculative.draft_model=no/such/draft/model"],
     "rollout.speculative.draft_model='no/such/draft/model': no Hugging Face model directory there (config.json)"),
    (["rollout.speculative.method=draft_model"],
     "rollout.speculative.draft_model: method=draft_model needs a model directory"),
    (["rollout.speculative.method=ngram", "rollout.speculative.num_draft_tokens=0"],
     "rollout.speculative.num_draft_tokens=0: must be >= 1"),
    (["rollout.speculative.method=eagle"], "rollout.speculative.method='eagle': expected one of"),
])
def test_speculative_keys_are_checked_with_the_run_config(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_run_config(apply_overrides(RECIPES.get("quickstart")(), sets))


def test_a_draft_model_the_loader_cannot_read_names_the_key(tmp_path):
    """A folder without a model (here: empty) was transformers' "Unrecognized model in ..." ValueError."""
    import torch

    from tidal.rollout.speculative import load_draft_model

    for path in (str(tmp_path), "a/b/c"):
        with pytest.raises(ConfigError) as e:
            load_draft_model(path, torch.float32, torch.device("cpu"))
        assert str(e.value).startswith(f"rollout.speculative.draft_model={path!r}: not a loadable model directory")
        assert len(str(e.value).splitlines()) == 1
