"""One device, three numbers: trainer MFU, engine speed vs Hugging Face ``generate``, and where an RL step's time goes.

Runs on whatever device is present (``--set device=cpu`` forces the CPU). On CUDA the model has
Qwen2.5-0.5B's exact shapes (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151,936,
tied embeddings, rope theta 1e6), built locally with random weights (no hub); on CPU a small stand-in
(hidden 128, 2 layers, vocab 4,096) and smaller workloads (``CPU_DEFAULTS``), so every code path runs in
seconds and the JSON says ``"model": "...stand-in..."`` and ``"on_cpu": true`` (the log: ON CPU);
``--set tiny=true`` shrinks everything to toy sizes (``TINY_DEFAULTS``). Each part catches its own failure
(the error string goes under its key) so one part's crash never loses the others' numbers.

1. ``train``: tidal's ``Trainer`` (fp32 master weights, ``trainer.precision`` bf16 autocast on CUDA, packed
   rows of ``pack_tokens``) on groups of ``group_size`` samples sharing a ``prompt_len``-token prompt, with
   response lengths n ~ 1/n up to ``max_response`` (the long tail of reasoning traces, as in
   ``benchmarks/packing.py``), random token ids and rewards that vary inside every group. One warm-up step,
   then ``train_steps`` timed steps (synchronized). MFU = model FLOPs per second / peak, with

       FLOPs per step = 6 * N * tokens + 12 * layers * d_attn * sum_seq L (L + 1) / 2

   - 6N per token: a forward costs 2 FLOPs per parameter per token and the backward twice that (Kaplan et
     al. 2020, arXiv 2001.08361, sec. 2.1; PaLM, arXiv 2204.02311, appendix B: 6N + 12 L H Q T). N counts
     every parameter outside the input embedding plus the LM head's V x h matmul, which runs on every token
     even when it is tied to the embedding (Chinchilla, arXiv 2203.15556, appendix F, counts the logits).
   - Attention: per layer and token, QK^T and AV cost 2 * d_attn FLOPs each per attended key, so 4 d_attn
     ctx forward and 12 d_attn ctx with the backward (PaLM's 12 L H Q T). Packed sequences attend only
     within themselves and causally, so the attended keys of a length-L sequence sum to L (L + 1) / 2
     exactly (PaLM's T counts the whole window; we count what the causal mask keeps).
   - What is not counted (model FLOPs, not hardware FLOPs): the LM-head recomputation of the chunked fp32
     log-prob head (``models/logprobs.py`` recomputes each chunk in the backward), norms, softmaxes,
     entropies, the optimizer. The head runs in float32 there (MiniMax-M1's fix), not bf16: at a 152k
     vocabulary it is ``head_flops_frac`` of the FLOPs, so ``matmul_tflops_measured_fp32`` is reported too.
   - One forward and one backward per step: with the default ``AlgoConfig`` (one minibatch, no KL, no
     reference model) ``Trainer.step`` takes pi_prox from the training forward itself (``logp.detach()``),
     so no extra scoring pass runs. A hook counts the decoder's forwards and the part asserts there is
     exactly one per micro-batch, so a changed trainer cannot silently make the FLOP count wrong.
   Peaks: the bf16 dense datasheet figure for the detected GPU (``_roofline.DATASHEET_BF16_TFLOPS``; None when
   the name is not in the table, and on CPU) and a measured one, the median of timed ``matmul_size``^3 matmuls
   in the autocast dtype (about 790 TFLOP/s on an H100 or H200, FACTS.md). ``trainer_mfu`` uses the
   datasheet peak (the measured one where there is none, as on a CPU: ``trainer_mfu_peak`` says which),
   ``trainer_mfu_vs_measured_matmul`` the measured one.

2. ``generate``: the same model in the engine dtype (bf16 on CUDA) in tidal's ``LocalEngine`` and in Hugging
   Face's ``model.generate`` (``do_sample``, temperature 1, no top-k/top-p, as the engine samples), on the
   same ``gen_prompts`` x ``gen_group_size`` requests of ``gen_prompt_len`` random tokens. Each request has
   its own budget n ~ 1/n up to ``gen_max_new_tokens`` (``GenRequest.max_new_tokens``), and neither side
   may stop early (EOS is switched off on both: a random model would otherwise stop at random), so both do
   the same useful work. ``generate`` runs every row to the longest budget; only the tokens within each
   row's budget are useful (what a user gets), and only those are counted for either side.
   ``engine_over_hf_generate`` = engine useful tok/s / HF useful tok/s (one warm-up each on a few rows,
   then one timed batch each; the engine's slot cache is sized and its CUDA graphs recorded for the batch before
   its clock starts, ``LocalEngine.prepare``).
   The engine's roofline: decoding is memory-bound, and a step must read every weight once (shared by the
   step's rows) plus each live row's keys and values, so the least time a schedule can take is

       T_min = sum over decode steps (W + kv_per_token * sum_rows context_row) / bandwidth,

   W = N * bytes (N as above; the input-embedding lookup reads only a few rows), kv_per_token = 2 * layers
   * kv_heads * head_dim * bytes, the steps those of the engine's own schedule (``decode_steps``: rows
   admitted in order up to ``max_batch_size``, each makes one token per step, a finished row's slot refilled
   at the next; one forward per token, the prefill counting as a row's first). ``engine_roofline_frac`` =
   T_min / measured time = measured tok/s / ceiling tok/s.
   Assumptions: prefill, sampling and the logits' traffic cost nothing; a shared prompt's keys and values
   are read once per row (as the slot cache stores them); bandwidth is the measured device-to-device
   ``copy_`` rate counting bytes read plus written (about 3.0 TB/s on an H100, 4.3 on an H200, FACTS.md).

3. ``rl_step``: one RL step of tidal's real components on the same model: the engine generates
   ``rl_group_size`` samples for each of ``rl_prompts`` prompts (character-tokenizer prompts from
   ``models/tiny.py``: its ids are valid rows of any larger embedding; long-tailed budgets as above), the
   ``RewardPool`` (a worker process) scores them with the ``length`` reward (DAPO's soft overlong penalty with
   its ramp over the whole budget, ``-len / rl_max_new_tokens``: the budgets differ inside a group, so its
   rewards do and nothing needs assigning by hand; a group of equal lengths is dropped as in a run),
   ``build_train_batch`` + ``Trainer.step`` train on them, and the weights
   go back to the engine (``state_dict_for_engine`` in the engine's dtype, ``request_weight_update``, then
   applied at once through the engine's interruption point). ``step_time_split`` is the seconds of each
   phase of the last of ``rl_steps`` steps (the first warms up the reward workers and the engine) and their
   fractions. Before the first step ``LocalEngine.prepare`` sizes the engine's slot cache for the requests and
   records every CUDA-graph bucket (``rl_prepare_s``, outside the steps); ``rl_first_generate_s`` and
   ``rl_second_generate_s`` are the first two steps' generate seconds (recording inside the first made it 4.12 s
   against 2.06 s on an H200), ``rl_engine_counters`` the engine's ``rollout/*`` counters after all steps
   (``graph_late_steps`` and ``slot_resizes``: recordings in the middle of decoding and buffer growths, both 0
   when the sizing held).

4. ``decode_attention`` (not a default part): the engine alone under each ``rollout.decode_attention`` arm
   (``attention_modes``: ``repeat`` is transformers' SDPA with ``repeat_kv``, ``gqa`` SDPA's ``enable_gqa``, ``fold``
   the query heads folded into rows; ``rollout/decode_attention.py``) on the same long-context rows (64 rows of
   2,048-token prompts by default), each row decoding ``attention_new_tokens`` tokens: ``decode_step_ms_<mode>``,
   ``decode_kernels``, the SDPA backend each arm's attention call gets at those shapes, and ``decode_call_ms``,
   one such call's time (``repeat``'s K/V copy included). ``--set
   decode_attention=gqa`` instead runs the ``generate`` and ``rl_step`` engines under one arm.

5. ``host_reads`` (not a default part; ``benchmarks/_gpu_engine.py``): the engine's decode step with
   ``rollout.host_reads=sync`` against ``late`` on ``generate``'s requests: ``decode_step_ms_by_host_reads``, the
   host ms and (CUDA) synchronizations per step of each, and ``host_reads_same_tokens``.

6. ``graph_widths`` (not a default part; ``benchmarks/_gpu_widths.py``): the static decode step with
   ``rollout.graph_widths=full`` against ``buckets`` at a long budget (``widths_rows`` rows, ``widths_prompt_len``
   prompt, ``widths_budget`` budget, the first ``widths_steps`` steps): ``decode_step_ms_by_graph_widths``,
   ``graph_widths_speedup``, ``graph_widths_same_tokens``.

Issue 51's keys, at the top level of the JSON: ``trainer_phase_ms`` (``train``'s last step, ``{forward, head,
backward, optimizer}`` from its ``perf/trainer_<phase>_ms`` metrics; the head's ms lie inside the forward's),
``decode_step_ms`` (``generate``: the engine's timed seconds over the decode steps of its schedule, prefill
included) and ``rl_samples_per_s`` (``rl_step``: samples of the last step over its seconds) with
``rl_response_lengths`` beside it (the responses' token counts: mean, median, p90, max, and their budgets' law),
and ``rl_prepare_s``, ``rl_first_generate_s``, ``rl_second_generate_s``, ``rl_engine_counters`` (part 3);
``decode_step_ms_repeat``, ``decode_step_ms_gqa``, ``decode_step_ms_fold``, ``decode_kernels`` and ``decode_call_ms``
(part 4).

Reading the numbers: one device and these shapes; the model is small for an H100, so per-step overheads (kernel
launches, Python) weigh more than at 7B. On an H200 the default parts took 71 + 149 s (train, generate) and
more (rl_step); ``budget_s`` bounds the whole (the device check passes it).

    tidal bench gpu [--set device=cpu] [--set 'parts=[train]'] [--set train_steps=5] ...
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import json
import random
import statistics
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import transformers

from tidal.bench import load
from tidal.config import apply_overrides
from tidal.utils.device import resolve_device, resolve_dtype

DESCRIPTION = "one device: trainer tokens/s and MFU, engine vs HF generate (and its roofline), an RL step's time split"

MODELS = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                         max_position_embeddings=32768, rms_norm_eps=1e-6),
    "stand-in": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=512, vocab_size=4096, tie_word_embeddings=True, rope_theta=1e6,
                     max_position_embeddings=2048, rms_norm_eps=1e-6),
}
"""Model shapes (``transformers.Qwen2Config`` arguments; Qwen2.5-0.5B's are from its config.json)."""
MODEL_NOTES = {"qwen2.5-0.5b": "Qwen2.5-0.5B's shapes, random weights",
               "stand-in": "a small stand-in for CPU runs, random weights: not Qwen2.5-0.5B's shapes"}

# benchmarks/_roofline.py: FLOP, byte and peak accounting; _gpu_table.py: the printed table; the parts in their
# own modules: _gpu_generate.py (generate), _gpu_attention.py (decode_attention), _gpu_head.py (head_kernel),
# _gpu_engine.py (host_reads), _gpu_widths.py (graph_widths)
roofline, gpu_table = load("_roofline"), load("_gpu_table")
gpu_generate, gpu_attention, gpu_head = load("_gpu_generate"), load("_gpu_attention"), load("_gpu_head")
gpu_engine, gpu_widths = load("_gpu_engine"), load("_gpu_widths")


@dataclass
class Settings:
    device: str = "auto"
    """``auto`` (CUDA if present), ``cpu``, ``cuda`` or ``cuda:N``. On CPU, ``CPU_DEFAULTS`` apply first."""
    tiny: bool = False
    """Toy shapes and workloads (``TINY_DEFAULTS``, after ``CPU_DEFAULTS`` and before the command line's ``--set``):
    every part's code path in seconds, numbers meaningless (``bash scripts/device_check.sh --dry-run`` uses it)."""
    model: str = "qwen2.5-0.5b"
    """A key of ``MODELS``."""
    parts: list[str] = field(default_factory=lambda: ["train", "generate", "rl_step", "train_tf32"])
    """``train_tf32`` is ``train`` again with ``trainer.head_matmul=tf32`` (the LM head on tensor cores). In order of
    what a device check must not miss: ``budget_s`` skips from the end."""
    profile: bool = False
    """Also run one trainer step and one engine ``generate`` under ``torch.profiler`` and keep the 20 costliest
    operations of each (device and host time) under ``profile`` in the part's results: where the time goes."""
    head_matmul: str = "fp32"
    """``trainer.head_matmul`` of the ``train`` part (and the RL step)."""
    head_tokens: str = "all"
    """``trainer.head_tokens`` of the ``train`` part (and the RL step): ``loss`` runs the LM head on the response
    tokens only, and the MFU then counts the head's FLOPs on those tokens only (``head_tokens_per_step``)."""
    head_kernel: str = "chunked"
    """``trainer.head_kernel`` of the ``train`` part (and the RL step): ``--set head_kernel=fused`` gives the trainer's
    MFU with the fused head (the ``head_kernel`` part times the head alone, every kernel side by side)."""
    precision: str = "auto"
    """``trainer.precision``: bf16 autocast on CUDA with ``auto``, fp32 on CPU."""
    weights: str = "fp32"
    """``trainer.weights`` of the ``train`` part (and the RL step): ``bf16_master`` runs bf16 parameters without
    autocast over float32 masters (``train/precision.py``). The ``train_bf16_master`` part is ``train`` with it,
    side by side: ``--set 'parts=[train,train_bf16_master]'`` compares the two MFUs on one machine."""
    engine_dtype: str = "auto"
    """``rollout.dtype`` of the engine, and the dtype HF ``generate`` runs in: bf16 on CUDA with ``auto``."""
    decode_attention: str = "repeat"
    """``rollout.decode_attention`` of the ``generate`` and ``rl_step`` engines (``rollout/decode_attention.py``)."""
    budget_s: float = 0.0
    """Seconds the whole bench may take (0: no limit). A part still running when they are spent is stopped (an alarm
    raises inside it: its entry says so) and the parts after it are skipped, so ``gpu.json`` is always written:
    the device check passes its stage limit less a margin, where an outside kill used to lose every figure."""
    seed: int = 0
    matmul_size: int = 8192
    """Side of the square matmuls timed for the measured peak."""
    copy_mb: int = 2048
    """Bytes of the buffer copied device to device for the measured bandwidth."""
    # ---- train
    train_groups: int = 8
    group_size: int = 16
    prompt_len: int = 256
    max_response: int = 1536
    pack_tokens: int = 2048
    micro_batch_tokens: int = 8192
    """A few packed rows per forward/backward."""
    train_steps: int = 3
    """Timed steps after one warm-up step."""
    # ---- generate
    gen_prompts: int = 16
    gen_group_size: int = 8
    gen_prompt_len: int = 128
    gen_max_new_tokens: int = 512
    gen_max_batch_size: int = 256
    """The engine's ``max_batch_size``; HF ``generate`` runs the same number of rows per call."""
    # ---- rl_step
    rl_prompts: int = 8
    rl_group_size: int = 16
    rl_max_new_tokens: int = 256
    rl_steps: int = 2
    """RL steps run; the last one's split is reported (the first starts the reward workers)."""
    # ---- decode_attention
    attention_modes: list[str] = field(default_factory=lambda: ["repeat", "gqa", "fold"])
    """The ``rollout.decode_attention`` arms of the ``decode_attention`` part, run one after another."""
    attention_prompts: int = 8
    attention_group_size: int = 8
    """Rows of the ``decode_attention`` part: all decode together (``max_batch_size`` = prompts x group size)."""
    attention_prompt_len: int = 2048
    """Long contexts, where copying K and V to every query head (``repeat``) costs the most."""
    attention_new_tokens: int = 64
    """Every row's budget (EOS ignored): each decode step runs every row."""
    # ---- graph_widths (benchmarks/_gpu_widths.py)
    widths_rows: int = 64
    widths_prompt_len: int = 256
    widths_budget: int = 4096
    """The slot cache is sized for prompt + this budget: ``full`` reads all of it every step, ``buckets`` about the
    live width."""
    widths_steps: int = 256
    """Decode steps timed, the first of the budget."""


CPU_DEFAULTS = [
    "model=stand-in", "parts=[train,generate,rl_step]", "matmul_size=1024", "copy_mb=256",
    "train_groups=2", "group_size=8", "prompt_len=32", "max_response=192", "pack_tokens=256",
    "micro_batch_tokens=512", "train_steps=2",
    "gen_prompts=4", "gen_group_size=4", "gen_prompt_len=16", "gen_max_new_tokens=64", "gen_max_batch_size=16",
    "rl_prompts=4", "rl_group_size=4", "rl_max_new_tokens=32",
    "attention_prompts=2", "attention_group_size=4", "attention_prompt_len=256", "attention_new_tokens=16",
    "widths_rows=8", "widths_prompt_len=64", "widths_budget=1024", "widths_steps=32",
]
"""What changes on a CPU (before the command line's ``--set``): the stand-in model and small workloads."""

TINY_DEFAULTS = [
    "model=stand-in", "parts=[train,generate,rl_step]", "matmul_size=64", "copy_mb=8",
    "train_groups=2", "group_size=4", "prompt_len=8", "max_response=24", "pack_tokens=64", "micro_batch_tokens=64",
    "train_steps=1", "gen_prompts=2", "gen_group_size=3", "gen_prompt_len=4", "gen_max_new_tokens=8",
    "gen_max_batch_size=4", "rl_prompts=2", "rl_group_size=3", "rl_max_new_tokens=6", "rl_steps=1",
    "attention_prompts=1", "attention_group_size=2", "attention_prompt_len=16", "attention_new_tokens=4",
    "widths_rows=2", "widths_prompt_len=8", "widths_budget=200", "widths_steps=4",
]
"""``tiny=true``: toy sizes (6 generate requests over 4 slots, so the engine refills a slot and HF runs two batches)."""


# ---- formulas (pure) -------------------------------------------------------------------------------------
def long_tailed(rng: random.Random, count: int, top: int) -> list[int]:
    """``count`` lengths n in [1, top] with P(n) proportional to 1/n (most short, a few near ``top``)."""
    return rng.choices(range(1, top + 1), [1 / n for n in range(1, top + 1)], k=count)


def build_model(s: Settings) -> torch.nn.Module:
    """A Qwen2 causal LM of ``MODELS[s.model]``'s shapes with random float32 weights (seeded), on the CPU."""
    torch.manual_seed(s.seed)
    config = transformers.Qwen2Config(**MODELS[s.model])
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ---- part 1: the trainer ---------------------------------------------------------------------------------
def train_batch(s: Settings, vocab: int):
    """``train_groups`` groups of ``group_size`` sequences: a shared ``prompt_len``-token prompt, a long-tailed
    response, random ids; uniform random rewards (never equal inside a group) and plausible behaviour log-probs."""
    from tidal.types import TrainBatch

    rng = random.Random(s.seed)
    num = s.train_groups * s.group_size
    lengths = [s.prompt_len + n for n in long_tailed(rng, num, s.max_response)]
    width = max(lengths)
    gen = torch.Generator().manual_seed(s.seed)
    attn_bt = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    group_b = torch.arange(num) // s.group_size
    ids_bt = torch.randint(0, vocab, (num, width), generator=gen)
    ids_bt[:, : s.prompt_len] = ids_bt[group_b * s.group_size, : s.prompt_len]  # a group shares its prompt
    ids_bt = ids_bt * attn_bt
    loss_mask_bt = attn_bt.float()
    loss_mask_bt[:, : s.prompt_len] = 0
    behav_bt = -torch.rand(num, width, generator=gen) * loss_mask_bt
    versions_bt = torch.where(loss_mask_bt > 0, 0, -1)
    rewards_b = torch.rand(num, generator=gen)
    return TrainBatch(ids_bt, attn_bt, loss_mask_bt, behav_bt, versions_bt, group_b, rewards_b), lengths


def make_trainer(model: torch.nn.Module, s: Settings, device: torch.device):
    from tidal.algo.config import AlgoConfig
    from tidal.optim import OptimConfig
    from tidal.train.config import TrainerConfig
    from tidal.train.trainer import Trainer

    cfg = TrainerConfig(precision=s.precision, packing=True, pack_tokens=s.pack_tokens,
                        micro_batch_tokens=s.micro_batch_tokens, head_matmul=s.head_matmul, head_tokens=s.head_tokens,
                        weights=s.weights, head_kernel=s.head_kernel)
    return Trainer(model, AlgoConfig(), OptimConfig(lr=1e-6), cfg, device=device)


def part_train(s: Settings, base: torch.nn.Module, device: torch.device, peaks: dict) -> dict:
    from tidal.train.microbatch import pack_sequences

    trainer = make_trainer(copy.deepcopy(base), s, device)
    config = trainer.model.config
    batch, lengths = train_batch(s, config.vocab_size)
    forwards = [0]
    hook = trainer.model.get_decoder().register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        _, warm_s = roofline.timed(lambda: trainer.step(batch), device)
        forwards[0] = 0
        times, metrics = [], {}
        for _ in range(s.train_steps):
            metrics, seconds = roofline.timed(lambda: trainer.step(batch), device)
            times.append(seconds)
    finally:
        hook.remove()
    profiled = roofline.profile_table(lambda: trainer.step(batch), device) if s.profile else None
    micro_batches = len(pack_sequences(lengths, s.micro_batch_tokens))
    assert forwards[0] == micro_batches * s.train_steps, (
        f"{forwards[0] / s.train_steps} decoder forwards per step, {micro_batches} micro-batches: the step does "
        "more than one forward + backward, and the 6N FLOP count would be wrong")
    n = roofline.matmul_params(trainer.model)
    attn_dim = config.num_attention_heads * (getattr(config, "head_dim", None)
                                             or config.hidden_size // config.num_attention_heads)
    head = config.vocab_size * config.hidden_size
    head_tokens = int(batch.loss_mask_bt.sum()) if s.head_tokens == "loss" else sum(lengths)  # what the head computes
    flops = roofline.training_flops(n, config.num_hidden_layers, attn_dim, lengths, head, head_tokens)
    step_s = statistics.median(times)
    achieved = flops / step_s / 1e12
    datasheet, measured = peaks["peak_tflops_datasheet"], peaks["matmul_tflops_measured"]
    return {
        "trainer_tokens_per_s": sum(lengths) / step_s,
        "trainer_response_tokens_per_s": (sum(lengths) - len(lengths) * s.prompt_len) / step_s,
        "step_s": step_s, "step_times_s": times, "warmup_step_s": warm_s, "tokens_per_step": sum(lengths),
        "sequences_per_step": len(lengths), "micro_batches_per_step": micro_batches,
        "decoder_forwards_per_step": forwards[0] / s.train_steps, "flops_per_step": flops,
        "matmul_params": n, "head_tokens_per_step": head_tokens, "head_flops_frac": 6.0 * head * head_tokens / flops,
        "achieved_tflops": achieved,
        "trainer_mfu": achieved / (datasheet or measured), "trainer_mfu_peak": "datasheet" if datasheet else
        "measured matmul (no datasheet peak for this device)", "trainer_mfu_vs_measured_matmul": achieved / measured,
        "autocast_dtype": str(trainer.autocast_dtype), "weights": s.weights,
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "last_step_metrics": {k: v for k, v in metrics.items() if k.startswith("perf/")},
        "trainer_phase_ms": trainer_phase_ms(metrics),
        **({"profile": profiled} if profiled is not None else {}),
    }


def trainer_phase_ms(metrics: dict) -> dict:
    """``{forward, head, backward, optimizer}`` milliseconds of a trainer step from its ``perf/trainer_<phase>_ms``
    metrics (``utils/phases.py``: CUDA events on a GPU, ``perf_counter`` on a CPU); the head's time is inside the
    forward's (the head runs within the forward pass), the backward's includes the head's recompute."""
    from tidal.utils.phases import PHASES

    return {name: metrics.get(f"perf/trainer_{name}_ms") for name in PHASES}


# ---- part 2: the engine vs HF generate (its requests here; the part in _gpu_generate.py) ----------------
def gen_requests(s: Settings, vocab: int) -> list:
    """``gen_prompts`` x ``gen_group_size`` requests: random ``gen_prompt_len``-token prompts, long-tailed budgets."""
    from tidal.api import GenRequest
    from tidal.types import Prompt

    rng = random.Random(s.seed + 1)
    budgets = long_tailed(rng, s.gen_prompts * s.gen_group_size, s.gen_max_new_tokens)
    requests = []
    for i in range(s.gen_prompts):
        ids = tuple(rng.randrange(vocab) for _ in range(s.gen_prompt_len))
        for j in range(s.gen_group_size):
            requests.append(GenRequest(Prompt(f"p{i}", "", ""), ids, j, budgets[len(requests)]))
    return requests


# ---- part 3: one RL step ---------------------------------------------------------------------------------
def rl_requests(s: Settings, tokenizer) -> list:
    from tidal.api import GenRequest
    from tidal.rollout.requests import prompt_ids
    from tidal.types import Prompt

    rng = random.Random(s.seed + 2)
    budgets = long_tailed(rng, s.rl_prompts * s.rl_group_size, s.rl_max_new_tokens)
    requests = []
    for i in range(s.rl_prompts):
        prompt = Prompt(f"q{i}", f"{rng.randrange(100)}+{rng.randrange(100)}=", "")
        ids = prompt_ids(tokenizer, prompt)
        for j in range(s.rl_group_size):
            requests.append(GenRequest(prompt, ids, j, budgets[len(requests)]))
    return requests


def length_summary(lengths: list[int], budget: int) -> dict:
    """The response-length distribution that ``rl_samples_per_s`` holds for: samples/s means little without it."""
    ordered = sorted(lengths)
    return {"distribution": f"budgets n ~ 1/n in [1, {budget}] (rl_max_new_tokens), EOS may end one sooner",
            "count": len(ordered), "mean": statistics.fmean(ordered), "min": ordered[0],
            "median": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1], "total": sum(ordered)}


def rl_step(trainer, engine, pool, requests, s: Settings, pad_id: int, device: torch.device) -> dict:
    """One generate -> score -> train -> weight sync step; seconds of each phase."""
    from tidal.algo.config import AlgoConfig
    from tidal.train.batch import build_train_batch
    from tidal.types import Group

    trajs, gen_s = roofline.timed(lambda: engine.generate(requests), device)
    items = [(t.text, dataclasses.replace(r.prompt, meta={**r.prompt.meta, "num_tokens": t.num_tokens}))
             for t, r in zip(trajs, requests)]  # the controller hands the reward each response's length the same way
    scores, score_s = roofline.timed(lambda: pool.score(items), device)
    for t, (reward, _) in zip(trajs, scores):
        t.reward = reward
    groups = [Group(requests[i].prompt, trajs[i : i + s.rl_group_size]) for i in range(0, len(trajs), s.rl_group_size)]

    def train():
        batch, _ = build_train_batch(groups, AlgoConfig(), pad_id)
        assert batch is not None, "every group's rewards were equal: nothing to train on"
        return trainer.step(batch)

    _, train_s = roofline.timed(train, device)

    def weight_sync():
        engine.request_weight_update(trainer.state_dict_for_engine(dtype=engine.dtype), trainer.version)
        assert engine._apply_pending_update(), "the weight update was not applied"

    _, sync_s = roofline.timed(weight_sync, device)
    split = {"generate": gen_s, "score": score_s, "train": train_s, "weight_sync": sync_s}
    total = sum(split.values())
    return {"seconds": split, "fractions": {k: v / total for k, v in split.items()}, "total_s": total,
            "samples": len(trajs), "response_tokens": sum(t.num_tokens for t in trajs),
            "response_lengths": length_summary([t.num_tokens for t in trajs], s.rl_max_new_tokens),
            "reward_std": statistics.pstdev(t.reward for t in trajs)}


def part_rl_step(s: Settings, base: torch.nn.Module, device: torch.device, peaks: dict) -> dict:
    from tidal.models import tiny
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardConfig, RewardPool
    from tidal.rollout.local import LocalEngine, SamplingConfig

    tokenizer = tiny.build_tokenizer()
    trainer = make_trainer(copy.deepcopy(base), s, device)
    cfg = SamplingConfig(dtype=s.engine_dtype, max_new_tokens=s.rl_max_new_tokens, decode_attention=s.decode_attention)
    engine = LocalEngine(trainer.model, tokenizer, cfg, seed=s.seed)
    params = {"max_len": s.rl_max_new_tokens, "cache_len": s.rl_max_new_tokens}
    pool = RewardPool(build_reward("length", params), RewardConfig("length", params))
    requests = rl_requests(s, tokenizer)
    # the slot cache sized and every decode bucket recorded before the first step's clock starts (issue 51)
    _, prepare_s = roofline.timed(lambda: engine.prepare(requests), device)
    try:
        steps = [rl_step(trainer, engine, pool, requests, s, tokenizer.pad_token_id, device) for _ in range(s.rl_steps)]
    finally:
        pool.close()
    last = steps[-1]
    generate_s = [step["seconds"]["generate"] for step in steps]
    counters = ("decode_steps", "slot_resizes", "graph_recordings", "graph_record_s", "graph_late_steps")
    stats = engine.stats()
    return {"step_time_split": {**last["seconds"], "fractions": last["fractions"]},
            "rl_samples_per_s": last["samples"] / last["total_s"], "rl_response_lengths": last["response_lengths"],
            "rl_step_s": last["total_s"], "rl_steps": steps, "engine_dtype": str(engine.dtype),
            "rl_prepare_s": prepare_s, "rl_first_generate_s": generate_s[0],
            "rl_second_generate_s": generate_s[1] if len(generate_s) > 1 else None,
            "rl_engine_counters": {k: stats[f"rollout/{k}"] for k in counters}}


# ---- the benchmark ---------------------------------------------------------------------------------------
def part_train_tf32(s: Settings, base: torch.nn.Module, device: torch.device, peaks: dict) -> dict:
    """``part_train`` with the LM head's float32 matmul on TF32 tensor cores (``trainer.head_matmul=tf32``)."""
    return part_train(dataclasses.replace(s, head_matmul="tf32"), base, device, peaks)


def part_train_bf16_master(s: Settings, base: torch.nn.Module, device: torch.device, peaks: dict) -> dict:
    """``part_train`` with bf16 parameters over float32 masters (``trainer.weights=bf16_master``); not a default
    part (its MFU against ``train``'s is unmeasured on a GPU so far: issue 51)."""
    return part_train(dataclasses.replace(s, weights="bf16_master"), base, device, peaks)


PARTS = {"train": part_train, "train_tf32": part_train_tf32, "train_bf16_master": part_train_bf16_master,
         "generate": functools.partial(gpu_generate.part_generate, gen_requests=gen_requests),
         "rl_step": part_rl_step,
         "decode_attention": functools.partial(gpu_attention.part_decode_attention, timed=roofline.timed),
         "head_kernel": gpu_head.part_head_kernel,
         "host_reads": functools.partial(gpu_engine.part_host_reads, gen_requests=gen_requests, timed=roofline.timed),
         "graph_widths": functools.partial(gpu_widths.part_graph_widths, timed=roofline.timed)}
HEADLINE = {"train": "trainer_mfu", "generate": "engine_over_hf_generate", "rl_step": "step_time_split",
            "decode_attention": "decode_kernels", "head_kernel": "head_kernel_speedup",
            "host_reads": "decode_step_ms_by_host_reads", "graph_widths": "decode_step_ms_by_graph_widths"}
TOP_LEVEL = {"train": ["trainer_phase_ms"], "generate": ["decode_step_ms"],
             "rl_step": ["rl_samples_per_s", "rl_response_lengths", "rl_prepare_s", "rl_first_generate_s",
                         "rl_second_generate_s", "rl_engine_counters"],
             "decode_attention": ["decode_step_ms_repeat", "decode_step_ms_gqa", "decode_step_ms_fold",
                                  "decode_kernels", "decode_call_ms"],
             "host_reads": ["host_reads_same_tokens"],
             "graph_widths": ["graph_widths_speedup", "graph_widths_same_tokens"]}
"""Issue 51's keys, copied to the top level of the JSON (None when their part did not run or failed)."""


def resolve(overrides: list[str]) -> tuple[Settings, torch.device]:
    """Settings with ``CPU_DEFAULTS`` under the command line's overrides when the device is a CPU."""
    first = apply_overrides(Settings(), overrides)
    device = resolve_device(first.device, "device")
    s = apply_overrides(Settings(), [*(CPU_DEFAULTS if device.type == "cpu" else []),
                                     *(TINY_DEFAULTS if first.tiny else []), *overrides])
    unknown = set(s.parts) - set(PARTS)
    assert not unknown and s.model in MODELS, f"parts must be among {list(PARTS)}, model among {list(MODELS)}"
    return s, device


def measure_peaks(s: Settings, device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = resolve_dtype(s.precision, device, "precision")
    return {"device": name, "peak_tflops_datasheet": roofline.datasheet_tflops(name) if device.type == "cuda" else None,
            "matmul_tflops_measured": roofline.matmul_tflops(device, dtype, s.matmul_size), "matmul_dtype": str(dtype),
            "matmul_tflops_measured_fp32": roofline.matmul_tflops(device, torch.float32, s.matmul_size),
            "copy_bandwidth_bytes_per_s": roofline.copy_bandwidth(device, s.copy_mb)}


def run(overrides: list[str], out_dir: Path) -> dict:
    s, device = resolve(overrides)
    tiny = ", tiny shapes" if s.tiny else ""
    print(f"[bench gpu] device {device}, model {s.model}, parts {s.parts}{tiny}", flush=True)
    if device.type == "cpu":
        print("[bench gpu] ON CPU: no GPU was used; CPU figures of a stand-in model, not a GPU's", flush=True)
    result: dict = {"benchmark": "gpu", "description": DESCRIPTION, "model": f"{s.model} ({MODEL_NOTES[s.model]})",
                    "on_cpu": device.type == "cpu", "tiny": s.tiny,
                    "torch": torch.__version__, "transformers": transformers.__version__}
    result.update(measure_peaks(s, device))
    print(f"[bench gpu] peaks: {result['matmul_tflops_measured']:.4g} TFLOP/s matmul, "
          f"{result['copy_bandwidth_bytes_per_s'] / 1e12:.4g} TB/s copy", flush=True)
    start = time.perf_counter()
    base = build_model(s)
    result["model_build_s"] = time.perf_counter() - start
    deadline = time.monotonic() + s.budget_s if s.budget_s > 0 else None
    for name in s.parts:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 1:
            result[name] = {"skipped": f"budget_s={s.budget_s:g} spent before this part", "part_s": 0.0}
            print(f"[bench gpu] part {name} skipped: budget_s={s.budget_s:g} spent", flush=True)
            continue
        print(f"[bench gpu] part {name} ...", flush=True)
        start = time.perf_counter()
        try:
            with roofline.within(left):
                result[name] = PARTS[name](s, base, device, result)
        except Exception as e:  # one part's failure must not lose the others' numbers
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        result[name]["part_s"] = time.perf_counter() - start
        print(f"[bench gpu] part {name} done in {result[name]['part_s']:.1f} s: "
              f"{result[name].get(HEADLINE.get(name, 'trainer_mfu'), result[name].get('error'))}", flush=True)
        # A borrowed machine's time limit can stop the bench mid-part: what is done so far stays on disk.
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        (out_dir.parent / "gpu_partial.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, key in HEADLINE.items():
        result[key] = result.get(name, {}).get(key)
    result["trainer_mfu_tf32_head"] = result.get("train_tf32", {}).get("trainer_mfu")
    result["trainer_mfu_bf16_master"] = result.get("train_bf16_master", {}).get("trainer_mfu")
    for name, keys in TOP_LEVEL.items():
        for key in keys:
            result[key] = result.get(name, {}).get(key)
    result["settings"] = {f.name: getattr(s, f.name) for f in fields(s)}
    result["table"] = gpu_table.table(result)
    return result
