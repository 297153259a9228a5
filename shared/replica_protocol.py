"""The replica's wire contract: the commands its listen socket answers (docs/protocol.md §13b).

Same frames and envelope as the control socket (shared/protocol.py `REQUEST`, its
version `PROTOCOL_VERSION`); the commands are `status`, `slot`, `generate`, `cancel`, and
`blob` (a peer replica fetching a blob this one holds; statesvc's `blob`, same args and reply).
The replica (computed/daemon.py, computed/serving/engine.py) validates with these schemas;
clients build their requests with `generate_args` and `slot_args`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, NotRequired, Required, TypedDict

from shared.grammar import check_wire
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
    # the sampling parameters of computed/serving/sampling.py, each off by default
    "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "logit_bias": [], "min_tokens": 0,
    # choices: `n` returned, of `best_of` generated (None: n), ranked by cumulative logprob
    "n": 1, "best_of": None,
    "grammar": None,  # the output constrained to a grammar (shared/grammar.py): {kind, spec}
    # logprobs (docs/protocol.md §13b): off unless sent; k top logprobs per token
    "logprobs": None, "prompt_logprobs": None,
}
MAX_LOGIT_BIAS = 1024  # (token, bias) pairs per request
MAX_CHOICES = 256  # n and best_of (each choice also needs a batch row: --max-batch)


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

    def biases(v: Any) -> str | None:
        if not isinstance(v, list) or len(v) > MAX_LOGIT_BIAS:
            return f"must be a list of at most {MAX_LOGIT_BIAS} [token id, bias] pairs"
        for pair in v:
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int
                    and type(pair[1]) in (int, float)):
                return "must be a list of [token id, bias] pairs"
            if not 0 <= pair[0] < vocab_size:
                return in_vocab
            if not -100.0 <= pair[1] <= 100.0:
                return "biases must be between -100 and 100"
        return None

    def between(lo: float, hi: float) -> Callable[[float], str | None]:
        return lambda v: None if lo <= v <= hi else f"must be between {lo:g} and {hi:g}"

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
        "top_k": Field(int, required=False, default=d["top_k"], check=int_range(0, vocab_size)),
        "min_p": Field(float, required=False, default=d["min_p"], check=between(0.0, 1.0)),
        "presence_penalty": Field(float, required=False, default=d["presence_penalty"],
                                  check=between(-2.0, 2.0)),
        "frequency_penalty": Field(float, required=False, default=d["frequency_penalty"],
                                   check=between(-2.0, 2.0)),
        "repetition_penalty": Field(float, required=False, default=d["repetition_penalty"],
                                    check=lambda v: None if 0.0 < v <= 10.0 else
                                    "must be in (0, 10]"),
        "logit_bias": Field(list, required=False, default=d["logit_bias"], check=biases),
        "min_tokens": Field(int, required=False, default=d["min_tokens"],
                            check=int_range(0, max_len)),
        "n": Field(int, required=False, default=d["n"], check=int_range(1, MAX_CHOICES)),
        "best_of": Field(int, required=False, default=d["best_of"],
                         check=int_range(1, MAX_CHOICES)),
        # the output constrained to a grammar (shared/grammar.py): {kind, spec}
        "grammar": Field(dict, required=False, default=d["grammar"], check=check_wire),
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


class Choice(TypedDict):
    """One of the choices of a `generate` with n or best_of above 1."""

    output_ids: list[int]
    cumulative_logprob: float | None  # of its sampled tokens (the model's own); null unless best_of > n
    finish: NotRequired[str]  # "grammar": its grammar was done (no eos token ends it)
    logprobs: NotRequired[list[TokenScores]]  # where the request asked: each output token's


class GenerateResult(TypedDict, total=False):
    """`generate`'s result (`choices` only when n or best_of is above 1)."""

    id: Required[str]
    output_ids: Required[list[int]]  # with choices: the first choice's
    adapter: Required[AdapterVersion | None]  # None: the base model
    seq: Required[int]  # the replica's applied seq when the request was admitted
    timings: Required[Timings]
    choices: list[Choice]
    finish: str  # "grammar": its (first choice's) grammar was done (no eos token ends it)
    # only where the request asked: each output token's scores (with choices: the first's); the
    # prompt's (the first None)
    logprobs: list[TokenScores]
    prompt_logprobs: list[TokenScores | None]


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
                  stream: bool = False, **sampling: Any) -> dict[str, Any]:
    """The args of a `generate` request, as a client sends them (`stream`, and each of
    `sampling`, the other args of `generate_schema`, only when set off its default, so replicas
    that predate them keep accepting what old clients send)."""
    args = {"adapter": adapter, "input_ids": list(input_ids), "max_new_tokens": max_new_tokens,
            "temperature": temperature, "top_p": top_p, "seed": seed,
            "stop_token_ids": list(stop_token_ids), "min_seq": min_seq}
    if stream:
        args["stream"] = True
    for name, value in sampling.items():
        if name not in GENERATE_DEFAULTS or name in args:
            raise TypeError(f"generate_args() got an unknown argument {name!r}")
        if value != GENERATE_DEFAULTS[name]:
            args[name] = value
    return args


def token_frame(req_id: str | None, index: int, token: int, choice: int = 0,
                scores: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed token of a `generate` with `stream: true` (docs/protocol.md §13b): `ok`
    with `token` instead of `result`; the final frame is the usual reply. With n above 1 each
    token names its `choice`, and `index` counts that choice's tokens. `scores`: the token's
    `TokenScores` fields where the request asked for logprobs, and on the first token the
    prompt's `prompt_logprobs`."""
    token_of: dict[str, Any] = {"index": index, "id": token}
    if choice:
        token_of["choice"] = choice
    if scores is not None:
        token_of.update(scores)
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": True, "token": token_of}


def slot_args(slot: int) -> dict[str, Any]:
    """The args of a `slot` request: read one pool slot's contents."""
    return {"slot": slot}
