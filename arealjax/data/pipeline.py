"""Prompts from a converted dataset (builders.py), streamed with grain: seeded shuffle (a new order every epoch),
epochs, sharding by JAX process, a checkpointable position, and prompt formatting with a length filter.

    stream = PromptStream("/data/tfds/gsm8k/1.0.0", "train", tokenizer, seed=0, template="chat")
    prompt = next(stream)                 # Prompt(id, tokens, reward_kwargs={"answer": ...} or {"tests": [...]})
    state = stream.get_state()            # JSON-able; PromptStream(...).set_state(state) continues exactly there

Prompts longer than `max_prompt_tokens` are skipped and counted (`stream.too_long`); they still advance the
position, so a restored stream skips them again and yields the same prompts. A whole pass over the split without
one prompt that fits is an error that gives the lengths seen (instead of skipping forever).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

import grain
import jax

from arealjax.metrics import Count
from arealjax.tokenizer import Tokenizer
from arealjax.workflows import Prompt


def load_split(path: str | Path, split: str, key: str = "data.split"):
    """Random-access source of a converted dataset directory (…/<name>/<version>); no TensorFlow needed. Errors
    say what `data.path` should be (`key` names the split's config key)."""
    path = Path(path)
    convert = "python -m arealjax.data.convert --out=DIR --train=FILE.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"data.path={path} does not exist (expected a converted dataset directory "
                                f"…/<name>/<version>; make one with {convert})")
    if path.is_file():
        raise ValueError(f"data.path={path} is a file; convert it first ({convert}) and pass the directory it "
                         f"prints")
    if not (path / "dataset_info.json").is_file():
        found = sorted(str(p.parent) for p in path.glob("*/*/dataset_info.json")) + \
            sorted(str(p.parent) for p in path.glob("*/dataset_info.json"))
        hint = f"pass one of {found}" if found else f"make one with {convert}"
        raise FileNotFoundError(f"data.path={path} is not a converted dataset (no dataset_info.json): {hint}")
    import tensorflow_datasets as tfds  # here: the synthetic tasks never load it (~0.2 s of every run's start)

    builder = tfds.builder_from_directory(str(path))
    if split not in builder.info.splits:
        raise ValueError(f"{key}='{split}': {path} has no such split; it has {sorted(builder.info.splits)}")
    if builder.info.splits[split].num_examples == 0:
        raise ValueError(f"{key}='{split}': split '{split}' of {path} is empty")
    return builder.as_data_source(split=split)


def format_prompt(tokenizer: Tokenizer, text: str, template: str = "chat", instruction: str = "{prompt}"
                  ) -> list[int]:
    """The question written into `instruction` (a format string with {prompt}, e.g. '{prompt}\\nPut your final
    answer within \\boxed{{}}.'), then 'chat': the tokenizer's chat template with it as one user message (plus
    BOS if the model has one), or any other string: a Python format template with {prompt}, e.g.
    'Question: {prompt}\\nAnswer:'."""
    text = instruction.format(prompt=text)
    if template == "chat":
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    else:
        ids = tokenizer.encode(template.format(prompt=text))
    return with_bos(tokenizer, ids)


def with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` starting with the model's BOS (once: Llama 3's and DeepSeek's templates write it themselves)."""
    return ids if tokenizer.bos_id is None or ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id, *ids]


def chat_tokens(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """A conversation rendered by the chat template as (tokens, loss mask): True on each assistant turn's tokens
    (its content and end-of-turn marker), False on everything else (system, user, tool turns and each generation
    prompt). Each piece is tokenized on its own, as the generator would see it: the prompt up to a generation
    prompt, then the model's tokens. Needs a template whose rendering of a conversation extends the rendering of
    its beginning (ChatML, Llama 3, DeepSeek-R1 do; one that rewrites earlier turns is refused)."""
    tokens: list[int] = []
    mask: list[bool] = []
    done = ""

    def add(text: str, trained: bool, i: int) -> None:
        nonlocal done
        if not text.startswith(done):
            raise ValueError(f"the chat template renders message {i} ({messages[i]['role']}) by rewriting what came "
                             f"before it ({text[:60]!r}... does not start with the earlier rendering "
                             f"...{done[-60:]!r}); SFT on it needs a template that only appends")
        ids = tokenizer.encode(text[len(done):])
        tokens.extend(ids)
        mask.extend([trained] * len(ids))
        done = text

    for i, m in enumerate(messages):
        after = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if m["role"] != "assistant":
            add(after, False, i)
            continue
        add(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True), False, i)
        if after.startswith(done):
            add(after, True, i)
        else:  # the template writes history differently from a generation (DeepSeek-R1 drops "<think>"): the
            ids = tokenizer.encode(m["content"]) + [tokenizer.eos_ids[0]]  # turn as generated, ended by EOS
            tokens.extend(ids)
            mask.extend([True] * len(ids))
            done = after
    full = with_bos(tokenizer, tokens)
    return full, [False] * (len(full) - len(tokens)) + mask


class PromptStream:
    def __init__(self, path: str | Path, split: str, tokenizer: Tokenizer, *, seed: int = 0,
                 epochs: int | None = None, shuffle: bool = True, template: str = "chat",
                 max_prompt_tokens: int = 512, process_index: int | None = None, process_count: int | None = None,
                 key: str = "data.split", instruction: str = "{prompt}"):
        """`epochs` None = endless. Each process reads its own 1/process_count of the records (JAX processes by
        default). `key` names the split's config key in errors."""
        if template != "chat" and "{prompt}" not in template:
            raise ValueError(f"prompt template {template!r}: expected 'chat' or a string containing {{prompt}}")
        self.tokenizer, self.template, self.max_prompt_tokens = tokenizer, template, max_prompt_tokens
        self.instruction = instruction
        index = jax.process_index() if process_index is None else process_index
        count = jax.process_count() if process_count is None else process_count
        self.path, self.split = path, split
        ds = grain.MapDataset.source(load_split(path, split, key))[index::count]
        if shuffle:
            ds = ds.seed(seed).shuffle()
        self._records = len(ds)
        self._iter = iter(ds.repeat(epochs).to_iter_dataset())
        self.too_long = 0
        self.position = 0  # records read, skipped ones included (their epoch = position // records)
        self._skipped_lengths: list[int] = []  # of the prompts skipped since the last one that fit

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Prompt:
        while True:
            rec = {k: v.decode() if isinstance(v, bytes) else v for k, v in next(self._iter).items()}
            epoch = self.position // max(self._records, 1)
            self.position += 1
            tokens = format_prompt(self.tokenizer, rec["prompt"], self.template, self.instruction)
            if len(tokens) > self.max_prompt_tokens:
                self.too_long += 1
                self._skipped_lengths.append(len(tokens))
                if len(self._skipped_lengths) >= max(self._records, 1):
                    lengths = sorted(self._skipped_lengths)
                    raise ValueError(
                        f"{self.path} split '{self.split}': none of its {self._records} prompts fits "
                        f"data.max_prompt_tokens={self.max_prompt_tokens} (formatted with data.template="
                        f"{self.template!r}, their lengths are {lengths[0]} to {lengths[-1]} tokens, median "
                        f"{lengths[len(lengths) // 2]}): raise data.max_prompt_tokens (and generator.max_len) or "
                        f"shorten the template")
                continue
            self._skipped_lengths.clear()
            kwargs = {"tests": json.loads(rec["tests"])} if rec["tests"] else {"answer": rec["answer"]}
            return Prompt(rec["id"], tokens, kwargs, epoch, rec["prompt"])

    def get_state(self) -> dict[str, Any]:
        return {"grain": self._iter.get_state(), "too_long": self.too_long, "position": self.position}

    def metrics(self) -> dict[str, float]:
        """The prompts skipped as longer than max_prompt_tokens so far (the rollout controller reports them)."""
        return {"prompts_too_long": Count(self.too_long)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._iter.set_state(state["grain"])
        self.too_long, self.position = state["too_long"], state["position"]


class SFTStream:
    """Conversations of a converted SFT dataset (layout 'sft') as trajectories with the loss on assistant turns:
    grain-shuffled, epochs, sharded by process, checkpointable like PromptStream. Conversations longer than
    `max_tokens` are skipped and counted (`too_long`)."""

    def __init__(self, path: str | Path, split: str, tokenizer: Tokenizer, *, seed: int = 0,
                 epochs: int | None = None, max_tokens: int = 4096, key: str = "sft.data.split"):
        source = load_split(path, split, key)
        ds = grain.MapDataset.source(source)[jax.process_index()::jax.process_count()].seed(seed).shuffle()
        self.path, self.split, self.tokenizer, self.max_tokens = path, split, tokenizer, max_tokens
        self._records = len(ds)
        self._iter = iter(ds.repeat(epochs).to_iter_dataset())
        self.too_long = 0

    def __iter__(self) -> SFTStream:
        return self

    def __next__(self):
        from arealjax.rl.trajectory import Trajectory

        for _ in range(max(self._records, 1)):
            rec = next(self._iter)
            if "messages" not in rec:
                raise ValueError(f"{self.path}: records have no 'messages' (layout is not 'sft'; convert SFT data "
                                 f"with --layout=sft)")
            messages = json.loads(rec["messages"].decode() if isinstance(rec["messages"], bytes) else rec["messages"])
            tokens, mask = chat_tokens(self.tokenizer, messages)
            if len(tokens) > self.max_tokens:
                self.too_long += 1
                continue
            n = len(tokens)
            return Trajectory(tokens=tokens, loss_mask=mask, logprobs=[0.0] * n, versions=[-1] * n)
        raise ValueError(f"{self.path} split '{self.split}': no conversation in a whole pass fits "
                         f"sft.max_tokens={self.max_tokens}: raise it")

    def get_state(self) -> dict[str, Any]:
        return {"grain": self._iter.get_state(), "too_long": self.too_long}

    def set_state(self, state: dict[str, Any]) -> None:
        self._iter.set_state(state["grain"])
        self.too_long = state["too_long"]


class ReissueFirst:
    """Prompts to issue again (admitted before a checkpoint but not trained), then the stream. Its state holds
    both, so a checkpoint taken while re-issued prompts are still waiting keeps them."""

    def __init__(self, stream, reissue: list[Prompt] = ()):
        self.stream, self._reissue = stream, collections.deque(reissue)

    def __iter__(self) -> ReissueFirst:
        return self

    def __next__(self) -> Prompt:
        return self._reissue.popleft() if self._reissue else next(self.stream)

    def get_state(self) -> dict[str, Any]:
        return {"stream": self.stream.get_state(), "reissue": [dataclasses.asdict(p) for p in self._reissue]}

    def metrics(self) -> dict[str, float]:
        return self.stream.metrics()

    def set_state(self, state: dict[str, Any], admitted: list[dict] = ()) -> None:
        """`admitted`: prompts admitted but not trained at the checkpoint; they go first, in admission order."""
        self.stream.set_state(state["stream"])
        self._reissue = collections.deque(Prompt(**p) for p in [*admitted, *state["reissue"]])
