"""The interfaces between the RL loop's parts: what a rollout backend serves, how trainer params reach it, what
scores completions and where prompts come from.

    backend = builders.make_backend(config, model, version, meshes, rules)   # a RolloutBackend
    fut = backend.submit(prompt_ids, SamplingParams(n=4))    # Future[list[Completion]]: tokens, logprobs, versions
    transport.push(trainer.params, trainer.version)          # Future: resolves once the backend serves that version

The controller, the workflows and evaluation see only `RolloutBackend`; the loop sees only `WeightTransport` and
the backend's `metrics()`. Two backends implement both protocols: the in-process interruptible generator
(generation/generator.py, `generator.backend = 'local'`) and generation servers in processes of their own
(generation/remote.py, `'remote'`); each owns its weight mapping (the transport), as in AReaL's InferenceEngine and
Tunix's BaseRollout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import numpy as np

MAX_STOP_IDS = 8  # stop token ids per request (a backend may pad them into a fixed-size array)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k 0 and top_p 1 = off. `grammar`: an llguidance grammar
    (generation/grammar.py, e.g. `response_grammar`): only the tokens it allows are drawn."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int = 0
    grammar: str | None = None

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.n >= 1, "n must be >= 1"),
            (len(self.stop_token_ids) <= MAX_STOP_IDS, f"at most {MAX_STOP_IDS} stop_token_ids"),
            (0 <= self.seed < 2**32, "seed must be in [0, 2**32)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {msg} (got {self})")

    @property
    def logprob_temperature(self) -> float:
        """The temperature behaviour logprobs are taken at: the sampling one, 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def truncates(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)

    @property
    def draw(self) -> str:
        """How its tokens are drawn (generation/engine.py DRAWS): 'greedy', 'sample', or 'truncate' (top-k/top-p)."""
        return "greedy" if self.temperature <= 0 else "truncate" if self.truncates else "sample"


@dataclasses.dataclass(frozen=True)
class Routes:
    """A mixture-of-experts model's routing of one token sequence: `experts` int16 [T, layers, k], the experts each
    sparse layer sent each position to, best first; -1 where the model did not run that position (a completion's
    last token as generated, environment tokens after the last model turn). The generator records them,
    completions, turns, trajectories and the wire carry them, packing aligns them with the trainer's input tokens,
    and the trainer replays them (trainer.router_replay)."""

    experts: np.ndarray

    def __post_init__(self):
        experts = np.asarray(self.experts)
        if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer):
            raise ValueError(f"Routes.experts is {experts.dtype} {experts.shape}; expected integers [T, layers, k]")
        if experts.size and (experts.min() < -1 or experts.max() > np.iinfo(np.int16).max):
            bad = experts.min() if experts.min() < -1 else experts.max()
            raise ValueError(f"Routes.experts holds {bad}; expected expert ids (int16), or -1 where none ran")
        object.__setattr__(self, "experts", experts.astype(np.int16, copy=False))

    def __len__(self) -> int:
        return len(self.experts)

    @property
    def per_position(self) -> tuple[int, int]:
        """(layers, k): the expert ids of one position."""
        return self.experts.shape[1:]

    def padded(self, n: int) -> Routes:
        """These routes followed by -1 (none) up to n positions."""
        if n < len(self):
            raise ValueError(f"Routes of {len(self)} positions cannot be padded to {n}")
        if n == len(self):
            return self
        return Routes(np.concatenate([self.experts, np.full((n - len(self), *self.per_position), -1, np.int16)]))

    def check(self, num_experts: int) -> None:
        """Refuses expert ids outside [-1, num_experts) (routes from a peer, before any is replayed)."""
        if self.experts.size and self.experts.max() >= num_experts:
            raise ValueError(f"expert ids {self.experts.min()}..{self.experts.max()}: outside -1..{num_experts - 1}")

    def to_bytes(self) -> bytes:
        return self.experts.tobytes()

    @classmethod
    def from_bytes(cls, raw: bytes, n: int, layers: int, k: int) -> Routes:
        """The routes of n positions from `to_bytes`; ValueError when the size is not n · layers · k int16s."""
        if len(raw) != n * layers * k * 2:
            raise ValueError(f"holds {len(raw)} bytes, not {n * layers * k} int16 values ({layers} x {k} per position)")
        return cls(np.frombuffer(raw, np.int16).reshape(n, layers, k).copy())


