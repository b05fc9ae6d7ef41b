"""``tidal bench gpu``'s table: one row per figure of every part that ran (``benchmarks/gpu.py`` calls it)."""

from __future__ import annotations

from tidal.bench import load

gpu_widths = load("_gpu_widths")


def table(result: dict) -> list[dict]:
    """Rows of (part, quantity, value, note) from ``result``; a part that failed shows its error in the note."""
    rows = []
    train, gen, rl = (result.get(k, {}) for k in ("train", "generate", "rl_step"))

    def row(part, quantity, value, note=""):
        rows.append({"part": part, "quantity": quantity, "value": value, "note": note})

    row("peak", "matmul TFLOP/s measured", result.get("matmul_tflops_measured"), result.get("matmul_dtype", ""))
    row("peak", "datasheet TFLOP/s", result.get("peak_tflops_datasheet"), result.get("device", ""))
    row("peak", "copy TB/s measured", (result.get("copy_bandwidth_bytes_per_s") or 0) / 1e12, "read + write")
    row("train", "tokens/s", train.get("trainer_tokens_per_s"), train.get("error", "packed, one fwd+bwd"))
    row("train", "MFU vs datasheet", train.get("trainer_mfu"), "6N + causal attention")
    row("train", "MFU vs measured matmul", train.get("trainer_mfu_vs_measured_matmul"), "")
    tf32 = result.get("train_tf32", {})
    row("train", "MFU vs datasheet, TF32 head", tf32.get("trainer_mfu"), tf32.get("error", "trainer.head_matmul=tf32"))
    if "train_bf16_master" in result:
        master = result["train_bf16_master"]
        row("train", "MFU vs datasheet, bf16_master", master.get("trainer_mfu"),
            master.get("error", "trainer.weights=bf16_master"))
    row("generate", "engine useful tok/s", gen.get("engine_tokens_per_s"), gen.get("error", ""))
    row("generate", "HF generate useful tok/s", gen.get("hf_generate_tokens_per_s"), "")
    row("generate", "engine / HF generate", gen.get("engine_over_hf_generate"), "")
    row("generate", "engine roofline frac", gen.get("engine_roofline_frac"), "weights + live KV per step")
    split = rl.get("step_time_split") or {}
    row("generate", "decode step ms", gen.get("decode_step_ms"), "engine s / decode steps of its schedule")
    for phase, ms in (train.get("trainer_phase_ms") or {}).items():
        row("train", f"{phase} ms", ms, "perf/trainer_*_ms of the last step")
    for phase in ("generate", "score", "train", "weight_sync"):
        note = f"{split['fractions'][phase]:.1%}" if split else rl.get("error", "")
        row("rl_step", f"{phase} s", split.get(phase), note)
    lengths = rl.get("rl_response_lengths") or {}
    note = (f"response tokens mean {lengths['mean']:.1f}, median {lengths['median']}, max {lengths['max']}"
            if lengths else rl.get("error", ""))
    row("rl_step", "samples/s", rl.get("rl_samples_per_s"), note)
    counters = rl.get("rl_engine_counters") or {}
    row("rl_step", "prepare s", rl.get("rl_prepare_s"), "slot cache sized, decode buckets recorded, before the clock")
    row("rl_step", "first generate s", rl.get("rl_first_generate_s"),
        f"graph recordings {counters.get('graph_recordings')}, in decode {counters.get('graph_late_steps')}, "
        f"slot resizes {counters.get('slot_resizes')} (all steps)")
    row("rl_step", "second generate s", rl.get("rl_second_generate_s"), "the same requests again")
    if "decode_attention" in result:
        arms = result["decode_attention"]
        kernels = arms.get("decode_kernels") or {}
        for mode in ("repeat", "gqa", "fold"):
            if f"decode_step_ms_{mode}" in arms or "error" in arms:
                row("decode_attention", f"decode step ms, {mode}", arms.get(f"decode_step_ms_{mode}"),
                    arms.get("error", f"SDPA kernel {kernels.get(f'{mode} q=1')} (q=1), "
                                      f"{kernels.get(f'{mode} q=5')} (q=5)"))
                calls = arms.get("decode_call_ms") or {}
                row("decode_attention", f"one attention call ms, {mode}", calls.get(f"{mode} q=1"),
                    f"q=5: {calls.get(f'{mode} q=5')}")
    for args in gpu_widths.table_rows(result):
        row(*args)
    for mode in ("sync", "late") if "host_reads" in result else ():
        arm = result["host_reads"].get(mode) or {}
        row("host_reads", f"decode step ms, {mode}", arm.get("decode_step_ms"), result["host_reads"].get(
            "error", f"host ms {arm.get('decode_step_host_ms')}, syncs/step {arm.get('syncs_per_step')}"))
    return rows
