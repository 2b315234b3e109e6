"""The default job's synthetic, verifiable reasoning task: column addition with a worked trace.

    prompt   "47+85="
    answer   "7+5=12,4+8+1=13;132"     one column per step, right to left, carry written as "+1"; then the result

`demonstration(..., error=p)` drops each carry with probability p (the rest of the trace stays consistent,
so the result is wrong): imperfect demonstrations for the SFT warm start, whose policy then answers correctly
only when it happens to carry every time. RL with the exact-match `reward` has to learn the carry rule.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def sample_problems(n: int, seed: int, min_digits: int = 2, max_digits: int = 3) -> list[Problem]:
    """Problems with operands of min..max digits; one seed gives one stream (train and held-out use different
    seeds)."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        da, db = rng.randint(min_digits, max_digits + 1, 2)
        out.append(Problem(int(rng.randint(10 ** (da - 1), 10**da)), int(rng.randint(10 ** (db - 1), 10**db))))
    return out


def demonstration(p: Problem, rng: np.random.RandomState | None = None, error: float = 0.0) -> str:
    """The worked trace and result; with `error`, each carry is forgotten with that probability."""
    xs, ys = str(p.a)[::-1], str(p.b)[::-1]
    steps, digits, carry = [], [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        if carry and rng is not None and rng.rand() < error:
            carry = 0
        s = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        digits.append(str(s % 10))
        carry = s // 10
    result = ("1" if carry else "") + "".join(reversed(digits))
    return ",".join(steps) + ";" + result


_RESULT = re.compile(r";\s*(-?\d+)\s*$")


def extract_answer(completion: str) -> str | None:
    """The result after the last ';' (the whole completion must end with it)."""
    m = _RESULT.search(completion.strip())
    return m.group(1) if m else None


def reward(completion: str, answer: str) -> float:
    """1.0 when the final result equals the answer, else 0.0 (the trace itself is not graded)."""
    got = extract_answer(completion)
    return float(got is not None and got.lstrip("0") == answer.lstrip("0"))
