"""Records for ``samples.jsonl``: a step's scored groups as the trainer saw them, and greedy eval answers.

Each sample of a ``train`` record carries, per response token: the token id and its text (decoded on
its own, so the inspector needs no tokenizer), the behaviour log-prob the engine sampled it with, the
trainer's log-prob of it (the forward the loss used, before the step's update for its first
minibatch), the policy version that sampled it, the loss mask the trainer applied (0 for an agent's
observation tokens, for a truncated sample under DAPO's overlong filter, and for every token of a
zero-advantage group left out of the batch) and, for agent episodes, ``policy_mask`` (1 sampled by
the policy, 0 returned by the environment). Per sample: the advantage (a number, or one per token for
token-level estimators), reward and ``details`` (the components of a composed reward), finish reason,
staleness (training step minus the version of its oldest sampled token, as ``async/staleness_*``)
and, for episodes, the episode's counters (turns, tool calls, errors). For an MoE policy, ``routes``: the
experts the engine chose for each response token (``Trajectory.routes``, one entry per token like ``ids``),
as ``models.moe.encode_routes`` writes them (shape and base64 of the uint8 ids: a list of numbers would be
several times the size); the inspector shows a token's experts per layer on hover.

A prompt with images (``Prompt.images``, vision-language tasks) adds two fields to its record's ``prompt``:
``tokens`` (its ids' texts, as a sample's, so the page can show the ``<|image_pad|>`` runs) and ``images``, one
entry per image in placeholder order: ``{"url": PNG data URL, "width", "height"}`` (the image's own size),
with ``"thumbnail": true`` when its longest side was over ``THUMB_SIDE`` px and the URL holds a downscaled
copy, or ``{"error": why}`` when it could not be read (the recorder counts those; the run goes on). A record
is one prompt and all its samples at one step, so a group's images are stored once, not once per sample,
and they count towards ``log.samples.max_mb`` like every other byte of the line. A text prompt's record
has neither field (byte-identical to a record from before images).

A sample whose trajectory carries its own pictures (``Trajectory.images``: an agent episode whose observations
showed pictures) adds ``images`` to its sample: the pictures after the prompt's (as many as its record's
``prompt.images``), i.e. the ones behind its observations' ``<|image_pad|>`` runs, in token order, as entries of
the same form (thumbnails, errors counted). They are stored once per sample, since each episode saw its own; a
sample without them (text, a single-turn image sample) has no such field, byte-identical to before.

Why record the trainer's own numbers rather than recompute them later: the inspector is for finding
what went wrong in *this* run (an engine/trainer mismatch, an advantage with the wrong sign), which
only the values the loss actually used can show.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from tidal.inspector.samples import SampleLog, SampleLogConfig, clean
from tidal.types import Group, Prompt, TrainBatch, Trajectory
from tidal.utils.images import load_image, to_data_url

log = logging.getLogger(__name__)

THUMB_SIDE = 256
"""An image whose longest side is over this many pixels is stored as a downscaled copy (``"thumbnail": true``):
the page shows it beside the tokens, which a full-size photo would not fit, and a run of them would fill
``log.samples.max_mb`` with pixels instead of samples."""


def pick(num: int, k: int) -> list[int]:
    """``k`` of ``range(num)`` spread evenly (the first included): an unbiased look across the batch,
    the same groups for the same batch."""
    k = min(k, num)
    return sorted({(i * num) // k for i in range(k)}) if k > 0 else []


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token decoded on its own (a byte-level BPE piece of a multi-byte character shows as U+FFFD)."""
    return tokenizer.batch_decode([[i] for i in ids]) if ids else []


def task_of(prompt: Prompt, default: str) -> str:
    """The prompt's own task when its row names one (a ``task`` field; reasoning-gym's
    ``metadata.source_dataset``, which differs per row in a composite dataset), else the run's task."""
    metadata = prompt.meta.get("metadata")
    source = metadata.get("source_dataset") if isinstance(metadata, dict) else None
    return str(prompt.meta.get("task") or source or default)


