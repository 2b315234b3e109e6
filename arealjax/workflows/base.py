"""The workflow API: a workflow turns one dataset sample into one trajectory (or None = reject) by talking to the
generator, the reward service and, for tools, the code sandbox, through an `Episode`.

    class MyWorkflow:
        async def run(self, ep: Episode) -> Trajectory | None:
            turns = Turns(ep.prompt.tokens)
            c = await ep.generate(turns.tokens)          # one model turn (a Completion)
            turns.model(c)                               # model tokens: trained, with logprobs and versions
            turns.env(ep.tokenizer.encode("..."))        # environment tokens: in the context, not trained
            return turns.build(reward=await ep.reward(ep.tokenizer.decode(c.output_tokens)))

The controller runs `group_size` episodes of each admitted prompt concurrently on its asyncio loop (episode index
j = sample j of the group) and trains on the trajectories they return. Config names the workflow by import path
(`workflow.path = "package.module:Class"`, `workflow.kwargs = {...}`), so user workflows plug in like rewards do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from arealjax.api import Completion, Rewards, RolloutBackend, Routes, SamplingParams
from arealjax.rewards.sandbox import Limits, RunResult, run_python
from arealjax.rewards.service import resolve
from arealjax.rl.trajectory import Trajectory
from arealjax.runtime import error_text
from arealjax.tokenizer import Tokenizer
from arealjax.validate import Problems

log = logging.getLogger(__name__)


def seed_of(key: str) -> int:
    """A 32-bit sampling seed from a string key: independent draws for different keys, the same for the same."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    tokens: list[int]
    reward_kwargs: dict  # passed to the reward function with the completion text, e.g. {"answer": "132"}
    epoch: int = 0  # the pass over the dataset that drew it
    text: str = ""  # the row's prompt as written, before the template (what an agent is handed)

    def sampling_seed(self, run_seed: int) -> int:
        """The seed of this prompt's samples, from (run seed, id, epoch): draws are independent across prompts and
        a prompt drawn again in a later epoch (or a duplicate row, which has its own id) gets new samples, while a
        prompt re-issued after a resume draws exactly what it drew before."""
        return seed_of(f"{run_seed}/{self.id}/{self.epoch}")


class Workflow(Protocol):
    """Turns an episode into a trajectory, several (each trained, all in the prompt's group) or None (rejected).
    Optional: `metrics()` (counters the run logs each step) and `async close()` (run on the controller's event loop
    when it stops: what the workflow started there, such as a server)."""

    async def run(self, ep: Episode) -> Trajectory | list[Trajectory] | None: ...


