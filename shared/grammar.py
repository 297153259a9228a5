"""A request's grammar as the replica wire carries it (docs/protocol.md `generate`'s `grammar`)
and its translation to llguidance, the engine both sides use (docs/structured-outputs.md).

On the wire a grammar is `{"kind": KIND, "spec": TEXT}`: `json_schema` (TEXT a JSON schema, as
JSON), `regex`, `choice` (TEXT a JSON list of strings) or `lark` (llguidance's Lark, which
also reads GBNF). The gateway checks the grammar compiles before sending it (a 400 naming the
request's field); the replica compiles it against its tokenizer and refuses what fails too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

KINDS = ("json_schema", "regex", "choice", "lark")
MAX_SPEC_CHARS = 64 * 1024  # a grammar's text on the wire (a schema, a regex, a Lark grammar)
# JSON without optional whitespace: a sampled model could otherwise fill max_tokens with
# spaces between two tokens of the object (vLLM's llguidance backend does the same by default)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    kind: str
    spec: str

    def wire(self) -> dict[str, str]:
        return {"kind": self.kind, "spec": self.spec}


def json_schema(schema: Any) -> Grammar:
    return Grammar("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))


def check_wire(v: Any) -> str | None:
    """Why `v` is not a grammar as the wire carries it; None when it is."""
    if not isinstance(v, dict) or set(v) != {"kind", "spec"}:
        return "must be a map of kind and spec"
    if v["kind"] not in KINDS:
        return f"kind must be one of {', '.join(KINDS)}"
    if not isinstance(v["spec"], str) or not 0 < len(v["spec"]) <= MAX_SPEC_CHARS:
        return f"spec must be 1 to {MAX_SPEC_CHARS} characters"
    return None


def llguidance_grammar(g: Grammar) -> str:
    """The llguidance grammar of `g`; ValueError saying what is wrong when it has none."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if g.kind == "json_schema":
        try:
            schema = json.loads(g.spec)
        except ValueError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object (or true)")
        return str(LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                      defaults=cast(Any, JSON_OPTIONS)))
    if g.kind == "regex":
        return str(LLMatcher.grammar_from_regex(g.spec))
    if g.kind == "choice":
        try:
            choices = json.loads(g.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or \
                not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c)
                                                                      for c in choices)))
    if g.kind == "lark":
        try:
            return str(LLMatcher.grammar_from_lark(any_to_lark(g.spec)))
        except Exception as exc:
            raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from None
    raise ValueError(f"kind must be one of {', '.join(KINDS)}")


def problem(g: Grammar, tokenizer: Any = None) -> str | None:
    """Why `g` does not compile (llguidance's message), against `tokenizer` (an LLTokenizer)
    when given; None when it compiles."""
    from llguidance import LLMatcher

    try:
        grammar = llguidance_grammar(g)
    except ValueError as exc:
        return str(exc)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    return str(error) if error else None
