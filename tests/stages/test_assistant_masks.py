"""Assistant masks of templates without ``{% generation %}`` blocks (``chat_data.derived_mask``), checked three ways:
equal to the tags' mask on tidal's tagged templates (tags stripped); equal to TRL 1.16's ``assistant_only_loss`` on
the real templates TRL ships a tagged training copy of (Qwen2.5, Llama 3, Gemma, Phi-3: TRL swaps its copy in
itself), up to the whitespace TRL's copies put at a turn's edges; and by hand on SmolLM2-135M-Instruct's template.

Run as a script (in TRL's venv), this file prints TRL's side as JSON."""

import json
import os
import re
import subprocess
import sys
from itertools import groupby
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRL_VENV = ROOT / ".tidal_cache" / "bench-trl-venv"
TRL_TEMPLATES = ("qwen2_5", "llama3", "gemma", "phi3")
MARKERS = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<start_of_turn>", "<end_of_turn>",
           "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
"""The turn markers of those templates, added to SmolLM2's tokenizer as special tokens (their models have them)."""


def _chat(*turns: str, system: str | None = None) -> list[dict]:
    """Alternating user/assistant messages, after an optional system one."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


TRL_ROWS = [
    _chat("What is 2+3?", "2 + 3 = 5."),
    _chat("hi", "Hello! How can I help?", "What is the capital of France?", "Paris."),
    _chat("Write two lines.", "Line one.\nLine two.", "Again", "One.\nTwo.", "Once more", "Done."),
    _chat("hi", "Hello.", "And 1+1?", "2", system="Be brief."),
]

TOOL_ROW = [{"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+3"}}}]},
            {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
"""A tool call and its result (Qwen2.5's template renders both)."""


def _trl_side(tokenizer_dir: str) -> dict:
    """Per template and row: the ids and assistant mask of TRL's ``SFTTrainer(assistant_only_loss=True)`` on
    SmolLM2's tokenizer carrying the template as its model ships it (TRL swaps in its tagged training copy)."""
    import datasets
    import trl
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    templates = Path(trl.__file__).parent / "chat_templates"
    out = {"trl_version": trl.__version__}
    for name in TRL_TEMPLATES:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        tok.chat_template = (templates / f"{name}.jinja").read_text()
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32))
        rows = [r for r in TRL_ROWS if name != "gemma" or r[0]["role"] != "system"]  # Gemma refuses system turns
        rows += [TOOL_ROW] if name == "qwen2_5" else []
        args = SFTConfig(output_dir=str(Path(tokenizer_dir) / "out"), assistant_only_loss=True, report_to=[],
                         use_cpu=True, dataset_num_proc=None, max_length=None)
        trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list([{"messages": r} for r in rows]))
        assert trainer.chat_template, f"TRL has no training template for {name}"
        out[name] = [{"messages": r, "ids": list(ex["input_ids"]),  # TRL folds the mask into labels
                      "mask": [int(label != -100) for label in ex["labels"]]}
                     for r, ex in zip(rows, trainer.train_dataset)]
    return out


if __name__ == "__main__":
    print(json.dumps(_trl_side(sys.argv[1])))
    sys.exit(0)

import pytest  # noqa: E402

from tidal.models import tiny  # noqa: E402
from tidal.stages.chat_data import (  # noqa: E402
    GENERATION_CHAT_TEMPLATE,
    PLAIN_TEMPLATE,
    assistant_mask,
    encode_all,
    encode_pair,
    encode_sft,
)