def image_entry(value: Any, where: str = "image") -> dict:
    """One prompt image as its record stores it: a PNG data URL (``THUMB_SIDE`` px at most on its longest
    side, else a downscaled copy marked ``thumbnail``) and the image's own width and height; ``{"error": why}``
    when it cannot be read or encoded (recording never stops a run)."""
    try:
        image = load_image(value, where)
        entry = {"width": image.width, "height": image.height}
        if max(image.width, image.height) > THUMB_SIDE:
            image = image.copy()
            image.thumbnail((THUMB_SIDE, THUMB_SIDE), Image.Resampling.LANCZOS)
            entry["thumbnail"] = True
        return {"url": to_data_url(image), **entry}
    except Exception as e:  # noqa: BLE001  (any failure of one image: counted and shown, never a crash of the run)
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def prompt_record(prompt: Prompt, prompt_ids: Sequence[int], task: str, tokenizer=None) -> dict:
    """A record's ``prompt``; with images (and a ``tokenizer``), also its ``tokens`` and ``images``."""
    record = {"uid": prompt.uid, "text": prompt.text, "answer": prompt.answer, "ids": list(prompt_ids),
              "task": task_of(prompt, task)}
    try:
        images = prompt.images
    except Exception as e:  # noqa: BLE001  (meta["images"] not a list: one bad entry rather than no record)
        images, record["images"] = [], [{"error": f"meta['images']: {type(e).__name__}: {e}"[:300]}]
    if images:
        if tokenizer is not None:
            record["tokens"] = token_texts(tokenizer, record["ids"])
        record["images"] = [image_entry(v, f"prompt {prompt.uid!r} image {i}") for i, v in enumerate(images)]
    return record


def image_errors(records: Sequence[dict]) -> list[str]:
    """Why each image of ``records`` (its prompt's, then its samples' observation pictures) could not be recorded."""
    return [image["error"] for r in records
            for image in (*r["prompt"].get("images", ()), *(i for s in r["samples"] for i in s.get("images", ())))
            if "error" in image]


def bad_images(records: Sequence[dict]) -> int:
    """How many images of ``records`` (prompts' and observations') could not be recorded."""
    return len(image_errors(records))


def encode_routes(routes_tlk: torch.Tensor) -> dict:
    """``models.moe.encode_routes``, written here again because the inspector sits below ``models`` in the layer
    table (``tests/inspector/test_record.py`` holds the two equal): ``{"shape", "uint8_b64"}``."""
    data = routes_tlk.to(torch.uint8).contiguous().cpu()
    return {"shape": list(data.shape), "uint8_b64": base64.b64encode(data.numpy().tobytes()).decode()}


def sample_record(t: Trajectory, tokens: list[str], prompt_images: int = 0, **extra) -> dict:
    """One sample's fields shared by train and eval records; ``extra`` adds the trainer's side. ``prompt_images``:
    how many of ``t.images`` are its prompt's (recorded with the prompt, so not again here)."""
    record = {"index": t.sample_index, "text": t.text, "ids": list(t.token_ids), "tokens": tokens,
              "behav_logp": clean(list(t.logprobs)), "versions": list(t.versions), "policy_mask": t.loss_mask,
              "reward": clean(float(t.reward)), "details": clean(t.reward_details), "finish_reason": t.finish_reason,
              "episode": clean(t.episode), **extra}
    if t.routes is not None:  # the response's tokens only, aligned with ``ids`` (the page shows those)
        record["routes"] = encode_routes(t.routes[len(t.prompt_ids) :])
    own = list(t.images or ())[prompt_images:]  # the observations' pictures (None: the prompt's only)
    if own:
        record["images"] = [image_entry(v, f"prompt {t.prompt_uid!r} sample {t.sample_index} image {prompt_images + k}")
                            for k, v in enumerate(own)]
    return record


