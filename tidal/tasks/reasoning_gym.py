"""``reasoning_gym``: any of reasoning-gym's procedurally generated datasets as a task, offline.

reasoning-gym (Stojanovski et al. 2025, arXiv 2505.24760) generates verifiable problems from a
seed: no download, any size. ``task.params.dataset`` names one (``tidal`` lists them in
docs/tasks.md; ``python -c "import reasoning_gym.factory as f; print(sorted(f.DATASETS))"``),
``task.params.size`` is the number of training problems, and every other key of ``task.params`` goes
to the dataset's config (e.g. ``min_terms``; ``composite`` takes ``datasets: [{name, weight, config}]``).

The task generates ``size + num_eval`` entries and holds out ``num_eval`` by a hash of the question
text (as the file adapters do), so problems that repeat in a small problem space never straddle the
split. Each prompt keeps the entry's ``metadata`` (and its question) in ``Prompt.meta``: the
``reasoning_gym`` reward (``tidal/rewards/reasoning_gym.py``) scores with the dataset's own
``score_answer`` from it. Entries whose answer is None (puzzles with many valid answers, which the
scorer checks against the metadata) have an empty ``Prompt.answer`` and no SFT example.
"""

from __future__ import annotations

from typing import Any

from tidal.config import ConfigError
from tidal.tasks import TASKS
from tidal.tasks.config import FieldMap, TaskConfig
from tidal.tasks.rows import RowTask, numbered, parse_rows, split_eval
from tidal.types import Prompt

DEFAULT_SIZE = 1000


def generate(dataset: str, size: int, seed: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    """``size`` entries ``{question, answer, metadata}`` of reasoning-gym dataset ``dataset``."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError("task reasoning_gym needs the reasoning-gym package: pip install 'tidal[reasoning-gym]'"
                          ) from None
    if dataset not in DATASETS:
        import difflib

        close = difflib.get_close_matches(dataset, DATASETS, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ConfigError(f"task.params.dataset={dataset!r} is not a reasoning-gym dataset{hint} "
                          f"({len(DATASETS)} exist)")
    if dataset == "composite" and "datasets" in config:
        from reasoning_gym.composite import DatasetSpec

        config = {**config, "datasets": [DatasetSpec(d["name"], float(d.get("weight", 1.0)), d.get("config", {}))
                                         for d in config["datasets"]]}
    try:
        ds = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"reasoning-gym {dataset!r} with config {config}: {e}") from None
    return [ds[i] for i in range(size)]


def entry_row(entry: dict[str, Any], lowercase: bool = False) -> dict[str, Any]:
    """A reasoning-gym entry as a row for the field mapping: ``answer`` None becomes "" (no reference).
    ``lowercase``: the prompt text in lower case (``prompt``), the scorer still sees the entry's own question."""
    answer = entry["answer"]
    return {"question": entry["question"], "answer": "" if answer is None else str(answer),
            "metadata": entry["metadata"], "prompt": entry["question"].lower() if lowercase else entry["question"]}


@TASKS.register("reasoning_gym")
class ReasoningGymTask(RowTask):
    """A reasoning-gym dataset (see the module docstring)."""

    name = "reasoning_gym"

    def __init__(self, cfg: TaskConfig):
        params = dict(cfg.params)
        dataset = params.pop("dataset", None)
        if not dataset:
            raise ConfigError("task reasoning_gym needs task.params.dataset (e.g. basic_arithmetic)")
        size, seed = params.pop("size", DEFAULT_SIZE), params.pop("seed", cfg.seed)
        # For a character vocabulary without capitals (the tiny model's): questions start "Calculate ...".
        lowercase = params.pop("lowercase", False)
        if not isinstance(lowercase, bool):
            raise ConfigError(f"task.params.lowercase={lowercase!r}: must be true or false")
        for key, value in (("size", size), ("seed", seed)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "size" else 0):
                raise ConfigError(f"task.params.{key}={value!r}: must be a whole number >= {1 if key == 'size' else 0}")
        entries = generate(dataset, size + cfg.num_eval, seed, params)
        source = f"task reasoning_gym ({dataset})"
        # The mapping is fixed (reasoning-gym's entry layout); the template may use {prompt} (the text the model
        # reads) or {question} (the entry's own, which the scorer reads from meta).
        fields = FieldMap(prompt="prompt", answer="answer", solution=None, meta=["question", "metadata"])
        rows = (entry_row(e, lowercase) for e in entries)
        loaded = parse_rows(numbered(rows), fields, cfg.template, source)
        train, evals = split_eval(loaded.prompts, cfg, source)
        super().__init__(cfg, train, evals, skipped=len(loaded.skipped))
        self.dataset = dataset

    def sft_example(self, prompt: Prompt) -> str:
        """The entry's answer: what the reward extracts from a response without <answer> tags."""
        if not prompt.answer:
            raise ConfigError(f"reasoning-gym {self.dataset!r} has no reference answers (many answers are valid), "
                              "so it cannot be warm-started; point model.path at an existing model")
        return prompt.answer
