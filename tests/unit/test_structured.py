"""The body fields of structured outputs read into one grammar (gateway/structured.py), and
what the replica does with one: compiled on its worker thread, cached by grammar, refused with
llguidance's reason when it does not compile (real llguidance, the example tokenizer)."""
from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from computed.serving import grammar as grammars
from computed.serving.grammar import GrammarError, Grammars
from gateway.errors import ApiError
from gateway.requests import parse_completion
from shared.grammar import Grammar
from statesvc.tools.tokenizer import TOKENIZERS, write_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a"]}


def _grammar(extra: dict[str, Any]) -> Grammar | None:
    return parse_completion({"model": "m", "prompt": "x", **extra}).grammar


@pytest.mark.parametrize("extra,kind,spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA,
                                                                 "strict": True}}},
     "json_schema", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_schema", {"type": "object"}),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json_object": True}}, "json_schema", {"type": "object"}),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
    ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
    ({"guided_choice": ["x", "y"]}, "choice", ["x", "y"]),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, "lark", 'start: "a"'),
    ({"guided_grammar": 'root ::= "a" | "b"'}, "lark", 'root ::= "a" | "b"'),
])
def test_each_field_becomes_one_grammar(extra: dict[str, Any], kind: str, spec: Any) -> None:
    g = _grammar(extra)
    assert g is not None and g.kind == kind
    assert (json.loads(g.spec) if kind in ("json_schema", "choice") else g.spec) == spec


def test_text_and_nothing_are_no_grammar() -> None:
    assert _grammar({}) is None and _grammar({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_bad_constraints_are_400_naming_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        _grammar(extra)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d: Path = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, vocab_size=512, max_len=256, spec=TOKENIZERS["llama"])
    g = Grammars((d / "tokenizer.json").read_text(), vocab_size=512, eos_ids=[2])
    yield g
    g.close()


def test_the_replica_compiles_once_per_grammar_and_refuses_what_fails(compiled: Any) -> None:
    g = Grammar("json_schema", json.dumps(SCHEMA))
    first = compiled.compile(g)
    assert compiled.compile(Grammar("json_schema", json.dumps(SCHEMA))) is first  # cached
    start = first.result(timeout=60)
    # two requests on one grammar: each its own matcher
    a, b = grammars.start(start), grammars.start(start)
    ones = np.zeros(512, np.float32)
    allowed = np.isfinite(grammars.mask(a, ones))
    assert allowed.sum() >= 1 and np.isfinite(grammars.mask(b, ones)).sum() == allowed.sum()
    token = int(np.flatnonzero(allowed)[0])
    assert not grammars.advance(a, token)
    assert not np.array_equal(np.isfinite(grammars.mask(a, ones)), allowed)  # b unmoved
    with pytest.raises(GrammarError, match="regex"):
        compiled.compile(Grammar("regex", "a(")).result(timeout=60)


class UniformModel:
    """The engine's `Model` as pure logic: every token equally likely, every step."""

    vocab_size, max_len, max_batch = 512, 64, 2

    def new_cache(self) -> Any:
        return None

    def prefill(self, pool: Any, cache: Any, prompts: list[list[int]], rows: list[int],
                slots: list[int]) -> tuple[np.ndarray, Any]:
        return np.zeros((len(prompts), self.vocab_size), np.float32), cache

    def decode(self, pool: Any, cache: Any, tokens: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, Any]:
        return np.zeros((self.max_batch, self.vocab_size), np.float32), cache


class HeldCompiles:
    """The replica's grammars, each compile held until the test lets it finish."""

    def __init__(self, real: Grammars) -> None:
        self.real, self.held = real, Future[Any]()

    def compile(self, g: Grammar) -> Future[Any]:
        return self.held


def test_a_request_waits_for_its_compile_without_a_row_and_ends_with_its_grammar(
        compiled: Grammars) -> None:
    from computed.serving.engine import Engine
    from shared.replica_protocol import generate_args
    from testkit.ports import BaseOnly

    held = HeldCompiles(compiled)
    engine = Engine(UniformModel(), BaseOnly(), grammars=held)  # type: ignore[arg-type]
    g = Grammar("regex", "ab|cd")
    assert engine.submit("g", generate_args([5], max_new_tokens=20, temperature=1.0,
                                            grammar=g.wire()), None) is None
    assert engine.submit("plain", generate_args([5], max_new_tokens=3), None) is None
    engine.step()  # the plain request runs; the other waits for its compile, without a row
    assert [r.req.req_id for r in engine.rows if r is not None] == ["plain"]
    assert [r.req_id for r in engine.waiting] == ["g"]
    held.held.set_result(compiled.compile(g).result(timeout=60))
    done = []
    while engine.busy:
        done += engine.step()
    result = next(d.result for d in done if d.req_id == "g")
    assert result is not None and result["finish"] == "grammar"
    text = compiled.tokenizer.decode_str(result["output_ids"])
    assert text in ("ab", "cd")
    plain = next(d.result for d in done if d.req_id == "plain")
    assert plain is not None and len(plain["output_ids"]) == 3 and "finish" not in plain
