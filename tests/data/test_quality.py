import random

import pytest

from tests.data.corpus import document, vocabulary
from tidal.data.pipeline import Pipeline
from tidal.data.quality import (
    C4Filter,
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    GopherRepetitionConfig,
    LanguageConfig,
    LanguageFilter,
    dup_ngram_char_frac,
    top_ngram_char_frac,
)

GOOD = ("The committee met on Tuesday to review the budget and the plans that staff have prepared with care. "
        "Members of the public asked questions about the new library, and the chair promised a written answer. "
        "Several residents said that the opening hours should be longer, to help families with young children. "
        "The next meeting will be held in the town hall, and the agenda will be published online a week before.")


def reason(block, text):
    return block.decide({"text": text}, block.prepare({"text": text}))


def test_gopher_quality_each_rule_by_hand():
    q = GopherQuality(GopherQualityConfig())
    assert reason(q, GOOD) is None
    assert reason(q, "the cat and the dog") == "too_few_words"
    assert reason(q, " ".join(["supercalifragilistic"] * 30 + ["the", "and"] * 20)) == "mean_word_length"
    assert reason(q, GOOD + " #tag" * 20) == "symbol_word_ratio"
    bullets = "\n".join(f"- the item {i} and that with have" for i in range(20))
    assert reason(q, bullets) == "bullet_lines"
    assert reason(q, " ".join(["12345 6789"] * 30) + " the and") == "alpha_words"
    no_stop = " ".join(random.Random(0).choice(["apple", "river", "stone", "cloud"]) for _ in range(80))
    assert reason(q, no_stop) == "stop_words"
    assert reason(q, {"x": 1}.get("text")) == "no_text"


def test_repetition_fractions_by_hand():
    tokens = "a b a b c".split()
    # most frequent 2-gram "a b" occurs twice: 2 chars x 2 over 5 chars
    assert top_ngram_char_frac(tokens, 2) == pytest.approx(4 / 5)
    # the 2-gram "a b" repeats: words 0,1,2,3 are covered: 4 of 5 chars
    assert dup_ngram_char_frac(tokens, 2) == pytest.approx(4 / 5)
    assert dup_ngram_char_frac("a b c d".split(), 2) == 0.0


def test_gopher_repetition_drops_repeated_lines_and_keeps_prose():
    r = GopherRepetition(GopherRepetitionConfig())
    rng = random.Random(0)
    prose = document(rng, vocabulary(rng), 300)
    assert reason(r, prose) is None
    assert reason(r, "\n".join(["buy now and save"] * 5 + ["a unique line here", "another one"])) == "dup_lines"
    assert reason(r, prose + " " + " ".join(["click here"] * 200)) == "top_2gram"


def test_c4_rules():
    c4 = C4Filter()
    assert reason(c4, GOOD) is None
    assert reason(c4, GOOD + " Lorem ipsum dolor.") == "lorem_ipsum"
    assert reason(c4, GOOD + " function() { return 1; }") == "curly_bracket"
    assert reason(c4, "One sentence. Two sentences.") == "too_few_sentences"


def test_language_filter_keeps_english_and_names_the_language_it_drops():
    lang = LanguageFilter(LanguageConfig(languages=["en"]))
    assert reason(lang, GOOD) is None
    german = ("Der Ausschuss hat am Dienstag den Haushalt geprüft und die Pläne besprochen, die die "
              "Mitarbeiter sorgfältig vorbereitet haben. Die Bürger stellten viele Fragen zur neuen Bibliothek.")
    assert reason(lang, german) == "language_de"


def test_counters_add_up_across_a_chain():
    rng = random.Random(0)
    vocab = vocabulary(rng)
    rows = [{"text": document(rng, vocab, rng.choice([20, 300]))} for _ in range(50)] + [{"text": GOOD}, {"no": 1}]
    p = Pipeline([GopherQuality(GopherQualityConfig()), C4Filter(), GopherRepetition(GopherRepetitionConfig())])
    out = list(p.run(rows))
    rep = p.report()
    assert rep["rows_in"] == len(rows) and rep["rows_out"] == len(out)
    prev = len(rows)
    for b in rep["blocks"]:
        assert b["seen"] == prev == b["kept"] + sum(b["dropped"].values())
        prev = b["kept"]
    assert prev == len(out)
