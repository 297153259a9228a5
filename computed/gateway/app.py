"""The gateway's HTTP surface (Starlette): OpenAI's /v1/models, /v1/completions and
/v1/chat/completions (JSON, or server-sent events with one chunk per token), vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, /health and /metrics."""
from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from computed.gateway import admin
from computed.gateway.auth import Operator, operator_of
from computed.gateway.metrics import UNRESOLVED, Metrics
from computed.gateway.requests import (MAX_BODY_BYTES, ApiError, Chat, Completion,
                                       parse_chat, parse_completion, parse_json)
from computed.gateway.service import Gateway, Output
from shared.keys import ClientKeys
from shared.text import IncrementalDecoder


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def read_body(request: Request) -> dict[str, Any]:
    """The JSON body, read at most MAX_BODY_BYTES far."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    return parse_json(bytes(raw))


def _usage(out: Output) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def pieces(gw: Gateway, out: Output) -> list[str]:
    """The output's text, one piece per token (whole characters only: a token that ends
    inside a character gives "" and the character comes with the token that completes it),
    up to where a stop string cut out.text."""
    dec, sent, parts = IncrementalDecoder(gw.codec), 0, []
    for t in out.ids:
        new = dec.push(t)
        if sent >= len(out.text) and len(dec.sent) > len(out.text):
            break  # past a stop string
        piece = out.text[sent:sent + len(new)]
        sent += len(piece)
        parts.append(piece)
    if sent < len(out.text):  # a character the output never completed, shown as U+FFFD
        rest = out.text[sent:]
        parts = parts[:-1] + [parts[-1] + rest] if parts else [rest]
    return parts


def build_app(gw: Gateway, *, max_pending: int = 256,
              operators: list[Operator] | None = None) -> Starlette:
    """operators: with --auth, who may load and unload (else anyone who reaches the
    gateway, as the gateway's own identity on statesvc)."""
    pending = threading.BoundedSemaphore(max_pending)
    metrics = Metrics(gw.router)

    async def generate(request: Request, parse: Callable[[dict[str, Any]], Completion | Chat],
                       chat: bool) -> Response:
        started, label = time.perf_counter(), UNRESOLVED
        endpoint = request.url.path
        try:
            req = parse(await read_body(request))
            target = gw.resolve(req.model)  # 404 before queueing
            label = target.adapter or gw.served_name
            if not pending.acquire(blocking=False):
                raise ApiError(429, f"the gateway has {max_pending} requests in flight "
                               f"(--max-pending); retry later", code="overloaded")
            metrics.pending.inc()
            try:
                out = await run_in_threadpool(gw.run, req)
            finally:
                pending.release()
                metrics.pending.dec()
        except ApiError as exc:
            metrics.requests.labels(label, endpoint, str(exc.status)).inc()
            return error_response(exc)
        metrics.requests.labels(label, endpoint, "200").inc()
        metrics.prompt_tokens.labels(label).inc(out.prompt_tokens)
        metrics.generation_tokens.labels(label).inc(out.completion_tokens)
        metrics.latency.labels(label).observe(time.perf_counter() - started)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "created": created, "model": req.model}
        if req.sampling.stream:
            return StreamingResponse(_sse(gw, out, head, chat, req.sampling.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": _usage(out)})

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat, chat=True)

    async def models(request: Request) -> Response:
        created = int(time.time())
        base = gw.served_name
        data = [{"id": base, "object": "model", "created": created, "owned_by": "loraplane",
                 "root": base, "parent": None}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "loraplane",
                  "root": name, "parent": base, "version": version}
                 for name, version in sorted(gw.router.view.adapters.items())]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        view = gw.router.view
        if not view.ok:
            return error_response(ApiError(503, view.error, code="not_ready"))
        if not view.replicas:
            return error_response(ApiError(503, "no replica is ACTIVE and agreeing with the "
                                           "log yet", code="not_ready"))
        return JSONResponse({"status": "ok", "head_seq": view.head_seq,
                             "replicas": [r.id for r in view.replicas]})

    def caller_keys(request: Request) -> ClientKeys | None:
        if operators is None:
            return gw.router.keys
        return operator_of(operators, request.headers.get("authorization")).keys

    async def load_lora_adapter(request: Request) -> Response:
        try:
            keys = caller_keys(request)
            body = await read_body(request)
            return PlainTextResponse(await run_in_threadpool(admin.load, gw.router, keys,
                                                             gw.served_name, body))
        except ApiError as exc:
            return error_response(exc)

    async def unload_lora_adapter(request: Request) -> Response:
        try:
            keys = caller_keys(request)
            body = await read_body(request)
            return PlainTextResponse(await run_in_threadpool(admin.unload, gw.router, keys,
                                                             body))
        except ApiError as exc:
            return error_response(exc)

    async def metrics_page(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ])


async def _sse(gw: Gateway, out: Output, head: dict[str, Any], chat: bool,
               include_usage: bool) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, *, role: bool = False) -> str:
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

    # the replica answered whole, so every event is known now: one write carries them all
    # (one SSE event per token still; a write per event costs the event loop for nothing)
    events = [chunk("", None, role=True)] if chat else []
    events += [chunk(piece, None) for piece in pieces(gw, out)]
    events.append(chunk(None if chat else "", out.finish_reason))
    if include_usage:
        usage = {**head, "object": obj, "choices": [], "usage": _usage(out)}
        events.append(f"data: {json.dumps(usage)}\n\n")
    events.append("data: [DONE]\n\n")
    yield "".join(events)
