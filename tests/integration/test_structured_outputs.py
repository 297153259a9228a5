"""Structured outputs and forced tool calls through the official `openai` client, a real
gateway and a real replica (subprocesses) on the example Llama (a random model: whatever it
samples, the grammar decides what may come). Every answer is checked with `jsonschema`."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from shared.protocol import pack, unpack
from statesvc.tools.example import make_example
from testkit.fleet import Gateway
from tests.helpers import Fleet, dealer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(900)
SCHEMAS = 50
MAX_TOKENS = 200  # every schema below ends well within it, whatever the model samples


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["enum", "int", "bool", "str", "pattern"])
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "ok", "no"], rng.randint(1, 4))}
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 900)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "str":  # few characters: an escape is one character but many tokens
        return {"type": "string", "maxLength": rng.randint(0, 3)}
    return {"type": "string", "pattern": "^[a-z]{1,5}$"}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 3)):
        pick = rng.random()
        if depth < 2 and pick < 0.25:
            props[f"o{i}"] = _object(rng, depth + 1)
        elif pick < 0.45:
            props[f"a{i}"] = {"type": "array", "items": _leaf(rng),
                              "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
        else:
            props[f"k{i}"] = _leaf(rng)
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


def schemas(n: int, seed: int = 49) -> list[dict[str, Any]]:
    """`n` schemas: enums, bounded integers, booleans, short strings, nested objects, arrays."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]


class Setup:
    def __init__(self, fleet: Fleet, gateway: Gateway) -> None:
        self.fleet, self.gateway = fleet, gateway
        self.base = fleet.example.model_dir.name
        self.client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    # the example Llama with a longer context: a prompt with tools in it is 1,200 tokens of
    # its 512-token vocabulary
    tmp = tmp_path_factory.mktemp("structured")
    example = make_example(tmp / "example", seed=0, config={"max_position_embeddings": 2048})
    fleet = Fleet(tmp, example)
    try:
        # warmed up before it serves (its compiles off the serving loop): compiled on the
        # loop instead, a 1,200-token prompt's shapes held it past REPLICA_STALE_AFTER_S on a
        # loaded machine, and the gateway saw no ACTIVE replica (503)
        fleet.serving(args=("--max-len", "1536"))
        yield Setup(fleet, fleet.gateway("--request-timeout", "600"))
    finally:
        fleet.stop()


def test_json_schema_outputs_validate_for_every_generated_schema(setup: Setup) -> None:
    """50 schemas, sampled at temperature 1 (a different seed each) as a batch: every answer
    parses and validates, and each ended by its grammar (finish_reason stop)."""
    def ask(i: int, schema: dict[str, Any]) -> tuple[str, str | None]:
        r = setup.client.chat.completions.create(
            model=setup.base, messages=[{"role": "user", "content": f"item {i}"}],
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    cases = schemas(SCHEMAS)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(len(cases)), cases))
    for schema, (text, finish) in zip(cases, answers):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_the_other_constraints_through_completions(setup: Setup) -> None:
    c = setup.client.completions
    base = setup.base
    obj = c.create(model=base, prompt="x", max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                   extra_body={"response_format": {"type": "json_object"}}).choices[0]
    if obj.finish_reason == "stop":  # any object: the random model may run past max_tokens
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    regex = c.create(model=base, prompt="x", max_tokens=40, temperature=1.0, seed=4,
                     extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}).choices[0]
    assert regex.finish_reason == "stop" and len(regex.text) == 6 and regex.text[3] == "-"
    for seed in range(6):
        choice = c.create(model=base, prompt="x", max_tokens=40, temperature=1.0, seed=seed,
                          extra_body={"guided_choice": ["yes", "no", "maybe"]}).choices[0]
        assert choice.text in ("yes", "no", "maybe")
    lark = c.create(model=base, prompt="x", max_tokens=40, temperature=1.0, seed=5,
                    extra_body={"guided_grammar": 'start: "a" ("b" | "c") "!"'}).choices[0]
    assert lark.text in ("ab!", "ac!")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}}, "required": ["n"]}
    stream = c.create(model=base, prompt="x", max_tokens=40, temperature=1.0, seed=6,
                      stream=True, extra_body={"guided_json": schema})
    pieces = [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in stream]
    jsonschema.validate(json.loads("".join(p for p, _ in pieces)), schema)
    assert pieces[-1][1] == "stop"


def test_constraints_the_engine_cannot_compile_are_400_naming_the_field(setup: Setup) -> None:
    url = setup.gateway.url + "/v1/chat/completions"
    msg = [{"role": "user", "content": "x"}]
    cases = {
        "response_format.json_schema.schema": {"response_format": {"type": "json_schema",
            "json_schema": {"name": "s", "schema": {"$ref": "#/nowhere"}}}},
        "structured_outputs.regex": {"structured_outputs": {"regex": "a("}},
        "structured_outputs.structural_tag": {"structured_outputs": {"structural_tag": "x"}},
        "guided_grammar": {"guided_grammar": "start: undefined_rule"},
        "guided_whitespace_pattern": {"guided_whitespace_pattern": " "},
        "response_format.type": {"response_format": {"type": "yaml"}},
        "guided_choice": {"guided_json": {"type": "object"}, "guided_choice": ["a"]},
        "tools": {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}],
            "tool_choice": "required"},
        "tool_choice.function.name": {"tools": [{"type": "function", "function": {"name": "f"}}],
                                      "tool_choice": {"type": "function", "function": {"name": "g"}}},
    }
    for param, extra in cases.items():
        r = httpx.post(url, json={"model": setup.base, "messages": msg, **extra}, timeout=60)
        assert r.status_code == 400, (param, r.text)
        assert r.json()["error"]["param"] == param, (param, r.text)


