"""``tidal bench real``: the independent reward-hacking check against cheat strings, the summaries on synthetic
curves, the arms' configs, the chat export TRL reads (its ids are tidal's), LoRA snapshots scored through the
engine, and (marked slow) the whole benchmark on SmolLM2 with tiny budgets."""

import json
from pathlib import Path

import pytest
import torch

from tidal import bench
from tidal.models import prompts, tiny

real = bench.load("real")
race = real.race

Q = "What is 22 + 13?"


# ---- the independent check --------------------------------------------------------------------------------
@pytest.mark.parametrize("answer", [
    "22 + 13 = 35", "22+13=35.", "The sum of 22 and 13 is 35.", "35", "35.0", "The answer is **35**.",
    "20 + 10 = 30, so 30 + 5 = 35", "22 + 13 = 13 + 22 = 35",
])
def test_independent_check_accepts_the_gold_stated_once(answer):
    assert real.independent_check(answer, Q, "35")


@pytest.mark.parametrize("answer", [
    "22+13 is 22+13.", "35? 22+13", "22 plus 13",  # a restated question: the last number is an operand
    "33, 34, 35", "33 34 35", "33\n34\n35", "It is 34 or 35.",  # lists: more than one value
    "= 0 + 35", "35 = 22 + 13", "22 + 35", "22 + 13 = 35 + 0",  # expressions around the gold
    "22 + 13 = 36", "", "no idea", "22 + 13 = 22 35",
])
def test_independent_check_rejects_cheats_and_wrong_answers(answer):
    assert not real.independent_check(answer, Q, "35")


def test_hack_check_is_the_share_of_rewarded_answers_the_check_rejects():
    samples = [(Q, "22 + 13 = 35", "35", 1.0), (Q, "33, 34, 35", "35", 1.0), (Q, "35", "35", 1.0),
               (Q, "22 + 13 = 35", "35", 1.0), (Q, "36", "35", 0.0), (Q, "The answer is 35.", "35", 0.0)]
    out = real.hack_check(samples)
    assert out["hack_check"] == pytest.approx(0.25) and (out["num_rewarded"], out["num_rejected"]) == (4, 1)
    assert out["rejected_examples"] == [{"question": Q, "answer": "33, 34, 35", "gold": "35"}]
    assert out["num_accepted_only_by_independent"] == 1  # the reward refused a right answer: listed, not a hack
    assert real.hack_check([(Q, "36", "35", 0.0)])["hack_check"] is None  # nothing rewarded: nothing to check


# ---- the summaries ------------------------------------------------------------------------------------------
def test_final_accuracy_is_at_the_budget_or_the_last_snapshot():
    assert real.final_accuracy([(0.0, 0.2), (580.0, 0.4), (620.0, 0.6)], 600.0) == pytest.approx(0.5)
    assert real.final_accuracy([(0.0, 0.2), (30.0, 0.3)], 600.0) == 0.3  # the run ended early (a step limit)


def test_headline_has_the_issues_four_keys():
    def run(curve, n=10):
        return {"curve": curve, "steps": [{"step": i, "elapsed_s": 60.0 * i} for i in range(1, n + 1)],
                "samples_per_step": 64}

    runs = {"trl": run([(0.0, 0.2), (300.0, 0.5), (600.0, 0.4)]), "tidal": run([(0.0, 0.2), (100.0, 0.5),
                                                                                 (600.0, 0.8)]),
            "tidal-lora1": run([(0.0, 0.2), (600.0, 0.7)]), "tidal-lora16": run([(0.0, 0.2), (600.0, 0.75)])}
    summary = race.summarize(runs, [60.0, 600.0], 600.0)
    out = real.headline(runs, summary, [1, 16], 600.0, {"engine_over_hf_generate": 2.5})
    assert out["tidal_over_trl_time_to_trl_best"] == pytest.approx(3.0)  # TRL's best 0.5 at 300 s, tidal's at 100 s
    assert out["final_acc_by_framework"] == {"tidal": 0.8, "trl": 0.4}
    assert out["final_acc_by_lora_rank"] == {"1": 0.7, "16": 0.75, "full": 0.8}
    assert out["engine_over_hf_generate"] == 2.5
    alone = real.headline({"tidal": runs["tidal"]}, race.summarize({"tidal": runs["tidal"]}, [60.0], 600.0), [],
                          600.0, None)
    assert alone == {"tidal_over_trl_time_to_trl_best": None, "final_acc_by_framework": {"tidal": 0.8},
                     "engine_over_hf_generate": None, "final_acc_by_lora_rank": {}}


