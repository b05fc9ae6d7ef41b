"""``tidal chain --config``: a user's chain from one file (issue 53): the model each stage starts from, the
placeholders, one-line errors before anything runs, and a short chain run end to end."""

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from tidal import cli
from tidal.config import ConfigError
from tidal.stages import chain as chains
from tidal.stages import synthetic


def _write(tmp_path: Path, doc) -> Path:
    path = tmp_path / "chain.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def _model_path(argv: list[str]) -> str | None:
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    found = [kv.split("=", 1)[1] for kv in sets if kv.startswith("model.path=")]
    assert len(found) <= 1, argv
    return found[0] if found else None


def test_each_stage_starts_from_the_previous_policy(tmp_path):
    """The chain's model feeds the first stage; a reward model is never the next stage's base; model_from and an
    explicit model.path win; placeholders name stages' models."""
    path = _write(tmp_path, textwrap.dedent("""\
        model: smollm2-135m-instruct
        stages:
          - {name: sft, command: sft, set: {data.path: chat.jsonl, run.steps: 200, optim.lr: 2e-5}}
          - {name: dpo, command: dpo, set: {data.path: pairs.jsonl, beta: 0.1}}
          - {name: rm, command: rm, model_from: sft, set: [data.path=pairs.jsonl]}
          - name: rl
            command: train
            recipe: smollm2_quickstart
            set: {reward.name: rm, reward.params.path: "{rm}", max_steps: 40, log.progress: false}
          - {name: again, command: sft, set: {model.path: elsewhere, data.path: "{out}/x.jsonl"}}
        """))
    chain = chains.load(path)
    out = "runs/c"
    argvs = {s.name: chains.argv(chain, i, out) for i, s in enumerate(chain.stages)}
    assert _model_path(argvs["sft"]) == "smollm2-135m-instruct"
    assert _model_path(argvs["dpo"]) == "runs/c/sft/model"
    assert _model_path(argvs["rm"]) == "runs/c/sft/model"
    assert _model_path(argvs["rl"]) == "runs/c/dpo/model"  # the rm stage in between is skipped
    assert _model_path(argvs["again"]) == "elsewhere"
    assert argvs["rl"][:2] == ["train", "smollm2_quickstart"] and argvs["rl"][-2:] == ["--out", "runs/c/rl"]
    assert "reward.params.path=runs/c/rm/model" in argvs["rl"]
    assert "max_steps=40" in argvs["rl"] and "log.progress=false" in argvs["rl"]  # YAML values as --set text
    assert "optim.lr=2e-5" in argvs["sft"] and "run.steps=200" in argvs["sft"]
    assert "data.path=runs/c/x.jsonl" in argvs["again"]


def test_without_a_model_the_first_stage_takes_its_default():
    chain = chains.Chain([chains.Stage("sft", "sft", ["data.path=a.jsonl"])])
    assert _model_path(chains.argv(chain, 0, "o")) is None


@pytest.mark.parametrize("doc,message", [
    ("stages: []", "stages must be a non-empty list"),
    ({"model": "m", "stagez": []}, "unknown key 'stagez'"),
    ({"stages": ["sft"]}, "stage 1: expected a mapping"),
    ({"stages": [{"name": "a", "command": "sft", "sets": {}}]}, "stage 1: unknown key 'sets'"),
    ({"stages": [{"name": "a b", "command": "sft"}]}, "name 'a b'"),
    ({"stages": [{"name": "a", "command": "sft"}, {"name": "a", "command": "dpo"}]}, "two stages are named 'a'"),
    ({"stages": [{"name": "a", "command": "ppo"}]}, "stage a: command 'ppo'; one of sft, dpo, rm, train"),
    ({"stages": [{"name": "a", "command": "train"}]}, "stage a: command train needs a recipe"),
    ({"stages": [{"name": "a", "command": "sft", "recipe": "quickstart"}]}, "recipe is for command train only"),
    ({"stages": [{"name": "a", "command": "sft", "model_from": "b"}]}, "model_from 'b' names no earlier stage"),
    ({"stages": [{"name": "r", "command": "rm"}, {"name": "a", "command": "sft", "model_from": "r"}]},
     "model_from 'r' is a reward model"),
    ({"stages": [{"name": "a", "command": "sft", "set": "x=1"}]}, "set must be a mapping"),
], ids=["empty", "top-key", "not-mapping", "stage-key", "name", "duplicate", "command", "recipe-missing",
        "recipe-extra", "model-from", "model-from-rm", "set-type"])
def test_a_bad_chain_file_is_one_error_naming_the_stage(tmp_path, doc, message):
    with pytest.raises(ConfigError) as e:
        chains.load(_write(tmp_path, doc))
    assert message in str(e.value), str(e.value)


