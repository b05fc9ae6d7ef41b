import json
import random

import pytest

from tests.data.corpus import document, vocabulary
from tidal.data.decontam import DecontamConfig, Decontaminate
from tidal.data.pipeline import Pipeline


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_planted_contaminated_item_is_removed_and_reported(tmp_path):
    rng = random.Random(0)
    vocab = vocabulary(rng)
    evals = [{"question": document(rng, vocab, 60)} for _ in range(20)]
    evals.append({"question": "What is seven plus five times two minus three?"})  # 9 words: matched whole
    evals.append({"question": "Compute 2+2."})  # 2 words: matched only as an identical text
    eval_path = _write(tmp_path / "eval.jsonl", evals)
    clean = [{"id": f"clean{i}", "text": document(rng, vocab, 200)} for i in range(200)]
    planted = []
    for i, e in enumerate(evals[:20]):  # 13+ consecutive words of an eval item, embedded in new text
        words = e["question"].split()
        k = rng.randrange(len(words) - 15)
        snippet = " ".join(words[k : k + 15]).upper()  # case and punctuation do not hide it
        text = document(rng, vocab, 50) + " " + snippet + "! " + document(rng, vocab, 50)
        planted.append({"id": f"dirty{i}", "text": text})
    short = "Solve this: what is SEVEN plus five times two minus three? Show work."
    planted.append({"id": "dirty_short", "text": short})
    planted.append({"id": "dirty_exact", "prompt": "compute 2 + 2"})
    near_miss = {"id": "clean_short", "prompt": "Compute 2+2 and then add 1."}  # contains the short item, not equal
    rows = clean + planted + [near_miss]
    rng.shuffle(rows)
    p = Pipeline([Decontaminate(DecontamConfig(), [eval_path])])
    kept = {r["id"] for r in p.run(rows)}
    assert not kept & {r["id"] for r in planted}
    assert kept == {r["id"] for r in clean} | {"clean_short"}
    block = p.report()["blocks"][0]
    assert block["dropped"] == {"contaminated": len(planted)} and len(block["examples"]) == len(planted)
    assert all(e["detail"]["eval_item"].startswith("eval.jsonl:") for e in block["examples"])


def test_an_eval_row_without_text_fields_is_an_error_naming_it(tmp_path):
    path = _write(tmp_path / "e.jsonl", [{"question": "ok"}, {"other": 1}])
    with pytest.raises(ValueError, match=r"e\.jsonl:2: "):  # its 1-based line, as an editor numbers it
        Decontaminate(DecontamConfig(), [path])
