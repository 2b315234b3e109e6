"""Answer → feedback → retry: after a wrong answer the user says so and the model tries again, up to `max_turns`.
The reward of the first right answer is discounted by `turn_discount` per extra turn (AReaL's multi-turn math),
so a first-turn answer is worth most; the feedback tokens are in the context but not trained on."""

from __future__ import annotations

from arealjax.rl.trajectory import Trajectory
from arealjax.workflows.base import Episode, Turns, user_turn


class MultiTurn:
    def __init__(self, max_turns: int = 3, turn_discount: float = 0.9,
                 feedback: str = "your answer is wrong. try again.", success: float = 1.0):
        if max_turns < 1 or not 0 < turn_discount <= 1:
            raise ValueError(f"MultiTurn: need max_turns >= 1 and 0 < turn_discount <= 1 (got {max_turns}, "
                             f"{turn_discount})")
        self.max_turns, self.turn_discount, self.feedback, self.success = max_turns, turn_discount, feedback, success

    async def run(self, ep: Episode) -> Trajectory:
        turns = Turns(ep.prompt.tokens)
        interrupts = 0
        for turn in range(self.max_turns):
            c = await ep.generate(turns.tokens)
            turns.model(c)
            interrupts += c.interrupts
            reward = await ep.reward(ep.tokenizer.decode(c.output_tokens))
            if reward >= self.success or turn + 1 == self.max_turns:
                break
            feedback = user_turn(ep.tokenizer, self.feedback, after_eos=c.stop_reason == "stop")
            if ep.room(turns.tokens + feedback) < 1:
                break
            turns.env(feedback)
        return turns.build(reward * self.turn_discount ** turn, raw_reward=reward, interrupts=interrupts)
