"""The tool-call delta splitter (gateway/tool_calls.py ToolStream) on pure text, per format: an
answer cut into random pieces streams content and OpenAI's `delta.tool_calls` that join to
exactly what the whole answer parses into (names, arguments text, ids), and with `one`
(parallel_tool_calls false) stops at the first call's end."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.errors import ApiError
from gateway.requests import parse_chat
from gateway.tool_calls import HERMES, LLAMA_JSON, MISTRAL, Format, ToolStream

NOW = '{"name": "now", "arguments": {}}'
WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo \\"}\\" {", "days": [1, {"d": 2}]}}'
LATE_NAME = '{"arguments": {"tz": "CET"}, "name": "get_time"}'
ANSWERS = [  # (format, answer, content, [(name, arguments text)])
    (HERMES, f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{LATE_NAME}"
             "\n</tool_call>", "Let me check.\n",
     [("get_weather", '{"city": "Oslo \\"}\\" {", "days": [1, {"d": 2}]}'),
      ("get_time", '{"tz": "CET"}')]),
    (HERMES, '<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", "{}")]),
    (MISTRAL, f"Sure [TOOL_CALLS] [{WEATHER}, {NOW}]", "Sure ",
     [("get_weather", '{"city": "Oslo \\"}\\" {", "days": [1, {"d": 2}]}'), ("now", "{}")]),
    (MISTRAL, f"[TOOL_CALLS] {LATE_NAME}", "", [("get_time", '{"tz": "CET"}')]),
    (LLAMA_JSON, '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                 '{"name": "now", "parameters": {}}', "",
     [("get_time", '{"tz": "UTC"}'), ("now", "{}")]),
    (LLAMA_JSON, ' {"parameters":{"tz":"CET"},"name":"get_time"}', "",
     [("get_time", '{"tz":"CET"}')]),
]
NOT_CALLS = [  # answers whose calls do not parse: all content, whole
    (HERMES, '<tool_call>\n{"name": "now", "arguments": {"a": '),  # cut by max_tokens
    (HERMES, '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>'),  # not an object
    (MISTRAL, f"[TOOL_CALLS] [{NOW}] and more"),
    (LLAMA_JSON, "plain {text}"),
    (LLAMA_JSON, '{"name": 3, "parameters": {}}'),
    (HERMES, "no <tool_ call here"),
]


def streamed(fmt: Format, text: str, seed: int, **kw: Any) -> tuple[str, list[dict[str, Any]],
                                                                    ToolStream]:
    """The content and the deltas of `text` pushed in random pieces of 1 to 4 characters."""
    stream, rng = ToolStream(fmt, "stem", **kw), random.Random(seed)
    content, deltas, i = "", [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        piece, got = stream.push(text[i:i + n])
        content, i = content + piece, i + n
        deltas.append(got)
    return content, [d for got in deltas for d in got], stream


def joined(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls a client builds from deltas (as the openai client's stream accumulates them),
    each call's deltas checked for OpenAI's shape on the way."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if d["index"] == len(calls):  # a call's first delta: all of its head
            assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
            assert set(d["function"]) == {"name", "arguments"}
            calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            assert d["function"]["arguments"], d  # no empty piece is sent
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize("fmt,text,content,calls", ANSWERS)
def test_streamed_deltas_join_to_the_whole_answers_calls(fmt: Format, text: str, content: str,
                                                         calls: list[tuple[str, str]]) -> None:
    whole_content, whole = fmt.parse(text, "stem")
    assert whole_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == calls
    for c, (_, args) in zip(whole, calls):
        json.loads(args)  # the model's own text of the arguments: JSON, an object
        assert c["id"].startswith("call_") and c["type"] == "function"
    assert len({c["id"] for c in whole}) == len(whole)
    for seed in range(8):
        got_content, deltas, stream = streamed(fmt, text, seed)
        assert got_content == content, seed
        assert joined(deltas) == whole == stream.calls(), seed
        if text.count('{"name"') == len(calls) and "{}" not in dict(calls).values():
            assert len(deltas) > len(whole)  # name first: the arguments came in pieces


@pytest.mark.parametrize("fmt,text", NOT_CALLS)
def test_calls_that_do_not_parse_leave_the_answer_all_content(fmt: Format, text: str) -> None:
    assert fmt.parse(text, "stem") == (text, [])
    content, _, stream = streamed(fmt, text, 0)
    assert stream.calls() == [] and text.startswith(content)


@pytest.mark.parametrize("fmt,text,content,calls", [a for a in ANSWERS if len(a[3]) > 1])
def test_one_call_stops_at_the_first_calls_end(fmt: Format, text: str, content: str,
                                               calls: list[tuple[str, str]]) -> None:
    """parallel_tool_calls false: the first call alone, and the stream is done at its end."""
    whole_content, whole = fmt.parse(text, "stem", one=True)
    assert whole_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == calls[:1]
    got_content, deltas, stream = streamed(fmt, text, 3, one=True)
    assert got_content == content and joined(deltas) == whole and stream.done
    first = text[:text.index(calls[0][1]) + len(calls[0][1])]
    half = ToolStream(fmt, "stem", one=True)
    half.push(first)
    assert not half.done  # the arguments' end is not yet the call object's
    half.push("}")
    assert half.done


def test_call_ids_come_from_the_stem() -> None:
    text = ANSWERS[0][1]
    ids = [c["id"] for c in HERMES.parse(text, "a")[1]]
    assert ids == [c["id"] for c in HERMES.parse(text, "a")[1]]
    assert not set(ids) & {c["id"] for c in HERMES.parse(text, "b")[1]}
    assert HERMES.parse(text)[1][0]["id"] != HERMES.parse(text)[1][0]["id"]  # no stem: random


def test_parallel_tool_calls_is_read_and_checked() -> None:
    tools = [{"type": "function", "function": {"name": "now"}}]
    msgs = [{"role": "user", "content": "x"}]
    for value, parallel in ((False, False), (True, True), (None, True)):
        chat = parse_chat({"model": "m", "messages": msgs, "tools": tools,
                           "parallel_tool_calls": value})
        assert chat.tools is not None and chat.tools.parallel is parallel
    with pytest.raises(ApiError) as exc:
        parse_chat({"model": "m", "messages": msgs, "tools": tools, "parallel_tool_calls": 1})
    assert exc.value.status == 400 and exc.value.param == "parallel_tool_calls"
