"""LoRA runs end to end on the tiny model (models/lora.py, docs/lora.md): sync and async, the KL reference as
the base with adapters disabled, exact resume, checkpoints in PEFT's layout, and the combinations refused."""

import json

import pytest
import torch

from tidal.config import ConfigError
from tidal.models import lora
from tidal.models.logprobs import token_logprobs
from tidal.system.run import check_inputs
from tidal.train.checkpoint import latest_checkpoint
from tidal.utils.yaml_file import read_yaml

from .test_controller import comparable, run, tiny_cfg

pytest.importorskip("peft", reason="needs peft: pip install 'tidal[lora]'")
LORA = ("model.lora.rank=4", "optim.lr=5e-2")


def adapters(controller):
    return {k: v.clone() for k, v in controller.trainer.model.state_dict().items() if "lora_" in k}


def test_sync_lora_run_trains_adapters_only_and_sends_only_them(tmp_path):
    c, result = run(tiny_cfg(tmp_path, "system.mode=sync", *LORA), tmp_path / "run")
    trainer = c.trainer
    base = {k: v for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    fresh = c.trainer.model.get_base_model()  # the base weights never moved
    assert all(not p.requires_grad for n, p in fresh.named_parameters() if "lora_" not in n)
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in trainer.model.named_parameters() if id(p) in held]
    assert names and all("lora_" in n for n in names), "the optimizer holds a base parameter"
    rows = [r for r in result.history if "perf/weight_sync_bytes" in r]
    adapter_bytes = sum(v.numel() * 4 for k, v in trainer.model.state_dict().items() if "lora_" in k)
    scales = 4 * sum(1 for k in trainer.model.state_dict() if "lora_A" in k)  # one float32 scale per layer
    assert rows and all(r["perf/weight_sync_bytes"] == adapter_bytes + scales for r in rows)
    assert any(r.get("train/grad_norm", 0) > 0 for r in result.history), "the test must actually train"
    assert base
    assert c.engine._apply_pending_update()  # the last update, staged: the engine applies it at its next stream
    assert c.engine.version == trainer.version
    ids = torch.randint(3, 40, (3, 9))
    want = token_logprobs(trainer.model, ids, None)[0]
    got = token_logprobs(c.engine.model, ids, None)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert (ckpt / lora.ADAPTER_CONFIG).exists() and not (ckpt / "model.safetensors").exists()


