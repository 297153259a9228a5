"""The replica's wire contract: the commands its listen socket answers (docs/protocol.md §13b).

Same frames and envelope as the control socket (shared/protocol.py `REQUEST`, its
version `PROTOCOL_VERSION`); the commands are `status`, `slot`, `generate`, `cancel`, and
`blob` (a peer replica fetching a blob this one holds; statesvc's `blob`, same args and reply).
The replica (computed/daemon.py, computed/serving/engine.py) validates with these schemas;
clients build their requests with `generate_args` and `slot_args`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, NotRequired, TypedDict

from shared.config import MAX_SEED, MAX_SEQ, PROTOCOL_VERSION
from shared.protocol import COMMANDS as CONTROL_COMMANDS
from shared.protocol import (REQUEST, Field, ProtocolError, Schema, int_range, str_len,
                             validate)

STATUS, SLOT, GENERATE, CANCEL, BLOB = "status", "slot", "generate", "cancel", "blob"
COMMANDS = (STATUS, SLOT, GENERATE, CANCEL, BLOB)
MAX_STOP_TOKENS = 64
MAX_TOP = 20  # top logprobs a token carries at most (OpenAI's limit for `logprobs`/`top_logprobs`)

SLOT_ARGS: Schema = {"slot": Field(int, check=int_range(0, 1 << 20))}
# `cancel`: the id of a `generate` this client sent (docs/protocol.md §13b)
CANCEL_ARGS: Schema = {"id": Field(str, check=str_len(128))}
# `blob`: a chunk of a blob in the replica's cache, as statesvc's `blob` (§13c)
BLOB_ARGS: Schema = CONTROL_COMMANDS["blob"]

# `generate`'s optional args as a replica fills them in (loractl's defaults too)
GENERATE_DEFAULTS: dict[str, Any] = {
    "adapter": None, "max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 0,
    "stop_token_ids": [], "min_seq": 0, "stream": False,
    # logprobs (docs/protocol.md §13b): off unless sent; k top logprobs per token
    "logprobs": None, "prompt_logprobs": None,
}


def _token_list(limit: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if not isinstance(v, list) or not all(type(t) is int for t in v):
            return "must be a list of integers"
        if len(v) > limit:
            return f"has {len(v)} entries, above the limit of {limit}"
        return None
    return check


def generate_schema(vocab_size: int, max_len: int) -> dict[str, Field]:
    """`generate`'s args on a replica whose model has `vocab_size` tokens and `max_len`."""
    in_vocab = f"must be token ids in [0, {vocab_size})"
    d = GENERATE_DEFAULTS

    def tokens(v: Any) -> str | None:
        problem = _token_list(max_len)(v)
        if problem:
            return problem
        if not v:
            return "must not be empty"
        return None if all(0 <= t < vocab_size for t in v) else in_vocab

    def stops(v: Any) -> str | None:
        problem = _token_list(MAX_STOP_TOKENS)(v)
        return problem or (None if all(0 <= t < vocab_size for t in v) else in_vocab)

    return {
        "adapter": Field(str, required=False, check=str_len(64)),
        "input_ids": Field(list, check=tokens),
        "max_new_tokens": Field(int, required=False, default=d["max_new_tokens"],
                                check=int_range(1, max_len)),
        "temperature": Field(float, required=False, default=d["temperature"],
                             check=lambda v: None if 0.0 <= v <= 100.0 else
                             "must be between 0 and 100"),
        "top_p": Field(float, required=False, default=d["top_p"],
                       check=lambda v: None if 0.0 < v <= 1.0 else "must be in (0, 1]"),
        "seed": Field(int, required=False, default=d["seed"], check=int_range(0, MAX_SEED)),
        "stop_token_ids": Field(list, required=False, default=d["stop_token_ids"], check=stops),
        "min_seq": Field(int, required=False, default=d["min_seq"],
                         check=int_range(0, MAX_SEQ)),
        "stream": Field(bool, required=False, default=d["stream"]),
        "logprobs": Field(int, required=False, default=d["logprobs"], check=int_range(0, MAX_TOP)),
        "prompt_logprobs": Field(int, required=False, default=d["prompt_logprobs"],
                                 check=int_range(0, MAX_TOP)),
    }


