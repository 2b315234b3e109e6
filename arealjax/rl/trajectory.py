"""The unit of RL data between the generator, the rewards, the controller and the trainer.

One trajectory is one token sequence (prompt, model turns, environment turns) with per-token arrays of equal
length L, aligned with `tokens`:

    tokens     int32 [L]   the whole sequence
    loss_mask  bool  [L]   True where the model produced the token (it is trained on); prompt/env tokens False
    logprobs   f32   [L]   behaviour logprob of each model token (0 elsewhere)
    versions   int32 [L]   policy version that sampled each model token (-1 elsewhere)

and, for a mixture-of-experts model, `routes` (api.Routes, L positions): the experts the generator's forward chose
at each position, what the trainer replays (trainer.router_replay); plus a scalar `reward` (from the reward
service) and `advantage` (set by `advantages.py`; every model token of a trajectory gets its trajectory's
advantage), and the sampling `temperature` its logprobs were taken at: the trainer scores π_θ and π_prox as
log softmax(logits / temperature) too, or the behaviour weight and the PPO ratio would compare different
distributions. `group` ties the n samples of one prompt together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from arealjax.api import Routes


@dataclasses.dataclass
class Trajectory:
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float = 0.0
    advantage: float = 0.0
    temperature: float = 1.0
    group: str = ""
    info: dict = dataclasses.field(default_factory=dict)  # free-form: prompt id, stop reason, turns, ...
    routes: Routes | None = None

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32)
        self.loss_mask = np.asarray(self.loss_mask, bool)
        self.logprobs = np.asarray(self.logprobs, np.float32)
        self.versions = np.asarray(self.versions, np.int32)
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"Trajectory.{name} has shape {getattr(self, name).shape}; expected ({n},) "
                                 f"like tokens")
        if self.routes is not None and not isinstance(self.routes, Routes):
            self.routes = Routes(self.routes)  # an array: checked as the type checks it
        if self.routes is not None and len(self.routes) != n:
            raise ValueError(f"Trajectory.routes has {len(self.routes)} positions; expected {n} like tokens")
        if not self.temperature > 0:
            raise ValueError(f"Trajectory.temperature = {self.temperature}; expected > 0 (1 for greedy samples)")
        if n and self.loss_mask[0]:
            raise ValueError("Trajectory.loss_mask[0] is True: the first token has no context to be scored from")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_model_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def oldest_version(self) -> int:
        """Version of the stalest model token (staleness is measured from it); -1 if there are none."""
        v = self.versions[self.loss_mask]
        return int(v.min()) if v.size else -1

    @classmethod
    def from_completion(cls, prompt_tokens: Sequence[int], output_tokens: Sequence[int], logprobs: np.ndarray,
                        versions: np.ndarray, **kw) -> Trajectory:
        """A single-turn trajectory: prompt tokens unscored, every output token scored."""
        p, o = len(prompt_tokens), len(output_tokens)
        return cls(tokens=np.concatenate([np.asarray(prompt_tokens, np.int32), np.asarray(output_tokens, np.int32)]),
                   loss_mask=np.concatenate([np.zeros(p, bool), np.ones(o, bool)]),
                   logprobs=np.concatenate([np.zeros(p, np.float32), np.asarray(logprobs, np.float32)]),
                   versions=np.concatenate([np.full(p, -1, np.int32), np.asarray(versions, np.int32)]), **kw)
