"""The agentic CPU recipes: a tiny model learns to use a calculator tool, multi-turn.

``agentic_quickstart``: 2-digit products, one call (reaches issue 23's 0.8). ``agentic_sums``: sums of
2-5 terms, one call per pair (1-5 turns, a long tail of turns: ``tidal bench agentic`` runs it; the tiny
model flattens at ~0.65 there, limited by copying operands)."""

from __future__ import annotations

from tidal.recipes import RECIPES
from tidal.system.config import RunConfig


@RECIPES.register("agentic_quickstart")
def agentic_quickstart() -> RunConfig:
    """Tiny Qwen2 (1M params) multiplies two 2-digit numbers with a calculator tool, async multi-turn RL.

    An episode: ``37*54=`` -> ``<c>37*54</c>`` (a call, ended at ``</c>``) -> ``=1998 `` (the
    calculator's result: observation tokens, never trained on) -> ``1998`` (the answer, ended by EOS;
    reward 1 if it is the product). Without the tool the same model, warm-started 1,000 steps on bare
    answers (``task.params.demos=answer``, ``env.name=null``), solves 0.065 of the 200 held-out products.
    With it, a warm start on correct tool-use episodes (``calculator_call_trace``) stops in
    ``sft.accuracy_band`` [0.3, 0.5], and async RL (64 prompts x 8 episodes per step, lr 2e-4, eta 1)
    takes it to the 0.8 target. ``tidal train agentic_quickstart --set seed=S --set model.init_seed=S
    --set sft.seed=S``, one at a time on an idle 2-core machine (the slow test runs seeds 0 and 1):

    ====  =====  ================================================  ===========  ==================
    seed  base   held-out success at RL step 0 / 10 / 20 / ...     0.8 after    whole command
    ====  =====  ================================================  ===========  ==================
    0     0.335  0.335 / 0.52 / 0.705 / 0.78 / 0.795 / 0.80         50 steps     124 s
    1     0.31   0.31 / 0.67 / 0.805                               20 steps     65 s
    2     0.34   0.34 / 0.38 / 0.525 / 0.695 / 0.825               40 steps     112 s
    ====  =====  ================================================  ===========  ==================

    Median 40 RL steps (80 s) to 0.8, +0.47 over the base; the whole command (warm start included)
    1-2 minutes. The warm start's jump is steep (seed 1: 0.015 at step 80, 0.635 at 90; it goes back
    and stops at step 87, 0.31); an earlier band of [0.35, 0.45] was jumped over in one step by seed 1
    (0.325 -> 0.475). First measured with that band on a machine shared with three other jobs
    (seed 0, base 0.36): 0.36 / 0.57 / 0.765 / 0.785 / 0.805 at steps 0-40, 0.845 at 120.

    Tried first (seed 0, 32 x 8, band [0.3, 0.45], 3-digit x 2-digit products, shared machine): 0.33 /
    0.20 / 0.285 / 0.255 / 0.18 at steps 0-40, 0.31 at 100, 0.615 at 200.
    On the harder 3-digit x 2-digit products (and a base fresh off its jump) the first RL steps undid the
    base and it recovered slowly; the errors left were copies again (an operand's digits swapped,
    ``212*94`` -> ``<c>221*94</c>``; a 4-digit result copied with a doubled digit, ``=6721 `` ->
    ``66721``).
    """
    cfg = agentic_sums()
    cfg.target_accuracy = 0.8  # issue 23's goal (and at least +0.3 over the base)
    cfg.task.name = "product"
    cfg.task.params = {"digits": [2, 2]}
    cfg.env.max_turns = 3  # a call and an answer (one spare turn for a second call)
    cfg.rollout.prompts_per_step = 64  # 32 was noisier for the sums (agentic_sums' table); episodes are short here
    # [0.35, 0.45] was jumped over in one step by seed 1's warm start (0.325 -> 0.475 at step 89)
    cfg.sft.accuracy_band = [0.3, 0.5]
    return cfg