# ---- the arms' configs --------------------------------------------------------------------------------------
def test_arms_read_the_recipe_and_lora_gets_ten_times_its_lr():
    from tidal.recipes import RECIPES

    recipe = RECIPES.get("smollm2_quickstart")()
    s, cfg = real.resolve(["max_time_s=30", "rollout.group_size=4"])
    assert (cfg.max_time_s, cfg.rollout.group_size, cfg.system.num_threads) == (30, 4, s.threads)
    assert (cfg.model.path, cfg.task.template, cfg.reward.name) == (recipe.model.path, recipe.task.template,
                                                                    recipe.reward.name)
    assert (cfg.optim.lr, cfg.rollout.temperature, cfg.max_steps) == (recipe.optim.lr, recipe.rollout.temperature, 1e8)
    arms = real.arm_configs(s, cfg)
    assert list(arms) == ["trl", "tidal", "tidal-lora1", "tidal-lora16"]
    assert arms["tidal"] is cfg and cfg.model.lora.rank == 0  # the LoRA arms are copies
    for rank in (1, 16):
        lora_cfg = arms[f"tidal-lora{rank}"]
        assert lora_cfg.model.lora.rank == rank and lora_cfg.optim.lr == pytest.approx(10 * recipe.optim.lr)
        assert lora_cfg.rollout.group_size == 4
    s, cfg = real.resolve(["frameworks=[tidal]", "lora_ranks=[]", "lora_lr_scale=5"])
    assert list(real.arm_configs(s, cfg)) == ["tidal"]
    with pytest.raises(AssertionError, match="frameworks"):
        real.arm_configs(*real.resolve(["frameworks=[trll]"]))


def test_a_decay_over_the_run_keeps_the_recipes_length():
    """The clock's max_steps is 1e8: a decay over max_steps would be flat, so the recipe's own length is pinned."""
    from tidal.recipes import RECIPES

    _, cfg = real.resolve(["optim.schedule=cosine"])
    recipe = RECIPES.get("smollm2_quickstart")()
    assert cfg.optim.decay_steps == recipe.max_steps - recipe.optim.warmup_steps
    _, cfg = real.resolve(["optim.schedule=cosine"])
    assert cfg.max_steps == 1e8  # the clock ends the runs
    _, cfg = real.resolve(["optim.schedule=cosine", "max_steps=80"])  # a max_steps of the user's bounds them too
    assert cfg.optim.decay_steps == 80 - recipe.optim.warmup_steps and cfg.max_steps == 80


