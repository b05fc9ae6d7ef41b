"""``tidal bench gpu``: its FLOP and roofline formulas against hand-computed numbers, and the whole benchmark on a
toy size on CPU in bf16 (the dtypes it uses on a GPU), every part's code path included."""

import dataclasses
import json

import pytest
import torch
import transformers

from tidal import bench

gpu = bench.load("gpu")
roofline = bench.load("_roofline")

TOY = ["device=cpu", "precision=bf16", "engine_dtype=bf16", "matmul_size=64", "copy_mb=8",
       "train_groups=2", "group_size=4", "prompt_len=8", "max_response=24", "pack_tokens=64", "micro_batch_tokens=64",
       "train_steps=1", "gen_prompts=2", "gen_group_size=3", "gen_prompt_len=4", "gen_max_new_tokens=8",
       "gen_max_batch_size=4", "rl_prompts=2", "rl_group_size=3", "rl_max_new_tokens=6", "rl_steps=1",
       "attention_prompts=1", "attention_group_size=2", "attention_prompt_len=16", "attention_new_tokens=4",
       "widths_rows=2", "widths_prompt_len=8", "widths_budget=200", "widths_steps=4"]
"""Toy sizes; 6 generate requests over 4 slots, so the engine refills a slot and HF runs two batches."""


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_and_training_flops_by_hand(tied):
    """hidden 8, 2 layers, 2 heads of 4, 1 KV head, intermediate 16, vocab 10. Per layer: q 8x8 + 8 bias, k and v
    8x4 + 4 each, o 8x8, MLP 3 x 8x16, two norms of 8: 72 + 36 + 36 + 64 + 384 + 16 = 608. Two layers and the
    final norm: 1224; plus the head's 10 x 8 (tied or not; the input embedding is never counted): 1304."""
    config = transformers.Qwen2Config(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=16, vocab_size=10, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert roofline.matmul_params(model) == 1304
    # sequences of 3 and 4 tokens: 7 tokens; causal (query, key) pairs 3*4/2 + 4*5/2 = 16
    # 6 * 1304 * 7 + 12 * 2 layers * 8 * 16 = 54768 + 3072
    assert roofline.training_flops(1304, 2, 8, [3, 4]) == 57840
    # the head (10 x 8 = 80 of N) on 3 of the 7 tokens only (trainer.head_tokens=loss): 6 * 80 * 4 fewer
    assert roofline.training_flops(1304, 2, 8, [3, 4], head_params=80, head_tokens=3) == 57840 - 6 * 80 * 4


def test_decode_schedule_and_roofline_by_hand():
    # prompts of 2 and 3 tokens, budgets 1 and 2. One slot: the second request waits for the first.
    assert roofline.decode_steps([2, 3], [1, 2], max_rows=1) == [(1, 2), (1, 3), (1, 4)]
    steps = roofline.decode_steps([2, 3], [1, 2], max_rows=2)
    assert steps == [(2, 5), (1, 4)]
    # weights 100 B, 10 B of KV per context token, 1000 B/s: (100 + 50) + (100 + 40) B = 0.29 s for 3 tokens
    assert roofline.roofline_tokens_per_s(100, 10, steps, 1000) == pytest.approx(3 / 0.29)
    config = transformers.Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                      num_key_value_heads=2)
    assert roofline.kv_bytes_per_token(config, torch.bfloat16) == 2 * 24 * 2 * 64 * 2  # K, V; 24 layers, 2 heads of 64


def test_datasheet_peaks_by_device_name():
    assert roofline.datasheet_tflops("NVIDIA H100 80GB HBM3") == 989.0  # the SXM part
    assert roofline.datasheet_tflops("NVIDIA H100 PCIe") == 756.0
    assert roofline.datasheet_tflops("NVIDIA H200") == 989.0
    assert roofline.datasheet_tflops("Tesla T4") is None


def test_cpu_defaults_sit_under_the_command_line():
    s, device = gpu.resolve(["device=cpu", "pack_tokens=99"])
    assert device.type == "cpu" and s.model == "stand-in" and s.pack_tokens == 99 and s.matmul_size == 1024
    assert gpu.MODELS["qwen2.5-0.5b"]["vocab_size"] == 151936 and gpu.Settings().model == "qwen2.5-0.5b"


