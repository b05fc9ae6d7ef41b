import json
import random

from tests.data.corpus import document, vocabulary
from tidal.cli import main
from tidal.data.io import write_rows


def test_compare_ranks_in_distribution_text_above_noise(tmp_path, capsys):
    rng = random.Random(0)
    vocab = vocabulary(rng, 300)
    write_rows(tmp_path / "eval.jsonl", [{"text": document(rng, vocab, 200)} for _ in range(5)])
    write_rows(tmp_path / "clean.jsonl", [{"text": document(rng, vocab, 200)} for _ in range(20)])
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 "
    noise = [{"text": "".join(rng.choice(letters) for _ in range(1200))} for _ in range(20)]
    write_rows(tmp_path / "noise.jsonl", noise)
    out = tmp_path / "compare.json"
    args = ["curate", "compare", "--out", str(out), "--set", f"proxy.datasets=[{tmp_path / 'noise.jsonl'}, "
            f"{tmp_path / 'clean.jsonl'}]", "--set", f"proxy.eval={tmp_path / 'eval.jsonl'}",
            "--set", "proxy.steps=15", "--set", "proxy.batch_size=8",
            "--set", "proxy.seeds=[0, 1]", "--set", "proxy.hidden_size=32", "--set", "proxy.lr=3e-3",
            "--set", "proxy.compare_lrs=[1e-3]", "--set", "proxy.seq_len=32", "--set", "proxy.eval_windows=8"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["ranking"] == [str(tmp_path / "clean.jsonl"), str(tmp_path / "noise.jsonl")]
    first = result["by_lr"][0]
    assert first["lr"] == 3e-3 and first["seeds"] == 2 and len(first["rows"][0]["losses"]) == 2
    assert first["rows"][0]["mean_loss"] < first["rows"][1]["mean_loss"]
    assert [b["lr"] for b in result["by_lr"]] == [3e-3, 1e-3]
    assert "seeds agree" in capsys.readouterr().out


def test_compare_needs_two_datasets_and_an_eval_set(tmp_path, capsys):
    assert main(["curate", "compare", "--out", str(tmp_path / "c.json"), "--set", "proxy.datasets=[a.jsonl]"]) == 2
    assert "proxy.datasets" in capsys.readouterr().err


def test_compare_keeps_an_existing_out_without_overwrite(tmp_path, monkeypatch, capsys):
    """Issue 50 item 4, for ``compare``'s report too: an existing --out (a user's file) was replaced; now it is
    refused before any proxy trains."""
    from tidal.data import proxy

    def trained(*args, **kwargs):
        raise AssertionError("the proxies trained")

    for name in ("a", "b", "e"):
        write_rows(tmp_path / f"{name}.jsonl", [{"text": f"rows of {name}"}])
    out = tmp_path / "c.json"
    out.write_text("a user's file\n")
    monkeypatch.setattr(proxy, "compare", trained)
    argv = ["curate", "compare", "--out", str(out), "--set", f"proxy.datasets=[{tmp_path / 'a.jsonl'}, "
            f"{tmp_path / 'b.jsonl'}]", "--set", f"proxy.eval={tmp_path / 'e.jsonl'}"]
    assert main(argv) == 2
    assert f"--out {out} exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "a user's file\n"
