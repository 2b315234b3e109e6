"""A tool-call loop: the model writes code between `start` and `end` markers, the code runs in the sandbox, and
its output is appended (not trained on) for the model to continue from, up to `max_calls` calls. The reward
scores the model's last turn (after the last tool output), e.g. its final answer.

Generation stops on `end`'s last token; if the text does not end with the whole marker yet, the same turn
continues (markers of several tokens work with any tokenizer; a single special token such as Qwen's
`</tool_call>` stops at once)."""

from __future__ import annotations

from arealjax.rewards.sandbox import Limits, RunResult
from arealjax.rl.trajectory import Trajectory
from arealjax.tokenizer import Tokenizer
from arealjax.workflows.base import Episode, Turns


class ToolCalls:
    def __init__(self, max_calls: int = 4, start: str = "<code>", end: str = "</code>",
                 output: str = "<out>{output}</out>", timeout: float = 5.0, memory_mb: int = 512,
                 max_output_chars: int = 512):
        if not start or not end or "{output}" not in output:
            raise ValueError("ToolCalls: start and end markers must be non-empty and output must contain {output}")
        self.max_calls, self.start, self.end, self.output = max_calls, start, end, output
        self.limits = Limits(timeout=timeout, cpu_seconds=max(1, int(timeout)), memory_mb=memory_mb)
        self.max_output_chars = max_output_chars

    async def run(self, ep: Episode) -> Trajectory:
        tok = ep.tokenizer
        stop = tuple(dict.fromkeys((*ep.sampling.stop_token_ids, tok.encode(self.end)[-1])))
        turns = Turns(ep.prompt.tokens)
        turn_start, calls, interrupts = len(turns.tokens), 0, 0
        while True:
            c = await ep.generate(turns.tokens, stop_token_ids=stop)
            turns.model(c)
            interrupts += c.interrupts
            text = tok.decode(turns.tokens[turn_start:])
            if c.stop_reason != "stop" or c.output_tokens[-1] in tok.eos_ids:
                break  # the final answer (or out of tokens)
            if not text.endswith(self.end):  # stopped on a token the end marker shares: the turn goes on
                if ep.room(turns.tokens) < 1:
                    break
                continue
            if calls == self.max_calls or self.start not in text:
                break
            code = text[text.rindex(self.start) + len(self.start): -len(self.end)]
            result = await ep.run_code(code, limits=self.limits)
            env = _encode_lossy(tok, self.output.format(output=self._show(result)))
            if ep.room(turns.tokens + env) < 1:
                break
            turns.env(env)
            calls += 1
            turn_start = len(turns.tokens)
        reward = await ep.reward(tok.decode(turns.tokens[turn_start:]))
        return turns.build(reward, tool_calls=calls, interrupts=interrupts)

    def _show(self, r: RunResult) -> str:
        """What the model sees: stdout, then the last line of stderr on failure, capped."""
        out = r.stdout
        if r.timed_out:
            out += f"timeout after {self.limits.timeout}s"
        elif not r.ok and r.stderr.strip():
            out += r.stderr.strip().splitlines()[-1]
        return out[-self.max_output_chars:]


def _encode_lossy(tok: Tokenizer, text: str) -> list[int]:
    """Tool output may hold characters a small vocabulary lacks (a character tokenizer): those are dropped."""
    try:
        return tok.encode(text)
    except ValueError:
        out = []
        for ch in text:
            try:
                out += tok.encode(ch)
            except ValueError:
                pass
        return out
