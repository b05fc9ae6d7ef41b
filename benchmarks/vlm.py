"""The cost of vision: samples/s with images against the same task rendered as text, and the vision-tower
passes saved by sharing a prompt's picture across its group (issue 54).

One tiny Qwen2-VL (``models/vlm.py``, ~0.8M parameters, one set of weights for every arm) on ``count_squares``
(``tasks/visual.py``): ``prompts`` held-out problems, ``group_size`` samples each, as ``vlm_quickstart`` runs
them (64 x 8, ``max_new_tokens`` 2: one digit and EOS). The arms, side by side in one process, interleaved
``repeats`` times (their order rotated each repeat), each generating with a fresh ``LocalEngine`` (built
outside the timing, so no picture's features are kept from an earlier repeat):

- ``image``: the 56x56 picture and "how many squares?" (31 prompt tokens: 4 image tokens, the two vision
  markers, the question and the chat markers);
- ``text``: the same problems as text (``params.render=text``: "squares at (5,4),(5,5): how many?", 35-53
  tokens by the count), no picture; the only difference is the picture;
- ``image_unshared``: the image prompts with each of a group's G samples under its own prompt uid (same
  picture, same tokens). The engine keys kept features, and the contexts its prefill shares, by uid and
  pictures, so this arm embeds the picture once per sample and prefills every sample; the vision tower's own
  share of the difference is measured with hooks (``tower_s``);
- ``image_long`` / ``text_long`` (``long_new_tokens`` > 0): the first two with longer answers (the random
  policy's samples run to the cap or EOS), so decoding weighs more than prefill and the picture.

The trainer takes a step on the image arm's samples (first repeat) and on the same responses behind the text
prompts (same tokens, rewards = sample index mod 2 so every group has an advantage; the text rows' behaviour
log-probs are the image prompts', which only moves the clipped ratio, not the work), each its own copy of the
weights, in ``trainer`` layout (``vlm_quickstart``'s ``share_prefixes``). A hook on the vision tower counts
the patches each step embeds against what a per-row forward (transformers' ``Qwen2VLForConditionalGeneration``
on every row) would embed. A whole RL step's samples/s per arm is samples / (generation + batch build +
trainer step), each from the same repeat.

Headline (top level): ``image_over_text_samples_per_s``, ``image_over_text_train_step`` (image step time over
text step time), ``vision_passes_saved_frac`` (the engine's: 1 - images embedded / samples, 1 - 1/G for
distinct prompts), ``trainer_vision_passes_saved_frac``, ``shared_over_unshared_samples_per_s``,
``image_over_text_rl_step_samples_per_s``; each ratio the median of the repeats' paired ratios with its
min and max. ``device`` and ``threads`` say where it ran, ``load_average`` how busy the machine was. On cores
shared with other work single repeats swing several-fold, so ``best`` also gives each arm's fastest repeat
(the least disturbed) and the ratios of those, the ``*_cpu_s`` figures the same ratios in the process's CPU
seconds (all threads), and the shares of the unshared arm's extra seconds spent in the
vision tower and in the image processor (``image_processor_s``: decoding and patching the pictures alone, per
prompt and per sample, timed directly); the rest is the prefill of every sample, which the engine also shares
by uid and pictures.

    tidal bench vlm [--set repeats=7 --set prompts=64 --set group_size=8 --set long_new_tokens=32 ...]
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from tidal.config import apply_overrides

DESCRIPTION = "VLM cost of vision: image vs text samples/s and train step, vision passes saved by group sharing"

TRAINER_LAYOUTS = ("padded", "packing", "share_prefixes")


@dataclass
class Settings:
    prompts: int = 64
    """Distinct problems (held-out ``count_squares`` prompts; distinct problems are distinct pictures)."""
    group_size: int = 8
    max_new_tokens: int = 2
    """``vlm_quickstart``'s: one digit and EOS."""
    long_new_tokens: int = 32
    """The longer-answer arms' cap (0: no such arms)."""
    repeats: int = 7
    warmup: int = 1
    """Untimed rounds of every arm first (allocator, kernels, the image processor's first call)."""
    trainer: str = "share_prefixes"
    """The trainer layout: padded, packing or share_prefixes (``vlm_quickstart``'s)."""
    lr: float = 1e-4
    threads: int = 1
    """Torch threads. One by default: on 2 cores shared with other work (the usual machine), 2 threads ran 4-10x
    slower with several-fold swings between repeats (their barriers wait on a descheduled thread), 1 thread
    steadily."""
    device: str = "cpu"
    """cpu, cuda or auto (CUDA when there is one)."""
    seed: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TowerClock:
    """Forward hooks on a model's vision tower: calls, patches embedded and seconds spent in it."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from tidal.models import vlm

        self.visual, self.device = vlm.hf_model(model).model.visual, device
        self.calls = self.patches = 0
        self.seconds, self._t0 = 0.0, 0.0
        self._hooks = [self.visual.register_forward_pre_hook(self._pre), self.visual.register_forward_hook(self._post)]

    def _pre(self, module, args):
        _sync(self.device)
        self.calls += 1
        self.patches += int(args[0].shape[0])
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        _sync(self.device)
        self.seconds += time.perf_counter() - self._t0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def task_prompts(s: Settings, render: str):
    from tidal.tasks import TASKS
    from tidal.tasks.config import TaskConfig

    task = TASKS.get("count_squares")(TaskConfig(name="count_squares", num_eval=s.prompts, seed=s.seed,
                                                 params={"render": render}))
    return task.eval_prompts()[: s.prompts]


def unshared(prompts, group_size: int):
    """Each prompt G times under its own uid (``uid#j``): same picture and tokens, nothing shared by the engine."""
    return [dataclasses.replace(p, uid=f"{p.uid}#{j}") for p in prompts for j in range(group_size)]


def generate_arm(model, tokenizer, prompts, group: int, new_tokens: int, seed: int, device: torch.device) -> dict:
    from tidal.rollout.local import LocalEngine, SamplingConfig
    from tidal.rollout.requests import group_requests

    engine = LocalEngine(model, tokenizer, SamplingConfig(max_new_tokens=new_tokens, dtype="fp32"), seed)
    clock = TowerClock(engine.model, device)
    requests = group_requests(tokenizer, prompts, group)
    try:
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        trajs = engine.generate(requests)
        _sync(device)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    finally:
        clock.remove()
    stats = engine.stats()
    tokens = sum(t.num_tokens for t in trajs)
    return {"seconds": seconds, "cpu_s": cpu_s, "samples_per_cpu_s": len(trajs) / cpu_s, "samples": len(trajs),
            "tokens": tokens, "samples_per_s": len(trajs) / seconds,
            "tokens_per_s": tokens / seconds, "tower_s": clock.seconds, "tower_patches": clock.patches,
            "vision_passes": stats.get("rollout/vision_passes", 0.0),
            "vision_images": stats.get("rollout/vision_images", 0.0),
            "vision_images_reused": stats.get("rollout/vision_images_reused", 0.0),
            "prompt_tokens": [len(t.prompt_ids) for t in trajs[::group]] if group > 1 else
            [len(t.prompt_ids) for t in trajs], "trajectories": trajs}


def _groups(prompts, trajs, group: int, text_prompts=None, text_ids=None):
    """The arm's groups with rewards = sample index mod 2; with ``text_prompts``, the same responses behind the text
    prompts (``text_ids``: their prompt ids)."""
    from tidal.types import Group

    out = []
    for i, p in enumerate(prompts):
        rows = trajs[i * group:(i + 1) * group]
        if text_prompts is not None:
            p = text_prompts[i]
            rows = [dataclasses.replace(t, prompt_uid=p.uid, prompt_ids=list(text_ids[i])) for t in rows]
        out.append(Group(p, [dataclasses.replace(t, reward=float(t.sample_index % 2)) for t in rows]))
    return out


def _trainer_config(s: Settings):
    from tidal.train.config import TrainerConfig

    if s.trainer not in TRAINER_LAYOUTS:
        raise ValueError(f"trainer={s.trainer!r}: one of {', '.join(TRAINER_LAYOUTS)}")
    return TrainerConfig(packing=s.trainer == "packing", share_prefixes=s.trainer == "share_prefixes")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run(overrides: list[str], out_dir: Path) -> dict:
    from tidal.algo.config import AlgoConfig
    from tidal.models import vlm
    from tidal.optim import OptimConfig
    from tidal.rollout.requests import prompt_ids
    from tidal.train.batch import build_train_batch
    from tidal.train.trainer import Trainer
    from tidal.utils.device import resolve_device
    from tidal.utils.images import load_image

    s = apply_overrides(Settings(), overrides)
    load_before = os.getloadavg()
    device = resolve_device(s.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        cfg = vlm.VLMConfig(init_seed=s.seed)
        processor = vlm.build_processor(cfg)
        model = vlm.build_vlm(cfg, processor).to(device)
        tokenizer = vlm.attach_processor(processor.tokenizer, processor)
        G = s.group_size
        image_prompts, text_prompts = task_prompts(s, "image"), task_prompts(s, "text")
        assert [p.answer for p in image_prompts] == [p.answer for p in text_prompts]
        text_ids = [prompt_ids(tokenizer, p) for p in text_prompts]
        arms = {"image": (image_prompts, G, s.max_new_tokens), "text": (text_prompts, G, s.max_new_tokens),
                "image_unshared": (unshared(image_prompts, G), 1, s.max_new_tokens)}
        if s.long_new_tokens > 0:
            arms |= {"image_long": (image_prompts, G, s.long_new_tokens),
                     "text_long": (text_prompts, G, s.long_new_tokens)}

        gen: dict[str, list[dict]] = {a: [] for a in arms}
        train: dict[str, list[dict]] = {"image": [], "text": []}
        trainers = {a: Trainer(copy.deepcopy(model), AlgoConfig(skip_zero_adv_groups=False), OptimConfig(lr=s.lr),
                               _trainer_config(s)) for a in train}
        groups = None
        processor_s: dict[str, list[float]] = {"per_prompt": [], "per_sample": []}
        for r in range(s.warmup + s.repeats):
            names = list(arms)
            names = names[r % len(names):] + names[: r % len(names)]  # rotate the order: no arm always first
            for name in names:
                ps, g, n = arms[name]
                out = generate_arm(model, tokenizer, ps, g, n, s.seed + r, device)
                trajs = out.pop("trajectories")
                if r >= s.warmup:
                    gen[name].append(out)
                if groups is None and name == "image":
                    groups = {"image": _groups(image_prompts, trajs, G),
                              "text": _groups(image_prompts, trajs, G, text_prompts, text_ids)}
            if r >= s.warmup:  # the host's image processing alone: each prompt's picture, and one per sample
                for key, pictures in (("per_prompt", image_prompts), ("per_sample", unshared(image_prompts, G))):
                    t0 = time.perf_counter()
                    vlm.image_batch(processor, [load_image(p.images[0]) for p in pictures])
                    processor_s[key].append(time.perf_counter() - t0)
            if groups is None:
                continue
            for name in (["image", "text"] if r % 2 == 0 else ["text", "image"]):
                trainer = trainers[name]
                t0 = time.perf_counter()
                batch, _ = build_train_batch(groups[name], AlgoConfig(skip_zero_adv_groups=False),
                                             processor.tokenizer.pad_token_id, processor)
                build_s = time.perf_counter() - t0
                clock = TowerClock(trainer.model, device)
                try:
                    _sync(device)
                    t0, c0 = time.perf_counter(), time.process_time()
                    trainer.step(batch)
                    _sync(device)
                    step_s, step_cpu_s = time.perf_counter() - t0, time.process_time() - c0
                finally:
                    clock.remove()
                per_row = 0
                if batch.images is not None:
                    per_image = batch.images.image_grid_thw_n3.prod(-1).tolist()
                    per_row = sum(per_image[i] for row in batch.images.row_images for i in row)
                if r >= s.warmup:
                    train[name].append({"build_s": build_s, "step_s": step_s, "step_cpu_s": step_cpu_s,
                                        "tower_s": clock.seconds,
                                        "tower_calls": clock.calls, "tower_patches": clock.patches,
                                        "per_row_patches": per_row, "rows": batch.num_sequences,
                                        })
    finally:
        torch.set_num_threads(threads)
    out = summarize(s, device, gen, train, image_prompts, text_ids)
    out["image_processor_s"] = {k: _spread(v) for k, v in processor_s.items()}
    best = out["best"]
    extra = best["image_unshared_s"] - best["image_s"]
    best["unshared_extra_s_in_image_processor_frac"] = (
        (min(processor_s["per_sample"]) - min(processor_s["per_prompt"])) / extra if extra > 0 else None)
    out["load_average"] = {"before": list(load_before), "after": list(os.getloadavg()),
                           "note": "1/5/15-minute load of the machine: above the threads, other work shared the cores"}
    return out


def summarize(s: Settings, device: torch.device, gen: dict, train: dict, image_prompts, text_ids) -> dict:
    G = s.group_size
    samples = s.prompts * G

    def paired(a: str, b: str, key: str, store=gen) -> dict:
        return _spread([x[key] / y[key] for x, y in zip(store[a], store[b])])

    def med(arm: str, key: str, store=gen) -> float:
        return statistics.median(x[key] for x in store[arm])

    rl = {arm: [samples / (g["seconds"] + t["build_s"] + t["step_s"]) for g, t in zip(gen[arm], train[arm])]
          for arm in ("image", "text")}
    image_over_text = paired("image", "text", "samples_per_s")
    train_ratio = _spread([x["step_s"] / y["step_s"] for x, y in zip(train["image"], train["text"])])
    shared_ratio = paired("image", "image_unshared", "samples_per_s")
    rl_ratio = _spread([x / y for x, y in zip(rl["image"], rl["text"])])
    # process CPU seconds (all threads)
    cpu = {"image_over_text_samples_per_cpu_s": paired("image", "text", "samples_per_cpu_s"),
           "image_over_text_train_step_cpu_s": _spread([x["step_cpu_s"] / y["step_cpu_s"]
                                                        for x, y in zip(train["image"], train["text"])]),
           "shared_over_unshared_samples_per_cpu_s": paired("image", "image_unshared", "samples_per_cpu_s")}
    if "image_long" in gen:
        cpu["image_over_text_samples_per_cpu_s_long"] = paired("image_long", "text_long", "samples_per_cpu_s")
    engine_saved = 1 - gen["image"][0]["vision_images"] / samples
    unshared_saved = 1 - gen["image_unshared"][0]["vision_images"] / samples
    t0 = train["image"][0]
    trainer_saved = 1 - t0["tower_patches"] / t0["per_row_patches"]

    image_len = gen["image"][0]["prompt_tokens"]
    text_len = [len(ids) for ids in text_ids]
    by_count: dict[int, list[int]] = {}
    for p, ids in zip(image_prompts, text_ids):
        by_count.setdefault(p.meta["count"], []).append(len(ids))
    prompt_tokens = {
        "image": {"mean": statistics.fmean(image_len), "min": min(image_len), "max": max(image_len),
                  "image_tokens": 4, "vision_markers": 2},
        "text": {"mean": statistics.fmean(text_len), "min": min(text_len), "max": max(text_len),
                 "histogram": {str(k): v for k, v in sorted(Counter(text_len).items())},
                 "by_count": {str(c): sorted(set(v)) for c, v in sorted(by_count.items())}},
    }

    table = []
    for arm in gen:
        table.append({
            "arm": arm, "samples": samples,
            "new_tokens": s.long_new_tokens if arm.endswith("_long") else s.max_new_tokens,
            "samples_per_s": med(arm, "samples_per_s"),
            "spread": "{:.0f}-{:.0f}".format(*(f(x["samples_per_s"] for x in gen[arm]) for f in (min, max))),
            "tokens_per_s": med(arm, "tokens_per_s"),
            "samples_per_cpu_s": med(arm, "samples_per_cpu_s"),
            "prompt_tokens": statistics.fmean(text_len if arm.startswith("text") else image_len),
            "images_embedded": gen[arm][0]["vision_images"], "tower_s": med(arm, "tower_s"),
            "train_step_s": med(arm, "step_s", train) if arm in train else None,
            "rl_step_samples_per_s": statistics.median(rl[arm]) if arm in rl else None,
        })
    arms = {arm: {"samples_per_s": _spread([x["samples_per_s"] for x in runs]),
                  "tokens_per_s": _spread([x["tokens_per_s"] for x in runs]),
                  "seconds": _spread([x["seconds"] for x in runs]),
                  "cpu_s": _spread([x["cpu_s"] for x in runs]),
                  "tower_s": _spread([x["tower_s"] for x in runs]),
                  "tokens": [x["tokens"] for x in runs],
                  "vision_passes": runs[0]["vision_passes"], "vision_images": runs[0]["vision_images"],
                  "vision_images_reused": runs[0]["vision_images_reused"],
                  "tower_patches": runs[0]["tower_patches"]} for arm, runs in gen.items()}
    trainer = {arm: {"step_s": _spread([x["step_s"] for x in runs]),
                     "step_cpu_s": _spread([x["step_cpu_s"] for x in runs]),
                     "build_s": _spread([x["build_s"] for x in runs]),
                     "tower_s": _spread([x["tower_s"] for x in runs]),
                     "tower_calls": runs[0]["tower_calls"], "tower_patches": runs[0]["tower_patches"],
                     "per_row_patches": runs[0]["per_row_patches"], "rows": runs[0]["rows"],

                     "rl_step_samples_per_s": _spread(rl[arm])} for arm, runs in train.items()}
    best = {  # each arm's fastest repeat: the least disturbed by other work on shared cores
        "image_over_text_samples_per_s": max(x["samples_per_s"] for x in gen["image"])
        / max(x["samples_per_s"] for x in gen["text"]),
        "image_over_text_train_step": min(x["step_s"] for x in train["image"])
        / min(x["step_s"] for x in train["text"]),
        "shared_over_unshared_samples_per_s": max(x["samples_per_s"] for x in gen["image"])
        / max(x["samples_per_s"] for x in gen["image_unshared"]),
        "image_tower_s": min(x["tower_s"] for x in gen["image"]),
        "image_unshared_tower_s": min(x["tower_s"] for x in gen["image_unshared"]),
        "image_s": min(x["seconds"] for x in gen["image"]),
        "text_s": min(x["seconds"] for x in gen["text"]),
        "image_unshared_s": min(x["seconds"] for x in gen["image_unshared"]),
    }
    extra = best["image_unshared_s"] - best["image_s"]
    best["unshared_extra_s_in_tower_frac"] = ((best["image_unshared_tower_s"] - best["image_tower_s"]) / extra
                                              if extra > 0 else None)
    long = {}
    if "image_long" in gen:
        long = {"image_over_text_samples_per_s_long": paired("image_long", "text_long", "samples_per_s")["median"],
                "image_over_text_tokens_per_s_long": paired("image_long", "text_long", "tokens_per_s")["median"]}
    return {
        "benchmark": "vlm", "description": DESCRIPTION, "table": table,
        "image_over_text_samples_per_s": image_over_text["median"],
        "image_over_text_train_step": train_ratio["median"],
        "vision_passes_saved_frac": engine_saved,
        "trainer_vision_passes_saved_frac": trainer_saved,
        "shared_over_unshared_samples_per_s": shared_ratio["median"],
        "image_over_text_rl_step_samples_per_s": rl_ratio["median"],
        **long,
        **{k: v["median"] for k, v in cpu.items()},
        "device": str(device) if device.type == "cuda" else "cpu (no accelerator: wall-clock seconds on the CPU)",
        "threads": s.threads,
        "ratios": {"image_over_text_samples_per_s": image_over_text,
                   "image_over_text_tokens_per_s": paired("image", "text", "tokens_per_s"),
                   "image_over_text_train_step": train_ratio,
                   "shared_over_unshared_samples_per_s": shared_ratio,
                   "image_over_text_rl_step_samples_per_s": rl_ratio,
                   "image_unshared_vision_passes_saved_frac": unshared_saved},
        "cpu_time_ratios": cpu,
        "best": best,
        "prompt_tokens": prompt_tokens, "arms": arms, "trainer": trainer,
        "settings": {f.name: getattr(s, f.name) for f in fields(s)},
    }


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run([], Path("benchmarks/results/vlm")), indent=2, default=str))
