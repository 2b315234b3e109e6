"""Math answers: extract the final answer from a completion and check it against the reference with math-verify.

    math_reward("... so the total is \\boxed{\\frac{1}{2}}", "0.5")        # 1.0
    math_reward("Natalia sold 48 + 24 = 72 clips.\\n#### 72", "#### 72")  # 1.0 (GSM8K style)

Extraction, first that applies: the last `\\boxed{...}` (or `\\fbox{...}`), the last match of `answer_pattern`
(its first group), a GSM8K `#### <answer>` line, the last number. Equivalence is math-verify's (values in other
forms: fractions, decimals, LaTeX, percentages, sets and intervals, simple units, equal expressions), bounded in
time so a pathological expression cannot stall a reward worker.
"""

from __future__ import annotations

import math
import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def last_boxed(text: str) -> str | None:
    """Content of the last outermost \\boxed{...} / \\fbox{...}, braces balanced; None if there is none closed."""
    found, pos = None, 0
    while (m := _BOXED.search(text, pos)) is not None:
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:  # unclosed: nothing after it can close either
            break
        found, pos = text[m.end():i - 1].strip(), i
    return found


def extract_answer(completion: str, answer_pattern: str | None = None) -> str | None:
    """The final answer of `completion` (see the module docstring), or None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    if answer_pattern:
        found = re.findall(answer_pattern, completion)
        if found:
            last = found[-1]
            return (last[0] if isinstance(last, tuple) else last).strip()
    gsm = _GSM8K.findall(completion)
    if gsm:
        return gsm[-1]
    numbers = _NUMBER.findall(completion)
    return numbers[-1].rstrip(".") if numbers else None


def reference(answer: str) -> str:
    """A dataset's answer field as the reference: a GSM8K solution ('... #### 72') gives '72'."""
    gsm = _GSM8K.findall(answer)
    return gsm[-1] if gsm else answer.strip()


def equivalent(predicted: str, answer: str, timeout: float = 5.0) -> bool:
    """math-verify equivalence of two answers (LaTeX or plain). `timeout` bounds parsing and comparison each; it
    uses SIGALRM, so off the main thread only the reward service's per-call timeout bounds it."""
    seconds = max(1, math.ceil(timeout)) if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{answer}}}", extraction_config=_EXTRACTION, parsing_timeout=seconds)
    pred = parse(f"\\boxed{{{predicted}}}", extraction_config=_EXTRACTION, parsing_timeout=seconds)
    if not gold or not pred:
        return predicted.strip() == answer.strip()
    return bool(verify(gold, pred, timeout_seconds=seconds))


def math_reward(completion: str, answer: str, answer_pattern: str | None = None, timeout: float = 5.0) -> float:
    """1.0 if the final answer of `completion` equals `answer` (see `equivalent`), else 0.0."""
    predicted = extract_answer(completion, answer_pattern)
    if predicted is None:
        return 0.0
    return float(equivalent(predicted, reference(answer), timeout))