@dataclasses.dataclass
class Episode:
    """One episode's view of the system. Generation calls are numbered so request ids stay unique; every call
    samples as sample `index` of its prompt, so episode j of a group draws what sample j of one n-sample request
    would (and η = 0 stays reproducible)."""

    prompt: Prompt
    index: int
    request_id: str
    backend: RolloutBackend
    rewards: Rewards
    tokenizer: Tokenizer
    sampling: SamplingParams  # n = 1; max_new_tokens caps each call
    max_len: int  # the backend's max_len: context + new tokens of one call
    _calls: int = 0

    def room(self, tokens: Sequence[int]) -> int:
        """How many tokens one more call may add after `tokens`."""
        return min(self.sampling.max_new_tokens, self.max_len - len(tokens))

    async def generate(self, tokens: Sequence[int], draw: int = 0, **overrides: Any) -> Completion:
        """One model turn continuing `tokens`; `overrides` replace sampling fields (e.g. stop_token_ids). Draws are
        keyed by (seed, sample, position): `draw` > 0 gives a call draws of its own (an alternative of the same
        tokens, a retry), independent of draw 0's and reproducible."""
        room = self.room(tokens)
        if room < 1:
            raise ValueError(f"episode {self.request_id}: {len(tokens)} tokens leave no room in max_len={self.max_len}")
        sampling = dataclasses.replace(self.sampling, **{**overrides, "n": 1})
        if draw:
            sampling = dataclasses.replace(sampling, seed=seed_of(f"{sampling.seed}/draw/{draw}"))
        sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
        self._calls += 1
        fut = self.backend.submit(tokens, sampling, request_id=f"{self.request_id}.{self._calls}",
                                    first_sample=self.index)
        return (await asyncio.wrap_future(fut))[0]

    @classmethod
    def group(cls, prompt: Prompt, sampling: SamplingParams, request_id: str, backend: RolloutBackend,
              rewards: Rewards, tokenizer: Tokenizer) -> list[Episode]:
        """The `sampling.n` episodes of `prompt` (episode j samples as sample j; request ids `<request_id>/<j>`),
        each generating with `sampling` at n = 1."""
        one = dataclasses.replace(sampling, n=1)
        return [cls(prompt, j, f"{request_id}/{j}", backend, rewards, tokenizer, one, backend.max_len)
                for j in range(sampling.n)]

    async def reward(self, text: str, **kwargs: Any) -> float:
        """The reward service's score of `text`, with the prompt's reward kwargs (overridable) and its text (for a
        function that reads it: a judge)."""
        prompt = self.prompt.text or self.tokenizer.decode(self.prompt.tokens, skip_special_tokens=True)
        return await self.rewards.score(text, prompt, **{**self.prompt.reward_kwargs, **kwargs})

    async def run_code(self, code: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
        """Runs model-written code in the sandbox, off the event loop."""
        return await asyncio.to_thread(run_python, code, stdin, limits)


class Turns:
    """Builds a multi-turn trajectory: prompt, then model turns (trained) and environment turns (not trained)."""

    def __init__(self, prompt_tokens: Sequence[int]):
        n = len(prompt_tokens)
        self.tokens = [int(t) for t in prompt_tokens]
        self._mask, self._logprobs, self._versions = [False] * n, [0.0] * n, [-1] * n
        self.model_turns = 0
        self.temperature: float | None = None  # of the model turns' logprobs, which must agree
        self.routes: Routes | None = None  # MoE: the last model turn's, of every position up to its output

    def model(self, c: Completion) -> None:
        if self.temperature is not None and c.temperature != self.temperature:
            raise ValueError(f"a model turn sampled at temperature {c.temperature} after one at {self.temperature}: "
                             f"the model turns of one trajectory must share a temperature (the trainer scores "
                             f"them at it)")
        self.temperature = c.temperature
        if c.routes is not None:  # this turn's prefill ran every earlier position again: its routes are the latest
            self.routes = c.routes
        self.tokens += c.output_tokens
        self._mask += [True] * len(c.output_tokens)
        self._logprobs += [float(x) for x in c.logprobs]
        self._versions += [int(v) for v in c.versions]
        self.model_turns += 1

    def branch(self) -> Turns:
        """A branch of the conversation so far: its tokens as context, not trained (they are trained once, in
        this trajectory); its model turns are those added after."""
        out = Turns(self.tokens)
        out.temperature, out.routes = self.temperature, self.routes
        return out

    def env(self, tokens: Sequence[int]) -> None:
        self.tokens += [int(t) for t in tokens]
        n = len(tokens)
        self._mask += [False] * n
        self._logprobs += [0.0] * n
        self._versions += [-1] * n

    def build(self, reward: float, **info: Any) -> Trajectory:
        routes = None if self.routes is None else self.routes.padded(len(self.tokens))  # -1: environment tokens
        return Trajectory(np.array(self.tokens), np.array(self._mask), np.array(self._logprobs),
                          np.array(self._versions), reward=reward, temperature=self.temperature or 1.0,
                          info={"turns": self.model_turns, **info}, routes=routes)


async def wind_down(workflow: Workflow) -> None:
    """The end of an event loop that ran `workflow`'s episodes: cancels every other task on it (episodes still
    running), then closes the workflow (its optional `close`: what it started on this loop; a failure is logged,
    the run's outcome stands)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if (close := getattr(workflow, "close", None)) is not None:  # e.g. an agents' endpoint
        try:
            await close()
        except Exception as e:  # noqa: BLE001 - the run is over; its outcome stands
            log.warning("workflow %s: close failed: %s", type(workflow).__name__, error_text(e))


def user_turn(tokenizer: Tokenizer, text: str, after_eos: bool) -> list[int]:
    """Tokens that close the model's turn, add a user message `text` and open the next assistant turn, rendered
    through the tokenizer's chat template. `after_eos`: the model's turn already ended with its end-of-turn token
    (kept as its last output), so the template's copy of it is left out."""
    mark = "\x00TURN\x00"
    history = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}]
    full = tokenizer.apply_chat_template(history + [{"role": "user", "content": text}], add_generation_prompt=True)
    tail = full[full.index(mark) + len(mark):]
    eos_text = tokenizer.decode(tokenizer.eos_ids[:1], skip_special_tokens=False) if tokenizer.eos_ids else ""
    if after_eos and eos_text and tail.startswith(eos_text):
        tail = tail[len(eos_text):]
    return tokenizer.encode(tail)


@dataclasses.dataclass(frozen=True)
class WorkflowConfig:
    """The `workflow` section: the episode's class or factory ('package.module:Class') and its keyword arguments."""

    path: str = "arealjax.workflows:RLVR"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def check(config: Any, problems: Problems) -> None:
    """The workflow section (its import path), at start-up."""
    path = config.workflow.path
    problems.need(isinstance(path, str) and ":" in path, "workflow.path", "'package.module:Class'")


def load_workflow(path: str, kwargs: dict[str, Any] | None = None) -> Workflow:
    """'package.module:Class' (or a factory) called with `kwargs`; must give an object with `async run(ep)`."""
    factory = resolve(path, what="workflow")
    try:
        workflow = factory(**(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"workflow '{path}' with kwargs {kwargs}: {e}") from e
    if not asyncio.iscoroutinefunction(getattr(workflow, "run", None)):
        raise ValueError(f"workflow '{path}': expected an object with 'async def run(self, ep)'; got {workflow!r}")
    return workflow
