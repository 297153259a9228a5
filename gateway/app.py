"""The gateway's HTTP surface (Starlette): OpenAI's /v1/models, /v1/completions and
/v1/chat/completions (JSON, or server-sent events with one chunk per token), vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, /health and /metrics."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import admin, logprobs
from gateway.auth import OPERATOR_KEY_WITHOUT_AUTH, Operator, may_change_log, operator_of
from gateway.crosssite import SameOrigin
from gateway.errors import ApiError
from gateway.metrics import UNRESOLVED, Metrics
from gateway.output import Output
from gateway.requests import (MAX_BODY_BYTES, Chat, Completion, parse_chat, parse_completion,
                              parse_json)
from gateway.service import Gateway
from gateway.streaming import (Chunks, EventStream, Inbox, ScoredChunks, StreamText, TokenGate, events,
                               usage)
from gateway.tool_calls import ToolStream, call_stem
from shared.config import GATEWAY_BODY_TIMEOUT_S
from shared.keys import ClientKeys

log = logging.getLogger("computed.gateway")
TOKENS_PER_TURN = 1  # streams woken for their tokens a turn of the loop (docs/gateway.md)
CLIENT_GONE = "499"  # the status label of a stream whose client went away (nginx's code)


# answered before the whole body was read: the connection is closed after the answer, so
# what the client still sends is not read as its next request
UNREAD_BODY = frozenset({408, 413})


def error_response(exc: ApiError) -> Response:
    """OpenAI's error shape, in ASCII JSON: a message that quotes a caller's text renders
    whatever that text holds (JSONResponse's UTF-8 fails on a lone surrogate)."""
    return Response(json.dumps(exc.body()), status_code=exc.status,
                    media_type="application/json",
                    headers={"connection": "close"} if exc.status in UNREAD_BODY else None)


def internal_error(exc: Exception) -> ApiError:
    """A bug met while answering: logged, and answered as OpenAI's 500, never as Starlette's
    plain-text page."""
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}")


def answering(handler: Callable[[Request], Awaitable[Response]]
              ) -> Callable[[Request], Awaitable[Response]]:
    """`handler`, its ApiError and any other exception answered in OpenAI's error shape."""
    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except Exception as exc:  # a bug: still OpenAI's shape, not Starlette's plain text
            return error_response(internal_error(exc))
    return answer


class ClientGone(Exception):
    """The HTTP client went away before its answer: mid-body, or before an unstreamed
    request's answer. Counted under status 499, never logged as an error."""


async def read_body(request: Request, timeout_s: float = GATEWAY_BODY_TIMEOUT_S
                    ) -> dict[str, Any]:
    """The JSON body, read at most MAX_BODY_BYTES far and for at most `timeout_s` seconds
    (--body-timeout: a client sending a byte at a time holds its connection no longer);
    ClientGone when the client closes the connection before the body's end."""
    too_large = ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise too_large
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    raise too_large
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout_s:g} s "
                       "(--body-timeout); send it at once", code="timeout") from None
    except ClientDisconnect:
        log.info("%s: the client closed the connection before the end of its body (499)",
                 request.scope["path"])
        raise ClientGone from None
    return parse_json(bytes(raw))


