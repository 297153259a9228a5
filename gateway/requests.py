"""OpenAI request bodies, checked: every field's type and range, with the limits of
docs/security.md; anything else is an ApiError in OpenAI's error shape, before any replica
or token is touched. A field the endpoint does not take (`FIELDS`) is refused with a 400
naming it, never ignored."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.tools import Tools
    from shared.grammar import Grammar

from gateway.errors import ApiError, bad
from shared.replica_protocol import MAX_CHOICES

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused unread (413)
MAX_STOP = 16  # stop strings (or stop token ids) per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_MESSAGES = 512
MAX_PROMPT_CHARS = 256 * 1024
MAX_MODEL_CHARS = 200
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's own limit)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BOTH = frozenset({COMPLETIONS, CHAT})
# Every body field a generation endpoint takes, and which endpoints take it: anything else is a
# 400 naming it. Adding a field is one line here (and its parsing below).
FIELDS: dict[str, frozenset[str]] = {
    "model": BOTH,
    "prompt": frozenset({COMPLETIONS}),
    "messages": frozenset({CHAT}),
    "max_tokens": BOTH,
    "max_completion_tokens": BOTH,
    "temperature": BOTH,
    "top_p": BOTH,
    "n": BOTH,
    "best_of": frozenset({COMPLETIONS}),
    "stop": BOTH,
    "stream": BOTH,
    "stream_options": BOTH,
    "seed": BOTH,
    "user": BOTH,  # an end user's id for the caller's own tracking: nothing to generate with
    "presence_penalty": BOTH,
    "frequency_penalty": BOTH,
    "logit_bias": BOTH,
    # vLLM's extra sampling parameters (the openai client's extra_body)
    "top_k": BOTH,
    "min_p": BOTH,
    "repetition_penalty": BOTH,
    "min_tokens": BOTH,
    "stop_token_ids": BOTH,
    "ignore_eos": BOTH,
    # issue 49's: logprobs, structured outputs, tool calls
    "logprobs": BOTH,
    "echo": frozenset({COMPLETIONS}),
    "top_logprobs": frozenset({CHAT}),
    "response_format": BOTH,
    "structured_outputs": BOTH,
    "guided_json": BOTH,
    "guided_regex": BOTH,
    "guided_choice": BOTH,
    "guided_grammar": BOTH,
    "tools": frozenset({CHAT}),
    "tool_choice": frozenset({CHAT}),
    "parallel_tool_calls": frozenset({CHAT}),
}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    n: int = 1
    best_of: int | None = None  # completions: choices generated, the n best returned
    top_k: int = 0  # 0: off (vLLM's -1 too)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    @property
    def rows(self) -> int:
        """The replica batch rows the request takes: one per choice generated."""
        return self.best_of or self.n

    def replica_args(self) -> dict[str, Any]:
        """The `generate` args of these parameters (shared/replica_protocol.py `generate_args`
        leaves out those at their defaults)."""
        return {"n": self.n, "best_of": self.best_of if self.best_of != self.n else None,
                "top_k": self.top_k, "min_p": self.min_p,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty,
                "logit_bias": [list(p) for p in self.logit_bias], "min_tokens": self.min_tokens}


MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's API (shared/replica_protocol.py MAX_TOP)


@dataclass(frozen=True)
class Logprobs:
    """What a request asks of logprobs (gateway/logprobs.py): `top` most likely tokens per
    position (None: no logprobs), the prompt's text and logprobs first (`echo`, completions), and
    whether to generate at all (False: max_tokens 0 with echo, the prompt alone)."""

    top: int | None = None
    echo: bool = False
    generate: bool = True


@dataclass(frozen=True)
class Completion:
    model: str
    prompt: str | list[int]  # text, or token ids
    sampling: Sampling
    grammar: Grammar | None = None  # structured outputs (gateway/structured.py)
    logprobs: Logprobs = Logprobs()


@dataclass(frozen=True)
class Chat:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    grammar: Grammar | None = None  # structured outputs, or a forced tool call's
    tools: Tools | None = None  # the functions it may call (gateway/tools.py)
    logprobs: Logprobs = Logprobs()


def _logprobs(body: dict[str, Any], chat: bool) -> Logprobs:
    """Completions' `logprobs` (0-20) and `echo`; chat's `logprobs` (true/false) and
    `top_logprobs` (0-20, with `logprobs` true). Completions' `max_tokens` 0 asks for the
    prompt alone, with `echo` only."""
    def flag(name: str) -> bool:
        v = body.get(name, False)
        if not isinstance(v, bool) and v is not None:
            raise bad(f"{name} must be true or false", name)
        return bool(v)
    if chat:
        wanted = flag("logprobs")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not wanted:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return Logprobs(top=(top or 0) if wanted else None)
    top = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = flag("echo")
    generate = body.get("max_tokens") != 0 or type(body.get("max_tokens")) is not int
    if not generate and not echo:
        raise bad("max_tokens must be at least 1 (0 asks for the prompt alone, with echo: true)",
                  "max_tokens")
    return Logprobs(top=top, echo=echo, generate=generate)


def _streamable(sampling: Sampling, logprobs: Logprobs, chat: bool) -> None:
    """A 400 for logprobs or echo on a stream of several choices, which this gateway does not
    stream (each choice's would need its own chunks); send stream: false or n: 1."""
    if sampling.stream and sampling.n > 1 and (logprobs.top is not None or logprobs.echo):
        name = "logprobs" if logprobs.top is not None else "echo"
        raise bad(f"{name} with n > 1 does not stream here; send stream: false (or n: 1)",
                  name if not chat else "logprobs")


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the body is not valid UTF-8 (byte {exc.start}); send JSON in UTF-8")
    try:
        body = json.loads(text)
    except RecursionError:
        raise bad("the JSON body is nested too deeply")
    except ValueError as exc:
        raise bad(f"the body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    # a lone surrogate can come only from a \u escape: the strict decode refuses an encoded one
    if "\\ud" in text or "\\uD" in text:
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """A 400 naming the field when any string in the body, a key too, holds a lone surrogate
    (JSON's "\\ud800" escape alone): valid JSON but not text, which tokenizers, ZeroMQ frames
    and JSON answers in UTF-8 cannot carry. Iterative: the body may be nested deeply."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            _text(v, where, where)
        elif isinstance(v, dict):
            for k, item in v.items():
                _text(k, f"a key of {where or 'the body'}", where or None)
                key = k if len(k) <= 64 else k[:61] + "..."  # never echo a long key whole
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(v)
                         if isinstance(item, (str, dict, list)))


def _text(v: str, where: str, param: str | None) -> None:
    if v.isascii():
        return
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(f"{where} contains a lone surrogate (\\u{ord(v[exc.start]):04x}), which is not "
                  f"valid Unicode text; send UTF-8 text", param)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float,
            *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"{name} must be a number", name)
    if not (lo < v if lo_open else lo <= v) or v > hi:
        raise bad(f"{name} is {v}; it must be in {'(' if lo_open else '['}{lo}, {hi}]", name)
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer", name)
    if not lo <= v <= hi:
        raise bad(f"{name} is {v}; it must be in [{lo}, {hi}]", name)
    return v


def _token_ids(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(type(t) is int and t >= 0 for t in v):
        raise bad(f"{name} must be a list of non-negative integer token ids", name)
    return list(v)


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """A 400 naming the first field of `body` that `endpoint` does not take (FIELDS)."""
    for name in body:
        shown = name if len(name) <= 64 else name[:61] + "..."
        if endpoint not in FIELDS.get(name, ()):
            raise ApiError(400, f"{shown!r} is not a field this gateway supports on {endpoint}; "
                           "remove it (docs/gateway.md lists the fields it takes)", param=shown,
                           code="unsupported_parameter")


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids (as "
                  "strings) to biases in [-100, 100]", "logit_bias")
    out = []
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise bad(f"logit_bias keys must be token ids, got {key[:32]!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(f"logit_bias[{key}] must be a number in [-100, 100]", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _choices(body: dict[str, Any], stream: bool) -> tuple[int, int | None]:
    """(n, best_of): best_of choices generated (None: n) and the n best returned."""
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    best_of = _int(body, "best_of", 1, MAX_CHOICES)
    if best_of is not None and best_of < n:
        raise bad(f"best_of is {best_of}; it must be at least n ({n})", "best_of")
    if best_of is not None and best_of > n and stream:
        raise bad("best_of above n cannot be used with stream: the n best are known only when "
                  "every choice has ended", "best_of")
    return n, best_of


def _sampling(body: dict[str, Any]) -> Sampling:
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 20)
    max_tokens = _int(body, "max_tokens", 1, 1 << 20) or max_tokens
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS or not s for s in stops):
        raise bad(f"stop takes at most {MAX_STOP} non-empty strings of at most "
                  f"{MAX_STOP_CHARS} characters each", "stop")
    stop_ids = body.get("stop_token_ids")
    ids = () if stop_ids is None else tuple(_token_ids(stop_ids, "stop_token_ids"))
    if len(ids) > MAX_STOP:
        raise bad(f"stop_token_ids takes at most {MAX_STOP} ids", "stop_token_ids")
    stream = body.get("stream", False)
    ignore_eos = body.get("ignore_eos", False)
    for name, flag in (("stream", stream), ("ignore_eos", ignore_eos)):
        if not isinstance(flag, bool) and flag is not None:
            raise bad(f"{name} must be true or false", name)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = (opts or {}).get("include_usage", False)
    if not isinstance(include_usage, bool) and include_usage is not None:
        raise bad("stream_options.include_usage must be true or false",
                  "stream_options.include_usage")
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    n, best_of = _choices(body, bool(stream))
    top_k = _int(body, "top_k", -1, 1 << 30) or 0
    min_tokens = _int(body, "min_tokens", 0, 1 << 20) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(f"min_tokens is {min_tokens}; it must be at most max_tokens ({max_tokens})",
                  "min_tokens")
    return Sampling(max_tokens=max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                    seed=0 if seed is None else seed % (2**63),
                    stop=stops, stop_token_ids=ids, ignore_eos=bool(ignore_eos),
                    stream=bool(stream), include_usage=bool(include_usage),
                    n=n, best_of=best_of, top_k=max(top_k, 0),
                    min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                    presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                    frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                    repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0,
                                               lo_open=True),
                    logit_bias=_logit_bias(body), min_tokens=min_tokens)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_CHARS:
        raise bad(f"model must be a non-empty string of at most {MAX_MODEL_CHARS} "
                  f"characters: the base model's name or an adapter's (see GET /v1/models)",
                  "model")
    return model


def parse_completion(body: dict[str, Any]) -> Completion:
    check_fields(body, COMPLETIONS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt or len(prompt) > MAX_PROMPT_CHARS:
            raise bad(f"prompt must be 1 to {MAX_PROMPT_CHARS} characters", "prompt")
        parsed: str | list[int] = prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        parsed = _token_ids(prompt, "prompt")
    else:
        raise bad("prompt must be a non-empty string or a non-empty list of token ids "
                  "(one prompt per request)", "prompt")
    from gateway.structured import parse_structured
    structured = parse_structured(body)
    logprobs = _logprobs(body, chat=False)
    # max_tokens 0 (the prompt alone): the replica generates one token, which is not answered
    sampling = _sampling(body if logprobs.generate else {**body, "max_tokens": 1})
    _streamable(sampling, logprobs, chat=False)
    return Completion(model=_model(body), prompt=parsed, sampling=sampling, logprobs=logprobs,
                      grammar=None if structured is None else structured[0])


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # content parts: only text ones
        parts = []
        for part in v:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"{where} parts must be {{\"type\": \"text\", \"text\": ...}}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where} must be a string or a list of text parts", where)


def parse_chat(body: dict[str, Any]) -> Chat:
    check_fields(body, CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise bad(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    from gateway.structured import parse_structured
    from gateway.tools import message_fields, parse_tools
    out: list[dict[str, Any]] = []
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise bad(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        calls = message_fields(m, f"messages[{i}]")
        # an assistant's tool calls may come with null content, as OpenAI's client sends them
        raw = m.get("content")
        content = _content("" if raw is None else raw, f"messages[{i}].content")
        total += len(content)
        out.append({"role": m["role"][:64], "content": content, **calls})
    if total > MAX_PROMPT_CHARS:
        raise bad(f"the messages hold {total} characters, above {MAX_PROMPT_CHARS}", "messages")
    structured, tools = parse_structured(body), parse_tools(body)
    if structured is not None and tools is not None and tools.forced:
        raise bad(f"{structured[1]} and a forced tool_choice each constrain the answer: send "
                  "one of them", "tool_choice")
    sampling, logprobs = _sampling(body), _logprobs(body, chat=True)
    _streamable(sampling, logprobs, chat=True)
    return Chat(model=_model(body), messages=out, sampling=sampling,
                grammar=None if structured is None else structured[0], tools=tools,
                logprobs=logprobs)
