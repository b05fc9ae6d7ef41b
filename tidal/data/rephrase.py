"""Rephrasing: rewrite documents with a language model through tidal's rollout engine (WRAP, Maini et
al. 2024, arXiv 2401.16380: rephrasing web text "like Wikipedia" or as question-answer pairs trains
models faster than the raw text; Nemotron-CC, Su et al. 2024, arXiv 2412.02595, rewrites
low-quality documents and generates diverse QA, distillations and knowledge lists from high-quality
ones). Each kept row becomes a new row: ``{text: the rewrite, source: {row, id}, template: name}``
(``row``: the source's 1-based line number in the input; ``keep_original`` adds the original text),
so every synthetic document names where it came from.

Built-in templates follow those papers' styles; ``rephrase.template`` takes any text with a
``{text}`` slot instead. ``chat=true`` wraps the prompt in the model's chat template (instruction
models); the default feeds the raw prompt (base models, and tidal's tiny test models).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal.data.dedup import text_of
from tidal.data.io import Row
from tidal.data.pipeline import Block
from tidal.models import prompts

TEMPLATES = {
    "wikipedia": "For the following paragraph give me a paraphrase of the same in high-quality English language "
                 "as in sentences on Wikipedia:\n{text}\n",
    "qa": "Convert the following paragraph into a conversational format with multiple tags of \"Question:\" "
          "followed by \"Answer:\":\n{text}\n",
    "simple": "For the following paragraph give me a paraphrase of the same using a very small vocabulary and "
              "extremely simple sentences that a toddler will understand:\n{text}\n",
    "knowledge_list": "Review the text and extract the key information as a concise list of facts:\n{text}\n",
}


@dataclass
class RephraseConfig:
    model: str = ""
    """A local Hugging Face model directory (model + tokenizer)."""
    template: str = "wikipedia"
    """A name in ``TEMPLATES`` or a text with a ``{text}`` slot."""
    max_new_tokens: int = 256
    temperature: float = 0.7
    """0: greedy."""
    chat: bool = False
    max_input_chars: int = 4000
    """Longer documents are cut here before rephrasing (WRAP rephrases ~300-token chunks)."""
    keep_truncated: bool = False
    """Keep rewrites that hit ``max_new_tokens`` (usually cut mid-sentence)."""
    keep_original: bool = False
    problems_per_batch: int = 64
    seed: int = 0


class Rephrase(Block):
    name = "rephrase"
    parallel = False

    def __init__(self, cfg: RephraseConfig, text_key: str = "text"):
        from tidal.config import ConfigError
        from tidal.models import tiny
        from tidal.rollout.local import LocalEngine, SamplingConfig

        if not cfg.model or not Path(cfg.model, "config.json").exists():
            raise ConfigError(f"rephrase needs rephrase.model=DIR with a Hugging Face model (got {cfg.model!r})")
        template = TEMPLATES.get(cfg.template, cfg.template)
        if "{text}" not in template:
            raise ConfigError(f"rephrase.template must be one of {', '.join(TEMPLATES)} or contain {{text}}")
        self.cfg, self.text_key, self.template = cfg, text_key, template
        self.template_name = cfg.template if cfg.template in TEMPLATES else "custom"
        model, self.tokenizer = tiny.load(cfg.model)
        sampling = SamplingConfig(temperature=cfg.temperature or 1.0, max_new_tokens=cfg.max_new_tokens)
        self.engine = LocalEngine(model, self.tokenizer, sampling, seed=cfg.seed)
        self.position = 0

    def _request(self, text: str, index: int):
        from tidal.api import GenRequest
        from tidal.types import Prompt

        prompt = self.template.format(text=text[: self.cfg.max_input_chars])
        ids = (prompts.chat_ids if self.cfg.chat else prompts.plain_ids)(self.tokenizer, prompt)
        return GenRequest(Prompt(f"rephrase-{index}", prompt, ""), tuple(ids), 0)

    def prepare_chunk(self, rows: list[Row]) -> list:
        """(rewrite, finish_reason) per row; None for rows without text."""
        out: list = [None] * len(rows)
        todo = [(i, t) for i, row in enumerate(rows) if (t := text_of(row, self.text_key))]
        step = self.cfg.problems_per_batch
        for start in range(0, len(todo), step):
            part = todo[start : start + step]
            reqs = [self._request(t, self.position + i) for i, t in part]
            trajs = self.engine.generate(reqs, greedy=self.cfg.temperature == 0)
            for (i, _), traj in zip(part, trajs):
                out[i] = (traj.text.strip(), traj.finish_reason)
        self.position += len(rows)
        return out

    def decide(self, row: Row, prepared) -> str | None:
        if prepared is None:
            return f"no_{self.text_key}"
        text, finish = prepared
        if not text:
            return "empty_rewrite"
        if finish == "length" and not self.cfg.keep_truncated:
            return "truncated_rewrite"
        return None

    def transform(self, row: Row, prepared) -> Row:
        text, _ = prepared
        new = {"text": text, "source": {"row": self.row_number, "id": row.get("id")}, "template": self.template_name}
        if self.cfg.keep_original:
            new["original"] = row[self.text_key]
        return new
