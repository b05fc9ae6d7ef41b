"""DPO and its relatives on preference rows: ``prompt``, ``chosen``, ``rejected``.

The reference log-probabilities are computed once per row, batched and packed, before the first policy
step, then the reference is gone: by default it is the starting policy itself (TRL's default when no
``ref_model`` is given), so no second model is ever held; ``ref_path`` names another model, loaded for
that pass and freed before training. They are saved with the run (``reference_logps.pt``) so ``--resume``
never recomputes them from a model that has since moved, with what they are a function of: digests of the rows'
token ids (train and held out) and of the reference's weights. A resume whose rows or reference differ by
content (another data file of the same size, another ``ref_path``) is one line naming which, never a silent reuse
of the old rows' log-probs. Reference-free losses (SimPO) skip the pass.

Each step packs the chosen and rejected sequences of ``batch_size`` pairs together, each pair one prefix trie
(``pair_tree.py``: the two share their prompt, and any answer tokens they agree on, computed once; the
reference pass too), sums each completion's token log-probs, and averages the chosen loss (``dpo_losses.py``)
over pairs. ``share_prefix=false`` packs them as 2B separate sequences (``train/packing.py``), with the same
losses and gradients, at nearly twice the tokens.
Held out: the loss and the preference accuracy (the share of pairs whose implicit margin is > 0).

    tidal dpo --set data.path=pairs.jsonl --set model.path=runs/sft/model --out runs/dpo
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.config import ConfigError
from tidal.models import catalog, tiny
from tidal.optim import OptimConfig
from tidal.stages.chat_data import PairExample, SFTExample, encode_pair
from tidal.stages.checks import validate_stage
from tidal.stages.common import (
    DataConfig,
    RunConfig,
    check_lora,
    chunks,
    load_policy,
    open_run,
    rows_digest,
    run_stage,
    stage_optim,
    train_and_held,
    weights_digest,
    with_lora,
)
from tidal.stages.dpo_losses import PREFERENCE_LOSSES, REFERENCE_FREE, implicit_margin
from tidal.stages.pair_tree import pair_logprobs, right_padded, shares_prefixes
from tidal.stages.sft import packed_logprobs


@dataclass
class DPOStageConfig:
    """``tidal dpo``: preference optimization (sigmoid | ipo | hinge | simpo)."""

    model: tiny.ModelConfig = field(default_factory=tiny.ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: stage_optim(lr=1e-6))
    """lr 1e-6: TRL DPOConfig's default (DPO's paper used 1e-6 too, sec. B)."""
    run: RunConfig = field(default_factory=lambda: RunConfig(batch_size=8))
    loss_type: str = "sigmoid"
    """sigmoid (DPO) | ipo | hinge (SLiC) | simpo (reference-free); ``dpo_losses.py`` cites each."""
    beta: float = 0.1
    """DPO's KL strength (Rafailov et al. 2023 use 0.1; TRL's default). SimPO's paper uses 2.0-2.5."""
    gamma: float = 0.5
    """SimPO's target margin (TRL CPOConfig's ``simpo_gamma`` default; the paper's gamma/beta ~0.5)."""
    ref_path: str = ""
    """The reference model; empty: the starting policy (``model.path``)."""
    ref_batch_size: int = 32
    """Pairs per batched reference pass."""
    pack_length: int = 0
    """Tokens per packed row (with ``share_prefix``, the most: rows are as wide as costs least,
    ``pair_tree.row_width``); 0: ``data.max_length``."""
    share_prefix: bool = True
    """Each pair as one prefix trie, its chosen and rejected's common token prefix computed once
    (``pair_tree.py``); false: 2B packed sequences. Same losses and gradients either way."""


def validate(cfg: DPOStageConfig) -> None:
    validate_stage(cfg)  # beta > 0 among the stage keys (checks.py)
    PREFERENCE_LOSSES.get(cfg.loss_type)  # an unknown name lists the registered ones


def sequence_logps(model, pairs: list[PairExample], pack_length: int,
                   share_prefix: bool = True) -> tuple[torch.Tensor, ...]:
    """(pc, pr, nc, nr) [B] each: summed completion log-probs of chosen and rejected, and their token counts;
    all 2B sequences in one packed forward, each pair's common prefix once (``share_prefix``, ``pair_tree.py``)
    or twice."""
    return _completion_sums(model, pairs, pack_length, share_prefix)[:4]


