import pytest

from tidal.config import ConfigError
from tidal.data.curate import curate
from tidal.data.io import read_rows, write_rows
from tidal.data.pipeline import Pipeline
from tidal.data.rephrase import Rephrase, RephraseConfig


@pytest.fixture(scope="module")
def model_dir(small_model_dir):
    return small_model_dir


ROWS = [{"id": "a", "text": "one plus one"}, {"id": "b", "text": "two"}, {"id": "c"}, {"id": "d", "text": "four"}]


def test_rewrites_name_their_source_and_are_reproducible(model_dir):
    cfg = RephraseConfig(model=str(model_dir), template="q: {text}\na:", max_new_tokens=6, keep_truncated=True,
                         keep_original=True)
    p = Pipeline([Rephrase(cfg)])
    out = list(p.run(ROWS))
    assert [o["source"] for o in out] == [{"row": 1, "id": "a"}, {"row": 2, "id": "b"}, {"row": 4, "id": "d"}]
    assert all(o["template"] == "custom" and isinstance(o["text"], str) for o in out)
    assert [o["original"] for o in out] == ["one plus one", "two", "four"]
    assert p.report()["blocks"][0]["dropped"] == {"no_text": 1}
    again = list(Pipeline([Rephrase(cfg)]).run(ROWS))
    assert again == out  # the engine keys its noise by row position: same rewrites


def test_truncated_rewrites_are_dropped_unless_asked_and_recipe_runs(model_dir, tmp_path):
    write_rows(tmp_path / "docs.jsonl", ROWS)
    report = curate("rephrase", tmp_path / "docs.jsonl", tmp_path / "out.jsonl",
                    [f"rephrase.model={model_dir}", "rephrase.max_new_tokens=2"],
                    progress=False)
    block = report["blocks"][0]
    assert block["seen"] == 4 and block["kept"] + sum(block["dropped"].values()) == 4
    assert block["dropped"].get("truncated_rewrite", 0) + block["kept"] == 3
    assert len(list(read_rows(tmp_path / "out.jsonl"))) == block["kept"]


def test_bad_template_and_missing_model_are_clear(model_dir):
    with pytest.raises(ConfigError, match="rephrase.model"):
        Rephrase(RephraseConfig(model=""))
    with pytest.raises(ConfigError, match="text"):
        Rephrase(RephraseConfig(model=str(model_dir), template="no slot"))