def test_tiny_shapes_sit_between_the_device_defaults_and_the_command_line():
    s, _ = gpu.resolve(["device=cpu", "tiny=true", "train_steps=2"])
    assert s.tiny and s.model == "stand-in" and s.matmul_size == 64 and s.rl_max_new_tokens == 6 and s.train_steps == 2
    toy, _ = gpu.resolve(TOY)
    assert gpu.resolve(["device=cpu", "tiny=true", "precision=bf16", "engine_dtype=bf16"])[0] == dataclasses.replace(
        toy, tiny=True)


def test_long_tailed_lengths_are_mostly_short():
    import random

    lengths = gpu.long_tailed(random.Random(0), 2000, 512)
    assert min(lengths) >= 1 and max(lengths) <= 512
    assert sorted(lengths)[1000] < 40 < max(lengths) - 200  # median short, a tail past 300


def test_the_whole_benchmark_on_a_toy_size(tmp_path):
    result = gpu.run(TOY, tmp_path / "gpu")
    assert result["device"] == "cpu" and "stand-in" in result["model"]
    train, gen, rl = result["train"], result["generate"], result["rl_step"]
    assert "error" not in train and "error" not in gen and "error" not in rl, (train, gen, rl)
    assert train["autocast_dtype"] == "torch.bfloat16" and gen["dtype"] == "torch.bfloat16"
    assert train["decoder_forwards_per_step"] == train["micro_batches_per_step"] >= 2  # 64-token micro-batches
    assert result["trainer_mfu"] == train["trainer_mfu_vs_measured_matmul"] > 0  # no datasheet peak on a CPU
    assert train["trainer_tokens_per_s"] == pytest.approx(train["tokens_per_step"] / train["step_s"])
    assert 0 < result["engine_over_hf_generate"] and 0 < gen["engine_roofline_frac"] < 1
    assert gen["requests"] == 6 and gen["useful_tokens"] == gen["hf_useful_tokens"]  # the same useful work
    assert gen["useful_tokens"] <= gen["hf_computed_tokens"] <= 6 * 8  # two batches, each to its longest budget
    split = result["step_time_split"]
    assert set(split) == {"generate", "score", "train", "weight_sync", "fractions"}
    assert all(split[k] > 0 for k in split["fractions"]) and sum(split["fractions"].values()) == pytest.approx(1)
    assert rl["rl_steps"][0]["samples"] == 6 and rl["rl_steps"][0]["reward_std"] > 0
    assert [r["part"] for r in result["table"]].count("rl_step") == 8  # phases, samples/s, prepare, 2 generates
    # issue 51's keys, at the top level
    assert result["on_cpu"] is True and result["tiny"] is False
    assert set(result["trainer_phase_ms"]) == {"forward", "head", "backward", "optimizer"}
    assert all(ms > 0 for ms in result["trainer_phase_ms"].values()), result["trainer_phase_ms"]
    assert result["trainer_phase_ms"]["head"] <= result["trainer_phase_ms"]["forward"]
    assert result["decode_step_ms"] == pytest.approx(gen["engine_s"] * 1e3 / gen["decode_steps"])
    step = rl["rl_steps"][-1]
    assert result["rl_samples_per_s"] == pytest.approx(6 / step["total_s"])
    lengths = result["rl_response_lengths"]
    assert lengths["count"] == 6 and lengths["total"] == step["response_tokens"]
    assert 1 <= lengths["min"] <= lengths["median"] <= lengths["max"] <= 6 and "1/n" in lengths["distribution"]
    assert bench.format_table(result["table"])
    json.dumps(result)  # the harness writes it as JSON
    partial = json.loads((tmp_path / "gpu_partial.json").read_text())  # kept after each part, for a timed-out run
    assert partial["rl_step"]["rl_steps"][0]["samples"] == 6