def _completion_sums(model, pairs: list[PairExample], pack_length: int, share_prefix: bool):
    """``sequence_logps``'s four, and the tokens the forward computed."""
    seqs = [SFTExample(p.chosen_ids, p.chosen_mask) for p in pairs] + \
           [SFTExample(p.rejected_ids, p.rejected_mask) for p in pairs]
    mask_bt, _ = right_padded([s.mask for s in seqs], torch.float)  # ``sft.masks``, converted once
    mask_bt[:, 0] = 0  # token 0 is never predicted
    if share_prefix and shares_prefixes(model):
        logp_bt, computed = pair_logprobs(model, [p.chosen_ids for p in pairs], [p.rejected_ids for p in pairs],
                                          pack_length, mask_bt)
    else:
        logp_bt, computed = packed_logprobs(model, [s.ids for s in seqs], pack_length), sum(len(s.ids) for s in seqs)
    mask_bt = mask_bt.to(logp_bt.device)
    sums, counts, n = (logp_bt * mask_bt).sum(1), mask_bt.sum(1), len(pairs)
    return sums[:n], sums[n:], counts[:n], counts[n:], computed


@torch.no_grad()
def reference_logps(model, pairs: list[PairExample], batch_size: int, pack_length: int,
                    share_prefix: bool = True) -> torch.Tensor:
    """[N, 2] (chosen, rejected) summed completion log-probs under ``model``, ``batch_size`` pairs a pass."""
    was_training = model.training
    model.eval()
    out = []
    for part in chunks(pairs, batch_size):
        pc, pr, _, _ = sequence_logps(model, part, pack_length, share_prefix)
        out.append(torch.stack([pc, pr], 1).cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros((0, 2))


def pair_loss(cfg: DPOStageConfig, model, rows: list[tuple[PairExample, torch.Tensor]], pack_length: int):
    """(mean loss over pairs, metrics) of ``rows``: (pair, its reference log-probs [2])."""
    pairs = [p for p, _ in rows]
    pc, pr, nc, nr, computed = _completion_sums(model, pairs, pack_length, cfg.share_prefix)
    ref = torch.stack([r for _, r in rows]).to(pc.device)
    rc, rr = ref[:, 0], ref[:, 1]
    loss_b = PREFERENCE_LOSSES.get(cfg.loss_type)(pc, pr, rc, rr, nc, nr, cfg.beta, cfg.gamma)
    margin = implicit_margin(cfg.loss_type, pc, pr, rc, rr, nc, nr).detach()
    metrics = {"pref_acc": float((margin > 0).float().mean()), "margin": float(margin.mean()),
               "num_tokens": sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs), "computed_tokens": computed}
    return loss_b.mean(), metrics


def reference_inputs(cfg: DPOStageConfig, ref_model, train_pairs, held_pairs) -> dict:
    """What the reference log-probs are a function of, by content: the rows' token ids and masks (train and held
    out) and the reference's weights (``weights_digest``; a reference-free loss has none)."""
    name = cfg.ref_path or cfg.model.path or "the model built from model.*"
    return {"train": rows_digest(train_pairs), "held": rows_digest(held_pairs),
            "num_train": len(train_pairs), "num_held": len(held_pairs),
            "reference": "none" if ref_model is None else weights_digest(ref_model),
            "reference_name": "none (reference-free loss)" if ref_model is None else name}


def check_reference_inputs(saved: dict, now: dict, cache: Path, cfg: DPOStageConfig) -> None:
    """One line naming what differs between the inputs ``cache`` was computed from and this run's."""
    differ = []
    for part, key in (("train", "data.path"), ("held", "data.eval_path" if cfg.data.eval_path else "data.path")):
        if saved[part] != now[part]:
            differ.append(f"the {part} rows are not those they were computed from ({now[f'num_{part}']} rows "
                          f"now, {saved[f'num_{part}']} then; {key}={getattr(cfg.data, key.split('.')[1])})")
    if saved["reference"] != now["reference"]:
        differ.append(f"the reference model differs (its weights; {saved['reference_name']} then, "
                      f"{now['reference_name']} now)")
    if differ:
        raise ConfigError(f"--resume: {cache} holds reference log-probs of other inputs: {'; '.join(differ)}; resume "
                          "with the run's own data and models, or start again with --overwrite")


