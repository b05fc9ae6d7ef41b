"""``tidal bench generate``'s speculative arms: the local engine with and without speculative decoding.

Per task, two engines on the same model, requests and sampling (temperature 1), differing only in
``rollout.speculative``: ``plain`` and ``speculative``. Both are warmed up, then take turns ``rounds``
times (round robin, so a load change on this shared machine hits both alike); the ratio of their
median new tokens per second is ``speculative_over_plain[task]``. Every round checks the samples are
the same (``speculative_identical[task]``: tokens of every trajectory equal) and records the draft
acceptance (``acceptance_rate[task]``).

Tasks, each from its recipe's warm-started tiny base (cached under ``.tidal_cache``):
- ``repeat``: answers are a character repeated n times: prompt lookup's best case (Saxena 2023).
- ``agentic``: ``agentic_quickstart`` episodes (``37*54=`` -> ``<c>37*54</c>`` -> ``=1998 `` -> ``1998``):
  the call copies the operands from the prompt and the answer copies the tool's result. Only the
  policy's sampled tokens count (not the observations); tools answer at once (no simulated latency).
- ``quickstart``: the quickstart's arithmetic answers, where drafts rarely match: what speculation costs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from tidal.config import apply_overrides

TASK_RECIPES = {
    "repeat": ("quickstart_grpo", ["task.name=repeat", "task.max_repeat=48", "task.num_eval=200", "sft.steps=300",
                              "sft.accuracy_band=null", "rollout.max_new_tokens=56"]),
    "agentic": ("agentic_quickstart", []),
    "quickstart": ("quickstart_grpo", []),
}


def _setup(task_name: str, num_prompts: int, seed: int):
    from tidal.models import tiny
    from tidal.recipes import RECIPES
    from tidal.system.run import base_model_path, env_factory, sampling_for
    from tidal.tasks import TASKS

    recipe, overrides = TASK_RECIPES[task_name]
    cfg = apply_overrides(RECIPES.get(recipe)(), [*overrides, f"seed={seed}"])
    task = TASKS.get(cfg.task.name)(cfg.task)
    model, tokenizer = tiny.load(base_model_path(cfg, task, progress=False))
    make_env = env_factory(cfg)
    prompts = [task.train_prompt(i) for i in range(num_prompts)]
    return cfg, model.eval(), tokenizer, make_env, sampling_for(cfg, make_env), prompts


class SpecArm:
    """One task's engine (an EpisodeEngine around it for agent tasks), with or without speculation."""

    def __init__(self, task_name, cfg, model, tokenizer, make_env, sampling, requests, spec, batch_size):
        from tidal.rollout.local import LocalEngine
        from tidal.system.run import with_episodes

        sampling = dataclasses.replace(sampling, speculative=spec, max_batch_size=batch_size)
        self.local = LocalEngine(model, tokenizer, sampling, seed=cfg.seed)
        self.engine = with_episodes(self.local, cfg, tokenizer, make_env)
        self.requests = requests

    def __call__(self, requests=None) -> int:
        self.trajs = self.engine.generate(requests or self.requests)
        return sum(sum(t.loss_mask) if t.loss_mask is not None else t.num_tokens for t in self.trajs)

    def warm_up(self) -> None:
        self(self.requests[:64])


def run_speculative(s) -> dict:
    """The speculative arms of every task in ``s.speculative_tasks``; ``s`` is generate.py's Settings."""
    from tidal.rollout.requests import group_requests
    from tidal.rollout.speculative import SpeculativeConfig

    spec = SpeculativeConfig(method=s.speculative_method, num_draft_tokens=s.num_draft_tokens)
    out: dict[str, dict] = {"speculative_over_plain": {}, "acceptance_rate": {}, "speculative_identical": {},
                            "speculative_table": []}
    for task_name in s.speculative_tasks:
        cfg, model, tokenizer, make_env, sampling, prompts = _setup(task_name, s.speculative_prompts, s.seed)
        requests = group_requests(tokenizer, prompts, s.group_size)
        arms = {name: SpecArm(task_name, cfg, model, tokenizer, make_env, sampling, requests, c, s.speculative_batch)
                for name, c in (("plain", SpeculativeConfig()), ("speculative", spec))}
        for arm in arms.values():
            arm.warm_up()
        arms["speculative"].local.stats()  # open the acceptance window after the warm-up
        times = {name: [] for name in arms}
        tokens, identical = {}, True
        for _ in range(s.rounds):
            for name, arm in arms.items():
                start = time.perf_counter()
                tokens[name] = arm()
                times[name].append(time.perf_counter() - start)
            identical &= all(a.token_ids == b.token_ids for a, b in zip(arms["plain"].trajs, arms["speculative"].trajs))
        stats = arms["speculative"].local.stats()
        rate = {name: tokens[name] / statistics.median(times[name]) for name in arms}
        out["speculative_over_plain"][task_name] = rate["speculative"] / rate["plain"]
        out["acceptance_rate"][task_name] = stats["rollout/spec_acceptance"]
        out["speculative_identical"][task_name] = identical
        for name in arms:
            out["speculative_table"].append({
                "task": task_name, "arm": name, "samples": len(requests), "new_tokens": tokens[name],
                "seconds": statistics.median(times[name]), "new_tokens_per_s": rate[name],
                "times_s": times[name],
                **({"acceptance": stats["rollout/spec_acceptance"],
                    "tokens_per_forward": stats["rollout/spec_tokens_per_forward"]} if name != "plain" else {})})
    return out
