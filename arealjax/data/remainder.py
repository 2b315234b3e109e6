"""The long-tail synthetic task: a remainder by repeated subtraction, written out step by step.

    prompt   "47 mod 9="
    answer   "47-9=38,38-9=29,29-9=20,20-9=11,11-9=2;2"     subtract until below the divisor; then the remainder

Like a real chain of thought, the worked trace has one step per subtraction, so its length is the quotient
n // d, and quotients are drawn from a lognormal: most traces are short, a few are ten times longer (with the
defaults: output p50 ≈ 40 tokens, p99 ≈ 400, max ≈ 480). That is the regime where a synchronous batch waits for
its longest sample and asynchronous RL pays off.

`demonstration(..., error=p)` forgets each borrow with probability p (the step writes a − d + 10, and the trace goes
on consistently from there, so the remainder comes out wrong): imperfect demonstrations for the SFT warm start,
whose policy then answers correctly only when it happens to borrow every time, and less often the longer the
trace. RL with the exact-match `reward` has to learn the borrow rule. Divisors are 3, 4, 6, 7, 8, 9: for 2 and 5 a
forgotten borrow (+10) would not change the remainder.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from arealjax.data.arithmetic import extract_answer, reward  # noqa: F401 — the same answer format: ';<result>'

DIVISORS = (3, 4, 6, 7, 8, 9)


@dataclasses.dataclass(frozen=True)
class Problem:
    n: int
    d: int

    @property
    def prompt(self) -> str:
        return f"{self.n} mod {self.d}="

    @property
    def answer(self) -> str:
        return str(self.n % self.d)

    @property
    def steps(self) -> int:
        return self.n // self.d


def sample_problems(n: int, seed: int, median_steps: float = 4.0, sigma: float = 1.0, max_steps: int = 48
                    ) -> list[Problem]:
    """Problems whose number of steps (the quotient) is lognormal(log median_steps, sigma), clipped to
    [1, max_steps]; one seed gives one stream (train and held-out use different seeds)."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        q = int(np.clip(round(rng.lognormal(np.log(median_steps), sigma)), 1, max_steps))
        d = int(rng.choice(DIVISORS))
        out.append(Problem(q * d + int(rng.randint(d)), d))
    return out


def demonstration(p: Problem, rng: np.random.RandomState | None = None, error: float = 0.0) -> str:
    """The worked trace and the remainder; with `error`, each borrow is forgotten with that probability."""
    steps, a = [], p.n
    while a >= p.d:
        b = a - p.d
        if a % 10 < p.d and rng is not None and rng.rand() < error:
            b += 10  # the units digit is right, the borrow from the tens is not taken
        steps.append(f"{a}-{p.d}={b}")
        a = b
    return ",".join(steps) + f";{a}"
