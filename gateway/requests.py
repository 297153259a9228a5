"""OpenAI request bodies, checked: every field's type and range, with the limits of
docs/security.md; anything else is an ApiError in OpenAI's error shape, before any replica
or token is touched."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused unread (413)
MAX_STOP = 16  # stop strings (or stop token ids) per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_MESSAGES = 512
MAX_PROMPT_CHARS = 256 * 1024
MAX_MODEL_CHARS = 200


class ApiError(Exception):
    """An error answered as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        named = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 429: "rate_limit_error", 503: "service_unavailable"}
        return named.get(self.status, "invalid_request_error" if self.status < 500
                         else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


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
    logprobs: Logprobs = Logprobs()


@dataclass(frozen=True)
class Chat:
    model: str
    messages: list[dict[str, str]]
    sampling: Sampling
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


def _sampling(body: dict[str, Any]) -> Sampling:
    n = _int(body, "n", 1, 1 << 30)
    if n not in (None, 1):
        raise bad("n must be 1: this gateway returns one choice per request", "n")
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
    return Sampling(max_tokens=max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                    seed=0 if seed is None else seed % (2**63),
                    stop=stops, stop_token_ids=ids, ignore_eos=bool(ignore_eos),
                    stream=bool(stream), include_usage=bool(include_usage))


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_CHARS:
        raise bad(f"model must be a non-empty string of at most {MAX_MODEL_CHARS} "
                  f"characters: the base model's name or an adapter's (see GET /v1/models)",
                  "model")
    return model


def parse_completion(body: dict[str, Any]) -> Completion:
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
    logprobs = _logprobs(body, chat=False)
    # max_tokens 0 (the prompt alone): the replica generates one token, which is not answered
    sampling = _sampling(body if logprobs.generate else {**body, "max_tokens": 1})
    return Completion(model=_model(body), prompt=parsed, sampling=sampling, logprobs=logprobs)


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
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise bad(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    out: list[dict[str, str]] = []
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise bad(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        content = _content(m.get("content", ""), f"messages[{i}].content")
        total += len(content)
        out.append({"role": m["role"][:64], "content": content})
    if total > MAX_PROMPT_CHARS:
        raise bad(f"the messages hold {total} characters, above {MAX_PROMPT_CHARS}", "messages")
    return Chat(model=_model(body), messages=out, sampling=_sampling(body),
                logprobs=_logprobs(body, chat=True))
