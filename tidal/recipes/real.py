"""Recipes on real pretrained chat models from PyPI wheels (``models/catalog.py``): RL on a laptop CPU with the
model a user would bring, not the tiny character model."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("smollm2_quickstart")
def smollm2_quickstart() -> RunConfig:
    """SmolLM2-135M-Instruct from its PyPI wheel: 2-digit addition in its chat template, async RL, ~10 min on CPU.

    The model is imported on first use (``models/catalog.py``); the question is asked in words in the model's
    chat template and the answer scored by ``last_number``.

    The base answers in sentences ("37 + 48 = 85"), so the reward reads the last number of the answer and
    refuses restatements of the question and lists of candidates (``rewards/last_number.py``): the
    ``math`` reward in lenient mode was gamed by this model in 5 steps ("22+13 is 22+13." scored 1.0).

    Settings chosen by measurement (2 cores, one run each, seed 0; held-out greedy accuracy on 200 prompts,
    base 0.16; 40 steps or 480 s of RL, whichever came first; the wording "Answer with just the number."
    took the base from 0.09 to 0.23 on 64 prompts, and made answers shorter: 27 tokens sampled, against 38):

    ==============================  =====  =====  =====  =====  =========
    setting (8 prompts x 8 unless   @10    @20    @30    @40    whole run
    said; temperature 0.7)                                      (minutes)
    ==============================  =====  =====  =====  =====  =========
    lr 1e-5                         0.57   0.655  0.74   0.785  11.0
    **lr 2e-5 (this recipe)**       0.655  0.82   0.79   0.75   8.6
    lr 2e-5, cosine to 0.1x         0.64   0.665  0.69   0.73   8.1
    lr 2e-5, temperature 1.0        0.58   0.69   0.65   0.73   10.7
    lr 1e-5, temperature 1.0        0.585  0.72   0.80   (time) 10.5
    lr 1e-5, 16 prompts x 8         0.665  0.77   (time) (time) 10.1
    ==============================  =====  =====  =====  =====  =========

    Every setting passed base + 0.35 by step 10; lr 2e-5 got there soonest (135 s of RL) and highest. A
    replicate of the same config differed by up to 0.09 at one evaluation (async runs are not bit-for-bit
    repeatable: which version a group is sampled with depends on timing), so the table ranks settings only
    coarsely. Temperature 1.0 keeps entropy higher (0.25 against 0.06-0.1 at step 40) but learns no faster;
    16 prompts per step learns as much per step at twice the seconds per step. Entropy falls from 0.83 to
    ~0.1 by step 40 in every run: the policy settles on "a + b = c." and its remaining errors are carries.

    This recipe over three seeds (``--set seed=S --set task.seed=S``: RL sampling, data order and the held-out
    split; ``tidal train smollm2_quickstart``, 2 cores, one machine):

    ====  =====  =====  =====  =====  =====  ==================  =========
    seed  base   @10    @20    @30    @40    +0.35 reached       whole run
    ====  =====  =====  =====  =====  =====  ==================  =========
    0     0.160  0.63   0.73   0.74   0.755  step 10, 127 s RL   9.8 min
    1     0.135  0.645  0.675  0.67   0.71   step 10, 173 s RL   9.3 min
    2     0.170  0.55   0.60   0.67   0.745  step 10, 148 s RL   8.6 min
    ====  =====  =====  =====  =====  =====  ==================  =========

    Median gain +0.575 (0.575-0.595). Every greedy answer of the last evaluation was re-checked by
    ``benchmarks/real.py``'s independent check (the last number equals the sum and is no operand, and the
    final statement states no other value): 0 of the 142-151 answers ``last_number`` scored 1 were rejected.
    """
    cfg = RunConfig()
    cfg.model.path = "smollm2-135m-instruct"
    cfg.task.name = "addition"
    cfg.task.template = "What is {a} + {b}? Answer with just the number."
    cfg.task.params = {"min_operand": 10}  # both operands two-digit: 8,100 problems
    cfg.task.num_eval = 200
    cfg.reward.name = "last_number"
    cfg.max_steps = 40
    cfg.max_time_s = 480.0
    cfg.eval_every = 10
    cfg.checkpoint_every = 10
    cfg.rollout.max_new_tokens = 48
    cfg.rollout.temperature = 0.7
    cfg.trainer.temperature = 0.7
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 8
    cfg.rollout.max_staleness = 1
    cfg.optim.lr = 2e-5
    cfg.system.mode = "async"
    # A group's 8 samples share a ~40-token chat prompt (the template's system prompt included): computed
    # once per group in the trainer.
    cfg.trainer.share_prefixes = True
    cfg.log.samples.eval_prompts = cfg.task.num_eval  # every greedy answer recorded: read them for reward hacking
    return cfg
