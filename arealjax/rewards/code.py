"""Code answers: run the completion's last fenced python block against unit tests, in the sandbox.

    code_reward(completion, tests=[{"input": "1 2\\n", "output": "3\\n"}])                        # stdin/stdout
    code_reward(completion, tests=[{"fn_name": "add", "args": [1, 2], "expected": 3}])          # call-based

Reward 1.0 only if every test passes (or the passed fraction with `partial=True`). Outputs are compared with
whitespace normalised (tokens split on any whitespace); call results by value after a JSON round trip. Each test
runs in its own sandboxed process (`sandbox.py`) under `limits`; `total_timeout` bounds the whole call.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from arealjax.rewards.sandbox import Limits, run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Call-based tests: the code defines fn_name; the harness prints its JSON result after a marker line.
_MARK = "__AREALJAX_RESULT__"
_HARNESS = """

import json as _json, sys as _sys
_args = _json.loads({args!r})
_fn = globals().get({fn!r})
if _fn is None:
    raise SystemExit("function {fn} is not defined")
_out = _fn(*_args) if isinstance(_args, list) else _fn(**_args)
_sys.stdout.write("\\n{mark}\\n" + _json.dumps(_out))
"""


def extract_code(completion: str) -> str | None:
    """The last fenced python (or untagged) code block, or None."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else None


def _same_output(got: str, want: str) -> bool:
    return got.split() == want.split()


def _run_test(code: str, test: dict[str, Any], limits: Limits) -> bool:
    if "fn_name" in test:
        program = code + _HARNESS.format(args=json.dumps(test.get("args", [])), fn=test["fn_name"], mark=_MARK)
        result = run_python(program, test.get("input", ""), limits)
        if not result.ok or _MARK not in result.stdout:
            return False
        try:
            got = json.loads(result.stdout.rsplit(_MARK, 1)[1])
        except ValueError:
            return False
        return got == json.loads(json.dumps(test["expected"]))
    if "input" not in test or "output" not in test:
        raise ValueError(f"code test {test!r}: expected keys 'input' and 'output', or 'fn_name', 'args' and "
                         f"'expected'")
    result = run_python(code, test["input"], limits)
    return result.ok and _same_output(result.stdout, test["output"])


def code_reward(completion: str, tests: list[dict[str, Any]], partial: bool = False, timeout: float = 5.0,
                total_timeout: float = 30.0, memory_mb: int = 512) -> float:
    """1.0 if the extracted code passes every test (else 0.0, or the passed fraction with `partial`)."""
    if not tests:
        raise ValueError("code_reward: no tests given")
    code = extract_code(completion)
    if code is None:
        return 0.0
    limits = Limits(timeout=timeout, cpu_seconds=max(1, int(timeout)), memory_mb=memory_mb)
    deadline = time.monotonic() + total_timeout
    passed = 0
    for test in tests:
        if time.monotonic() > deadline:
            break
        if _run_test(code, test, limits):
            passed += 1
        elif not partial:
            return 0.0
    return passed / len(tests) if partial else float(passed == len(tests))
