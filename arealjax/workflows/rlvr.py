"""Single-turn RL with verifiable rewards: the prompt, one completion, the reward service's verdict."""

from __future__ import annotations

from arealjax.rl.trajectory import Trajectory
from arealjax.workflows.base import Episode, Turns


class RLVR:
    async def run(self, ep: Episode) -> Trajectory:
        c = await ep.generate(ep.prompt.tokens)
        turns = Turns(ep.prompt.tokens)
        turns.model(c)
        reward = await ep.reward(ep.tokenizer.decode(c.output_tokens))
        return turns.build(reward, stop_reason=c.stop_reason, interrupts=c.interrupts)
