"""A RolloutEngine that answers from a script instead of a model: each request's completion is
``script(context_text)``, tokenized and ended with EOS. For tests that need fixed completions to come
through the real server (the verifiers bridge's equal-rewards proof); no model, no sampling."""

from __future__ import annotations

from tidal.rollout.requests import generate_by_stream
from tidal.types import Trajectory


class ScriptedEngine:
    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.contexts: list[str] = []  # every context it was asked to continue, in order

    def stream(self, source, on_done, greedy: bool = False) -> None:
        while True:
            got = source(16, True)
            if got is None:
                return
            for request in got:
                context = self.tokenizer.decode(list(request.prompt_ids))
                self.contexts.append(context)
                text = self.script(context)
                ids = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
                on_done(request, Trajectory(request.prompt.uid, request.sample_index, list(request.prompt_ids), ids,
                                            [-0.25] * len(ids), [0] * len(ids), "stop", text=text))

    def generate(self, requests, greedy: bool = False):
        return generate_by_stream(self.stream, requests, greedy)

    def request_weight_update(self, state_dict, version: int) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}
