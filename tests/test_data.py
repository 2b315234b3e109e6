"""Data: each layout converts (JSONL and Parquet) to an array_record tfds dataset and streams through grain;
malformed rows and unknown layouts give errors naming file and line; skip mode counts; the stream's position
round-trips exactly (shuffle, epochs, process shards, too-long prompts)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from arealjax.data.builders import RowError, convert
from arealjax.data.pipeline import PromptStream
from arealjax.tokenizer import CharTokenizer

TOK = CharTokenizer("0123456789+-*=?.,:;#$\\{}()[]_/' abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n")

ROWS = {
    "gsm8k": [{"question": f"what is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
              for i in range(12)],
    "math": [{"problem": "solve x+1=2", "answer": "1"},
             {"problem": "what is 1/2 + 1/2?", "solution": "it is \\boxed{1}"}],  # DeepScaleR / MATH forms
    "code": [{"question": "add two numbers", "tests": [{"input": "1 2", "output": "3"}]},
             {"prompt": "double", "tests": json.dumps([{"fn_name": "f", "args": [2], "expected": 4}])},
             {"question": "apps style", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})},
             {"question": "lcb style", "public_test_cases": json.dumps([{"input": "a", "output": "b",
                                                                         "testtype": "stdin"}])}],
    "arithmetic": [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(5)],
}


def write_jsonl(path, rows, raw_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(raw_lines))
    return path


def test_every_layout_converts_and_streams(tmp_path):
    for layout, rows in ROWS.items():
        src = write_jsonl(tmp_path / f"{layout}.jsonl", rows)
        out = convert({"train": [src]}, tmp_path / "tfds")
        assert out == tmp_path / "tfds" / layout / "1.0.0"
        prompts = list(PromptStream(out, "train", TOK, epochs=1, template="{prompt}"))
        texts = [r.get("question") or r.get("prompt") or r.get("problem") for r in rows]
        assert sorted(p.id for p in prompts) == sorted(f"{layout}:{i + 1}" for i in range(len(rows)))
        assert all(TOK.decode(p.tokens) == texts[int(p.id.split(":")[1]) - 1] for p in prompts)
    by_id = {p.id: p for p in PromptStream(tmp_path / "tfds/gsm8k/1.0.0", "train", TOK, epochs=1)}
    assert by_id["gsm8k:3"].reward_kwargs == {"answer": "4"}  # the #### line
    assert TOK.decode(by_id["gsm8k:3"].tokens[1:]) == "u:what is 2 plus 2?\na:"  # chat template (+ BOS)
    math = {p.id: p.reward_kwargs for p in PromptStream(tmp_path / "tfds/math/1.0.0", "train", TOK, epochs=1)}
    assert math == {"math:1": {"answer": "1"}, "math:2": {"answer": "1"}}
    code = {p.id: p.reward_kwargs["tests"] for p in PromptStream(tmp_path / "tfds/code/1.0.0", "train", TOK,
                                                                    epochs=1)}
    assert code["code:1"] == [{"input": "1 2", "output": "3"}]
    assert code["code:2"] == [{"fn_name": "f", "args": [2], "expected": 4}]
    assert code["code:3"] == [{"input": "1\n", "output": "2\n"}]
    assert code["code:4"] == [{"input": "a", "output": "b"}]


def test_parquet_and_splits(tmp_path):
    rows = ROWS["math"]
    pq.write_table(pa.Table.from_pylist([{"problem": r["problem"], "answer": r.get("answer"),
                                          "solution": r.get("solution")} for r in rows]), tmp_path / "m.parquet")
    write_jsonl(tmp_path / "t.jsonl", rows[:1])
    out = convert({"train": [tmp_path / "m.parquet"], "test": [tmp_path / "t.jsonl"]}, tmp_path / "tfds")
    assert sorted(p.reward_kwargs["answer"] for p in PromptStream(out, "train", TOK, epochs=1)) == ["1", "1"]
    assert len(list(PromptStream(out, "test", TOK, epochs=1))) == 1
    with pytest.raises(ValueError, match="data.split='validation': .* has no such split; it has \\['test', 'train'\\]"):
        PromptStream(out, "validation", TOK)


def test_malformed_rows_name_file_and_line_or_are_skipped_and_counted(tmp_path):
    good = ROWS["gsm8k"][:3]
    cases = {
        "bad_json.jsonl": (good, ['{"question": "x", "answer"\n'], r"bad_json.jsonl:4: invalid JSON"),
        "no_hashes.jsonl": (good + [{"question": "q", "answer": "42"}], [],
                            r"no_hashes.jsonl:4: key 'answer' has no '#### <final answer>' line \(layout 'gsm8k'"),
        "missing.jsonl": (good + [{"question": "q"}], [], r"missing.jsonl:4: missing key 'answer'"),
        "wrong_type.jsonl": (good + [{"question": 3, "answer": "#### 3"}], [],
                             r"wrong_type.jsonl:4: key 'question' must be a non-empty string, got int"),
    }
    for name, (rows, raw, message) in cases.items():
        src = write_jsonl(tmp_path / name, rows, raw)
        with pytest.raises(RowError, match=message):
            convert({"train": [src]}, tmp_path / f"tfds_{name}", layout="gsm8k")
        out = convert({"train": [src]}, tmp_path / f"skip_{name}", layout="gsm8k", on_error="skip")
        assert json.loads((out / "skipped.json").read_text())["counts"] == {"train": 1}
        assert len(list(PromptStream(out, "train", TOK, epochs=1))) == 3
    bad_code = write_jsonl(tmp_path / "code.jsonl", [{"question": "q", "tests": [{"stdin": "1"}]}])
    with pytest.raises(RowError, match=r"code.jsonl:1: test 0 is .*expected \{'input': str, 'output': str\}"):
        convert({"train": [bad_code]}, tmp_path / "tfds_code")


def test_unknown_layout_lists_the_known_ones(tmp_path):
    src = write_jsonl(tmp_path / "odd.jsonl", [{"text": "hello", "label": 1}])
    with pytest.raises(ValueError, match=r"odd.jsonl:1: unknown dataset layout \(keys \['label', 'text'\]\); "
                                         r"known layouts — code: .*gsm8k: .*math: .*arithmetic: "):
        convert({"train": [src]}, tmp_path / "tfds")
    with pytest.raises(ValueError, match="unknown dataset layout 'alpaca'; known layouts — code"):
        convert({"train": [src]}, tmp_path / "tfds", layout="alpaca")


def test_stream_state_round_trips_shuffles_per_epoch_and_shards(tmp_path):
    rows = ROWS["gsm8k"] + [{"question": "x" * 200, "answer": "#### 1"}]  # one prompt over the limit
    out = convert({"train": [write_jsonl(tmp_path / "g.jsonl", rows)]}, tmp_path / "tfds")
    kw = dict(seed=3, epochs=2, template="{prompt}", max_prompt_tokens=100)
    prompts = list(PromptStream(out, "train", TOK, **kw))
    ids = [p.id for p in prompts]
    assert len(ids) == 24 and sorted(ids[:12]) == sorted(ids[12:]) and ids[:12] != ids[12:]  # reshuffled
    assert [p.epoch for p in prompts] == [0] * 12 + [1] * 12  # a prompt drawn again gets other sampling seeds
    assert len({p.sampling_seed(0) for p in prompts}) == 24
    stream = PromptStream(out, "train", TOK, **kw)
    head = [next(stream) for _ in range(7)]
    state = json.loads(json.dumps(stream.get_state()))  # JSON-able
    resumed = PromptStream(out, "train", TOK, **kw)
    resumed.set_state(state)
    assert head + list(resumed) == prompts  # ids, epochs, tokens
    assert resumed.too_long == 2  # the long prompt, once per epoch, counted across the restore
    shards = [[p.id for p in PromptStream(out, "train", TOK, epochs=1, template="{prompt}", max_prompt_tokens=100,
                                          process_index=i, process_count=2)] for i in range(2)]
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == sorted(ids[:12])


@pytest.mark.slow
def test_the_job_trains_on_a_converted_dataset(tmp_path, monkeypatch):
    """main's job reads prompts from a converted dataset: every trained prompt id comes from the train split, none
    twice within an epoch, and evaluation uses the test split. Training and evaluate.py open each split before they
    start a thread: tensorflow_datasets, loaded with the first split opened, swaps builtins.__import__ for a lazy
    stand-in while it imports, which breaks any import another thread makes meanwhile (a reward worker's)."""
    import threading

    from test_controller import small_config

    from arealjax import evaluate, train
    from arealjax.data import arithmetic, pipeline

    opened = []  # the threads alive whenever a split was opened
    load_split = pipeline.load_split
    monkeypatch.setattr(pipeline, "load_split", lambda *a: opened.append(set(threading.enumerate())) or load_split(*a))

    problems = arithmetic.sample_problems(40, seed=1)
    rows = [{"id": f"p{i}", "prompt": p.prompt, "answer": p.answer} for i, p in enumerate(problems)]
    out = convert({"train": [write_jsonl(tmp_path / "train.jsonl", rows[:32])],
                   "test": [write_jsonl(tmp_path / "test.jsonl", rows[32:])]}, tmp_path / "tfds")
    c = small_config(0, steps=3)
    c.data.update(path=str(out), epochs=1, max_prompt_tokens=16)
    before = set(threading.enumerate())
    summary = train.run(c, str(tmp_path / "run"))
    steps = [json.loads(x) for x in (tmp_path / "run" / "trained_prompts.jsonl").read_text().splitlines()]
    ids = [i for s in steps for i in s["ids"]]
    assert [s["step"] for s in steps] == [1, 2, 3] and len(ids) == 12 == summary["prompts"]["trained"]
    assert len(set(ids)) == 12 and set(ids) <= {f"p{i}" for i in range(32)}
    trained = len(opened)
    before_eval = set(threading.enumerate())
    evaluate.run(c, tmp_path / "eval", workdir=str(tmp_path / "run"), progress=False)
    assert len((tmp_path / "eval" / "problems.jsonl").read_text().splitlines()) == c.eval.num_problems
    assert trained == 2 and len(opened) == 3
    assert all(alive <= before for alive in opened[:2]) and opened[2] <= before_eval, [x - before for x in opened]


def test_convert_command_line(tmp_path, capsys):
    from arealjax.data.convert import main

    good = write_jsonl(tmp_path / "g.jsonl", ROWS["gsm8k"][:2])
    bad = write_jsonl(tmp_path / "b.jsonl", [{"question": "q"}])
    assert main([f"--out={tmp_path / 'tfds'}", f"--train={good}", f"--test={good}"]) == 0
    assert len(list(PromptStream(tmp_path / "tfds/gsm8k/1.0.0", "test", TOK, epochs=1))) == 2
    assert main([f"--out={tmp_path / 'bad'}", f"--train={bad}", "--layout=gsm8k"]) == 2
    assert "b.jsonl:1: missing key 'answer'" in capsys.readouterr().err


def test_convert_refuses_mistakes_with_one_line_each(tmp_path, capsys):
    """Into an existing --out it used to keep the *old* dataset silently; an empty split or one whose every row
    was skipped ended in a tfds AssertionError; a directory as --train was not named. stdout carries only the
    dataset's path (tfds printed its progress there)."""
    import subprocess
    import sys
    from pathlib import Path

    from arealjax.data.convert import main

    out = tmp_path / "tfds"
    a = write_jsonl(tmp_path / "a.jsonl", ROWS["gsm8k"][:3])
    b = write_jsonl(tmp_path / "b.jsonl", ROWS["gsm8k"][3:7])
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "arealjax.data.convert", f"--out={out}", f"--train={a}"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout == f"{out / 'gsm8k/1.0.0'}\n", (res.stdout, res.stderr[-2000:])
    capsys.readouterr()
    assert main([f"--out={out}", f"--train={a}"]) == 0  # the same files again: reused
    assert main([f"--out={out}", f"--train={b}"]) == 2
    assert "already holds a dataset converted from other files" in capsys.readouterr().err
    assert main([f"--out={out}", f"--train={b}", "--overwrite"]) == 0
    assert len(list(PromptStream(out / "gsm8k/1.0.0", "train", TOK, epochs=1))) == 4  # the new rows

    empty = write_jsonl(tmp_path / "empty.jsonl", [{"question": "q", "answer": "no final answer"}] * 2)
    assert main([f"--out={tmp_path / 'e'}", f"--train={empty}", "--layout=gsm8k", "--on-error=skip"]) == 2
    assert "split 'train' (" in (err := capsys.readouterr().err) and "has no usable rows (2 skipped)" in err
    assert main([f"--out={tmp_path / 'd'}", f"--train={tmp_path}"]) == 2
    assert "is a directory; give the .jsonl or .parquet files in it" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    """The recipes' tiny fixtures: BPE tokenizers with each family's chat template, datasets in real layouts."""
    from arealjax import tiny

    out = tmp_path_factory.mktemp("tiny")
    tiny.write_datasets(out, train=16, test=4)
    texts = tiny.corpus(out)
    for name, (_, template, specials, bos, eos, extra) in tiny.MODELS.items():
        tiny.write_tokenizer(out / name, texts, template, specials, bos, eos, extra)
    return out


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5-math", "r1-distill", "llama3"])
def test_format_prompt_writes_bos_once(tiny_root, name):
    """Llama 3's and DeepSeek-R1's templates write the BOS themselves: the prompt must not start with two."""
    from arealjax.data.pipeline import format_prompt
    from arealjax.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_root / name)
    ids = format_prompt(tok, "What is 2 + 3?", "chat", "{prompt} Think.")
    assert "What is 2 + 3? Think." in tok.decode(ids)
    if tok.bos_id is None:
        assert tok.bos_id not in ids
    else:
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5-math", "r1-distill", "llama3"])
def test_chat_tokens_train_on_assistant_turns_only(tiny_root, name):
    from arealjax.data.pipeline import chat_tokens
    from arealjax.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_root / name)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is \\boxed{5}."},
            {"role": "user", "content": "And plus 4?"}, {"role": "assistant", "content": "Then \\boxed{9}."}]
    tokens, mask = chat_tokens(tok, msgs)
    assert len(tokens) == len(mask) and not mask[0]
    trained = tok.decode([t for t, m in zip(tokens, mask) if m])
    untrained = tok.decode([t for t, m in zip(tokens, mask) if not m])
    assert trained.replace("\n", "") == "It is \\boxed{5}.Then \\boxed{9}."  # contents (+ end markers, skipped)
    assert "What is 2 + 3?" in untrained and "And plus 4?" in untrained and "boxed{5}" not in untrained
    # each assistant turn's end-of-turn token is trained, so the model learns to stop
    assert sum(t in tok.eos_ids for t, m in zip(tokens, mask) if m) == 2
    if tok.bos_id is not None:
        assert tokens.count(tok.bos_id) == 1