@RECIPES.register("agentic_sums")
def agentic_sums() -> RunConfig:
    """Tiny Qwen2 (1M params) adds 2-5 two-digit numbers with a calculator tool, async multi-turn RL.

    An episode (docs/agentic.md): ``12+34+56=`` -> ``<c>12+34</c>`` -> ``=46 `` -> ``<c>46+56</c>`` ->
    ``=102 `` -> ``102``; the model's turns end at ``</c>`` (a call) or EOS (the answer), the
    calculator's results are observation tokens (never trained on), and the reward is 1 for the right
    final answer. A warm start on correct tool-use traces (``calculator_trace``) stops at a partial
    base; RL takes it from there.

    Measured (2 shared cores, one run each, seed 0; issue 23). Without the tool the same model, warm-
    started 1,000 steps on bare answers (``task.params.demos=answer``, ``env.name=null``), solves 0.06
    of the held-out sums. With it, the warm start reaches the band at 0.315 after 266 steps, and RL:

    ================================  =================================================================
    setting                           held-out success at RL step 0 / 10 / 20 / 30 / ... / 80
    ================================  =================================================================
    32 x 8, lr 2e-4 (this recipe)     0.315 / 0.475 / 0.53 / 0.555 / 0.575 / 0.64 / 0.645 / 0.585 / 0.67
    64 x 8, lr 2e-4                   0.315 / 0.515 / 0.575 / 0.615 (stopped)
    64 x 8, lr 4e-4                   0.315 / 0.26 (stopped)
    32 x 8, lr 6e-4                   0.315 / 0.005 / 0.0 (collapsed)
    32 x 8, ``task.max_terms=4``      0.32 / 0.495 / 0.54 (stopped)
    32 x 8, ``pad_operands=true``     0.45 / 0.54 / 0.58 / 0.595 (stopped)
    ================================  =================================================================

    Issue 23's goal (0.8, and +0.3 over the base) is not met: the curve flattens at ~0.65. A second
    machine session, same recipe for 90 steps: 0.315 / 0.49 / 0.52 / 0.57 / 0.58 / 0.625 / 0.635 /
    0.63 / 0.655 / 0.65 at steps 0-90 (~3.5 s per step). What the policy gets wrong is copying an
    operand from the prompt into a call, and it gets worse with each call: at step 50, 40/40 two-term
    sums were right, 76/80 three-term, 9/41 four-term and 0/39 five-term (the 200 held-out problems
    are 20/40/20/20% by k, ``tasks/arithmetic.py``). The wrong operands mix digits of neighbours: the
    right tens digit with the next operand's units (``65+14+61+89`` -> ``<c>79+69</c>``,
    ``86+89+25+3`` -> ``<c>175+23</c>``), the mark of attention by approximate position in a context
    that grows ~18 tokens per call. Two ways around it that did not work (seed 0):

    - ``pad_operands=true``, 64 x 8, ``sft.accuracy_band=[0.25,0.4]``: 0.255 / 0.325 / 0.35 / 0.43 at
      steps 0-30 (6.6 s per step), behind the recipe per step and per second.
    - ``task.max_terms=3`` (``env.max_turns=4``): 0.30 / 0.55 / 0.705 at steps 0 / 40 / 60, best 0.715,
      0.70 at 100. Three-term sums reach 140/157, but two-term ones fall to 0/43: the policy always
      makes two calls, inventing a second operand for a two-term prompt; once all 8 samples of such a
      prompt fail, its group has zero advantage and gives no gradient, so RL cannot win it back.
    - A later base (``sft.accuracy_band=[0.45,0.55]``, what fixed the addition quickstart's slow seeds):
      the warm start stopped at 0.525 after 270 steps (266 gave 0.315: the jump is steep), and RL went
      0.525 / 0.585 / 0.60 / 0.615 / 0.625 / 0.65 / 0.645 at steps 0-60. The same ~0.65 ceiling from
      a base 0.21 higher: the limit is the 1M model copying operands, not where RL starts.
    Three more that did not work (seed 0, 60-80 steps each; the code for the last two was not kept):
    - A 4x wider model (``model.hidden_size=256``, ``intermediate_size=1024``, ~4M parameters): the
      warm start reached 0.395 after 360 steps, then RL 0.41 / 0.415 at steps 10 / 20, at ~7 s per step
      (3x the recipe's); the warm start alone took ~15 minutes, past the 10-minute budget.
    - Partial credit (a wrong answer earning 0.5 x the share of running sums its calls got right, so
      all-fail groups of long sums still rank their samples): 0.315 / 0.42 / 0.47 / 0.515 / 0.585 /
      0.55 / 0.575 / 0.58 at steps 0-70, no better than the terminal reward.
    - A rewriting trace: before each call the turn rewrites what is left of the sum with the last result
      in front (``<c>65+14</c>=79 79+61+89<c>79+61</c>=140 140+89<c>...``), so later calls copy from the
      line just written. Warm start 211 steps to 0.30; RL 0.40 / 0.46 / 0.49 / 0.54 / 0.545 / 0.575 /
      0.575 / 0.585 at steps 0-80, with 40/40, 75/80, 2/41, 0/39 by k at step 80: the first rewrite
      copied the wrong tail of the prompt (``16+91+32+44`` -> ``107+44+42``), while later rewrites
      copied their own line faithfully. Rewriting every turn, the first included (the prompt copied
      whole; 192 positions): warm start 150 steps to 0.37, RL 0.565 at step 10, then down to 0.47-0.50
      by steps 50-60.

    - One call instead of a chain (``task.name=product``: ``217*56=`` -> ``<c>217*56</c>`` -> ``=12152 ``
      -> ``12152``, ``env.max_turns=3``; issue 23's "3-4 digit multiplication"): warm start 80 steps to
      0.33, then RL 0.33 / 0.20 / 0.285 / 0.255 / 0.18 / 0.18 / 0.245 / 0.28 / 0.24 / 0.26 / 0.31 at
      steps 0-100 and 0.445 / 0.485 / 0.53 / 0.55 / 0.615 at steps 120-200 (345 s of RL on a machine
      shared with three other jobs). The first steps undo the fresh base; the errors left are copies
      again: an operand's digits swapped (``212*94`` -> ``<c>221*94</c>``) and a 4-digit result copied
      with a doubled digit (``=6721 `` -> ``66721``).

    The trainer packs each group's episodes as prefix tries (``trainer.share_prefixes``; same loss
    and gradients): that run took 2.4 s per step against ~3.5 s padded in earlier runs (one run each,
    not side by side).
    """
    cfg = RunConfig()
    cfg.max_steps = 200
    cfg.max_time_s = 480.0
    cfg.target_accuracy = 0.85
    cfg.eval_every = 10
    cfg.checkpoint_every = 50
    cfg.num_eval = 200
    cfg.task.name = "sum_chain"
    cfg.task.max_terms = 5
    cfg.env.name = "calculator"
    cfg.env.max_turns = 6  # 5 terms need 4 calls and an answer
    cfg.rollout.max_new_tokens = 16  # per turn: "<c>123+45</c>" is 13 tokens
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 32
    cfg.rollout.max_staleness = 1
    cfg.optim.lr = 2e-4
    cfg.system.mode = "async"
    cfg.trainer.share_prefixes = True
    cfg.trainer.pack_tokens = 256  # trie nodes per row; a group that does not fit is split (prefix_tree.py)
    return cfg