def test_a_failing_part_keeps_the_others(tmp_path, monkeypatch):
    def broken(*_):
        raise RuntimeError("out of memory, say")

    monkeypatch.setitem(gpu.PARTS, "generate", broken)
    result = gpu.run([*TOY, "parts=[generate]"], tmp_path / "gpu")
    assert result["generate"]["error"] == "RuntimeError: out of memory, say"
    assert result["engine_over_hf_generate"] is None and result["trainer_mfu"] is None
    assert result["decode_step_ms"] is None and result["rl_samples_per_s"] is None
    assert result["matmul_tflops_measured"] > 0 and bench.format_table(result["table"])


def test_a_spent_budget_stops_the_part_and_skips_the_rest(tmp_path, monkeypatch):
    """``budget_s``: a part still running when the budget is spent is stopped inside (its entry says so), the
    parts after it are skipped, and the result is still written: the device check's stage limit no longer loses
    every figure (the H200 recheck's bench was killed in its fourth part and wrote no gpu.json)."""
    import time

    def slow(*_):
        time.sleep(30)
        return {"never": True}

    monkeypatch.setitem(gpu.PARTS, "generate", slow)
    start = time.monotonic()
    result = gpu.run([*TOY, "parts=[train,generate,rl_step]", "budget_s=4"], tmp_path / "gpu")
    assert time.monotonic() - start < 25
    assert result["train"].get("trainer_mfu") is not None or "budget_s" in result["train"].get("error", "")
    assert result["generate"]["error"].startswith("BudgetSpent: stopped after")
    assert "budget_s=4 spent" in result["rl_step"]["skipped"]
    assert json.loads((tmp_path / "gpu_partial.json").read_text())["generate"]["error"]
    signal = __import__("signal")
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler, None)


def test_decode_attention_arms_on_a_toy_size(tmp_path):
    """Each ``rollout.decode_attention`` arm decodes the same rows: the same tokens, a step time each, and the SDPA
    backend of each arm's call named; the other parts' keys stay (None: they did not run)."""
    result = gpu.run([*TOY, "parts=[decode_attention]", "attention_new_tokens=5"], tmp_path / "gpu")
    arms = result["decode_attention"]
    assert "error" not in arms, arms
    assert arms["rows"] == 2 and arms["context"] == 16 + 5
    assert all(isinstance(result[f"decode_step_ms_{mode}"], float) for mode in ("repeat", "gqa", "fold"))  # toy: noise
    assert arms["decode_tokens_gqa"] == arms["decode_tokens_fold"] == arms["decode_tokens_repeat"]
    assert len(arms["decode_tokens_repeat"]) == 5
    assert set(result["decode_kernels"]) == {f"{m} q={q}" for m in ("repeat", "gqa", "fold") for q in (1, 5)}
    assert result["decode_step_ms"] is None and result["trainer_mfu"] is None
    assert set(result["decode_call_ms"]) == set(result["decode_kernels"])
    assert [r["part"] for r in result["table"]].count("decode_attention") == 6


def test_documented_commands_name_real_settings():
    """The ``tidal bench gpu`` lines of docs/benchmarks.md parse against the benchmark's settings."""
    import re
    import shlex
    from pathlib import Path

    from tidal.config import apply_overrides

    doc = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    lines = re.findall(r"^tidal bench gpu.*$", doc, flags=re.M)
    assert len(lines) == 4, lines
    for line in lines:
        args = shlex.split(line, comments=True)[3:]
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        settings = apply_overrides(gpu.Settings(), sets)
        for kv in sets:
            key, value = kv.split("=", 1)
            assert str(getattr(settings, key)).replace("'", "").lower() == value.lower(), kv


def test_profile_table_names_the_costliest_ops():
    a = torch.randn(256, 256)
    rows = roofline.profile_table(lambda: [a @ a for _ in range(3)], torch.device("cpu"), top=3)
    assert len(rows) <= 3 and rows[0]["op"] in ("aten::mm", "aten::matmul") and rows[0]["calls"] >= 3


def test_the_head_on_loss_tokens_only_is_counted_as_such(tmp_path):
    result = gpu.run([*TOY, "parts=[train]", "head_tokens=loss"], tmp_path / "gpu")
    train = result["train"]
    assert "error" not in train, train
    responses = train["tokens_per_step"] - train["sequences_per_step"] * 8  # TOY's prompt_len
    assert train["head_tokens_per_step"] == responses < train["tokens_per_step"]
