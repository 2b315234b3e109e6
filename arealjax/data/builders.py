"""Local JSONL / Parquet files in the common RL dataset layouts → a tensorflow-datasets dataset (array_record, no
TensorFlow) that `pipeline.py` streams with grain.

    path = convert({"train": ["gsm8k/train.jsonl"], "test": ["gsm8k/test.jsonl"]}, data_dir="/data/tfds")
    # -> /data/tfds/gsm8k/1.0.0 ; layout detected from the first row (or layout="gsm8k")

Every RL layout becomes one record shape: `id`, `prompt` (the question), `answer` (the reference final answer) and
`tests` (JSON list of code tests, as `rewards.code.code_reward` takes them; "" otherwise); the SFT layout becomes
`id` and `messages` (a JSON list of {role, content}). A malformed row is an
error naming its file and line (row, for Parquet) and what the layout expects, or with on_error="skip" it is left
out and counted (the counts are in the dataset's description and returned).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds

from arealjax.rewards.math import last_boxed, reference

VERSION = "1.0.0"


class RowError(ValueError):
    """A row that does not fit its layout."""


def _text(row: dict, *keys: str) -> str:
    for k in keys:
        if k in row and row[k] is not None:
            if not isinstance(row[k], str) or not row[k].strip():
                raise RowError(f"key '{k}' must be a non-empty string, got {type(row[k]).__name__} {row[k]!r:.60}")
            return row[k]
    raise RowError(f"missing key {' or '.join(repr(k) for k in keys)}")


def _gsm8k(row: dict) -> dict:
    answer = _text(row, "answer")
    if "####" not in answer:
        raise RowError("key 'answer' has no '#### <final answer>' line")
    return {"prompt": _text(row, "question"), "answer": reference(answer), "tests": ""}


def _math(row: dict) -> dict:
    if row.get("answer") is not None:
        answer = _text(row, "answer")
    else:
        answer = last_boxed(_text(row, "solution"))
        if answer is None:
            raise RowError("no key 'answer' and key 'solution' has no \\boxed{} final answer")
    return {"prompt": _text(row, "problem"), "answer": answer, "tests": ""}


def _tests(row: dict) -> list[dict]:
    """Tests from `tests` (a list, or its JSON), APPS-style `input_output` ({"inputs", "outputs"[, "fn_name"]}) or
    LiveCodeBench-style `public_test_cases` / `private_test_cases`."""
    def load(key):
        v = row[key]
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError as e:
                raise RowError(f"key '{key}' is not valid JSON: {e}") from None
        return v

    if row.get("tests") is not None:
        tests = load("tests")
    elif row.get("input_output") is not None:
        io = load("input_output")
        if not isinstance(io, dict) or not isinstance(io.get("inputs"), list) or \
                not isinstance(io.get("outputs"), list) or len(io["inputs"]) != len(io["outputs"]):
            raise RowError("key 'input_output' must hold equal-length lists 'inputs' and 'outputs'")
        if io.get("fn_name"):
            tests = [{"fn_name": io["fn_name"], "args": i, "expected": o[0] if isinstance(o, list) and len(o) == 1
                      else o} for i, o in zip(io["inputs"], io["outputs"])]
        else:
            tests = [{"input": i, "output": o} for i, o in zip(io["inputs"], io["outputs"])]
    else:
        tests = [t for key in ("public_test_cases", "private_test_cases") if row.get(key) for t in load(key)]
    if not isinstance(tests, list) or not tests:
        raise RowError("no tests: expected a non-empty list in 'tests', 'input_output' or 'public_test_cases'")
    out = []
    for i, t in enumerate(tests):
        if isinstance(t, dict) and "fn_name" in t and "expected" in t:
            out.append({"fn_name": t["fn_name"], "args": t.get("args", []), "expected": t["expected"]})
        elif isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str):
            out.append({"input": t["input"], "output": t["output"]})
        else:
            raise RowError(f"test {i} is {t!r:.80}; expected {{'input': str, 'output': str}} or "
                           f"{{'fn_name', 'args', 'expected'}}")
    return out


def _code(row: dict) -> dict:
    return {"prompt": _text(row, "question", "prompt", "problem"), "answer": "", "tests": json.dumps(_tests(row))}


ROLES = ("system", "user", "assistant", "tool")


def _sft(row: dict) -> dict:
    """A conversation for SFT: 'messages' ([{role, content}], trained on the assistant turns) or 'prompt' +
    'response' (one user turn, one assistant turn)."""
    if row.get("messages") is not None:
        messages = row["messages"]
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except ValueError as e:
                raise RowError(f"key 'messages' is not valid JSON: {e}") from None
        if not isinstance(messages, list) or not messages:
            raise RowError("key 'messages' must be a non-empty list of {'role', 'content'}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise RowError(f"message {i} is {m!r:.80}; expected {{'role': one of {ROLES}, 'content': str}}")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            raise RowError("no non-empty assistant message: nothing to train on")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        messages = [{"role": "user", "content": _text(row, "prompt")},
                    {"role": "assistant", "content": _text(row, "response")}]
    return {"messages": json.dumps(messages, ensure_ascii=False)}


def _arithmetic(row: dict) -> dict:
    return {"prompt": _text(row, "prompt"), "answer": _text(row, "answer"), "tests": ""}


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    keys: str  # what a row needs, for error messages
    detect: Callable[[dict], bool]
    convert: Callable[[dict], dict]


LAYOUTS = {layout.name: layout for layout in (
    Layout("code", "'question' (or 'prompt'/'problem') and tests in 'tests', 'input_output' or 'public_test_cases'",
           lambda r: any(k in r for k in ("tests", "input_output", "public_test_cases")), _code),
    Layout("gsm8k", "'question' and 'answer' ending in '#### <final answer>'",
           lambda r: "question" in r and "answer" in r, _gsm8k),
    Layout("math", "'problem' and 'answer' (or a 'solution' with a \\boxed{} answer) — MATH, DeepScaleR",
           lambda r: "problem" in r and ("answer" in r or "solution" in r), _math),
    Layout("sft", "'messages' (a list of {'role', 'content'}) or 'prompt' and 'response' — SFT conversations",
           lambda r: "messages" in r or ("prompt" in r and "response" in r), _sft),
    Layout("arithmetic", "'prompt' and 'answer' (the synthetic task)",
           lambda r: "prompt" in r and "answer" in r, _arithmetic),
)}


def known_layouts() -> str:
    return "; ".join(f"{layout.name}: {layout.keys}" for layout in LAYOUTS.values())


def read_rows(file: str | Path) -> Iterator[tuple[str, dict | RowError]]:
    """(location, row) for each row of a .jsonl or .parquet file; location is 'file:line' ('file:row i' for
    Parquet). A line that is not a JSON object comes as a RowError, so a caller may skip it and read on."""
    file = Path(file)
    if file.is_dir():
        raise ValueError(f"{file} is a directory; give the .jsonl or .parquet files in it (comma-separated)")
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(file).to_pylist()):
            yield f"{file}:row {i}", row
        return
    if file.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{file}: expected a .jsonl or .parquet file")
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{file}:{n}", RowError(f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            yield f"{file}:{n}", row if isinstance(row, dict) else RowError(
                f"expected a JSON object, got {type(row).__name__}")


def detect_layout(files: Sequence[str | Path]) -> Layout:
    """The layout of the first well-formed row of the first file."""
    for loc, row in read_rows(files[0]):
        if isinstance(row, RowError):
            continue
        for layout in LAYOUTS.values():
            if layout.detect(row):
                return layout
        raise ValueError(f"{loc}: unknown dataset layout (keys {sorted(row)}); known layouts — {known_layouts()}")
    raise ValueError(f"{files[0]}: no rows")


def records(files: Sequence[str | Path], layout: Layout, on_error: str, skipped: list[str]) -> Iterator[dict]:
    """The layout's record of every row; ids are the row's 'id' or 'file-stem:line'. Bad rows raise, or with
    on_error="skip" are listed in `skipped`."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got '{on_error}'")
    for file in files:
        for loc, row in read_rows(file):
            try:
                if isinstance(row, RowError):
                    raise row
                rec = layout.convert(row)
            except RowError as e:
                if on_error == "skip":
                    skipped.append(f"{loc}: {e}")
                    continue
                raise RowError(f"{loc}: {e} (layout '{layout.name}' expects {layout.keys})") from None
            rec["id"] = str(row["id"]) if row.get("id") is not None else f"{Path(file).stem}:{loc.rsplit(':', 1)[1]}"
            yield rec


