"""The local engine vs Hugging Face ``generate``: new tokens per second on long-tailed response lengths.

Same model (the warm-started tiny model of the ``repeat`` task, whose answers are "c" repeated n
times with n following a 1/n law, so a few responses are long and most are short), same prompts,
same number of samples, same sampling (temperature 1, top_p 1, no top-k), same ``max_new_tokens``,
same dtype and the same 2 threads. Only real new tokens count: each response's tokens up to and
including its EOS (or ``max_new_tokens`` if it never stops).

- ``hf`` arms batch the requests the way a user would: fixed batches of ``batch_size`` left-padded
  rows through ``model.generate``, which runs a batch until its longest row finishes; a finished
  row keeps computing (pad tokens) until then, which is the padding waste this measures.
- ``engine`` arms hand every request to ``LocalEngine.generate`` at once: continuous batching with
  up to ``max_batch_size`` rows, a finished row's slot refilled at the next step. The engine does
  more per token than ``generate`` (behaviour log-probs, versions, decoded text), not less.

Every arm is warmed up first; then the arms take turns (round robin, ``rounds`` times) and the
median time is reported, so a load change on this shared machine hits all of them alike.
- ``vllm`` arms run plain ``vllm.LLM.generate`` on every request at once (vLLM's own continuous
  batching; ``max_num_seqs`` = the batch size), started as tidal's vLLM engine starts it (float32
  on CPU, eager, a fixed CPU KV cache). vLLM on CPU lives in its own venv
  (``scripts/install_vllm_cpu.sh``): when it is not importable here and that venv exists, the
  benchmark runs its vLLM arms there (``--set only_vllm=true``) after the others and adds the rows;
  those rounds are not interleaved with the others'. ``vllm=false`` leaves them out.

Speculative arms (``_speculative.py``): per task (``repeat``, ``agentic``, ``quickstart``) the engine with and
without ``rollout.speculative`` (prompt lookup, Saxena 2023), side by side: ``speculative_over_plain`` and
``acceptance_rate`` per task, ``speculative_identical`` (the samples are the same).

    tidal bench generate [--set num_prompts=256 --set hf_batch_sizes=[64,256] ...]
    tidal bench generate --set only_speculative=true [--set speculative_tasks=[repeat] --set rounds=5]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from tidal.config import apply_overrides

DESCRIPTION = "local engine vs HF generate: new tokens/s on long-tailed response lengths"


@dataclass
class Settings:
    num_prompts: int = 256
    """Distinct prompts (training prompts of the ``repeat`` task)."""
    group_size: int = 8
    """Samples per prompt (adjacent requests, as in RL rollouts)."""
    max_new_tokens: int = 56
    max_repeat: int = 48
    """The task's longest answer; responses are 1..max_repeat characters plus EOS."""
    sft_steps: int = 300
    """Warm-start steps (the same cached model ``tidal bench async`` uses)."""
    model_path: str | None = None
    """A local Hugging Face model directory to use instead of the warm-started one."""
    hf_batch_sizes: list[int] = field(default_factory=lambda: [64, 256])
    engine_batch_sizes: list[int] = field(default_factory=lambda: [64, 256, 512])
    """The engine's ``max_batch_size`` (the most rows decoded in one forward; 512 is its default)."""
    unshared_batch_sizes: list[int] = field(default_factory=lambda: [512])
    """``engine-unshared`` arms: the engine with ``share_identical_rows=false`` (every row decoded, even
    when a group's samples still agree), to measure what sharing identical rows saves."""
    vllm_batch_sizes: list[int] = field(default_factory=lambda: [256])
    vllm: bool = True
    """Add vLLM arms when vLLM is importable here or ``vllm_venv`` exists (false: never)."""
    vllm_venv: str = ".tidal_cache/vllm-venv"
    only_vllm: bool = False
    """Run only the vLLM arms (how the benchmark calls itself inside the vLLM venv)."""
    rounds: int = 3
    threads: int = 2
    seed: int = 0
    temperature: float = 1.0
    """Sampling temperature of every arm (``tidal bench real`` sets its recipe's)."""
    top_p: float = 1.0
    speculative_tasks: list[str] = field(default_factory=lambda: ["repeat", "agentic", "quickstart"])
    """Tasks of the speculative arms (``benchmarks/_speculative.py``): the engine with and without
    ``rollout.speculative``; empty: none."""
    speculative_method: str = "ngram"
    num_draft_tokens: int = 4
    speculative_prompts: int = 64
    """Prompts per task in the speculative arms (x ``group_size`` samples)."""
    speculative_batch: int = 512
    only_speculative: bool = False
    """Run only the speculative arms (no HF, plain-engine-size or vLLM arms)."""


