"""Structured outputs, the request side: the grammar (llguidance's) of an OpenAI response format, which the
generator decodes within (generation/grammar.py).

    response_grammar({"type": "json_object"})                                   # any JSON object
    response_grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": {...}}}, tools)

JSON is laid out as `json.dumps` writes it (", " and ": ", no other whitespace): one spelling per value, so a model
cannot stall in whitespace, and the spelling most text models saw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance as llg

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL = ("<tool_call>\n", "\n</tool_call>")  # the Hermes block workflows/chat.py parses tool calls from


def json_grammar(schema: dict) -> str:
    """The grammar of JSON values that satisfy `schema`, in JSON_LAYOUT."""
    return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)


def response_grammar(response_format: Any, tools: Sequence[dict] = ()) -> str | None:
    """The grammar of a chat reply under OpenAI's `response_format` (None for {"type": "text"}): a JSON object
    ("json_object") or a value of the schema ("json_schema"); with `tools`, a reply may instead be tool calls,
    each a Hermes block whose JSON names one of the tools and gives arguments of its parameters' schema.
    ValueError saying what is wrong with the format."""
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                    "json_schema"):
        raise ValueError(f"{response_format!r}: expected {{'type': 'text' | 'json_object' | 'json_schema', ...}}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise ValueError("'json_schema' must be an object with 'name' and 'schema'")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"'json_schema.schema' must be a JSON schema object, got {type(schema).__name__}")
    if not tools:
        grammar = json_grammar(schema)
    else:
        calls = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "arguments": t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
        q = lambda x: json.dumps(x, ensure_ascii=False)  # noqa: E731 — a lark string or %json body
        with_layout = lambda s: {**s, "x-guidance": JSON_LAYOUT}  # noqa: E731
        grammar = llg.LLMatcher.grammar_from_lark(
            f"start: reply | calls\nreply: %json {q(with_layout(schema))}\ncalls: call ({q(chr(10))} call)*\n"
            f"call: {q(TOOL_CALL[0])} %json {q(with_layout(calls))} {q(TOOL_CALL[1])}\n")
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error.splitlines()[0])
    return grammar