_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def _untagged(template: str) -> str:
    return _TAG.sub("", template)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each masked run."""
    runs, i = [], 0
    for marked, group in groupby(mask):
        n = len(list(group))
        if marked:
            runs.append((i, i + n))
        i += n
    return runs


def _spans(tok, ids: list[int], mask: list[int]) -> list[list[int]]:
    """The masked runs of ids."""
    return [ids[a:b] for a, b in _runs(mask)]


CONVERSATIONS = [
    _chat("hi", "ok"),
    _chat("hi", "ok", system="be brief"),
    _chat("what is 2+3?", "5", "and 1+1?", "2", "thanks", "you are welcome."),
    _chat("x", "line one\nline two\n", "y", " spaced ", system="s"),
    _chat("q", "\nleading newline", "r", "trailing  "),
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
     {"role": "assistant", "content": "c"}],
]


@pytest.mark.parametrize("template", [GENERATION_CHAT_TEMPLATE, PLAIN_TEMPLATE], ids=["chatml", "plain"])
@pytest.mark.parametrize("max_length", [1000, 30])
def test_derived_mask_equals_the_tags_mask(template, max_length):
    tagged, plain = tiny.build_chat_tokenizer(), tiny.build_chat_tokenizer()
    tagged.chat_template, plain.chat_template = template, _untagged(template)
    assert (assistant_mask(tagged), assistant_mask(plain)) == ("template_tags", "derived")
    for messages in CONVERSATIONS:
        a, b = encode_sft(tagged, {"messages": messages}, max_length), encode_sft(plain, {"messages": messages},
                                                                                  max_length)
        assert (a.ids, a.mask) == (b.ids, b.mask), messages


LLAMA3_TAGGED = (  # TRL's llama3_training.jinja, whitespace control aside
    "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.mark.parametrize("template", [GENERATION_CHAT_TEMPLATE, LLAMA3_TAGGED], ids=["chatml", "llama3"])
def test_derived_mask_equals_the_tags_mask_on_a_bpe_tokenizer(smollm2_dir, template):
    """SmolLM2's byte-level BPE merges whitespace runs: ChatML's leading newline of a turn merges with the generation
    prompt's (the merged token starts the turn in both masks); Llama 3's ``\n\n`` after the header is one token
    alone and two before the answer (both the prompt's in both masks)."""
    tagged, plain = tiny.load_tokenizer(smollm2_dir), tiny.load_tokenizer(smollm2_dir)
    for tok in (tagged, plain):
        tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tagged.chat_template, plain.chat_template = template, _untagged(template)
    for messages in CONVERSATIONS:
        a, b = encode_sft(tagged, {"messages": messages}, 1000), encode_sft(plain, {"messages": messages}, 1000)
        assert (a.ids, a.mask) == (b.ids, b.mask), messages


def test_smollm2_template_by_hand(smollm2_dir):
    """SmolLM2-135M-Instruct's own template (ChatML, a default system turn, no tags): the masked spans are each
    answer and its ``<|im_end|>``; the role headers, the default system prompt, the user turns and the newline
    after each ``<|im_end|>`` are not."""
    tok = tiny.load_tokenizer(smollm2_dir)
    assert "{% generation" not in tok.chat_template and assistant_mask(tok) == "derived"
    row = {"messages": _chat("What is 2+3?", "2 + 3 = 5.", "And 4+4?", "8, since 4 + 4 = 8.")}
    ex = encode_sft(tok, row, 1000)
    assert tok.decode(ex.ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n"
        "<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n8, since 4 + 4 = 8.<|im_end|>\n")
    spans = _spans(tok, ex.ids, ex.mask)
    assert [tok.decode(s) for s in spans] == ["2 + 3 = 5.<|im_end|>", "8, since 4 + 4 = 8.<|im_end|>"]
    assert spans == [tok("2 + 3 = 5.<|im_end|>", add_special_tokens=False).input_ids,
                     tok("8, since 4 + 4 = 8.<|im_end|>", add_special_tokens=False).input_ids]
    assert tok.convert_ids_to_tokens(ex.ids[-1:]) == ["Ċ"] and ex.mask[-1] == 0
    assert (len(ex.ids), [a for a, _ in _runs(ex.mask)]) == (76, [37, 62])
    cut = encode_sft(tok, row, 55)  # the second turn starts past 55 tokens: the first is whole, as it is cut
    assert (cut.ids, cut.mask) == (ex.ids[:55], ex.mask[:55])


def test_smollm2_pairs_do_not_depend_on_tags(smollm2_dir):
    """DPO's completion is the prompt's longest common prefix with the pair (as TRL's DPO counts it), not a
    mask: the untagged template already works."""
    tok = tiny.load_tokenizer(smollm2_dir)
    pair = encode_pair(tok, {"prompt": "What is 2+3?", "chosen": "5.", "rejected": "6."}, 1000)
    assert tok.decode([t for t, m in zip(pair.chosen_ids, pair.chosen_mask) if m]) == "5.<|im_end|>\n"


REASONING_DROPPED = (  # Qwen3 / DeepSeek-R1 style: earlier turns lose their reasoning, the last keeps it
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('=')[-1] %}{% endif %}"
    "{{ c }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT_OPENS_A_BLOCK = _untagged(GENERATION_CHAT_TEMPLATE).replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n(({% endif %}")