def test_lora_resume_equals_uninterrupted(tmp_path):
    opts = ("system.mode=sync", *LORA)
    full_c, full_r = run(tiny_cfg(tmp_path, *opts), tmp_path / "full")
    run(tiny_cfg(tmp_path, *opts, "max_steps=2"), tmp_path / "split")
    resumed_c, _ = run(tiny_cfg(tmp_path, *opts), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert comparable(rows) == comparable(full_r.history)
    a, b = adapters(full_c), adapters(resumed_c)
    assert a and all(torch.equal(a[k], b[k]) for k in a)


def test_async_lora_run_keeps_the_staleness_bound(tmp_path):
    _, result = run(tiny_cfg(tmp_path, "system.mode=async", "rollout.max_staleness=1", *LORA), tmp_path / "a")
    rows = [r for r in result.history if "async/staleness_max" in r]
    assert len(rows) == 4 and max(r["async/staleness_max"] for r in rows) <= 1


@pytest.mark.parametrize(("override", "keys"), [
    ("rollout.engine=vllm", "rollout.engine"),
    ("rollout.weight_quant=fp8_block", "rollout.weight_quant"),
    ("trainer.data_parallel=elastic", "trainer.data_parallel"),
    ("optim.name=muon", "optim.name"),
    ("model.lora.quantize=4bit", "model.lora.quantize"),
    ("model.lora.init=pissa", "model.lora.init"),
    ("model.lora.dropout=1.5", "model.lora.dropout"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
])
def test_combinations_lora_cannot_serve_are_one_config_error(tmp_path, override, keys):
    cfg = tiny_cfg(tmp_path, "model.lora.rank=4", "system.device=cpu", override)
    with pytest.raises(ConfigError, match=keys.replace(".", r"\.")) as e:
        check_inputs(cfg)
    assert "\n" not in str(e.value)


def test_export_adapters_and_merged_model_give_the_trained_policy(tmp_path):
    """`tidal export RUN`: PEFT loads the adapters onto the base; `--merge`: a plain HF directory that
    AutoModelForCausalLM loads with the trained policy's log-probs, and that model.path accepts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tidal.cli import main

    c, _ = run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=2", *LORA), tmp_path / "run")
    ids = torch.randint(3, 40, (3, 9))
    want = token_logprobs(c.trainer.model, ids, None)[0].detach()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapters")]) == 0
    assert main(["export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "merged")]) == 0
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir() if "token" not in p.name) == [
        "adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(lora.base_of(tmp_path / "adapters"), local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapters"))
    torch.testing.assert_close(token_logprobs(peft_model, ids, None)[0], want, atol=0, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    torch.testing.assert_close(token_logprobs(merged, ids, None)[0], want, atol=1e-5, rtol=0)
    next_stage = tiny_cfg(tmp_path, "system.mode=sync", "max_steps=1", f"model.path={tmp_path / 'merged'}")
    c2, result = run(next_stage, tmp_path / "next")
    assert result.base_accuracy is not None
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "merged")]) == 2  # never mixed into


def test_a_lora_checkpoint_does_not_resume_a_full_run(tmp_path):
    run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=2", *LORA), tmp_path / "run")
    with pytest.raises(ConfigError, match="holds LoRA adapters but the run trains the whole model"):  # one line
        run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=3"), tmp_path / "run", resume=True)


def test_resume_with_another_rank_is_one_line_naming_the_keys(tmp_path):
    """Issue 50 item 11: PEFT's loader met another rank with a ~100-line size-mismatch traceback; another alpha
    loaded silently at another scale. Both are checked against the checkpoint's adapter_config.json first."""
    run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=2", *LORA), tmp_path / "run")
    for change, says in (("model.lora.rank=2", r"model\.lora\.rank=4 \(this run: 2\)"),
                         ("model.lora.alpha=16", r"model\.lora\.alpha=32(\.0)? \(this run: 16(\.0)?\)"),
                         ("model.lora.target_modules=[q_proj]", r"model\.lora\.target_modules")):
        with pytest.raises(ConfigError, match=says) as e:
            run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=3", *LORA, change), tmp_path / "run", resume=True)
        assert "\n" not in str(e.value) and len(str(e.value)) < 700  # one line, not a size-mismatch per layer
    saved = read_yaml(tmp_path / "run" / "config.yaml", mapping=True)["model"]["lora"]
    assert saved["rank"] == 4 and saved["alpha"] == 32 and saved["target_modules"] == ["all-linear"]  # not replaced


def test_lora_with_a_critic_kl_and_resume(tmp_path):
    """PPO with a learned critic on a LoRA policy (the critic copies the base and adapters, and trains its
    adapters and head only), a KL penalty against the adapters-off base, and exact resume of both."""
    opts = ("system.mode=sync", "algo.advantage=gae", "algo.skip_zero_adv_groups=false", "critic.optim.lr=1e-2",
            "algo.kl_coef=0.05", *LORA)
    full_c, full_r = run(tiny_cfg(tmp_path, *opts), tmp_path / "full")
    critic = full_c.trainer.critic
    held = {id(p) for g in critic.optimizer.param_groups for p in g["params"]}
    assert held and all(p.requires_grad for p in critic.model.parameters() if id(p) in held)
    assert not any(id(p) in held for n, p in critic.model.named_parameters() if "lora_" not in n and "head" not in n)
    kls = [r["algo/kl"] for r in full_r.history if "algo/kl" in r]
    assert len(kls) == 4 and kls[0] == 0.0 < max(kls)  # step 1 samples the base itself; then adapters move
    run(tiny_cfg(tmp_path, *opts, "max_steps=2"), tmp_path / "split")
    resumed_c, _ = run(tiny_cfg(tmp_path, *opts), tmp_path / "split", resume=True)
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert comparable(rows) == comparable(full_r.history)
    a, b = adapters(full_c), adapters(resumed_c)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_agentic_episodes_and_distillation_train(tmp_path):
    from tidal.models import tiny

    from .test_agentic_run import AGENT  # registers the test_countdown environment

    _, result = run(tiny_cfg(tmp_path, "system.mode=async", "max_steps=2", *AGENT, *LORA), tmp_path / "agent")
    assert any(r.get("train/grad_norm", 0) > 0 for r in result.history)
    tok = tiny.build_tokenizer()
    teacher = tiny.ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64,
                               init_seed=7)
    tiny.save(tiny.build_model(teacher, tok), tok, tmp_path / "teacher")
    _, result = run(tiny_cfg(tmp_path, "system.mode=async", "max_steps=2", f"distill.teacher={tmp_path / 'teacher'}",
                             "algo.skip_zero_adv_groups=false", *LORA), tmp_path / "distill")
    rows = [r for r in result.history if "distill/reverse_kl" in r]
    assert len(rows) == 2 and any(r.get("train/grad_norm", 0) > 0 for r in rows)


def test_lora_trains_a_harness_agent_through_the_endpoint(tmp_path):
    pytest.importorskip("fastapi", reason="needs the harness extra")
    from tests.serve.test_harness_run import DIGIT_AGENT, cfg_for
    from tests.serve.test_harness_run import run as harness_run

    result = harness_run(cfg_for(tmp_path, DIGIT_AGENT, "system.mode=async", "max_steps=2", *LORA), tmp_path / "h")
    rows = result.history[1:]
    assert len(rows) == 2 and all(r["harness/crashed"] == 0 for r in rows)
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows)