class Timings(TypedDict):
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float
    residency_ms: float  # within queue_ms: waiting for the adapter to be made resident


class AdapterVersion(TypedDict):
    name: str
    version: int


class TokenScores(TypedDict):
    """One token's logprob under the model's own distribution, and its position's k most likely
    tokens (ids and logprobs, descending; k the request's `logprobs` or `prompt_logprobs`)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class GenerateResult(TypedDict):
    """`generate`'s result."""

    id: str
    output_ids: list[int]
    adapter: AdapterVersion | None  # None: the base model
    seq: int  # the replica's applied seq when the request was admitted
    timings: Timings
    # only where the request asked: each output token's scores; the prompt's (the first None)
    logprobs: NotRequired[list[TokenScores]]
    prompt_logprobs: NotRequired[list[TokenScores | None]]


class InferenceStatus(TypedDict):
    """`status`'s `inference` field (null on a replica without inference)."""

    warm: bool
    # "warming" until the warm-up has compiled every shape serving uses (requests wait in the
    # queue meanwhile, and the gateway routes nothing here), then "ready"
    state: str
    # the warm-up: seconds so far, XLA compiles and those the persistent cache served
    # (computed/model/compile_cache.py), `ready_s` when it could serve, `pending` while the
    # forwards of several prompts still compile; null until it is ready
    warmup: dict[str, Any] | None
    running: int
    waiting: int
    max_batch: int
    max_len: int
    cancelled: int  # requests its clients cancelled since start (`cancel`)
    client_limit: int  # requests one client may have waiting or running (--client-queue-limit)


def decode_replica_request(msg: Any) -> tuple[str, dict[str, Any]]:
    """(cmd, raw args) of an unpacked request; each command checks its own args."""
    env = validate(REQUEST, msg, "request")
    if env["cmd"] not in COMMANDS:
        raise ProtocolError("unknown_command", f"unknown command {env['cmd']!r}; "
                            f"known: {', '.join(COMMANDS)}", "request.cmd")
    return env["cmd"], env["args"] or {}


def generate_args(input_ids: Sequence[int], *, adapter: str | None = None,
                  max_new_tokens: int = GENERATE_DEFAULTS["max_new_tokens"],
                  temperature: float = GENERATE_DEFAULTS["temperature"],
                  top_p: float = GENERATE_DEFAULTS["top_p"],
                  seed: int = GENERATE_DEFAULTS["seed"],
                  stop_token_ids: Sequence[int] = (),
                  min_seq: int = GENERATE_DEFAULTS["min_seq"],
                  stream: bool = False, logprobs: int | None = None,
                  prompt_logprobs: int | None = None) -> dict[str, Any]:
    """The args of a `generate` request, as a client sends them (`stream`, `logprobs` and
    `prompt_logprobs` only when set, so replicas that predate them keep accepting what old
    clients send)."""
    args: dict[str, Any] = {"adapter": adapter, "input_ids": list(input_ids), "max_new_tokens": max_new_tokens,
                            "temperature": temperature, "top_p": top_p, "seed": seed,
                            "stop_token_ids": list(stop_token_ids), "min_seq": min_seq}
    if stream:
        args["stream"] = True
    if logprobs is not None:
        args["logprobs"] = logprobs
    if prompt_logprobs is not None:
        args["prompt_logprobs"] = prompt_logprobs
    return args


def token_frame(req_id: str | None, index: int, token: int,
                scores: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed token of a `generate` with `stream: true` (docs/protocol.md §13b): `ok`
    with `token` instead of `result`; the final frame is the usual reply. `scores`: the
    token's `TokenScores` fields where the request asked for logprobs, and on the first
    token the prompt's `prompt_logprobs`."""
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": True,
            "token": {"index": index, "id": token} if scores is None else {"index": index, "id": token, **scores}}


def slot_args(slot: int) -> dict[str, Any]:
    """The args of a `slot` request: read one pool slot's contents."""
    return {"slot": slot}