@dataclasses.dataclass
class Completion:
    """One generated sample. logprobs[i] and versions[i] belong to output_tokens[i]."""

    request_id: str
    sample: int
    prompt_tokens: list[int]
    output_tokens: list[int]
    logprobs: np.ndarray  # float32, behaviour policy: log softmax(logits / temperature) of each sampled token
    versions: np.ndarray  # int32, policy version of the params that sampled each token
    stop_reason: str  # "stop" (a stop token, kept as the last output), "length", or "abort"
    interrupts: int  # weight swaps that happened while this sample was in flight
    temperature: float = 1.0  # logprobs are log softmax(logits / temperature) (1 for greedy): the trainer's too
    routes: Routes | None = None  # MoE: the experts of every position of prompt + output (none at the last token)


def checked_prompt(prompt: Sequence[int], max_len: int) -> list[int]:
    """A request's prompt as ints, refused when empty or leaving no room for a token in `max_len`."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("empty prompt")
    if len(prompt) >= max_len:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_len={max_len}")
    return prompt


@runtime_checkable
class RolloutBackend(Protocol):
    """Generates completions for the controller, the workflows and evaluation, and takes new weights mid-flight."""

    @property
    def version(self) -> int:
        """The policy version it serves now."""

    @property
    def max_len(self) -> int:
        """Tokens one request may hold: prompt + new tokens."""

    def submit(self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(), *,
               request_id: str | None = None, first_sample: int = 0) -> Future:
        """Queues `sampling.n` samples of `prompt`: a Future of their Completions, in sample order. Samples are
        numbered from `first_sample`; with the seed the number picks the random draws, so n one-sample requests
        numbered 0..n-1 draw what one n-sample request draws."""

    def update_weights(self, weights: Any, version: int) -> Future:
        """Serves `weights` (what this backend's transport delivered) from the next decode step on, in-flight
        samples included; the Future resolves once they are served."""

    def abort(self, request_id: str) -> bool:
        """Stops a request: its Future resolves with what was generated so far (stop_reason 'abort')."""

    def pause(self) -> None:
        """Returns once nothing runs; nothing does until resume()."""

    def resume(self) -> None: ...

    def in_flight(self) -> dict[str, int]:
        """request id -> tokens generated so far, for unfinished requests."""

    def metrics(self) -> dict[str, float]:
        """Its metrics: keys ending in `_total` are cumulative counters (the meter reports their change per step),
        the others gauges (metrics.Meter)."""

    def close(self) -> None:
        """Stops it; pending Futures fail."""


@runtime_checkable
class WeightTransport(Protocol):
    """Trainer params -> one backend: resharded, cast, sent, in whatever form the backend serves."""

    bytes: int  # what one push moves

    def push(self, params: Any, version: int) -> Future:
        """Hands the trainer's `params` (policy `version`) to the backend; the Future resolves once it serves them.
        Returns when the trainer may change `params` again."""

    def fingerprint(self, params: Any) -> float:
        """A digest of what the backend would serve for `params` (equal across processes when they agree)."""


class RewardFatal(Exception):
    """Raised by a reward function whose every call will fail (an endpoint that cannot be reached): the reward
    service stops at once with its message, instead of after `failure_window` calls."""


@runtime_checkable
class Rewards(Protocol):
    """Scores completions off the caller's thread (rewards/service.py: a pool of worker processes, timeouts,
    retries). The controller's workflows and evaluation see only this."""

    def submit(self, completion: str, prompt: str = "", **kwargs: Any) -> Future:
        """Future of the reward (a float) of `completion`; kwargs go to the reward function (answer=, tests=), and
        the prompt's text to one that declares `prompt` (a judge)."""

    async def score(self, completion: str, prompt: str = "", **kwargs: Any) -> float:
        """The reward, awaited from asyncio code without blocking its event loop."""

    def metrics(self) -> dict[str, float]:
        """Its metrics (metrics.Meter), e.g. calls that failed or timed out."""

    def close(self) -> None: ...


@runtime_checkable
class PromptSource(Protocol):
    """The RL job's prompts (data/prompts.py): an iterator of workflows.Prompt whose position is its state, so a
    checkpoint resumes it exactly; `admitted` prompts (admitted, not trained) are issued again first."""

    def __next__(self) -> Any: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any], admitted: list[dict] = ()) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Its metrics (metrics.Meter), e.g. prompts skipped as too long."""