def test_the_replica_refuses_a_grammar_it_cannot_compile(setup: Setup) -> None:
    """What a client other than the gateway sends: an error naming args.grammar, and the
    replica goes on serving."""
    replica = setup.fleet.replicas[0]
    sock = dealer(replica.listen, timeout_ms=60_000)
    try:
        for grammar in ({"kind": "regex", "spec": "a("}, {"kind": "yaml", "spec": "x"}):
            req = {"v": 1, "id": "g", "cmd": "generate",
                   "args": {"input_ids": [5, 6], "max_new_tokens": 4, "grammar": grammar}}
            sock.send(pack(req))
            reply = unpack(sock.recv())
            assert not reply["ok"] and "args.grammar" in str(reply["error"]), reply
    finally:
        sock.close()
    out = setup.client.completions.create(model=setup.base, prompt="x", max_tokens=8,
                                          extra_body={"guided_choice": ["fine"]})
    assert out.choices[0].text == "fine"


WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
             "required": ["tz"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_always_parses(setup: Setup, choice: str) -> None:
    forced: Any = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(8):
        r = setup.client.chat.completions.create(
            model=setup.base, messages=[{"role": "user", "content": "weather?"}],
            tools=TOOLS, tool_choice=forced, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        call = c.message.tool_calls[0]
        if choice == "named":
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    stream = setup.client.chat.completions.create(
        model=setup.base, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
        tool_choice=forced, max_tokens=MAX_TOKENS, temperature=1.0, seed=99, stream=True)
    chunks = list(stream)
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")
    arguments = "".join(d.function.arguments for d in deltas)
    jsonschema.validate(json.loads(arguments), params[deltas[0].function.name])


def streamed_and_not(setup: Setup, **kw: Any) -> tuple[Any, Any, list[Any]]:
    """The same request unstreamed, and streamed through the openai client's stream helper
    (which joins the tool-call deltas into its final completion), with the stream's chunks."""
    whole = setup.client.chat.completions.create(model=setup.base, **kw)
    chunks = []
    with setup.client.chat.completions.stream(model=setup.base, **kw) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        joined = stream.get_final_completion()
    return whole, joined, chunks


def calls_of(completion: Any) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments)
            for c in completion.choices[0].message.tool_calls or []]


# an `auto` answer of two calls in Llama's JSON, made certain by a choice constraint (the
# random model would not call a tool by itself): the gateway parses it as any answer
TWO_CALLS = ('{"name": "get_time", "parameters": {"tz": "UTC"}}; '
             '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}')
ASK = {"messages": [{"role": "user", "content": "time and weather?"}], "tools": TOOLS,
       "max_tokens": MAX_TOKENS}


@pytest.mark.parametrize("forced", ["required", "auto"])
def test_streamed_tool_calls_join_to_the_unstreamed_ones(setup: Setup, forced: str) -> None:
    """OpenAI's deltas: a call's first carries its index, id, type, name and arguments "",
    the next ones pieces of its arguments; joined by the openai client they are exactly the
    unstreamed answer's calls, ids included (same request, same seed)."""
    kw: dict[str, Any] = {**ASK, "tool_choice": forced, "temperature": 1.0, "seed": 7}
    if forced == "auto":
        kw["extra_body"] = {"guided_choice": [TWO_CALLS]}
    whole, joined, chunks = streamed_and_not(setup, **kw)
    assert whole.choices[0].finish_reason == joined.choices[0].finish_reason == "tool_calls"
    assert calls_of(joined) == calls_of(whole) and len(calls_of(whole)) == (
        2 if forced == "auto" else 1)
    if forced == "auto":
        assert [json.loads(a) for _, _, a in calls_of(whole)] == [
            {"tz": "UTC"}, {"city": "Oslo", "days": 2}]
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    firsts = [d for d in deltas if d.id is not None]
    assert [d.index for d in firsts] == list(range(len(calls_of(whole))))
    assert all(d.type == "function" and d.function.name and d.function.arguments == ""
               for d in firsts)  # the name comes before the arguments in both answers
    assert len(deltas) > 2 * len(firsts)  # the arguments came in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_returns_the_first_call_and_stops_there(setup: Setup) -> None:
    kw: dict[str, Any] = {**ASK, "temperature": 0.0, "extra_body": {"guided_choice": [TWO_CALLS]}}
    both = setup.client.chat.completions.create(model=setup.base, **kw)
    one, joined, chunks = streamed_and_not(setup, parallel_tool_calls=False, **kw)
    assert [n for _, n, _ in calls_of(both)] == ["get_time", "get_weather"]
    assert calls_of(one) == calls_of(joined) == calls_of(both)[:1]
    assert one.choices[0].finish_reason == "tool_calls"
    # generation stopped at the first call's end: the second was never generated
    assert one.usage.completion_tokens < both.usage.completion_tokens
    assert {d.index for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []} \
        == {0}
    forced = setup.client.chat.completions.create(
        model=setup.base, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
        seed=3, **ASK)
    assert len(forced.choices[0].message.tool_calls) == 1


def test_tool_results_render_back_and_tool_choice_none_answers_text(setup: Setup) -> None:
    """A second turn with the call and its result goes through the template; with
    tool_choice none the answer is text, never parsed into calls."""
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = setup.client.chat.completions.create(model=setup.base, messages=messages, tools=TOOLS,
                                             tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    # the prompt is the template's with the tools, the call and its result
    plain = setup.client.chat.completions.create(model=setup.base, messages=messages[:1],
                                                 max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 40