@pytest.mark.parametrize("template, why", [
    (REASONING_DROPPED, "messages[1] (assistant): the chat template renders this turn differently once later turns"),
    (PROMPT_OPENS_A_BLOCK, "messages[1] (assistant): the chat template renders the conversation before it, with the "
                           "generation prompt, differently"),
])
def test_a_template_without_a_turn_boundary_names_the_turn(template, why):
    tok = tiny.build_chat_tokenizer()
    tok.chat_template = template
    rows = [{"messages": _chat("q", "2+3=5", "r", "1+1=2")}]
    _, bad = encode_all(rows, encode_sft, tok, 1000)
    assert bad[0].reason.startswith(why) and "{% generation %}" in bad[0].reason, bad[0].reason


def test_end_of_conversation_tokens_are_allowed():
    """Phi-3 closes the conversation with EOS after the last message only: earlier turns end at their marker."""
    tok = tiny.build_chat_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    tok.chat_template = _untagged(GENERATION_CHAT_TEMPLATE).replace(
        "{% if add_generation_prompt %}", "{% if not add_generation_prompt %}<|endoftext|>{% endif %}"
        "{% if add_generation_prompt %}")
    ex = encode_sft(tok, {"messages": _chat("q", "ab", "r", "cd")}, 1000)
    assert [tok.decode(s) for s in _spans(tok, ex.ids, ex.mask)] == ["ab<|im_end|>", "cd<|im_end|>\n<|endoftext|>"]


def test_a_template_that_raises_is_the_rows_reason():
    tok = tiny.build_chat_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    _, bad = encode_all([{"messages": _chat("q", "a")}], encode_sft, tok, 100)
    assert bad[0].reason == "the chat template fails: roles must alternate"


def _trl_python() -> Path | None:
    env = os.environ.get("TIDAL_TRL_PYTHON")
    venv = Path(env) if env else TRL_VENV / "bin" / "python"
    return venv if venv.exists() else None


def _trimmed(tok, ids: list[int], mask: list[int]) -> list[list[int]]:
    """The masked runs without whitespace-only tokens at their edges."""
    blank = [not tok.decode([t]).strip() for t in ids]
    out = []
    for a, b in _runs(mask):
        while a < b and blank[a]:
            a += 1
        while b > a and blank[b - 1]:
            b -= 1
        out.append(ids[a:b])
    return out


def test_derived_mask_equals_trls_assistant_only_loss(smollm2_dir, tmp_path):
    """TRL's tagged training copies mark what ours does plus whitespace at a turn's edges (Qwen2.5's: the newline
    after ``<|im_start|>assistant`` and after ``<|im_end|>``; Gemma's and Phi-3's: the newline after the turn's end
    marker), which we leave out (module docstring of ``chat_data``); with those trimmed they are equal, and the
    ids are TRL's exactly. ~15 s."""
    python = _trl_python()
    if python is None:
        pytest.skip("no TRL environment: run `tidal bench trl` once (creates .tidal_cache/bench-trl-venv) "
                    "or set TIDAL_TRL_PYTHON to a python with trl 1.16")
    tok = tiny.load_tokenizer(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(python), __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["trl_version"] == "1.16.0"
    templates = Path(next(TRL_VENV.glob("lib/python*/site-packages/trl/chat_templates")))
    for name in TRL_TEMPLATES:
        tok.chat_template = (templates / f"{name}.jinja").read_text()
        assert assistant_mask(tok) == "derived", name
        for case in theirs[name]:
            ours = encode_sft(tok, {"messages": case["messages"]}, 10_000)
            assert ours.ids == case["ids"], name
            assert _trimmed(tok, ours.ids, ours.mask) == _trimmed(tok, case["ids"], case["mask"]), \
                (name, [tok.decode(s) for s in _spans(tok, ours.ids, ours.mask)],
                 [tok.decode(s) for s in _spans(tok, case["ids"], case["mask"])])
            assert _trimmed(tok, ours.ids, ours.mask) == _spans(tok, ours.ids, ours.mask), name  # no edge blanks


def test_the_pages_example_runs(smollm2_dir, capsys):
    """docs/stages.md's example on SmolLM2's own template prints what its comments say."""
    import textwrap

    page = (ROOT / "docs" / "stages.md").read_text()
    block = re.search(r"```python\n(.*?assistant_mask\(tok\).*?)```", page, re.S)
    exec(textwrap.dedent(block.group(1)), {})
    assert capsys.readouterr().out == "derived\n'5.<|im_end|>'\n"