class _Rows(tfds.core.GeneratorBasedBuilder):
    """Base of the layout builders: splits of records from local files (given at construction)."""

    VERSION = tfds.core.Version(VERSION)
    FIELDS = ("id", "prompt", "answer", "tests")

    def __init__(self, *, files: dict[str, Sequence[str]], layout: Layout, on_error: str = "raise", **kwargs: Any):
        self._files, self._layout, self._on_error = files, layout, on_error
        self.skipped: dict[str, list[str]] = {split: [] for split in files}
        self.counts = dict.fromkeys(files, 0)  # records written per split
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self, description=f"layout {self._layout.name} from {self._files}",
            features=tfds.features.FeaturesDict(dict.fromkeys(self.FIELDS, text)))

    def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(split) for split in self._files}

    def _generate_examples(self, split: str):
        seen: set[str] = set()
        for rec in records(self._files[split], self._layout, self._on_error, self.skipped[split]):
            if rec["id"] in seen:
                raise RowError(f"split '{split}': id '{rec['id']}' appears twice")
            seen.add(rec["id"])
            self.counts[split] += 1
            yield rec["id"], rec


class Gsm8k(_Rows):
    """GSM8K layout."""


class Math(_Rows):
    """MATH / DeepScaleR layout."""


class Code(_Rows):
    """Code-contest layout (CodeContests, APPS, LiveCodeBench)."""


