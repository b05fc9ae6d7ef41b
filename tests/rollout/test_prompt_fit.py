"""Prompts that cannot fit the model are one clear error before any work (issue 21, item 8)."""

import json
import subprocess
import sys

import pytest

from tidal.config import ConfigError
from tidal.rollout.requests import check_prompts_fit
from tidal.types import Prompt


def rows(*texts):
    return [(f"train prompt {i}", Prompt(f"u{i}", t, "1")) for i, t in enumerate(texts)]


def test_prompts_that_fit_pass_and_are_counted(tokenizer):
    assert check_prompts_fit(tokenizer, rows("12+34=", "99+1="), context=16, max_new_tokens=6) == 2
    # 9 prompt tokens + BOS + 6 new tokens = 16: exactly the context
    assert check_prompts_fit(tokenizer, rows("123456789"), context=16, max_new_tokens=6) == 1


def test_a_prompt_longer_than_the_context_names_its_row_and_the_keys(tokenizer):
    with pytest.raises(ConfigError, match=r"train prompt 1: the prompt is 10 tokens.*max_new_tokens=6.*context of 16"):
        check_prompts_fit(tokenizer, rows("1+1=", "1234567890"), context=16, max_new_tokens=6, chunk=1)
    with pytest.raises(ConfigError, match="leaves no room"):
        check_prompts_fit(tokenizer, rows("1"), context=6, max_new_tokens=6)


def test_characters_outside_the_vocabulary_are_named(tokenizer):
    with pytest.raises(ConfigError, match=r"train prompt 0: .*cannot encode: \['!', 'É'\]"):
        check_prompts_fit(tokenizer, rows("É1+1=!"), context=64, max_new_tokens=4)


def test_train_names_a_long_jsonl_row_in_one_line_before_the_warm_start(tmp_path):
    data = tmp_path / "rows.jsonl"
    good = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)]
    data.write_text("".join(json.dumps(r) + "\n" for r in [*good, {"prompt": "1+" * 200 + "1=", "answer": "201"}]))
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "train", "quickstart", "--out", str(tmp_path / "run"),
         "--set", "task.name=jsonl", "--set", f"task.path={data}", "--set", "task.num_eval=4",
         "--set", "task.fields.solution=answer", "--set", f"sft.cache_dir={tmp_path / 'cache'}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "is 402 tokens" in lines[0] and "model.max_position_embeddings" in lines[0], lines[0]
    assert not (tmp_path / "cache").exists()  # refused before the warm start
