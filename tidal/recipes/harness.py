"""The harness CPU recipe: an agent written against the ``openai`` client, trained through tidal's endpoint."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("harness_quickstart")
def harness_quickstart() -> RunConfig:
    """Tiny Qwen2 (1M params) + ``examples/calculator_agent.py`` (OpenAI function calling): 2-digit products.

    An episode (``examples/calculator_agent.py``, written only against the ``openai`` client): the agent
    sends ``37*54=`` with one tool in the OpenAI ``tools`` schema; the model's first turn is a hermes call
    ``<tool_call>{"name":"calculator","arguments":{"expression":"37*54"}}</tool_call>`` (59 sampled
    tokens with its end-of-turn marker), which the server returns as ``tool_calls``; the agent runs the
    tool and sends the result back as a ``tool`` message; the model answers ``1998``; the agent returns
    1.0 if that is the product. The tiny model uses the chat tokenizer (``model.tokenizer=chat``) and is
    warm-started on synthetic conversations of that agent (``task.params.demos=chat_tool``) until its
    held-out success is in [0.3, 0.5].

    Measured (operands 0-99 then, 10-99 since the task took ``task.params.digits``; seed 0, 2 CPU
    cores shared with other jobs at a load average of 7-10; wall-clock numbers
    are contention-bound): the warm start stopped at 0.40 held-out success after 280 steps (success
    0.0-0.02 up to step 240, then 0.065 / 0.09 / 0.2 / 0.4 at steps 250-280: the usual steep jump).
    RL through the endpoint, async, 32 tasks x 8 episodes per step:

    ===================  ===============  ===============  ===============  ====================
    run                  held-out step 0  step 10          step 20          s per step (load)
    ===================  ===============  ===============  ===============  ====================
    seed 0, first run    0.40             0.505            (stopped)        10-21 (~7)
    seed 0, second run   0.40             0.555 (273 s)    0.56 (437 s)     7-45 (~10)
    ===================  ===============  ===============  ===============  ====================

    Two runs of one seed differ because async batches depend on timing. Sampled (temperature 1)
    success is far below greedy: 0.03-0.12 per step against 0.40-0.55 held out, since any of the call's
    59 sampled tokens can break it; most groups are all-fail and give no gradient. What the held-out
    failures get wrong is a copied digit (``74*92=`` -> ``"75*92"``, or the tool's ``1984`` answered
    as ``1964``). **Not yet measured**: the 0.8 target within 10 minutes (the runs above were stopped
    after 12 and 22 steps for lack of CPU; at this rate 0.8 is not
    within reach in 10 minutes: the recipe needs tuning, e.g. a higher base or a lower temperature),
    a second seed, and the model's success without the tool
    (``task.params.demos=answer``, ``harness.function=null``, ``model.tokenizer=char``). A warm-start
    band of [0.55, 0.7] (sharper turns, higher sampled success) was tried and not finished: after a
    replay the warm start checks every step, and each check is 200 agent episodes through HTTP.
    """
    cfg = RunConfig()
    cfg.max_steps = 200
    cfg.max_time_s = 540.0
    cfg.target_accuracy = 0.8
    cfg.eval_every = 10
    cfg.checkpoint_every = 50
    cfg.num_eval = 200
    cfg.task.name = "product"
    cfg.task.params = {"demos": "chat_tool"}  # digits [2, 2]: 10-99 times 10-99
    cfg.task.num_eval = 200
    cfg.model.tokenizer = "chat"
    cfg.model.max_position_embeddings = 192
    cfg.sft.accuracy_band = [0.3, 0.5]
    cfg.harness.function = "examples/calculator_agent.py:run_episode"
    cfg.rollout.max_new_tokens = 32  # per turn: the call is 18 tokens with its end-of-turn marker
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 64  # 32 moved 0.50 -> 0.565 in 10 steps, 64 -> 0.64 (seed 0)
    cfg.rollout.max_staleness = 1
    cfg.optim.lr = 2e-4
    cfg.system.mode = "async"
    return cfg