def train_records(step: int, version: int, groups: Sequence[Group], picks: Sequence[int], batch: TrainBatch | None,
                  logp_bt: torch.Tensor | None, adv: torch.Tensor | None, tokenizer, task: str) -> list[dict]:
    """Records of ``groups[i]`` for i in ``picks``, trained (or left out) at training step ``version``
    and logged as ``step``. ``logp_bt`` and ``adv`` are the trainer's log-probs ([B, T], the batch's
    layout) and advantages ([B] or [B, T]) for ``batch``; any of the three None: not trained."""
    first_row: dict[int, int] = {}
    if batch is not None:
        for row, gi in enumerate(batch.group_index_b.tolist()):
            first_row.setdefault(gi, row)
    records = []
    for gi in picks:
        group = groups[gi]
        prompt_ids = group.trajectories[0].prompt_ids if group.trajectories else []
        prompt = prompt_record(group.prompt, prompt_ids, task, tokenizer)
        samples = []
        for j, t in enumerate(group.trajectories):
            p, n = len(t.prompt_ids), len(t.token_ids)
            row = first_row.get(gi)
            extra: dict = {"staleness": version - t.oldest_version, "trainer_logp": None, "advantage": None,
                           "loss_mask": [0] * n}
            if row is not None:
                row += j
                extra["loss_mask"] = [int(m) for m in batch.loss_mask_bt[row, p : p + n].tolist()]
                if logp_bt is not None:
                    extra["trainer_logp"] = clean(logp_bt[row, p : p + n].tolist())
                if adv is not None:
                    extra["advantage"] = clean(adv[row].item() if adv.dim() == 1 else adv[row, p : p + n].tolist())
            samples.append(sample_record(t, token_texts(tokenizer, t.token_ids), len(prompt.get("images", ())),
                                         **extra))
        records.append({"step": step, "kind": "train", "group": gi, "trained": gi in first_row,
                        "prompt": prompt, "samples": samples})
    return [r for r in records if r["samples"]]  # a group whose every episode failed has nothing to show


def eval_records(step: int, prompts: Sequence[Prompt], trajs: Sequence[Trajectory], tokenizer, task: str) -> list[dict]:
    """One record per held-out prompt: its greedy answer, scored (``correct``: full reward, as
    ``eval/accuracy`` counts it)."""
    records = []
    for p, t in zip(prompts, trajs):
        prompt = prompt_record(p, t.prompt_ids, task, tokenizer)
        records.append({"step": step, "kind": "eval", "prompt": prompt,
                        "samples": [sample_record(t, token_texts(tokenizer, t.token_ids), len(prompt.get("images", ())),
                                                  correct=t.reward >= 1.0)]})
    return records


class SampleRecorder:
    """Decides which steps and prompts are recorded (``log.samples.*``) and writes their records."""

    def __init__(self, log: SampleLog, cfg: SampleLogConfig, tokenizer, task: str):
        self.log, self.cfg, self.tokenizer, self.task = log, cfg, tokenizer, task
        self.bad_images = 0
        """Images (prompts' and observations') that could not be recorded (each record says which, with
        ``{"error": ...}``)."""

    def _write(self, step: int, records: list[dict]) -> None:
        errors = image_errors(records)
        if errors:
            if not self.bad_images:  # once per run: the records name every one
                log.warning("samples.jsonl: %d image(s) at step %d could not be recorded (first: %s); the "
                            "records say so and recording goes on", len(errors), step, errors[0])
            self.bad_images += len(errors)
        self.log.write(step, records)

    def wants_train(self, step: int) -> bool:
        return self.cfg.every > 0 and self.cfg.groups > 0 and step % self.cfg.every == 0 and not self.log.capped

    def record_train(self, step: int, version: int, groups: Sequence[Group], batch: TrainBatch | None, trainer) -> None:
        """Record the step's picked groups; ``trainer`` has just trained ``batch`` (None: nothing trained)
        and holds its log-probs and advantages (a data-parallel ``LeaderTrainer`` holds none: null)."""
        picks = pick(len(groups), self.cfg.groups)
        trained = batch is not None
        logp_bt = getattr(trainer, "last_logp_bt", None) if trained else None
        adv = getattr(trainer, "last_adv", None) if trained else None
        self._write(step, train_records(step, version, groups, picks, batch, logp_bt, adv, self.tokenizer,
                                        self.task))

    def record_eval(self, step: int, prompts: Sequence[Prompt], trajs: Sequence[Trajectory]) -> None:
        n = self.cfg.eval_prompts
        if n > 0 and not self.log.capped:
            self._write(step, eval_records(step, prompts[:n], trajs[:n], self.tokenizer, self.task))