def count_new_tokens(new_ids_bt: torch.Tensor, eos_id: int) -> list[int]:
    """Real new tokens per row of ``generate``'s output past the prompt: up to and including the
    first EOS, or the whole width when the row never stopped (rows finished early are padded)."""
    is_eos = new_ids_bt == eos_id
    first = is_eos.int().argmax(dim=1)
    return torch.where(is_eos.any(dim=1), first + 1, new_ids_bt.shape[1]).tolist()


def _prompts(s: Settings):
    from tidal.models import tiny
    from tidal.recipes import RECIPES
    from tidal.system.run import base_model_path
    from tidal.tasks import TASKS

    cfg = apply_overrides(RECIPES.get("quickstart_grpo")(), [
        "task.name=repeat", f"task.max_repeat={s.max_repeat}", "task.num_eval=200", f"sft.steps={s.sft_steps}",
        "sft.accuracy_band=null"])
    task = TASKS.get(cfg.task.name)(cfg.task)
    path = s.model_path or base_model_path(cfg, task, progress=False)
    model, tokenizer = tiny.load(path)
    prompts = [task.train_prompt(i) for i in range(s.num_prompts)]
    return model.eval(), tokenizer, prompts, str(path)


class HFArm:
    """``model.generate`` over fixed, left-padded batches of the requests, in request order."""

    def __init__(self, model, tokenizer, requests, batch_size: int, s: Settings):
        self.model, self.tok, self.s, self.batch_size = model, tokenizer, s, batch_size
        self.batches = []
        for i in range(0, len(requests), batch_size):
            seqs = [r.prompt_ids for r in requests[i : i + batch_size]]
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, seq in enumerate(seqs):
                ids[r, width - len(seq) :] = torch.tensor(seq)
                mask[r, width - len(seq) :] = 1
            self.batches.append((ids, mask))

    @torch.no_grad()
    def __call__(self, batches=None) -> tuple[int, int]:
        """Generate every batch; returns (real new tokens, tokens computed including padding)."""
        torch.manual_seed(self.s.seed)
        self.lengths, computed = [], 0
        for ids, mask in batches or self.batches:
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                      temperature=self.s.temperature, top_p=self.s.top_p,
                                      top_k=0, max_new_tokens=self.s.max_new_tokens,
                                      pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
            new = out[:, ids.shape[1] :]
            self.lengths += count_new_tokens(new, self.tok.eos_token_id)
            computed += new.numel()
        return sum(self.lengths), computed

    def warm_up(self) -> None:
        self(self.batches[:1])


class EngineArm:
    """``LocalEngine.generate`` over all requests at once (continuous batching)."""

    def __init__(self, model, tokenizer, requests, batch_size: int, s: Settings, share: bool = True):
        from tidal.rollout.local import LocalEngine, SamplingConfig

        cfg = SamplingConfig(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                             max_batch_size=batch_size, share_identical_rows=share)
        self.engine = LocalEngine(model, tokenizer, cfg, seed=s.seed)
        self.requests = requests

    def __call__(self, requests=None) -> tuple[int, int]:
        self.lengths = [len(t.token_ids) for t in self.engine.generate(requests or self.requests)]
        return sum(self.lengths), sum(self.lengths)  # every computed token is real: finished rows leave the batch

    def warm_up(self) -> None:
        self(self.requests[: self.engine.cfg.max_batch_size])


