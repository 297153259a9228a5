"""Tool calls per family, on the example tokenizers and their chat templates: the renders are
transformers' apply_chat_template's, the model's side of a rendered call parses back into the
same calls (`auto`), a forced call sampled under its grammar (real llguidance, random tokens
from the mask) always parses and validates, and streamed content stops where a call begins."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from computed.serving import grammar as grammars
from computed.serving.grammar import Grammars
from gateway.errors import ApiError
from gateway.requests import parse_chat
from gateway.tool_calls import HERMES, LLAMA_JSON, MISTRAL, Format, ToolStream, format_of
from shared.text import TextCodec
from statesvc.tools.tokenizer import TOKENIZERS, write_tokenizer

jsonschema = pytest.importorskip("jsonschema")
VOCAB = 512
FORMATS = {"llama": LLAMA_JSON, "qwen2": HERMES, "qwen3": HERMES, "mistral": MISTRAL}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1,
                                                          "maximum": 9},
    "units": {"enum": ["C", "F"]}}, "required": ["city", "days", "units"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3, "units": "C"}}}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path]:
    d = tmp_path_factory.mktemp(request.param)
    write_tokenizer(d, vocab_size=VOCAB, max_len=4096, spec=TOKENIZERS[request.param])
    return request.param, d


def _chat(body: dict[str, Any]) -> Any:
    return parse_chat({"model": "m", **body})


def test_every_family_with_a_tool_template_has_its_format(family: tuple[str, Path]) -> None:
    name, d = family
    assert format_of(TextCodec.load(d).chat_template) is FORMATS.get(name)


def test_renders_with_tools_are_transformers(family: tuple[str, Path]) -> None:
    """A chat with tools, a call and its result, through the gateway's parsing and rendering,
    is what transformers renders from the same messages."""
    transformers = pytest.importorskip("transformers")
    name, d = family
    if name not in FORMATS:
        pytest.skip(f"{name}'s template has no tool format")
    openai_call = {**CALL, "function": {**CALL["function"],
                                        "arguments": json.dumps(CALL["function"]["arguments"])}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [openai_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    if name == "mistral":  # its turns alternate: the call's result, then the user again
        messages += [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    req = _chat({"messages": messages, "tools": TOOLS})
    codec = TextCodec.load(d)
    got = codec.render_chat(req.messages, tools=list(req.tools.functions))
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    ref = [{**m, "tool_calls": [CALL]} if m.get("tool_calls") else
           {k: v for k, v in m.items() if v is not None} for m in messages]
    want = tok.apply_chat_template(ref, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert got == want
    assert "get_weather" in got and "sunny" in got


def test_a_rendered_call_parses_back(family: tuple[str, Path]) -> None:
    """`auto`: what the template writes for an assistant's call, read as the model's answer,
    is that call (with text before it, for the formats that allow it)."""
    name, d = family
    fmt = FORMATS.get(name)
    if fmt is None:
        pytest.skip(f"{name}'s template has no tool format")
    codec = TextCodec.load(d)
    user = [{"role": "user", "content": "Weather?"}]
    prompt = codec.render_chat(user)
    full = codec.render_chat(user + [{"role": "assistant", "content": "", "tool_calls": [CALL]}],
                             add_generation_prompt=False, tools=TOOLS)
    head = codec.render_chat(user, tools=TOOLS)
    assert full.startswith(head.rstrip("\n")) or name == "mistral", (head, full)
    answer = full[len(head):] if full.startswith(head) else full[len(prompt):]
    if name == "mistral":
        answer = full[full.index("[/INST]") + len("[/INST]"):]
    for eos in ("<|im_end|>", "</s>"):
        answer = answer.split(eos)[0]
    content, calls = fmt.parse(answer)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", CALL["function"]["arguments"])], answer
    assert not content.strip()
    if fmt is not LLAMA_JSON:
        content, calls = fmt.parse("Let me check. " + answer)
        assert content == "Let me check. " and len(calls) == 1
    assert fmt.parse("no call here") == ("no call here", [])


@pytest.mark.parametrize("named", [False, True])
def test_a_forced_call_sampled_under_its_grammar_always_parses(family: tuple[str, Path],
                                                               named: bool) -> None:
    name, d = family
    fmt = FORMATS.get(name)
    if fmt is None:
        pytest.skip(f"{name}'s template has no tool format")
    codec = TextCodec.load(d)
    eos = sorted(codec.eos_token_ids)
    compiled = Grammars((d / "tokenizer.json").read_text(), vocab_size=VOCAB, eos_ids=eos)
    tools = _chat({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}}
                   if named else "required"}).tools
    start = compiled.compile(fmt.grammar(tools)).result(timeout=60)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(12):
        rng, matcher, out = np.random.default_rng(seed), grammars.start(start), []
        for _ in range(400):
            logits = grammars.mask(matcher, rng.standard_normal(VOCAB).astype(np.float32))
            token = int(np.argmax(logits))
            out.append(token)
            if grammars.advance(matcher, token):
                break
        assert matcher.is_stopped() and not matcher.is_error(), codec.decode(out)
        content, calls = fmt.parse(codec.decode([t for t in out if t not in eos]))
        assert len(calls) == 1 and not content.strip(), codec.decode(out)
        fn = calls[0]["function"]
        assert not named or fn["name"] == "get_weather"
        jsonschema.validate(json.loads(fn["arguments"]), params[fn["name"]])
    compiled.close()


@pytest.mark.parametrize("fmt,text,content", [
    (HERMES, 'Checking.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Checking.\n"),
    (MISTRAL, 'Ok [TOOL_CALLS] [{"name": "now", "arguments": {}}]', "Ok "),
    (LLAMA_JSON, '{"name": "now", "parameters": {}}', ""),
    (HERMES, "plain <tool_ text", "plain <tool_ text"),
    (LLAMA_JSON, "plain {text}", "plain {text}"),
])
def test_streamed_content_stops_where_a_call_begins(fmt: Format, text: str, content: str) -> None:
    stream = ToolStream(fmt)
    rng = random.Random(0)
    released, i = "", 0
    while i < len(text):
        n = rng.randint(1, 3)
        released += stream.push(text[i:i + n])[0]
        i += n
    assert released == content[:len(released)]
    assert fmt.parse(text)[0] == content
    assert content.startswith(released)
    if content == text:  # no call: everything but what may still begin one is released
        assert len(released) >= len(text) - len(fmt.marker)


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS * 2}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
     "tools[0].function.extra"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
])
def test_bad_tool_fields_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        _chat({"messages": [{"role": "user", "content": "x"}], **body})
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message
