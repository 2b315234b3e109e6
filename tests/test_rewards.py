"""Reward functions: math answers (extraction + math-verify equivalence, time-bounded)."""

import time

import pytest

from arealjax.rewards.math import extract_answer, last_boxed, math_reward, reference

# (completion, reference answer, expected reward)
MATH_CASES = [
    # the same value in another form
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("So we get \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\frac34}", "0.75", 1.0),
    ("\\boxed{1.5}", "\\frac{3}{2}", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{10^{3}}", "1000", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{[0, 1)}", "[0,1)", 1.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{x = 2}", "2", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("first \\boxed{3} then, correcting myself, \\boxed{4}", "4", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{4}}} (nested braces)", "1/2", 1.0),
    ("\\fbox{12}", "12", 1.0),
    # GSM8K: '#### answer' in the completion and/or the reference
    ("48/2 = 24 clips in May.\n48 + 24 = 72\n#### 72", "#### 72", 1.0),
    ("#### 1,234", "Total: 1000 + 234 = 1234\n#### 1234", 1.0),
    ("#### 71", "#### 72", 0.0),
    # no box: the last number
    ("She has 3 apples and buys 4 more, so 7 apples.", "7", 1.0),
    ("3/4 of it", "0.75", 1.0),
    ("It is 12.50 dollars.", "12.5", 1.0),
    ("I think it is 7, no wait, 8", "7", 0.0),
    ("-.5 is the value", "-1/2", 1.0),
    # different values
    ("\\boxed{2}", "3", 0.0),
    ("\\boxed{-3}", "3", 0.0),
    ("\\boxed{0.333}", "1/3", 0.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{(0,1)}", "[0,1]", 0.0),
    ("\\boxed{\\{1,2,3\\}}", "\\{1,2\\}", 0.0),
    ("\\boxed{x^2}", "x^3", 0.0),
    ("\\boxed{a}", "b", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("\\boxed{1001}", "1000", 0.0),
    # nothing to extract, or an unclosed box
    ("I don't know.", "5", 0.0),
    ("", "5", 0.0),
    ("\\boxed{5", "5", 1.0),  # unclosed box: falls back to the last number
]


@pytest.mark.parametrize("completion,answer,expected", MATH_CASES)
def test_math_reward_verdicts(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_math_cases_cover_at_least_40_pairs():
    assert len(MATH_CASES) >= 40
    assert {e for *_, e in MATH_CASES} == {0.0, 1.0}


def test_answer_pattern_and_extraction_order():
    text = "Work: 2+2=4. Final answer: 17. (checked 3 times)"
    assert extract_answer(text) == "3"  # last number
    assert extract_answer(text, r"Final answer:\s*([^\s.]+)") == "17"
    assert math_reward(text, "17", answer_pattern=r"Final answer:\s*([^\s.]+)") == 1.0
    assert extract_answer("a \\boxed{9} and Final answer: 17", r"Final answer:\s*(\d+)") == "9"  # box first
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c" and last_boxed("no box") is None
    assert reference("step one\nstep two\n#### 42") == "42" and reference(" 42 ") == "42"


def test_pathological_expression_is_time_bounded():
    t0 = time.perf_counter()
    assert math_reward("\\boxed{9^{9^{9^{9^{9}}}}}", "9^{9^{9^{9^{8}}}}", timeout=1.0) == 0.0
    assert time.perf_counter() - t0 < 10
