"""The warm-start cache: keyed by what the model is trained on, not only by the config."""

import json

from tidal.models.tiny import ModelConfig
from tidal.stages.warm_start import SFTConfig, cache_path
from tidal.tasks import TASKS
from tidal.tasks.config import FieldMap, TaskConfig


def _task(path):
    cfg = TaskConfig(name="jsonl", path=str(path), num_eval=2, fields=FieldMap(solution="answer"))
    return cfg, TASKS.get("jsonl")(cfg)


def test_changing_a_data_file_in_place_changes_the_cache_key(tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, sft = ModelConfig(), SFTConfig(cache_dir=str(tmp_path / "cache"))
    cfg, task = _task(path)
    first = cache_path(model, cfg, sft, task)
    assert cache_path(model, cfg, sft, _task(path)[1]) == first  # same data: the same cached base
    path.write_text("".join(json.dumps({**r, "prompt": "q: " + r["prompt"]}) + "\n" for r in rows))
    assert cache_path(model, cfg, sft, _task(path)[1]) != first  # same path and config, new contents


def test_a_tokenizer_vocabulary_changed_in_code_changes_the_cache_key(tmp_path, monkeypatch):
    from tidal.models import char_tokenizers

    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20)))
    model, sft = ModelConfig(tokenizer="chat"), SFTConfig(cache_dir=str(tmp_path / "cache"))
    cfg, task = _task(path)
    first = cache_path(model, cfg, sft, task)
    assert cache_path(model, cfg, sft, task) == first
    monkeypatch.setattr(char_tokenizers, "CHAT_WORDS", char_tokenizers.CHAT_WORDS[:-1])  # one chat token fewer
    assert cache_path(model, cfg, sft, task) != first


def test_a_demonstration_changed_in_code_changes_the_cache_key(tmp_path, monkeypatch):
    """The same prompts and answers but other demonstrations (a demo function, a tool renamed, a system
    prompt reworded in an environment) train another base: it must not reuse the old one."""
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20)))
    model, sft = ModelConfig(), SFTConfig(cache_dir=str(tmp_path / "cache"))
    cfg, task = _task(path)
    first = cache_path(model, cfg, sft, task)
    demo = type(task).sft_example
    monkeypatch.setattr(type(task), "sft_example", lambda self, p: "so " + demo(self, p))
    assert cache_path(model, cfg, sft, task) != first
