"""Tokenizers behind one interface: a local Hugging Face tokenizer directory, or a character-level vocabulary.

Both render chat prompts through a Jinja chat template the way transformers does (sandboxed, `trim_blocks`,
`lstrip_blocks`), so a prompt formatted here tokenizes exactly as it would for the model's authors.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAR_FILE = "char_tokenizer.json"


def _bytes_to_unicode() -> dict[str, int]:
    """Byte-level BPE's stand-in character for each byte (GPT-2's table), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_BYTES = _bytes_to_unicode()


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """A chat template compiled once (prompts are formatted one by one, thousands per second)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent, **kw)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **special: Any) -> str:
    """Renders a HF chat template with the globals and filters transformers provides."""
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    return tok.get("content") if isinstance(tok, dict) else tok


class HFTokenizer:
    """`tokenizer.json` + `tokenizer_config.json` (+ optional generation_config.json) from a local directory."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: not found (expected a Hugging Face tokenizer directory)")
        self._tok = FastTokenizer.from_file(str(tok_file))
        self.config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        self.chat_template = self.config.get("chat_template")
        jinja_file = path / "chat_template.jinja"  # transformers >= 4.43 may store the template on its own
        if self.chat_template is None and jinja_file.is_file():
            self.chat_template = jinja_file.read_text()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_id = self._id(self.bos_token)
        eos = gen.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else list(eos)
        if self._id(self.eos_token) is not None and self._id(self.eos_token) not in eos:
            eos.insert(0, self._id(self.eos_token))
        self.eos_ids = tuple(eos)
        pad = self._id(_token_str(self.config.get("pad_token")))
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def json(self) -> str:
        """The tokenizer as its tokenizer.json (what llguidance reads: generation/grammar.py)."""
        return self._tok.to_str()

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, also when they are part of a UTF-8 character (decode gives U+FFFD):
        byte-level BPE's printable stand-ins mapped back, SentencePiece's <0xNN> byte tokens and ▁ spaces."""
        if int(token) in self._added:  # special and added tokens are their text as written
            return self._added[int(token)].encode()
        piece = self._tok.id_to_token(int(token))
        if piece is None:
            raise ValueError(f"token id {token} is not in this tokenizer (vocab_size {self.vocab_size})")
        if self._byte_level and all(ch in _UNICODE_BYTES for ch in piece):
            return bytes(_UNICODE_BYTES[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    @cached_property
    def _added(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @cached_property
    def _byte_level(self) -> bool:
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        return decoder.get("type") == "ByteLevel" or any(
            d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The template rendered as transformers renders it; `kwargs` (e.g. `tools`) become its variables."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json); use a template string")
        return render_chat(self.chat_template, messages, add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


class CharTokenizer:
    """One id per character of a fixed alphabet, after <pad>, <bos>, <eos>. For synthetic tasks and tiny models."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    DEFAULT_TEMPLATE = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )

    def __init__(self, alphabet: str, chat_template: str = DEFAULT_TEMPLATE):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self.chat_template = chat_template
        self.pad_id, self.bos_id, eos = 0, 1, 2
        self.eos_ids = (eos,)
        self.vocab_size = len(self.SPECIALS) + len(alphabet)

    @cached_property
    def _ids(self) -> dict[str, int]:
        return {c: i + len(self.SPECIALS) for i, c in enumerate(self.alphabet)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} in {text[:80]!r} is not in the character tokenizer's alphabet "
                             f"{self.alphabet!r} (config key tokenizer.alphabet)") from None
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        n = len(self.SPECIALS)
        special = lambda i: "" if skip_special_tokens else self.SPECIALS[i]  # noqa: E731
        return "".join(self.alphabet[i - n] if i >= n else special(i) for i in ids)

    def token_bytes(self, token: int) -> bytes:
        return self.decode([token], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        return render_chat(self.chat_template, messages, add_generation_prompt, **kwargs)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        data = {"alphabet": self.alphabet, "chat_template": self.chat_template}
        (Path(path) / CHAR_FILE).write_text(json.dumps(data, indent=2))


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON at line {e.lineno}: {e.msg}") from e


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """The `tokenizer` section: the character tokenizer's alphabet (the random tiny model's; a model_path brings
    its own tokenizer)."""

    alphabet: str = "0123456789+-*=?.,:; abcdefghijklmnopqrstuvwxyz\n"


def tokenizer_of(config: Any) -> Tokenizer:
    """The run's tokenizer: that of `config.model_path` (a HF directory) or, when empty, of `config.tokenizer`."""
    return load_tokenizer(config.model_path) if config.model_path else CharTokenizer(config.tokenizer.alphabet)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A HF tokenizer directory (tokenizer.json) or a saved CharTokenizer (char_tokenizer.json)."""
    path = Path(path)
    if (path / CHAR_FILE).is_file():
        data = _read_json(path / CHAR_FILE)
        if "alphabet" not in data:
            raise KeyError(f"{path / CHAR_FILE}: missing key 'alphabet'")
        return CharTokenizer(data["alphabet"], data.get("chat_template", CharTokenizer.DEFAULT_TEMPLATE))
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory (expected a model directory with a tokenizer)")
    raise FileNotFoundError(f"{path}: no tokenizer in it (expected tokenizer.json, a Hugging Face tokenizer, or "
                            f"{CHAR_FILE}, arealjax's character tokenizer)")
