"""logprobs in OpenAI's shapes, from what a replica reports (docs/protocol.md §13b `logprobs`,
`prompt_logprobs`): per token its logprob and its position's top ids and logprobs, computed on
the replica from the model's own distribution (docs/gateway.md "logprobs").

- Completions (the legacy format): `{tokens, token_logprobs, top_logprobs, text_offset}`; with
  `echo` the prompt's tokens come first, the first one's logprob and top logprobs null.
- Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gateway.errors import ApiError
from gateway.output import Output
from gateway.requests import Chat, Completion
from shared.text import TextCodec


def checked(entry: Any, vocab_size: int, replica: str) -> dict[str, Any] | None:
    """A replica's scores of one token, checked (a faulty replica's are a 502, never a crash);
    None stays None (a prompt's first token)."""
    if entry is None:
        return None
    ok = isinstance(entry, dict) and isinstance(entry.get("logprob"), (int, float)) \
        and isinstance(entry.get("top_ids"), list) and isinstance(entry.get("top_logprobs"), list) \
        and len(entry["top_ids"]) == len(entry["top_logprobs"]) \
        and all(type(t) is int and 0 <= t < vocab_size for t in entry["top_ids"]) \
        and all(isinstance(v, (int, float)) for v in entry["top_logprobs"])
    if not ok:
        raise ApiError(502, f"replica {replica} answered logprobs that are not per-token "
                       f"{{logprob, top_ids, top_logprobs}}; its operator should check its version "
                       f"against docs/protocol.md", code="bad_replica_reply")
    return {"logprob": float(entry["logprob"]), "top_ids": entry["top_ids"],
            "top_logprobs": [float(v) for v in entry["top_logprobs"]]}


def scores_of(result: dict[str, Any], key: str, n: int, vocab_size: int,
              replica: str) -> list[dict[str, Any] | None]:
    """`result[key]` checked: a list of at least `n` entries, of which the first `n` are kept."""
    got = result.get(key)
    if not isinstance(got, list) or len(got) < n:
        raise ApiError(502, f"replica {replica} answered without {key} for its {n} tokens; its "
                       f"operator should check its version against docs/protocol.md",
                       code="bad_replica_reply")
    return [checked(e, vocab_size, replica) for e in got[:n]]


def _value(lp: float) -> float:
    """A logprob as JSON carries it: -inf (a token of no probability) as OpenAI's -9999.0."""
    return lp if math.isfinite(lp) else -9999.0


def completion(codec: TextCodec, ids: Sequence[int], scores: Sequence[dict[str, Any] | None],
               offset: int) -> dict[str, Any]:
    """The legacy format for tokens `ids` with their `scores` (None: a prompt's first), their
    text starting at character `offset` of the choice's text."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for t, s in zip(ids, scores):
        text = codec.token_text(t)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if s is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(_value(s["logprob"]))
        top: dict[str, float] = {}
        for i, v in zip(s["top_ids"], s["top_logprobs"]):
            top.setdefault(codec.token_text(i), _value(v))  # two ids of one text: the likelier
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_entries(codec: TextCodec, ids: Sequence[int],
                 scores: Sequence[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries for tokens `ids`."""
    def one(t: int, lp: float) -> dict[str, Any]:
        text = codec.token_text(t)
        return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}
    out = []
    for t, s in zip(ids, scores):
        assert s is not None  # an output token always has its scores
        entry = one(t, s["logprob"])
        entry["top_logprobs"] = [one(i, v) for i, v in zip(s["top_ids"], s["top_logprobs"])]
        out.append(entry)
    return out


def echoed(codec: TextCodec, req: Completion, prompt_ids: Sequence[int]) -> str:
    """The prompt's text that `echo` puts before the output's: as sent, or its tokens' text."""
    return req.prompt if isinstance(req.prompt, str) else codec.decode(prompt_ids)


def choice(codec: TextCodec, req: Completion | Chat, out: Output) -> dict[str, Any] | None:
    """A whole answer's `logprobs` (None where not asked)."""
    if req.logprobs.top is None or out.scores is None:
        return None
    if isinstance(req, Chat):
        return {"content": chat_entries(codec, out.ids, out.scores)}
    return completion(codec, (out.prompt_ids or []) + out.ids, (out.prompt_scores or []) + out.scores, 0)
