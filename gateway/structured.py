"""Structured outputs: the body fields that constrain an answer to a grammar, read into one
`Grammar` (shared/grammar.py) the replica compiles (docs/structured-outputs.md).

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's extra-body
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older
`guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. At most one of them
constrains a request; each is checked here (llguidance compiles it without the vocabulary), so
a schema the engine cannot compile is a 400 naming its field before any replica sees it."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from gateway.errors import bad
from shared.grammar import MAX_SPEC_CHARS, Grammar, json_schema, problem

# vLLM's StructuredOutputsParams fields read here; the others it has are refused by name
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                   "grammar": "lark", "json_object": "json_object"}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# vLLM's other guided_* options: no meaning here, refused rather than ignored
GUIDED_UNSUPPORTED = ("guided_decoding_backend", "guided_whitespace_pattern")
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def parse_structured(body: dict[str, Any]) -> tuple[Grammar, str] | None:
    """The grammar `body` asks for and the field that asked (for errors), or None."""
    for name in GUIDED_UNSUPPORTED:
        if body.get(name) is not None:
            raise bad(f"{name} is not supported: llguidance is the one grammar engine, and "
                      "JSON is generated without optional whitespace; remove it", name)
    found: list[tuple[Grammar, str]] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append(rf)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs must be an object", "structured_outputs")
        for key, value in so.items():
            where = f"structured_outputs.{key}"
            if key not in STRUCTURED_KEYS:
                raise bad(f"{where} is not supported; structured_outputs takes one of "
                          f"{', '.join(STRUCTURED_KEYS)}", where)
            if value is not None and value is not False:
                found.append((_one(key, value, where), where))
    for name, key in GUIDED.items():
        if body.get(name) is not None:
            found.append((_one(key, body[name], name), name))
    if len(found) > 1:
        names = ", ".join(w for _, w in found)
        raise bad(f"{names} each constrain the output: send one of them", found[1][1])
    if not found:
        return None
    grammar, where = found[0]
    why = grammar_problem(grammar)
    if why is not None:
        raise bad(f"{where} does not compile: {why}", where)
    return grammar, where


def _response_format(rf: Any) -> tuple[Grammar, str] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad("response_format must be an object with a type (text, json_object or "
                  "json_schema)", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema(ANY_JSON_OBJECT), "response_format"
    if kind != "json_schema":
        raise bad(f"response_format.type {kind!r} is not supported; use text, json_object or "
                  "json_schema", "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise bad("response_format.json_schema must be an object with a name and a schema",
                  "response_format.json_schema")
    unknown = sorted(set(js) - {"name", "description", "schema", "strict"})
    if unknown:
        raise bad(f"response_format.json_schema.{unknown[0]} is not supported",
                  f"response_format.json_schema.{unknown[0]}")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict must be true or false",
                  "response_format.json_schema.strict")
    # strict or not, the schema is enforced: a grammar has no "mostly"
    schema = js.get("schema", ANY_JSON_OBJECT)
    where = "response_format.json_schema.schema"
    if not isinstance(schema, (dict, bool)):
        raise bad(f"{where} must be a JSON schema (an object)", where)
    return _sized(json_schema(schema), where), where


def _one(key: str, value: Any, where: str) -> Grammar:
    """One of structured_outputs' (or guided_*'s) constraints as a grammar."""
    if key == "json_object":
        if value is not True:
            raise bad(f"{where} must be true or false", where)
        return json_schema(ANY_JSON_OBJECT)
    if key == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad(f"{where} is not a valid JSON schema: {exc}", where) from None
        if not isinstance(value, (dict, bool)):
            raise bad(f"{where} must be a JSON schema (an object)", where)
        return _sized(json_schema(value), where)
    if key == "choice":
        if not isinstance(value, list) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise bad(f"{where} must be a non-empty list of non-empty strings", where)
        return _sized(Grammar("choice", json.dumps(value)), where)
    if not isinstance(value, str) or not value:
        raise bad(f"{where} must be a non-empty string", where)
    return _sized(Grammar(STRUCTURED_KEYS[key], value), where)


def _sized(g: Grammar, where: str) -> Grammar:
    if len(g.spec) > MAX_SPEC_CHARS:
        raise bad(f"{where} is {len(g.spec)} characters long, above the limit of "
                  f"{MAX_SPEC_CHARS}", where)
    return g


@lru_cache(maxsize=256)
def grammar_problem(g: Grammar) -> str | None:
    """Why `g` does not compile (llguidance, without the vocabulary), cached by grammar."""
    return problem(g)
