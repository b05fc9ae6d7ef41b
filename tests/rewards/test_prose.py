"""``rewards/prose.py``: numbers, operands and final statements read out of prose answers."""

from fractions import Fraction

from tidal.rewards.prose import final_statement, is_operand, numbers, parse_number, read_final


def test_numbers_signs_thousands_decimals_fractions_and_final_periods():
    got = [(n.text, n.value) for n in numbers("It is -5, 22 - 13, 1,234.50 or 1/2 and 85. Not x2; is −7.")]
    assert got == [("-5", -5), ("22", 22), ("13", 13), ("1,234.50", Fraction("1234.5")), ("1/2", Fraction(1, 2)),
                   ("85", 85), ("-7", -7)]
    assert [n.text for n in numbers("1, 2,3 and 33,34")] == ["1", "2", "3", "33", "34"]  # not thousands groups
    assert [n.divides_out for n in numbers("70/2 1/2 35/1")] == [True, False, True]
    got = [(n.text, n.value, n.divides_out) for n in numbers(r"x = \frac{3}{4}, \dfrac{70}{2} or \frac{-1}{2}")]
    assert got == [(r"\frac{3}{4}", Fraction(3, 4), False), (r"\dfrac{70}{2}", 35, True),
                   (r"\frac{-1}{2}", Fraction(-1, 2), False)]


def test_parse_number():
    assert parse_number("052") == 52 and parse_number(" -5 ") == -5 and parse_number("1,234") == 1234
    assert parse_number("3.50") == Fraction("3.5") and parse_number("$12.") == 12
    assert parse_number("1/2") == Fraction(1, 2) == parse_number(r"\frac{1}{2}")
    assert parse_number("x") is None and parse_number("1 2") is None and parse_number("35 apples") is None


def test_is_operand():
    text = "37 + 48 = 85, (22)+(13), 22 plus 13, x = 9"
    found = {n.text: is_operand(text, n) for n in numbers(text)}
    assert found == {"37": True, "48": True, "85": False, "22": True, "13": True, "9": False}


def test_final_statement_spans_a_trailing_list():
    text = "First 20 + 15 = 35. So:\n33\n34, 35"
    start, end = final_statement(text, numbers(text)[-1])
    assert text[start:end].split() == ["33", "34,", "35"]


def test_a_long_bare_list_is_one_statement_and_stays_fast():
    import time

    text = "\n".join(f"{i}." for i in range(20_000))  # each line ends twice: "." then the newline
    start = time.perf_counter()
    final = read_final(text, "q")
    assert len(final.values) == 20_000 and time.perf_counter() - start < 5


def test_read_final_values_and_restatements():
    final = read_final("33, 34 or 35", "What is 22+13?")
    assert final.last.text == "35" and final.values == [33, 34, 35] and final.restated is None
    final = read_final("The sum of 22 and 13 is 35.", "What is 22+13?")  # the question's numbers are no values
    assert final.values == [35]
    assert read_final("22+13", "What is 22+13?").restated == "restates the question"
    assert read_final("35*1", "What is 22+13?").restated == "not a value: arithmetic left to do"
    assert read_final("no digits", "q") is None
