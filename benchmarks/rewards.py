"""Reward service throughput: rewards/s with N worker processes, on math answers and on sandboxed code tests.

  python benchmarks/rewards.py                 # --workers 1,2 --math 400 --code 40
  python benchmarks/rewards.py --smoke         # one worker, a few calls (seconds): checks that the script runs

`RewardService` (arealjax/rewards/service.py) scores math answers with math-verify (a mix of right and wrong LaTeX
answers) and a Python solution against two stdin tests in the sandbox; timed after one warm-up call per worker.
Printed to stdout as a table (rewards/s and the mean reward, which shows the scoring is right); nothing is written.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealjax.rewards.sandbox import isolation  # noqa: E402
from arealjax.rewards.service import RewardService  # noqa: E402

MATH = [("The answer is \\boxed{\\frac{1}{2}}.", "0.5"), ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}"),
        ("48 + 24 = 72\n#### 72", "#### 72"), ("\\boxed{[0, 1)}", "[0,1)"), ("so 7 apples", "8"),
        ("\\boxed{(x+1)^2}", "x^2+2x+1"), ("\\boxed{0.333}", "1/3"), ("\\boxed{50\\%}", "0.5")]
CODE = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2", "output": "42"}]


def rate(fn: str, calls: list[tuple[str, dict]], workers: int) -> tuple[float, float]:
    """(rewards/s, mean reward) over `calls`, after one warm-up call per worker."""
    with RewardService(fn, workers=workers, timeout=60) as service:
        for f in [service.submit(*calls[i % len(calls)][:1], **calls[i % len(calls)][1]) for i in range(workers)]:
            f.result()
        t0 = time.perf_counter()
        futures = [service.submit(text, **kw) for text, kw in calls]
        values = [f.result() for f in futures]
        return len(calls) / (time.perf_counter() - t0), sum(values) / len(values)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--math", type=int, default=400)
    p.add_argument("--code", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="one worker, 16 math and 2 code calls")
    args = p.parse_args()
    if args.smoke:
        args.workers, args.math, args.code = "1", 16, 2
    math_calls = [(MATH[i % len(MATH)][0], {"answer": MATH[i % len(MATH)][1]}) for i in range(args.math)]
    code_calls = [(CODE, {"tests": TESTS})] * args.code
    print(f"{os.cpu_count()} CPU cores; sandbox isolation: {isolation()}\n")
    print("| reward | workers | calls | rewards/s | mean reward |\n|---|---|---|---|---|")
    for workers in map(int, args.workers.split(",")):
        for name, fn, calls in (("math (math-verify)", "arealjax.rewards.math:math_reward", math_calls),
                                (f"code ({len(TESTS)} stdin tests, sandboxed)", "arealjax.rewards.code:code_reward",
                                 code_calls)):
            r, mean = rate(fn, calls, workers)
            print(f"| {name} | {workers} | {len(calls)} | {r:,.1f} | {mean:.2f} |", flush=True)


if __name__ == "__main__":
    main()
