"""Arithmetic word problems in GSM8K's JSONL layout (question, worked answer, `#### n`), train and held-out splits.

  python -m arealjax.data.word_problems --out=/tmp/smollm2/raw            # -> train.jsonl, test.jsonl
  python -m arealjax.data.convert --out=/tmp/smollm2/tfds --train=/tmp/smollm2/raw/train.jsonl \
      --test=/tmp/smollm2/raw/test.jsonl                                 # as GSM8K itself is converted

The real-model recipe's task (configs/smollm2.py): one- and two-step problems about people and things, in plain
English, at a size a 135M-parameter instruct model solves some of the time (SmolLM2-135M-Instruct answers "17 + 25"
with 32): enough right answers for GRPO to learn from, enough wrong ones to learn. `--max-number` sets how large
the numbers get. The held-out split never repeats a training question.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

NAMES = ["Anna", "Ben", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kofi", "Lena", "Maya",
         "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "shells", "stamps", "coins", "cards",
         "balloons", "flowers", "candies", "toy cars", "eggs", "oranges"]
CONTAINERS = ["boxes", "bags", "baskets", "jars", "packs", "trays"]


def _pronoun(name: str) -> str:
    return "she" if name in ("Anna", "Dana", "Emma", "Grace", "Ines", "Lena", "Maya", "Priya", "Rosa", "Tara",
                             "Vera", "Yuki", "Zoe") else "he"


# Each kind: rng, largest number -> (question, worked solution, answer). Solutions use GSM8K's <<a+b=c>> notes.
def _add(rng, top):
    n, item = _pick(rng, NAMES), _pick(rng, ITEMS)
    a, b = _ints(rng, 2, top, 2)
    q = f"{n} has {a} {item}. {_pronoun(n).capitalize()} buys {b} more {item}. How many {item} does {n} have now?"
    return q, f"{n} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item} now.", a + b


def _together(rng, top):
    n1, n2 = _two(rng)
    item = _pick(rng, ITEMS)
    a, b = _ints(rng, 2, top, 2)
    q = f"{n1} has {a} {item} and {n2} has {b} {item}. How many {item} do they have together?"
    return q, f"Together they have {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.", a + b


def _more_than(rng, top):
    n1, n2 = _two(rng)
    item = _pick(rng, ITEMS)
    a, b = _ints(rng, 2, top, 2)
    q = f"{n1} has {a} {item}. {n2} has {b} more {item} than {n1}. How many {item} does {n2} have?"
    return q, f"{n2} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.", a + b


def _give(rng, top):
    n1, n2 = _two(rng)
    item = _pick(rng, ITEMS)
    b, c = _ints(rng, 1, top, 2)
    a = b + c
    q = f"{n1} had {a} {item}. {_pronoun(n1).capitalize()} gave {b} of them to {n2}. How many {item} does {n1} " \
        f"have left?"
    return q, f"{n1} has {a} - {b} = <<{a}-{b}={c}>>{c} {item} left.", c


def _eat(rng, top):
    n, item = _pick(rng, NAMES), _pick(rng, ["cookies", "candies", "apples", "oranges", "grapes", "crackers"])
    b, c = _ints(rng, 1, top, 2)
    a = b + c
    q = f"There were {a} {item} on the table. {n} ate {b} of them. How many {item} are on the table now?"
    return q, f"There are {a} - {b} = <<{a}-{b}={c}>>{c} {item} left.", c


def _groups(rng, top):
    box, item = _pick(rng, CONTAINERS), _pick(rng, ITEMS)
    a, b = _ints(rng, 2, max(3, int(top ** 0.5) + 2), 2)
    q = f"There are {a} {box} with {b} {item} in each. How many {item} are there in all?"
    return q, f"There are {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.", a * b


def _share(rng, top):
    n, item = _pick(rng, NAMES), _pick(rng, ITEMS)
    a, b = _ints(rng, 2, max(3, int(top ** 0.5) + 2), 2)
    q = f"{n} shares {a * b} {item} equally among {a} friends. How many {item} does each friend get?"
    return q, f"Each friend gets {a * b} / {a} = <<{a * b}/{a}={b}>>{b} {item}.", b


def _buy_then_give(rng, top):
    n, item = _pick(rng, NAMES), _pick(rng, ITEMS)
    a, b = _ints(rng, 2, top, 2)
    c = int(rng.integers(1, a + b))
    q = f"{n} has {a} {item}. {_pronoun(n).capitalize()} gets {b} more and then gives away {c}. How many {item} " \
        f"does {n} have now?"
    s = f"After getting more, {n} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n" \
        f"After giving some away, {n} has {a + b} - {c} = <<{a + b}-{c}={a + b - c}>>{a + b - c} {item}."
    return q, s, a + b - c


def _price(rng, top):
    n = _pick(rng, NAMES)
    thing = _pick(rng, ["pen", "notebook", "ticket", "sandwich", "toy", "ball"])
    a, b = _ints(rng, 2, max(3, int(top ** 0.5) + 2), 2)
    q = f"A {thing} costs {a} dollars. {n} buys {b} of them. How many dollars does {n} spend?"
    return q, f"{n} spends {a} * {b} = <<{a}*{b}={a * b}>>{a * b} dollars.", a * b


KINDS: dict[str, Callable] = {"add": _add, "together": _together, "more_than": _more_than, "give": _give,
                              "eat": _eat, "groups": _groups, "share": _share, "buy_then_give": _buy_then_give,
                              "price": _price}


def _pick(rng, xs):
    return xs[int(rng.integers(len(xs)))]


def _two(rng):
    i, j = rng.choice(len(NAMES), 2, replace=False)
    return NAMES[int(i)], NAMES[int(j)]


def _ints(rng, lo, hi, n):
    return [int(x) for x in rng.integers(lo, hi + 1, n)]


def rows(n: int, seed: int, max_number: int = 10, kinds: tuple[str, ...] = tuple(KINDS),
         exclude: set[str] = frozenset()) -> list[dict]:
    """`n` distinct problems (kinds in turn, numbers up to `max_number`), none of whose questions is in `exclude`:
    GSM8K's keys, and the problem's kind (which the converter ignores; per-kind accuracy reads it)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"unknown problem kinds {unknown or kinds}; known: {sorted(KINDS)}")
    if max_number < 3:
        raise ValueError(f"max_number must be at least 3, got {max_number}")
    if n < 1:
        raise ValueError(f"asked for {n} problems; expected at least 1")
    rng = np.random.default_rng(seed)
    out, seen, repeats = [], set(exclude), 0
    while repeats < 2000:  # draws until n distinct questions, or 2000 repeats in a row (the kinds are used up)
        kind = kinds[len(out) % len(kinds)]
        q, solution, answer = KINDS[kind](rng, max_number)
        repeats = repeats + 1 if q in seen else 0
        if q not in seen:
            seen.add(q)
            out.append({"question": q, "answer": f"{solution}\n#### {answer}", "kind": kind})
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} distinct problems of {n} with numbers up to {max_number}: raise "
                     f"--max-number or ask for fewer")


def write(out: str | Path, train: int, test: int, seed: int = 0, max_number: int = 10,
          kinds: tuple[str, ...] = tuple(KINDS)) -> dict[str, Path]:
    """out/test.jsonl (drawn first) and out/train.jsonl (no question of the test split); returns split -> file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    held_out = rows(test, seed + 1, max_number, kinds)
    splits = {"test": held_out, "train": rows(train, seed, max_number, kinds, {r["question"] for r in held_out})}
    files = {}
    for split, data in splits.items():
        files[split] = out / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in data))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    p.add_argument("--train", type=int, default=10000, help="training problems")
    p.add_argument("--test", type=int, default=500, help="held-out problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-number", type=int, default=10, help="the largest number in a problem")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"problem kinds, comma-separated: {','.join(KINDS)}")
    args = p.parse_args(argv)
    try:
        files = write(args.out, args.train, args.test, args.seed, args.max_number, tuple(args.kinds.split(",")))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(args.out))
    return 0 if files else 1


if __name__ == "__main__":
    sys.exit(main())