def test_sft_layout_converts_and_streams(tmp_path, tiny_root):
    from arealjax.data.pipeline import SFTStream
    from arealjax.tokenizer import load_tokenizer

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"prompt": "2+2?", "response": "4"}]
    out = convert({"train": [write_jsonl(tmp_path / "s.jsonl", rows)]}, tmp_path / "tfds")
    assert out == tmp_path / "tfds" / "sft" / "1.0.0"
    stream = SFTStream(out, "train", load_tokenizer(tiny_root / "qwen3"), epochs=1)
    trajs = list(stream)
    assert len(trajs) == 2 and all(t.loss_mask.any() and not t.loss_mask[0] for t in trajs)
    bad = [{"messages": [{"role": "user", "content": "no answer"}]}]
    with pytest.raises(RowError, match=r"b\.jsonl:1: no non-empty assistant message"):
        convert({"train": [write_jsonl(tmp_path / "b.jsonl", bad)]}, tmp_path / "tfds_bad", layout="sft")
    with pytest.raises(RowError, match=r"c\.jsonl:1: message 0 is .*expected"):
        convert({"train": [write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])]},
                tmp_path / "tfds_bad2", layout="sft")


def test_word_problems_are_gsm8k_rows_with_right_answers_and_a_disjoint_held_out_split(tmp_path, capsys):
    """`python -m arealjax.data.word_problems` writes GSM8K-layout rows whose worked answers compute (every
    <<expression=value>> note holds, the final '#### n' is the last note's value), no question repeats, none of the
    held-out questions is in train, every kind appears; the files convert as GSM8K does. Bad arguments exit 2 with
    one line saying what to change."""
    import re

    from arealjax.data import word_problems

    assert word_problems.main([f"--out={tmp_path}", "--train=300", "--test=60", "--max-number=10"]) == 0
    splits = {s: [json.loads(x) for x in (tmp_path / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")}
    assert [len(splits["train"]), len(splits["test"])] == [300, 60]
    for rows in splits.values():
        assert len({r["question"] for r in rows}) == len(rows)
        for r in rows:
            notes = re.findall(r"<<([\d+\-*/]+)=(\d+)>>", r["answer"])
            assert notes and all(eval(expr) == int(value) for expr, value in notes), r  # noqa: S307 — digits, + - * /
            assert r["answer"].endswith(f"#### {notes[-1][1]}")
            assert max(int(x) for x in re.findall(r"\d+", r["question"])) <= 10 * 10 + 10  # products of ≤ 10 at most
    assert not {r["question"] for r in splits["test"]} & {r["question"] for r in splits["train"]}
    assert {r["kind"] for r in splits["train"]} == {r["kind"] for r in splits["test"]} == set(word_problems.KINDS)
    out = convert({"train": [tmp_path / "train.jsonl"], "test": [tmp_path / "test.jsonl"]}, tmp_path / "tfds")
    assert out == tmp_path / "tfds" / "gsm8k" / "1.0.0"
    capsys.readouterr()
    assert word_problems.main([f"--out={tmp_path}", "--kinds=add,fly"]) == 2
    assert word_problems.main([f"--out={tmp_path}", "--train=50000", "--max-number=4"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "unknown problem kinds ['fly']" in err[0] and "raise --max-number" in err[1]