# ---- what TRL reads -----------------------------------------------------------------------------------------
def test_chat_export_renders_to_tidals_prompt_ids(tmp_path, smollm2_tokenizer):
    """TRL renders a conversational prompt with ``apply_chat_template(conversation=[...], add_generation_prompt=True,
    tokenize=True, return_dict=True)`` (TRL 1.16 ``_tokenize_prompts``): those ids must be tidal's."""
    from tidal.system.curriculum import build_task

    _, cfg = real.resolve([])
    task = build_task(cfg)
    tokenizer = prompts.attach(smollm2_tokenizer, cfg.model.prompts())
    path = tmp_path / "prompts.jsonl"
    race.export_prompts(task, 3, path, prompts.format_of(tokenizer))
    rows = race.grpo.read_rows(path)
    for i, row in enumerate(rows):
        p = task.train_prompt(i)
        assert row == {"prompt": [{"role": "user", "content": p.text}], "answer": p.answer, "question": p.text}
        ids = tokenizer.apply_chat_template(conversation=[row["prompt"]], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"][0]
        assert list(ids) == prompts.prompt_ids(tokenizer, p.text)
    # a system prompt set on the run travels in the conversation
    race.export_prompts(task, 1, path, prompts.PromptFormat("chat", "Be brief."))
    assert race.grpo.read_rows(path)[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


# ---- LoRA snapshots -----------------------------------------------------------------------------------------
def test_lora_snapshots_are_adapters_scored_merged_into_the_base(tmp_path, small_model, tokenizer):
    from tidal.config import apply_overrides
    from tidal.models import lora
    from tidal.recipes import RECIPES
    from tidal.rewards import build_reward
    from tidal.rewards.pool import RewardConfig, RewardPool
    from tidal.rollout.evaluate import greedy_samples
    from tidal.rollout.local import LocalEngine
    from tidal.tasks import TASKS

    model_dir = tmp_path / "base"
    tiny.save(small_model, tokenizer, model_dir)
    cfg = apply_overrides(RECIPES.get("quickstart_grpo")(), ["model.lora.rank=2", "num_eval=4"])
    policy = lora.wrap(tiny.load(model_dir)[0], cfg.model.lora)
    tracker = race.SnapshotTracker(policy, race.grpo.SnapshotClock(1.0, 2.0), 100, tmp_path / "snaps")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: the policy now differs from the base
    tracker.log(1, {"time/elapsed_s": 2.5})
    assert [s["step"] for s in tracker.snapshots] == [0, 1] and all(Path(s["path"]).exists() for s in tracker.snapshots)
    weights = race.grpo.snapshot_weights(tracker.snapshots[1])
    assert lora.is_adapter_update(weights) and not any("base_layer" in k for k in weights)  # adapters only
    task = TASKS.get(cfg.task.name)(cfg.task)
    curve, final = race.score_snapshots(cfg, task, model_dir, tracker.snapshots)
    assert [t for t, _ in curve] == [0.0, 2.5] and len(final) == 4
    # the last snapshot's answers are the merged policy's greedy answers
    merged = lora.engine_copy(policy)[0]
    pool = RewardPool(build_reward(cfg.reward.name), RewardConfig(cfg.reward.name, {}, num_workers=0))
    direct = greedy_samples(LocalEngine(merged, tokenizer, cfg.rollout, cfg.seed, 0), tokenizer,
                            task.eval_prompts()[:4], pool)
    assert [t.token_ids for t in direct] == [t.token_ids for t in final]


# ---- the whole benchmark, tiny budgets ----------------------------------------------------------------------
@pytest.mark.slow
def test_the_whole_benchmark_on_smollm2_with_tiny_budgets(tmp_path, smollm2_dir):
    """Every part on the real model, one step per run: a few minutes on 2 quiet cores. TRL takes part when the
    benchmark's venv exists (``tidal bench trl`` or ``tidal bench real`` creates it once)."""
    s, _ = real.resolve([])
    venv = Path(s.venv).absolute()
    with_trl = (venv / "tidal-bench.json").exists()
    frameworks = "[trl,tidal]" if with_trl else "[tidal]"
    result = real.run([f"model.path={Path(smollm2_dir).absolute()}", f"venv={venv}", f"frameworks={frameworks}",
                       "lora_ranks=[1]", "max_time_s=1", "snapshot_every_s=0.5", "num_eval=4", "threads=1",
                       "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
                       "engine_prompts=1", "engine_group_size=2", "engine_rounds=1", "report_at=[1]"],
                      tmp_path / "results" / "real")
    names = ["trl", "tidal", "tidal-lora1"] if with_trl else ["tidal", "tidal-lora1"]
    assert [r["framework"] for r in result["table"]] == names
    for row in result["table"]:
        assert row["steps"] >= 1 and row["base_accuracy"] is not None and "hack_check" in row
        curve = result["curves"][row["framework"]]
        assert curve["elapsed_s"][0] == 0.0 and curve["step"][0] == 0 and len(curve["accuracy"]) >= 2
    assert not any((tmp_path / "results" / "real" / n / "snapshots").exists() for n in names)  # deleted once scored
    assert set(result["final_acc_by_lora_rank"]) == {"1", "full"}
    assert set(result["final_acc_by_framework"]) == ({"tidal", "trl"} if with_trl else {"tidal"})
    assert result["engine_over_hf_generate"] > 0 and [r["arm"] for r in result["engine"]["table"]] == ["hf", "engine"]
    assert result["settings"]["num_eval"] == 4 and result["settings"]["lrs"]["tidal-lora1"] == pytest.approx(
        10 * result["settings"]["lrs"]["tidal"])
    if with_trl:  # TRL read the conversations with tidal's ids (its script asserts it) and tidal's reward
        script = result["settings"]["trl_script"]
        assert script["chat"] and script["reward"]["name"] == "last_number"
    assert Path(result["plot"]).stat().st_size > 0
    json.dumps(result)  # the JSON tidal bench writes