class VllmArm:
    """Plain ``vllm.LLM.generate`` over all requests at once (vLLM's continuous batching)."""

    def __init__(self, model_path: str, requests, batch_size: int, s: Settings):
        from tidal.rollout.local import SamplingConfig
        from tidal.rollout.vllm_engine import VllmDriver, import_vllm

        vllm = import_vllm()
        cfg = SamplingConfig(max_batch_size=batch_size, max_new_tokens=s.max_new_tokens)
        self.driver = VllmDriver(model_path, cfg, seed=s.seed)
        self.llm = self.driver.llm
        self.params = vllm.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=s.max_new_tokens, seed=None)
        self.prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        self.start_s = self.driver.start_seconds

    def __call__(self, prompts=None) -> tuple[int, int]:
        outs = self.llm.generate(prompts or self.prompts, self.params, use_tqdm=False)
        self.lengths = [len(o.outputs[0].token_ids) for o in outs]
        return sum(self.lengths), sum(self.lengths)

    def warm_up(self) -> None:
        self(self.prompts[:64])


def time_arms(arms: dict, rounds: int) -> tuple[dict, dict]:
    """Warm every arm up, then run them in turns, ``rounds`` times (round robin: a load change on this shared
    machine hits every arm alike). Returns (each arm's seconds per round, its (real, computed) new tokens)."""
    for arm in arms.values():
        arm.warm_up()
    times: dict = {key: [] for key in arms}
    counts = {}
    for _ in range(rounds):
        for key, arm in arms.items():
            start = time.perf_counter()
            counts[key] = arm()
            times[key].append(time.perf_counter() - start)
    return times, counts