def with_reference(cfg: DPOStageConfig, policy, train_pairs, held_pairs, out: Path, resume: bool, log=print):
    """Attach reference log-probs to every pair: from ``out/reference_logps.pt`` on resume (checked against this
    run's rows and reference by content: ``reference_inputs``), else one batched pass of the reference (zeros for
    reference-free losses, which never read them). ``policy`` is the starting policy, before any step."""
    cache = out / "reference_logps.pt"
    pack_length = cfg.pack_length or cfg.data.max_length
    ref_model = None if cfg.loss_type in REFERENCE_FREE else policy if not cfg.ref_path else tiny.load(cfg.ref_path)[0]
    inputs = reference_inputs(cfg, ref_model, train_pairs, held_pairs)
    if resume and cache.exists():
        saved = torch.load(cache)
        if "inputs" in saved:  # written before the inputs were recorded: the counts below are all it can check
            check_reference_inputs(saved["inputs"], inputs, cache, cfg)
        ref_train, ref_held = saved["train"], saved["held"]
    elif ref_model is None:
        ref_train, ref_held = torch.zeros((len(train_pairs), 2)), torch.zeros((len(held_pairs), 2))
    else:
        ref_train = reference_logps(ref_model, train_pairs, cfg.ref_batch_size, pack_length, cfg.share_prefix)
        ref_held = reference_logps(ref_model, held_pairs, cfg.ref_batch_size, pack_length, cfg.share_prefix)
        log(f"dpo: reference log-probs of {len(train_pairs)} + {len(held_pairs)} pairs computed")
    del ref_model
    if len(ref_train) != len(train_pairs) or len(ref_held) != len(held_pairs):
        raise ConfigError(f"{cache} holds reference log-probs of other data; start again with --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"train": ref_train, "held": ref_held, "inputs": inputs}, cache)
    return list(zip(train_pairs, ref_train)), list(zip(held_pairs, ref_held))


def train(cfg: DPOStageConfig, out: str, resume: bool = False, overwrite: bool = False, log=print) -> dict:
    validate(cfg)
    check_lora(cfg.model)
    with open_run(out, resume, overwrite, log, "dpo", cfg) as run_dir:  # checked and locked, nothing deleted yet
        return _train(cfg, out, resume, overwrite, log, run_dir.begin)


def _train(cfg: DPOStageConfig, out: str, resume: bool, overwrite: bool, log, begin) -> dict:
    model, tokenizer = load_policy(cfg.model, cfg.data)
    pairs, held = train_and_held(cfg, encode_pair, tokenizer, log)
    if cfg.ref_path and cfg.loss_type not in REFERENCE_FREE:  # an input too: found before anything is deleted
        if not catalog.is_model_dir(catalog.resolve(cfg.ref_path)):
            raise ConfigError(f"ref_path={cfg.ref_path}: no Hugging Face model there (a model directory, a .gguf, "
                              f"a .whl or one of {', '.join(catalog.CATALOG)})")
    begin()  # the model and rows loaded: only now may --overwrite delete the previous run
    if cfg.run.threads:  # the reference pass runs before run_stage sets them: on a shared CPU torch's default
        torch.set_num_threads(cfg.run.threads)  # thread count made it ~6x slower (measured, 2 cores, loaded)
    clock_start = time.perf_counter()  # the reference pass is part of the stage's time
    rows, held_rows = with_reference(cfg, model, pairs, held, Path(out), resume, log)
    model = with_lora(model, cfg.model, cfg.run.seed, "dpo", log)  # after the reference pass: the reference is the base
    pack_length = cfg.pack_length or cfg.data.max_length

    def step_fn(model, batch):
        return pair_loss(cfg, model, batch, pack_length)

    def eval_fn(model):
        losses, accs, n = 0.0, 0.0, 0
        for part in chunks(held_rows, cfg.ref_batch_size):
            loss, m = pair_loss(cfg, model, part, pack_length)
            losses, accs, n = losses + float(loss) * len(part), accs + m["pref_acc"] * len(part), n + len(part)
        return {"loss": losses / n, "pref_acc": accs / n}

    return run_stage("dpo", cfg, model, tokenizer, rows, step_fn, eval_fn, out, resume, overwrite, log, clock_start)