async def unless_gone(request: Request, work: Awaitable[Output]) -> Output:
    """`work`'s output, or ClientGone once the HTTP client has disconnected: the request is
    then cancelled, which tells its replica to drop it (ReplicaLinks), as a stream's is. With
    the body read, the server's next ASGI message for this request is `http.disconnect`,
    which comes when the client goes away (or after the response, when nothing waits)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # its replica is sent `cancel` meanwhile
        raise ClientGone
    return task.result()


class Endpoints:
    """The gateway's endpoints, one method each, over one Gateway: the requests in flight
    (at most `max_pending`, --max-pending), their metrics and the token gate their streams
    share. operators: with --auth, who may load and unload (else anyone who reaches the
    gateway, as the gateway's own identity on statesvc, which must then not be an operator's:
    `own_key_changes_log` is what statesvc said of it at start, None if it did not answer)."""

    def __init__(self, gw: Gateway, *, max_pending: int = 256,
                 operators: list[Operator] | None = None,
                 body_timeout_s: float = GATEWAY_BODY_TIMEOUT_S,
                 own_key_changes_log: bool | None = False) -> None:
        self.gw, self.max_pending, self.operators = gw, max_pending, operators
        self.body_timeout_s = body_timeout_s
        self.own_key_changes_log = own_key_changes_log
        self.pending = threading.BoundedSemaphore(max_pending)
        self.metrics = Metrics(gw.router)
        self.tasks: set[asyncio.Task[None]] = set()  # requests running: held until they end
        self.gate = TokenGate(TOKENS_PER_TURN)

    # ---- the generation endpoints: each answers every error itself ----------------------

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, parse_completion, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, parse_chat, chat=True)

    async def generate(self, request: Request,
                       parse: Callable[[dict[str, Any]], Completion | Chat],
                       chat: bool) -> Response:
        gw, metrics = self.gw, self.metrics
        started, label = time.perf_counter(), UNRESOLVED
        endpoint = request.scope["path"]  # request.url builds a whole URL object
        try:
            req = parse(await read_body(request, self.body_timeout_s))
            target = gw.resolve(req.model)  # 404 before queueing
            label = target.adapter or gw.served_name
            stop_ids = gw.stop_ids(req.sampling)
            if not self.pending.acquire(blocking=False):
                raise ApiError(429, f"the gateway has {self.max_pending} requests in flight "
                               f"(--max-pending); retry later", code="overloaded")
            metrics.pending.inc()
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            head = {"id": rid, "created": int(time.time()), "model": req.model}
            if req.sampling.stream:
                return await self.stream(req, stop_ids, label, endpoint, started, head, chat)
            try:
                out = await unless_gone(request, gw.run(req))
            except ClientGone:
                metrics.requests.labels(label, endpoint, CLIENT_GONE).inc()
                return Response(status_code=499)  # nobody reads it: the connection is gone
            finally:
                self.pending.release()
                metrics.pending.dec()
        except ApiError as exc:
            self.record(label, endpoint, started, exc)
            return error_response(exc)
        except ClientGone:  # before its body's end
            metrics.requests.labels(label, endpoint, CLIENT_GONE).inc()
            return Response(status_code=499)
        except Exception as exc:  # a bug: still OpenAI's shape, and counted
            error = internal_error(exc)
            self.record(label, endpoint, started, error)
            return error_response(error)
        self.record(label, endpoint, started, out)
        choices: list[dict[str, Any]] = []
        for index, one in enumerate(out.choices):
            choice: dict[str, Any] = {"index": index, "logprobs": logprobs.choice(gw.codec, req, one),
                                      "finish_reason": one.finish_reason}
            if isinstance(req, Chat):
                choice["message"] = {"role": "assistant", "content": one.text}
                if one.tool_calls:
                    choice["message"].update(content=one.text or None, tool_calls=one.tool_calls)
            else:
                echo = logprobs.echoed(gw.codec, req, one.prompt_ids or []) if req.logprobs.echo else ""
                choice["text"] = echo + one.text
            choices.append(choice)
        body = {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": choices, "usage": usage(out)}
        if out.timings is not None:
            body["timings"] = out.timings
        return JSONResponse(body)

    async def stream(self, req: Completion | Chat, stop_ids: set[int], label: str,
                     endpoint: str, started: float, head: dict[str, Any],
                     chat: bool) -> Response:
        """Run the request as a task whose replica streams its tokens into a queue; answer
        with an error status when it fails before the first token, else with the event
        stream. A client that goes away mid-stream cancels the task (streaming.events)."""
        gw, metrics, pending = self.gw, self.metrics, self.pending
        queue = Inbox(self.gate)

        def token(choice: int, t: int, frame: dict[str, Any] | None) -> None:
            if frame is not None:  # logprobs: choice 0's (they do not stream with n > 1)
                queue.put(("scored", (t, frame)))
            else:  # n > 1: the other choices' name theirs
                queue.put(("token", (choice, t) if choice else t))

        def output(out: Output) -> None:
            """The output, in the turn of the loop that read it with the last tokens: the
            stream sends them, the finish chunk and `[DONE]` in one write, where waiting for
            this task to resume would take a turn of the loop behind every other stream's
            tokens of that step, and a write of its own. The stream reads up to its first
            "done" or "error": what work() puts after this one goes unread."""
            queue.put(("done", out))

        async def work() -> None:
            result: Output | ApiError
            try:
                result = await gw.run(req, on_token=token, on_output=output)
            except ApiError as exc:
                result = exc
            except asyncio.CancelledError:
                metrics.requests.labels(label, endpoint, CLIENT_GONE).inc()
                raise
            except Exception as exc:  # a bug: the stream must still end
                result = internal_error(exc)
            finally:
                pending.release()
                metrics.pending.dec()
            self.record(label, endpoint, started, result)
            queue.put(("error" if isinstance(result, ApiError) else "done", result))

        task = asyncio.create_task(work())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            first = await queue.get()
        except asyncio.CancelledError:
            task.cancel()
            raise
        if first[0] == "error":
            return error_response(first[1])
        texts = [StreamText(gw.codec, stop_ids, req.sampling.stop) for _ in range(req.sampling.n)]
        chunks = Chunks(head, chat, req.sampling.include_usage,
                        None if req.logprobs.top is None and not req.logprobs.echo else
                        ScoredChunks(gw.codec, req, gw.vocab_size))
        tools, fmt = gw.tools_of(req), gw.tool_format
        calls = [] if tools is None or fmt is None or not isinstance(req, Chat) else [
            ToolStream(fmt, f"{call_stem(req)}/{i}", one=not tools.parallel,
                       marker_id=gw.tool_marker_id) for i in range(len(texts))]
        return EventStream(events(texts[0], queue, first, chunks, task, texts[1:], calls))

    def record(self, label: str, endpoint: str, started: float,
               out: Output | ApiError) -> None:
        metrics = self.metrics
        if isinstance(out, ApiError):
            metrics.requests.labels(label, endpoint, str(out.status)).inc()
            return
        metrics.requests.labels(label, endpoint, "200").inc()
        metrics.prompt_tokens.labels(label).inc(out.prompt_tokens)
        metrics.generation_tokens.labels(label).inc(out.all_completion_tokens)
        metrics.latency.labels(label).observe(time.perf_counter() - started)

    # ---- the other endpoints (through `answering`) --------------------------------------

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        base = self.gw.served_name
        data = [{"id": base, "object": "model", "created": created, "owned_by": "loraplane",
                 "root": base, "parent": None}]
        # an adapter named like the base model (statesvc allows it) is listed once, as the
        # base model, which its name means in `model`; BASE:NAME still reaches the adapter
        data += [{"id": name, "object": "model", "created": created, "owned_by": "loraplane",
                  "root": name, "parent": base, "version": version}
                 for name, version in sorted(self.gw.router.view.adapters.items())
                 if name != base]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """Healthy while a request could be routed: the replicas of the routing view, less
        those a request found gone since the last poll (as `Router.candidates`)."""
        router = self.gw.router
        view, replicas = router.view, router.routable()
        if not view.ok:
            return error_response(ApiError(503, view.error, code="not_ready"))
        if not replicas:
            warming = f" ({', '.join(view.warming)} warming up)" if view.warming else ""
            return error_response(ApiError(503, "no replica can be routed to: none is ACTIVE, "
                                           "agreeing with the log and warm, or those that were "
                                           f"have failed since{warming}", code="not_ready"))
        return JSONResponse({"status": "ok", "head_seq": view.head_seq,
                             "replicas": [r.id for r in replicas]})

    async def load_lora_adapter(self, request: Request) -> Response:
        keys = await self.caller_keys(request)
        body = await read_body(request, self.body_timeout_s)
        gw = self.gw
        return PlainTextResponse(await run_in_threadpool(admin.load, gw.router, keys,
                                                         gw.served_name, body))

    async def unload_lora_adapter(self, request: Request) -> Response:
        keys = await self.caller_keys(request)
        body = await read_body(request, self.body_timeout_s)
        return PlainTextResponse(await run_in_threadpool(admin.unload, self.gw.router, keys,
                                                         body))

    async def metrics_page(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def caller_keys(self, request: Request) -> ClientKeys | None:
        """The keys a load or unload goes to statesvc with: the caller's operator's under
        --auth, else the gateway's own, once statesvc has said they are not an operator's."""
        if self.operators is not None:
            return operator_of(self.operators, request.headers.get("authorization")).keys
        keys = self.gw.router.keys
        if keys is None:
            return None
        if self.own_key_changes_log is None:  # statesvc did not answer at start: ask now
            self.own_key_changes_log = await run_in_threadpool(
                may_change_log, self.gw.router.state, keys)
            if self.own_key_changes_log is None:
                raise ApiError(503, "statesvc does not answer", code="not_ready")
        if self.own_key_changes_log:
            raise ApiError(403, OPERATOR_KEY_WITHOUT_AUTH, code="forbidden")
        return keys


class GenerationFirst:
    """A POST to a generation endpoint goes straight to its handler, which answers every
    error itself; everything else goes through Starlette (`app`). Its middleware stack and
    route matching cost each request of a burst a share of the one event loop that all of
    the burst's requests queue on."""

    def __init__(self, app: ASGIApp,
                 generation: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.app, self.generation = app, generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.generation.get(scope["path"]) \
            if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send)
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def build_app(gw: Gateway, *, max_pending: int = 256,
              operators: list[Operator] | None = None, hosts: frozenset[str] | None = None,
              body_timeout_s: float = GATEWAY_BODY_TIMEOUT_S,
              own_key_changes_log: bool | None = False) -> ASGIApp:
    """The gateway's routes over its `Endpoints` (which says what `operators` and
    `own_key_changes_log` mean), behind the cross-site checks (gateway/crosssite.py;
    `hosts`: --allowed-hosts, None for any)."""
    api = Endpoints(gw, max_pending=max_pending, operators=operators,
                    body_timeout_s=body_timeout_s, own_key_changes_log=own_key_changes_log)
    app = Starlette(routes=[
        Route("/metrics", answering(api.metrics_page), methods=["GET"]),
        Route("/v1/load_lora_adapter", answering(api.load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", answering(api.unload_lora_adapter), methods=["POST"]),
        Route("/health", answering(api.health), methods=["GET"]),
        Route("/v1/models", answering(api.models), methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
    ])
    app.router.redirect_slashes = False  # SameOrigin redirects, without echoing the Host
    generation: dict[str, Callable[[Request], Awaitable[Response]]] = {
        "/v1/completions": api.completions, "/v1/chat/completions": api.chat_completions}

    def refused(path: str, status: int) -> None:
        if path in generation:  # every status of a generation endpoint is counted
            api.metrics.requests.labels(UNRESOLVED, path, str(status)).inc()

    routes = frozenset(r.path for r in app.routes if isinstance(r, Route))
    return SameOrigin(GenerationFirst(app, generation), hosts=hosts, routes=routes,
                      refused=refused)