def test_an_unknown_placeholder_names_the_known_ones():
    chain = chains.Chain([chains.Stage("sft", "sft", ["data.path={sfy}/a.jsonl"])])
    with pytest.raises(ConfigError, match=r"stage sft: data.path=\{sfy\}/a.jsonl: unknown placeholder \{sfy\}; "
                                          r"one of \{out\}, \{sft\}"):
        chains.argv(chain, 0, "o")


def _domain_chain(tmp_path: Path, **rl_sets) -> tuple[Path, str]:
    d = tmp_path / "domain"
    synthetic.build(str(d))
    doc = {"stages": [
        {"name": "sft", "command": "sft", "set": {"data.path": f"{d}/sft.jsonl", "optim.lr": 1e-3, "run.steps": 2,
                                                  "run.threads": 1}},
        {"name": "dpo", "command": "dpo", "set": {"data.path": f"{d}/pairs.jsonl", "run.steps": 2, "run.threads": 1}},
        {"name": "rm", "command": "rm", "model_from": "sft",
         "set": {"data.path": f"{d}/pairs.jsonl", "run.steps": 2, "run.threads": 1}},
        {"name": "rl", "command": "train", "recipe": "stages_rl",
         "set": {"task.path": f"{d}/rl.jsonl", "task.eval_path": f"{d}/eval.jsonl", "reward.name": "rm",
                 "reward.params.path": "{rm}", "max_steps": 1, "num_eval": 8, "rollout.prompts_per_step": 4,
                 "system.num_threads": 1, **rl_sets}},
    ]}
    return _write(tmp_path, doc), str(tmp_path / "out")


@pytest.mark.parametrize("mistake,message", [
    ({"bogus": 1}, "error: stage rl: unknown config key 'bogus'"),
    ({"task.eval_path": "nowhere.jsonl"}, "error: stage rl: task.eval_path=nowhere.jsonl: no such file"),
], ids=["key", "file"])
def test_a_last_stage_mistake_stops_the_chain_before_the_first_stage(tmp_path, capsys, mistake, message):
    config, out = _domain_chain(tmp_path, **mistake)
    assert cli.main(["chain", "--config", str(config), "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not Path(out).exists(), "a stage ran before the whole chain was checked"


def test_a_chain_file_runs_every_stage_from_the_one_before(tmp_path, capsys):
    config, out = _domain_chain(tmp_path)
    assert cli.main(["chain", "--config", str(config), "--out", out, "--set", "dpo:beta=0.2"]) == 0
    printed = capsys.readouterr().out
    table = json.loads((Path(out) / "chain.json").read_text())
    assert list(table) == ["sft", "dpo", "rm", "rl"]
    assert "eval/pref_acc" in table["dpo"] and "eval/accuracy" in table["rm"] and table["rm"]["step"] == 2
    assert "| dpo | 2 |" in printed
    saved = {s: yaml.safe_load((Path(out) / s / "config.yaml").read_text()) for s in ("dpo", "rm", "rl")}
    assert saved["dpo"]["model"]["path"] == f"{out}/sft/model" and saved["dpo"]["beta"] == 0.2
    assert saved["rm"]["model"]["path"] == f"{out}/sft/model"
    assert saved["rl"]["model"]["path"] == f"{out}/dpo/model"
    assert saved["rl"]["reward"]["params"]["path"] == f"{out}/rm/model"
    assert cli.main(["chain", "--config", str(config), "--out", out]) == 2  # a previous chain is kept
    assert "holds a previous chain's runs (sft/, dpo/, rm/, rl/)" in capsys.readouterr().err


DOC = Path(__file__).resolve().parents[2] / "docs" / "stages.md"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chain.yaml"


def test_the_pages_chain_file_is_the_example_and_runs(tmp_path, monkeypatch, capsys):
    """docs/stages.md shows examples/chain.yaml as it is, and it runs (every stage 2 steps) on the domain."""
    import re

    block = re.search(r"```yaml\n(# tidal chain --config examples/chain.yaml.*?)```", DOC.read_text(), re.S)
    assert block and block.group(1) == EXAMPLE.read_text()
    monkeypatch.chdir(tmp_path)
    synthetic.build("runs/stages/domain")
    short = [x for s in ("sft", "dpo", "rm") for x in ("--set", f"{s}:run.steps=2", "--set", f"{s}:run.threads=1")]
    short += [x for kv in ("max_steps=1", "num_eval=8", "rollout.prompts_per_step=4", "system.num_threads=1")
              for x in ("--set", f"rl:{kv}")]
    assert cli.main(["chain", "--config", str(EXAMPLE), "--out", "runs/my_chain", *short]) == 0
    capsys.readouterr()
    assert list(json.loads(Path("runs/my_chain/chain.json").read_text())) == ["sft", "dpo", "rm", "rl"]