def arm_rows(times: dict, counts: dict, num_samples: int) -> list[dict]:
    """One row per ``(arm, batch size)`` of ``time_arms``' results, at the median round's time."""
    rows = []
    for (name, b), (real, computed) in counts.items():
        seconds = statistics.median(times[(name, b)])
        rows.append({"arm": name, "batch_size": b, "samples": num_samples, "new_tokens": real,
                     "mean_len": real / num_samples, "seconds": seconds, "new_tokens_per_s": real / seconds,
                     "wasted_frac": 1 - real / computed})
    return rows


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _vllm_rows_from_venv(s: Settings, overrides: list[str], out_dir: Path) -> tuple[list[dict], dict]:
    """Run this benchmark's vLLM arms inside the vLLM venv and return their rows and lengths."""
    import json
    import subprocess

    tidal_bin = Path(s.vllm_venv) / "bin" / "tidal"
    sub_out = out_dir.parent / "generate_vllm"
    cmd = [str(tidal_bin), "bench", "generate", *[x for o in overrides for x in ("--set", o)],
           "--set", "only_vllm=true", "--out", str(sub_out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads((sub_out / "generate.json").read_text())
    return result["table"], result.get("lengths", {})


def _plot(rows: list[dict], lengths: dict[str, list[int]], s: Settings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hist) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"hf": "C0", "engine": "C1", "vllm": "C2", "engine-unshared": "C3"}
    bars = ax.bar([f"{r['arm']}\nbatch {r['batch_size']}" for r in rows], [r["new_tokens_per_s"] for r in rows],
                  color=[colors.get(r["arm"], "C2") for r in rows])
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['new_tokens_per_s']:,.0f}\n({r['vs_best_hf']:.2f}x)",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("real new tokens / s (median of rounds)")
    ax.set_title(f"{rows[0]['samples']} samples, max_new_tokens={s.max_new_tokens}, {s.threads} threads")
    ax.margins(y=0.2)
    for name, lens in lengths.items():
        hist.hist(lens, bins=range(1, s.max_new_tokens + 2), histtype="step", label=name,
                  color=colors.get(name.split("@")[0], "C2"))
    hist.set_xlabel("response length (new tokens incl. EOS)")
    hist.set_ylabel("samples")
    hist.set_yscale("log")
    hist.legend(fontsize=8)
    hist.set_title("long-tailed lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(overrides: list[str], out_dir: Path) -> dict:
    s = apply_overrides(Settings(), overrides)
    spec = {}
    if s.speculative_tasks and not s.only_vllm:
        from tidal.bench import load

        run_speculative = load("_speculative").run_speculative  # benchmarks/_speculative.py

        threads = torch.get_num_threads()
        torch.set_num_threads(s.threads)
        try:
            spec = run_speculative(s)
        finally:
            torch.set_num_threads(threads)
    if s.only_speculative:
        return {"benchmark": "generate", "description": DESCRIPTION, "table": spec.pop("speculative_table", []), **spec,
                "settings": {f.name: getattr(s, f.name) for f in fields(s)}}
    from tidal.rollout.requests import group_requests

    use_vllm = s.vllm and (s.only_vllm or _vllm_importable())
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        model, tokenizer, prompts, model_path = _prompts(s)
        requests = group_requests(tokenizer, prompts, s.group_size)
        arms = {}
        if not s.only_vllm:
            arms |= {("hf", b): HFArm(model, tokenizer, requests, b, s) for b in s.hf_batch_sizes}
            arms |= {("engine", b): EngineArm(model, tokenizer, requests, b, s) for b in s.engine_batch_sizes}
            arms |= {("engine-unshared", b): EngineArm(model, tokenizer, requests, b, s, share=False)
                     for b in s.unshared_batch_sizes}
        if use_vllm:
            arms |= {("vllm", b): VllmArm(model_path, requests, b, s) for b in s.vllm_batch_sizes}
            torch.set_num_threads(s.threads)  # vLLM's start changes the process's threads
        times, counts = time_arms(arms, s.rounds)
    finally:
        torch.set_num_threads(threads)
    rows = arm_rows(times, counts, len(requests))
    lengths = {f"{name}@{b}": arm.lengths for (name, b), arm in arms.items()}
    if s.only_vllm:
        return {"benchmark": "generate", "description": DESCRIPTION, "table": rows, "lengths": lengths}
    venv_vllm = not use_vllm and s.vllm and (Path(s.vllm_venv) / "bin" / "tidal").exists()
    if venv_vllm:
        vllm_rows, vllm_lengths = _vllm_rows_from_venv(s, overrides, out_dir)
        rows += vllm_rows
        lengths |= vllm_lengths
    best_hf = max(r["new_tokens_per_s"] for r in rows if r["arm"] == "hf")
    for r in rows:
        r["vs_best_hf"] = r["new_tokens_per_s"] / best_hf
    png = out_dir.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    _plot(rows, lengths, s, png)
    best = {arm: max((r["new_tokens_per_s"] for r in rows if r["arm"] == arm), default=float("nan"))
            for arm in ("engine", "vllm")}
    shared = {r["batch_size"]: r["new_tokens_per_s"] for r in rows if r["arm"] == "engine"}
    unshared = {r["batch_size"]: r["new_tokens_per_s"] for r in rows if r["arm"] == "engine-unshared"}
    common = sorted(set(shared) & set(unshared))
    return {"benchmark": "generate", "description": DESCRIPTION, "table": rows,
            "shared_over_unshared": shared[common[-1]] / unshared[common[-1]] if common else float("nan"),
            "settings": {f.name: getattr(s, f.name) for f in fields(s)}, "model": model_path,
            "engine_over_best_hf": best["engine"] / best_hf, "engine_over_best_vllm": best["engine"] / best["vllm"],
            "vllm": "in-process" if use_vllm else ("vllm venv" if venv_vllm else "not installed"), "plot": str(png),
            "times_s": {f"{name}@{b}": t for (name, b), t in times.items()}, **spec}
