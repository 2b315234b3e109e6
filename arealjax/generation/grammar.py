"""Constrained decoding (structured outputs): a sample whose `SamplingParams.grammar` is set draws, at every step,
only the tokens its grammar allows. Grammars are llguidance's (a Rust library, no torch);
arealjax/structured.py makes them from response formats.

    grammar = response_grammar({"type": "json_schema", "json_schema": {"schema": {...}}}, tools)   # structured.py
    grammars = Grammars(load_tokenizer, vocab_size)       # the generator's: the model's vocabulary, made once
    matcher = grammars.matcher(grammar)                   # one per constrained sample; ValueError naming the fault
    bits = grammars.masks([(matcher, stop_ids), (None, ())], rows)   # int32 [rows, ⌈V/32⌉]: a bit per token
    matcher.consume_token(token)                          # after each drawn token

The mask is the grammar's next tokens; where the grammar may end (or must), the request's stop tokens too, so a
reply ends with the model's own end of turn; a grammar with no way on (it cannot happen for a valid grammar) allows
the stop tokens only, which ends the sample. A row without a grammar has every bit set.

What the trainer sees: the behaviour logprob recorded for a constrained token is the policy's own,
log softmax(logits / T) at that token over the whole vocabulary, not the log of the masked, renormalised
distribution it was drawn from (which is higher by −log Σ_allowed p). It is what the trainer recomputes, so the
token's importance ratio is π_θ / π_behaviour of the unconstrained policy (exactly 1 at the version that drew it),
and a positive advantage raises the policy's own probability of the tokens the grammar let through: the model
learns to write the format by itself, and the constraint can be dropped later without a shift in what was learned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from arealjax.tokenizer import Tokenizer


class Grammars:
    """The generator's grammar side: the model's vocabulary for llguidance (made on first use), matchers, masks."""

    def __init__(self, load: Callable[[], Tokenizer], vocab_size: int):
        """`load`: the model's tokenizer, called on the first grammar (a generator that is never asked for one never
        loads it)."""
        self._load, self.vocab_size = load, vocab_size
        self.words = -(-vocab_size // 32)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        try:
            tok = self._load()
        except Exception as e:  # noqa: BLE001 — named to the request that needed it
            raise ValueError(f"constrained decoding needs the model's tokenizer, which did not load: {e}") from None
        if tok.vocab_size > self.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens, more than the model's {self.vocab_size}")
        return tok

    @functools.cached_property
    def _vocabulary(self) -> llg.LLTokenizer:
        tok, eos = self.tokenizer, list(self.tokenizer.eos_ids)
        if hasattr(tok, "json"):  # a Hugging Face tokenizer: llguidance reads its tokenizer.json itself
            return llg.LLTokenizer(tok.json(), n_vocab=self.vocab_size, eos_token=eos)
        return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tok, self.vocab_size)), n_vocab=self.vocab_size,
                               eos_token=eos)

    def matcher(self, grammar: str) -> llg.LLMatcher:
        """A matcher at the start of `grammar`; ValueError with llguidance's message when it does not compile."""
        m = llg.LLMatcher(self._vocabulary, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"grammar: {m.get_error().splitlines()[0]}")
        return m

    def masks(self, rows: Sequence[tuple[llg.LLMatcher | None, Sequence[int]]], n: int) -> np.ndarray:
        """The next-token bits of each (matcher, stop ids) row (module docstring), padded to `n` rows."""
        out = np.full((n, self.words), -1, np.int32)
        for i, (m, stops) in enumerate(rows):
            if m is None:
                continue
            fill_next_token_bitmask(m, out, i)
            dead = m.is_error() or not out[i].any()
            if dead:
                out[i] = 0
            if dead or m.is_accepting():
                for t in list(stops) or list(self.tokenizer.eos_ids):
                    out.view(np.uint32)[i, t // 32] |= np.uint32(1 << (t % 32))
        return out


class _Vocabulary:
    """Any `Tokenizer` as llguidance.TokenizerWrapper reads one: every id's bytes, its special ids and encode."""

    def __init__(self, tok: Tokenizer, vocab_size: int):
        self._tok = tok
        self.eos_token_id, self.bos_token_id = tok.eos_ids[0], tok.bos_id
        self.tokens = [tok.token_bytes(i) if i < tok.vocab_size else b"" for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(tok.vocab_size)
                                  if self.tokens[i] and not tok.decode([i], skip_special_tokens=True)]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text")  # TokenizerWrapper then sends str
        return self._tok.encode(text)