def test_lora_and_full_runs_start_from_the_same_cached_base(tmp_path):
    from tidal.system.run import base_model_path
    from tidal.tasks import TASKS

    full, low = tiny_cfg(tmp_path), tiny_cfg(tmp_path, *LORA)
    paths = [base_model_path(c, TASKS.get(c.task.name)(c.task), progress=False) for c in (full, low)]
    assert paths[0] == paths[1]


def test_sdc_replays_of_lora_steps_match_and_eval_reads_a_lora_run(tmp_path):
    """The SDC guard's sampled replays (a shadow trainer from an in-memory snapshot) reproduce LoRA steps
    bit for bit; `tidal eval RUN` reads the run's adapter checkpoint as its merged model."""
    from tidal.cli import main

    _, result = run(tiny_cfg(tmp_path, "system.mode=sync", "sdc.replay_every=2", *LORA), tmp_path / "run")
    assert result.history[-1]["sdc/replayed_steps"] >= 1  # matched: a mismatch raises SilentDataCorruption
    assert main(["eval", str(tmp_path / "run"), "--set", "num_eval=8"]) == 0


def test_diloco_under_torchrun_is_refused_and_fsdp_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"model\.lora with trainer\.data_parallel=diloco"):
        lora.check_run(tiny_cfg(tmp_path, "model.lora.rank=4", "trainer.data_parallel=diloco"))
    lora.check_run(tiny_cfg(tmp_path, "model.lora.rank=4", "trainer.data_parallel=fsdp"))


def test_export_of_a_full_run_copies_the_model_without_the_run_state(tmp_path):
    from transformers import AutoModelForCausalLM

    from tidal.cli import main

    c, _ = run(tiny_cfg(tmp_path, "system.mode=sync", "max_steps=2"), tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "full")]) == 0
    names = {p.name for p in (tmp_path / "full").iterdir()}
    assert "model.safetensors" in names and not names & {"trainer_state.pt", "hashes.json", "sdc.json"}
    ids = torch.randint(3, 40, (2, 7))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", local_files_only=True)
    torch.testing.assert_close(token_logprobs(model, ids, None)[0], token_logprobs(c.trainer.model, ids, None)[0],
                               atol=0, rtol=0)