class Arithmetic(_Rows):
    """The synthetic task's layout."""


class Sft(_Rows):
    """SFT conversations: id and messages (JSON)."""

    FIELDS = ("id", "messages")


_BUILDERS = {"gsm8k": Gsm8k, "math": Math, "code": Code, "sft": Sft, "arithmetic": Arithmetic}


def convert(files: dict[str, Sequence[str | Path]], data_dir: str | Path, layout: str = "auto",
            on_error: str = "raise", overwrite: bool = False) -> Path:
    """Converts local files (split -> files) into data_dir/<layout>/1.0.0 (array_record) and returns that path.
    Skipped rows (on_error="skip") are logged with their locations and counted in `skipped.json` beside it. An
    existing conversion of the same files is reused; one of other files is an error unless `overwrite`."""
    files = {split: [str(f) for f in fs] for split, fs in files.items()}
    if not files or not all(files.values()):
        raise ValueError(f"convert: expected split -> non-empty list of files, got {files}")
    if layout == "auto":
        found = detect_layout(next(iter(files.values())))
    elif layout in LAYOUTS:
        found = LAYOUTS[layout]
    else:
        raise ValueError(f"unknown dataset layout '{layout}'; known layouts — {known_layouts()}")
    builder = _BUILDERS[found.name](files=files, layout=found, on_error=on_error, data_dir=str(data_dir),
                                    file_format="array_record")
    out = Path(builder.data_dir)
    if overwrite and out.is_dir():
        shutil.rmtree(out)
    if (out / "dataset_info.json").is_file():
        before = json.loads((out / "dataset_info.json").read_text()).get("description", "")
        if before != builder.info.description:
            raise ValueError(f"{out} already holds a dataset converted from other files ({before}); this run "
                             f"converts {files}. Pass another --out, or --overwrite to replace it")
        logging.info("%s exists, converted from the same files: reusing it", out)
        return out
    try:
        builder.download_and_prepare()
    except AssertionError:  # tfds asserts that every split has examples
        empty = [split for split in files if not builder.counts[split]]
        if not empty:
            raise
        shutil.rmtree(out, ignore_errors=True)
        raise ValueError("; ".join(f"split '{s}' ({', '.join(files[s])}) has no usable rows" +
                                   (f" ({len(builder.skipped[s])} skipped)" if builder.skipped[s] else "")
                                   for s in empty)) from None
    skipped = {split: len(v) for split, v in builder.skipped.items()}
    for rows in builder.skipped.values():
        for loc in rows[:5]:
            logging.warning("skipped %s", loc)
    (out / "skipped.json").write_text(json.dumps({"counts": skipped, "rows": builder.skipped}, indent=1))
    return out
