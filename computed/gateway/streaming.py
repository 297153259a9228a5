"""Server-sent events for `stream: true`: the replica streams its tokens (docs/protocol.md
§13b), a worker thread passes each one to the event loop, and each becomes one `data:` chunk
at once, its text decoded incrementally (whole characters only) and held back while it may
be the start of a stop string."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any

from computed.gateway.requests import ApiError
from computed.gateway.service import Output
from shared.text import IncrementalDecoder, TextCodec

# what the worker thread hands the event loop: ("token", id), ("done", Output) or
# ("error", ApiError)
Item = tuple[str, Any]


class StreamText:
    """The text of a streamed output, one piece per token. A piece holds whole characters
    only, never a stop token's text, and nothing from where a stop string begins: text that
    could still become a stop string is held back until the next token says otherwise. What
    `rest` returns at the end completes the pieces to exactly the whole answer's text."""

    def __init__(self, codec: TextCodec, stop_ids: Collection[int],
                 stops: Sequence[str]) -> None:
        self.dec = IncrementalDecoder(codec)
        self.stop_ids, self.stops = stop_ids, [s for s in stops if s]
        self.sent = 0  # characters of self.dec.sent released so far

    def push(self, token: int) -> str:
        if token in self.stop_ids:  # a stop token is always the last
            return ""
        self.dec.push(token)
        text = self.dec.sent
        # the text is cut where a stop string first begins in the whole answer: release
        # neither what follows a stop string found so far nor what may still begin one
        end = min([i for i in (text.find(s) for s in self.stops) if i >= 0]
                  + [len(text) - self._held(text)])
        piece = text[self.sent:max(end, self.sent)]
        self.sent += len(piece)
        return piece

    def _held(self, text: str) -> int:
        """The longest end of `text` that begins a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def rest(self, whole: str) -> str:
        """What the pieces lack of the answer's whole text (`Output.text`): held-back text, a
        character the output never completed."""
        return whole[self.sent:]


def usage(out: Output) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def chunker(head: dict[str, Any], chat: bool, include_usage: bool
            ) -> Callable[[str | None, str | None, bool], str]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish)
        body = {**head, "object": obj, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"
    return chunk


async def events(text: StreamText, queue: asyncio.Queue[Item], first: Item,
                 head: dict[str, Any], chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: a chunk per token as tokens come (what has queued meanwhile goes out in
    one write), then the finish chunk, the usage chunk when asked and `[DONE]`; a replica
    that fails mid-stream ends it with an `error` event in OpenAI's shape."""
    chunk = chunker(head, chat, include_usage)
    out: list[str] = [chunk("", None, True)] if chat else []
    item: Item | None = first
    while True:
        while item is not None:
            kind, value = item
            if kind == "token":
                if value not in text.stop_ids:
                    out.append(chunk(text.push(value), None, False))
            elif kind == "done":
                o: Output = value
                rest = text.rest(o.text)
                out.append(chunk(rest or (None if chat else ""), o.finish_reason, False))
                if include_usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    last = {**head, "object": obj, "choices": [], "usage": usage(o)}
                    out.append(f"data: {json.dumps(last)}\n\n")
                out.append("data: [DONE]\n\n")
                yield "".join(out)
                return
            else:
                err: ApiError = value
                out.append(f"data: {json.dumps(err.body())}\n\n")
                yield "".join(out)
                return
            item = queue.get_nowait() if not queue.empty() else None
        if out:
            yield "".join(out)
            out = []
        item = await queue.get()
