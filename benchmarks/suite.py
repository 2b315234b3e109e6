"""The test suite's own time: the README's test command, timed, with where its time goes.

  python benchmarks/suite.py            # the whole suite (40 minutes on 2 AMD EPYC cores); benchmarks/results/suite.*
  python benchmarks/suite.py --smoke    # one small test file (seconds): the script itself works

Runs `python -m pytest -q -n 2 --dist loadfile tests` (the README's second command without its install; the install
is pip's cache and the network) in this Python, timing it by the wall clock and the CPU seconds of every process it
started. Writes suite.json and suite.md to --results (--smoke: a scratch directory): the commit, the passed and
failed counts, wall-clock, CPU share of the machine's cores, every test file's seconds (summed over its tests: the
work a worker spent on it), every test's seconds (the slowest in the report) and each failed test's traceback. A
file's seconds are measured with the other worker busy: they add up to about the cores times the wall-clock, not to
it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FAILURE_CHARS = 4000  # of a failed test's traceback, its end, kept in the results

from benchmarks.cells import cpu_model  # noqa: E402


def run(tests: list[str], workers: int, junit: Path) -> dict:
    """The pytest command over `tests`, timed: {command, exit_code, wall_seconds, cpu_seconds, cores, cpu_model,
    cpu_share}."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadfile", *tests,
           f"--junitxml={junit}", "-p", "no:cacheprovider"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cores = len(os.sched_getaffinity(0))
    print(proc.stdout[-3000:], flush=True)
    return {"command": f"python -m pytest -q -n {workers} --dist loadfile {' '.join(tests)}",
            "exit_code": proc.returncode, "wall_seconds": wall, "cpu_seconds": cpu, "cores": cores,
            "cpu_model": cpu_model(), "cpu_share": cpu / wall / cores}


def per_test(junit: Path) -> tuple[list[dict], dict]:
    """Every test's seconds (setup, call and teardown) and outcome, from pytest's JUnit XML; a failed one's
    traceback tail too (a crashed worker's: pytest's line naming the test it was running)."""
    tests, outcomes = [], collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if bad is None else bad.tag
        outcomes[outcome] += 1
        tests.append({"file": case.get("classname", "").split(".")[-1] + ".py", "name": case.get("name"),
                      "seconds": float(case.get("time") or 0), "outcome": outcome})
        if outcome in ("failure", "error"):
            tests[-1]["why"] = ((bad.get("message") or "") + "\n" + (bad.text or ""))[-FAILURE_CHARS:]
    return tests, dict(outcomes)


def report(res: dict) -> str:
    minutes = lambda s: f"{int(s // 60)} min {s % 60:02.0f} s"  # noqa: E731
    lines = [f"# The test suite: {minutes(res['wall_seconds'])}", "",
             f"`{res['command']}` at `{res['commit']}`, {res['date']}: {res['outcomes'].get('passed', 0)} passed"
             + "".join(f", {n} {k}" for k, n in res["outcomes"].items() if k != "passed")
             + f"; {res['cores']} cores ({res['cpu_model']}), CPU busy {res['cpu_share']:.0%} of them "
               f"({res['cpu_seconds']:.0f} CPU seconds). Made by `python benchmarks/suite.py`.", "",
             "| test file | tests | seconds (worker) | share |", "|---|---|---|---|"]
    total = sum(f["seconds"] for f in res["files"]) or 1
    lines += [f"| {f['file']} | {f['tests']} | {f['seconds']:.0f} | {f['seconds'] / total:.0%} |" for f in res["files"]]
    lines += ["", "Slowest tests:", "", "| test | seconds |", "|---|---|"]
    lines += [f"| {t['file']}::{t['name']} | {t['seconds']:.1f} |" for t in res["slowest"]]
    for t in res.get("failed", []):
        lines += ["", f"Failed: `{t['file']}::{t['name']}`", "", "```", t["why"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    from benchmarks.cells import commit

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (the README's: 2)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="tests/test_advantages.py only, results to a scratch dir")
    args = p.parse_args()
    tests = ["tests/test_advantages.py"] if args.smoke else ["tests"]
    results = Path(tempfile.mkdtemp(prefix="arealjax_suite_")) if args.smoke else Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        res = {"commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M"), **run(tests, args.workers, junit)}
        tests_run, res["outcomes"] = per_test(junit)
    files = collections.defaultdict(lambda: {"tests": 0, "seconds": 0.0})
    for t in tests_run:
        files[t["file"]]["tests"] += 1
        files[t["file"]]["seconds"] += t["seconds"]
    res["files"] = sorted(({"file": f, **v} for f, v in files.items()), key=lambda f: -f["seconds"])
    res["slowest"] = sorted(tests_run, key=lambda t: -t["seconds"])[:20]
    res["failed"] = [t for t in tests_run if "why" in t]
    res["tests"] = sorted(({k: t[k] for k in ("file", "name", "seconds")} for t in tests_run),
                          key=lambda t: -t["seconds"])  # every test: where the next minutes can come from
    (results / "suite.json").write_text(json.dumps(res, indent=1))
    (results / "suite.md").write_text(report(res))
    print(report(res))
    if res["exit_code"]:
        sys.exit(f"the suite failed (pytest exit {res['exit_code']}): {results / 'suite.md'}")


if __name__ == "__main__":
    main()
