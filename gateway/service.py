"""One gateway request, from checked body to finished output: the model name resolved to the
base model or an adapter, the prompt tokenized, a replica chosen (and another tried when one
fails or is full before answering), and the output cut at stop tokens and stop strings."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq

from gateway import logprobs
from gateway.errors import ApiError, bad
from gateway.requests import Chat, Completion, Sampling
from gateway.output import Output
from gateway.replicas import ReplicaLinks
from gateway.routing import ReplicaView, Router
from gateway.structured import grammar_problem
from gateway.tool_calls import Format, ToolStream, call_stem, format_of
from gateway.tools import Tools
from shared.client import RemoteError, Unavailable
from shared.grammar import Grammar
from shared.replica_protocol import MAX_STOP_TOKENS, Timings, generate_args
from shared.text import IncrementalDecoder, StopStrings, TextCodec
from shared.threadname import name_os_thread

log = logging.getLogger("computed.gateway")
CONNECT_TIMEOUT_S = 2.0  # a replica not reachable this long is skipped for another
DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's API
# replica error codes that another replica may not have: try the next one
WARMING_POLL_S = 0.2  # how often a request waiting for a warming replica looks again
RETRY_ELSEWHERE = {"overloaded": 429, "not_ready": 503}
REPLICA_ERRORS = {"bad_request": 400, "prompt_too_long": 400, "unknown_adapter": 404}
REPLICA_FIELDS = {"args.n", "args.best_of", "args.min_tokens"}  # named as the body's fields
INLINE_PROMPT_CHARS = 4096  # longer text prompts are tokenized on the tokenizer thread
TOKENIZER_THREADS = 1  # long prompts tokenized at once: each takes a CPU from the event loop


def prompt_chars(req: Completion | Chat) -> int:
    """The characters the caller sent to be tokenized (a chat's template adds its own)."""
    if isinstance(req, Chat):
        return sum(len(m["content"]) for m in req.messages)
    return len(req.prompt) if isinstance(req.prompt, str) else 0


@dataclass(frozen=True)
class Target:
    """What a `model` field names: the base model (adapter None) or an adapter."""

    model: str
    adapter: str | None
    min_seq: int


def passed_on(result: dict[str, Any], upstream_s: float) -> dict[str, float] | None:
    """What a client is told of a replica's `timings` (docs/protocol.md `generate`): its
    known fields that are numbers, nothing else the replica sent, and upstream_ms, from the
    gateway sending the request to that replica to its result (as Envoy's
    x-envoy-upstream-service-time); None without a result's timings (a request the gateway
    ended early, at a stop string)."""
    got = result.get("timings")
    if not isinstance(got, dict):
        return None
    out = {k: float(v) for k, v in got.items() if k in Timings.__required_keys__
           and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**out, "upstream_ms": upstream_s * 1e3}


def output_ids_of(result: dict[str, Any], vocab_size: int, replica: str) -> list[int]:
    """A replica's result's `output_ids`, checked: a result without a list of token ids in
    the vocabulary (a faulty or spoofed replica) is a 502 for its request, never an
    exception in the socket's read callback or the tokenizer."""
    ids = result.get("output_ids")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size
                                            for t in ids):
        raise ApiError(502, f"replica {replica} answered without a list of token ids in "
                       f"[0, {vocab_size}) as output_ids; its operator should check its "
                       f"version against docs/protocol.md", code="bad_replica_reply")
    return ids


class StopWatch:
    """Watches a request's text for its stop strings as tokens come: `hit` is the number of
    tokens up to the one that completed the first stop string found (None until then)."""

    def __init__(self, codec: TextCodec, stops: Sequence[str],
                 calls: ToolStream | None = None) -> None:
        self.text = IncrementalDecoder(codec)
        self.stops = StopStrings(stops)
        # parallel_tool_calls false: also ended where the first tool call does
        self.calls, self.fed = calls, 0
        self.checked = 0  # characters of the text before which no stop string can end
        self.hit: int | None = None
        self._future: asyncio.Future[None] | None = None

    def push(self, token: int) -> None:
        # the text as the whole answer's would be cut (Gateway._finish), to the last whole
        # character: a stop string the token completes is caught even when the token also
        # begins a character that the next one completes
        self.text.push(token)
        text = self.text.sent + self.text.unsent
        ended, self.checked = self.stops.ends_one(text, self.checked), len(text)
        if self.calls is not None:
            sent = self.text.sent
            marker = self.calls.fmt.marker if token == self.calls.marker_id else ""
            self.calls.push(sent[self.fed:] + marker)
            self.fed = len(sent)  # characters of the text pushed to `calls`
            ended = ended or self.calls.done
        if ended:
            self.hit = len(self.text.ids)
            if self._future is not None and not self._future.done():
                self._future.set_result(None)

    def hit_future(self) -> asyncio.Future[None]:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self.hit is not None:
                self._future.set_result(None)
        return self._future


class MidStream(ApiError):
    """A replica failed after tokens of its answer were streamed: no retry can hide that."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="replica_failed")


class Gateway:
    def __init__(self, router: Router, model_dir: Path, *, served_name: str,
                 request_timeout_s: float = 120.0) -> None:
        self.router = router
        self.codec = TextCodec.load(model_dir)
        self.served_name = served_name
        self.vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        # the model's eos ids (an id outside the vocabulary, never generated, is left out: a
        # replica refuses it as a stop token)
        self.eos_ids = frozenset(t for t in self.codec.eos_token_ids if 0 <= t < self.vocab_size)
        self.request_timeout_s = request_timeout_s
        self.links = ReplicaLinks(zmq.Context.instance(), router.replica_keys)
        # a prompt of more characters than this many per token of the context cannot fit:
        # refused before it is tokenized (`check_prompt_chars`)
        self.chars_per_token = self.codec.max_chars_per_token()
        max_pos = json.loads((model_dir / "config.json").read_text()).get(
            "max_position_embeddings")
        self.max_position = max_pos if type(max_pos) is int and max_pos > 0 else None
        # the chat template's tool-call format (gateway/tools.py), and its marker's id when the
        # marker is one special token (a grammar then names the token, not its text)
        self.tool_format = format_of(self.codec.chat_template)
        self.tool_marker_id = self._special_id(self.tool_format)
        self.tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize",
                                             initializer=name_os_thread)
        # under the replicas' --auth every request reaches a replica as the gateway's one
        # CURVE key, which each replica lets have --client-queue-limit requests at once:
        # the gateway keeps its requests within that, the rest wait here (`_room`)
        self.one_client = router.replica_keys is not None
        self._room_waiters: list[asyncio.Future[None]] = []

    def _special_id(self, fmt: Format | None) -> int | None:
        if fmt is None or fmt.name == "llama_json":
            return None
        added = self.codec.tokenizer.get_added_tokens_decoder()
        return next((i for i, t in added.items() if t.content == fmt.marker and t.special), None)

    def tools_of(self, req: Completion | Chat) -> Tools | None:
        """The request's tools when the model may call them (a 400 when its template has no
        tool format)."""
        tools = req.tools if isinstance(req, Chat) else None
        if tools is None or tools.choice == "none":
            return None
        if self.tool_format is None:
            raise bad("this model's chat template has no tool-call format (Qwen's <tool_call>, "
                      "Llama 3.1's JSON or Mistral's [TOOL_CALLS]); send the chat without tools",
                      "tools")
        return tools

    def grammar_of(self, req: Completion | Chat) -> Grammar | None:
        """What constrains the answer: the request's structured output, or the grammar of a
        `required` or named tool call (its parameters' schemas checked here: a 400 naming
        `tools` when one does not compile)."""
        tools = self.tools_of(req)
        if tools is None or not tools.forced or self.tool_format is None:
            return req.grammar
        grammar = self.tool_format.grammar(tools, self.tool_marker_id)
        why = grammar_problem(grammar)
        if why is not None:
            raise bad(f"the tools' parameters do not compile to a grammar: {why}", "tools")
        return grammar

    def resolve(self, model: str) -> Target:
        adapters = self.router.view.adapters
        name: str | None = model
        if model == self.served_name:
            name = None
        elif model.startswith(self.served_name + ":"):  # SGLang's base:adapter
            name = model[len(self.served_name) + 1:]
        if name is None:
            return Target(model, None, 0)
        if name not in adapters:
            raise ApiError(404, f"The model `{model}` does not exist: not the base model "
                           f"({self.served_name}) nor a registered adapter (GET /v1/models "
                           f"lists them; loractl load adds one)", param="model",
                           code="model_not_found")
        return Target(model, name, adapters[name])

    def context_tokens(self) -> int | None:
        """The longest context a request can have: the largest `--max-len` of the replicas
        in view, else (none in view) the model's max_position_embeddings."""
        return max((r.max_len for r in self.router.view.replicas), default=self.max_position)

    def check_prompt_chars(self, req: Completion | Chat) -> None:
        """A 400 for a prompt whose characters alone cannot fit the context: one token
        stands for at most `chars_per_token` characters. Tokenizing a prompt of 786 KB took
        0.4 s of CPU and hundreds of MB only to refuse it; this costs nothing."""
        context, chars = self.context_tokens(), prompt_chars(req)
        if context is None or chars <= context * self.chars_per_token:
            return
        param = "messages" if isinstance(req, Chat) else "prompt"
        raise ApiError(400, f"This model's maximum context length is {context} tokens, and "
                       f"no text of more than {context * self.chars_per_token} characters fits "
                       f"it (a token of this tokenizer stands for at most "
                       f"{self.chars_per_token}); the {param} has {chars}: shorten it",
                       param=param, code="context_length_exceeded")

    def prompt_ids(self, req: Completion | Chat, *, release_gil: bool = False) -> list[int]:
        if isinstance(req, Chat):
            tools = None if req.tools is None or self.tool_format is None else \
                list(req.tools.functions)
            try:
                return self.codec.encode_chat(req.messages, release_gil=release_gil, tools=tools)
            except Exception as exc:  # the template's own raise_exception, or a bad template
                raise bad(f"the chat template could not render these messages: {exc}",
                          "messages")
        if isinstance(req.prompt, str):
            return self.codec.encode(req.prompt, release_gil=release_gil)
        if any(t >= self.vocab_size for t in req.prompt):
            raise bad(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return req.prompt

    async def run(self, req: Completion | Chat,
                  on_token: Callable[[int, int, dict[str, Any] | None], None] | None = None,
                  on_output: Callable[[Output], None] | None = None) -> Output:
        """On the event loop. With `on_token` the replica streams and each token is passed on
        as it arrives, as (choice, token); a replica that fails before its first token is replaced by the next
        candidate, one that fails after it raises MidStream. Without stop strings, the output
        (its upstream_ms included) is made in the turn of the loop that reads the replica's
        result, streamed or not, and handed to `on_output` then, with its last tokens (this
        coroutine returns it a turn later). `on_token` gets each token with what its frame
        carries besides (its logprobs, where asked: docs/protocol.md §13b), else None."""
        target = self.resolve(req.model)
        self.check_prompt_chars(req)
        if prompt_chars(req) > INLINE_PROMPT_CHARS:  # long text: tokenize off the loop
            ids = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, lambda: self.prompt_ids(req, release_gil=True))
        else:
            ids = self.prompt_ids(req)
        if not ids:
            raise bad("the prompt has no tokens", "prompt")
        s = req.sampling
        stop_ids = self.stop_ids(s)
        self.check_vocab(s)
        # n > 1: each choice's stop strings are cut from its whole output (`_finish`), as the
        # request runs on for its other choices; n = 1 is cancelled at its stop string
        stops = s.stop if s.rows == 1 else ()
        grammar, tools = self.grammar_of(req), self.tools_of(req)
        stem = call_stem(req) if tools is not None and isinstance(req, Chat) else None
        # parallel_tool_calls false in auto mode (n = 1): the request ends where its first
        # call does (a forced call's grammar allows one call only)
        first_call = None if tools is None or tools.parallel or tools.forced or s.rows > 1 or \
            self.tool_format is None else self.tool_format
        tried: set[str] = set()
        last: ApiError | None = None
        deadline = time.monotonic() + self.request_timeout_s  # waits for a warming replica end here
        room_by: float | None = None  # how long it may wait for room on a replica (`_room`)
        while True:
            candidates = self.router.candidates(target.adapter, target.min_seq,
                                                frozenset(tried), tokens=ids)
            while not candidates and self.router.view.warming and time.monotonic() < deadline:
                # a replica is compiling: wait for it within the request's timeout, not 503 now
                await asyncio.sleep(WARMING_POLL_S)
                candidates = self.router.candidates(target.adapter, target.min_seq,
                                                    frozenset(tried), tokens=ids)
            if not candidates:
                if self.router.view.warming:
                    raise ApiError(503, f"no replica became ready within {self.request_timeout_s:g} s: "
                                   f"{', '.join(self.router.view.warming)} still warming up (compiling); "
                                   "retry, or raise --request-timeout", code="not_ready")
                raise last or ApiError(503, "no replica is ready to serve (none ACTIVE and "
                                       "agreeing with the log); see GET /health",
                                       code="not_ready")
            if self.one_client:
                if all(r.client_limit is not None and r.client_limit < s.rows for r in candidates):
                    raise bad(f"{s.rows} choices need {s.rows} of a replica's requests at once, above "
                              "every replica's --client-queue-limit; ask for fewer",
                              "best_of" if s.rows > s.n else "n")
                with_room = [r for r in candidates if self._has_room(r, s.rows)]
                if not with_room:
                    room_by = room_by or time.monotonic() + self.request_timeout_s
                    await self._room(candidates, room_by)
                    continue
                candidates = with_room
            replica = candidates[0]
            tried.add(replica.address)
            max_new = self._max_new(s, len(ids), replica.max_len, isinstance(req, Chat))
            lp = req.logprobs
            args = generate_args(ids, adapter=target.adapter, max_new_tokens=max_new,
                                 temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                 stop_token_ids=sorted(stop_ids), min_seq=target.min_seq,
                                 grammar=None if grammar is None else grammar.wire(),
                                 logprobs=lp.top, prompt_logprobs=lp.top if lp.echo else None,
                                 **s.replica_args())
            frames: list[dict[str, Any]] = []  # the streamed tokens' frames, for a stop string's end
            self.router.sent(replica.address, target.adapter, s.rows)
            streamed = 0  # tokens the client has seen
            watch = StopWatch(self.codec, stops, None if first_call is None else ToolStream(
                first_call, one=True, marker_id=self.tool_marker_id)) \
                if stops or first_call else None
            seen: list[int] = []  # the replica's tokens, to the one that completed a stop string

            def relay(choice: int, token: int, frame: dict[str, Any]) -> None:
                nonlocal streamed
                if not 0 <= token < self.vocab_size:
                    return  # a faulty replica's frame; its result is then a 502 (output_ids_of)
                if watch is not None:
                    if watch.hit is not None:
                        return  # past a stop string: the request is being cancelled
                    seen.append(token)
                    watch.push(token)
                if (lp.top is not None or lp.echo) and not choice:
                    frames.append(frame)
                if on_token is not None and lp.generate:
                    streamed += 1
                    if lp.echo and not choice and frame.get("index") == 0:  # the echo chunk first
                        frame = {**frame, "prompt_ids": ids}
                    on_token(choice, token, frame if lp.top is not None or lp.echo else None)

            def finish(res: dict[str, Any]) -> Output:
                out = output_ids_of(res, self.vocab_size, replica.id)
                first = self._finish(ids, out if lp.generate else [], stop_ids, s, replica.id,
                                     passed_on(res, time.perf_counter() - sent),
                                     grammar_done=res.get("finish") == "grammar", tools=tools,
                                     stem=None if stem is None else f"{stem}/0")
                if lp.echo:
                    first.prompt_ids = ids
                if lp.top is not None:
                    self._scored(first, res, replica.id)
                if s.n > 1:
                    got = self._choices(res, s.n, replica.id)
                    first.others = [self._finish(ids, more, stop_ids, s, replica.id, None,
                                                 grammar_done=ended, tools=tools,
                                                 stem=None if stem is None else f"{stem}/{i}")
                                    for i, (more, ended) in enumerate(got[1:], 1)]
                    for o, c in zip(first.others, res["choices"][1:]):
                        if lp.top is not None:
                            self._scored(o, c, replica.id)
                        if lp.echo:  # every choice echoes the one prompt
                            o.prompt_ids, o.prompt_scores = ids, first.prompt_scores
                return first

            made: list[Output] = []  # the output, made as the replica's result is read

            def result(res: dict[str, Any]) -> None:
                try:
                    made.append(finish(res))
                except ApiError:
                    return  # a faulty result: the request's task raises it when it resumes
                if on_output is not None:
                    on_output(made[0])

            try:
                # stop strings need the tokens as they come, streamed to the client or not:
                # the request is cancelled on its replica as soon as one is complete
                sent = time.perf_counter()
                res = await self._generate(replica.address, args, watch, seen,
                                           relay if on_token is not None or watch else None,
                                           None if watch else result)
            except Unavailable as exc:
                self.router.failed(replica.address)
                if streamed:
                    raise MidStream(f"replica {replica.id} failed after {streamed} tokens: "
                                    f"{exc}")
                log.warning("replica %s: %s; trying another", replica.id, exc)
                last = ApiError(503, f"replica {replica.id} failed: {exc}", code="not_ready")
                continue
            except RemoteError as exc:
                if exc.code in RETRY_ELSEWHERE:
                    last = ApiError(RETRY_ELSEWHERE[exc.code], f"replica {replica.id}: "
                                    f"{exc}", code=exc.code)
                    continue
                status = REPLICA_ERRORS.get(exc.code, 500)
                # a refused arg (args.n: more choices than the replica's batch rows) is the
                # body field of the same name
                param = "model" if exc.code == "unknown_adapter" else exc.field.removeprefix(
                    "args.") if exc.code == "bad_request" and exc.field in REPLICA_FIELDS else None
                raise ApiError(status, str(exc), code=exc.code, param=param)
            finally:
                self.router.sent(replica.address, target.adapter, -s.rows)
                self._room_freed()
            if made:
                return made[0]
            if frames and "output_ids" in res and "logprobs" not in res:  # ended at a stop string
                res = {**res, "logprobs": frames, "prompt_logprobs": frames[0].get("prompt_logprobs")}
            return finish(res)

    def _scored(self, out: Output, res: dict[str, Any], replica: str) -> None:
        """The replica's logprobs of `out`'s tokens (and with echo of its prompt's), checked."""
        out.scores = logprobs.scores_of(res, "logprobs", len(out.ids), self.vocab_size, replica)
        if out.prompt_ids is not None:
            out.prompt_scores = logprobs.scores_of(res, "prompt_logprobs", len(out.prompt_ids),
                                                   self.vocab_size, replica)

    def _choices(self, res: dict[str, Any], n: int, replica: str) -> list[tuple[list[int], bool]]:
        """The output ids of a result's n choices (docs/protocol.md `generate`, `choices`), each
        with whether its grammar ended it."""
        got = res.get("choices")
        if not isinstance(got, list) or len(got) != n or not all(isinstance(c, dict) for c in got):
            raise ApiError(502, f"replica {replica} answered a request of n={n} without its {n} "
                           "choices; its operator should check its version against "
                           "docs/protocol.md", code="bad_replica_reply")
        return [(output_ids_of(c, self.vocab_size, replica), c.get("finish") == "grammar")
                for c in got]

    def check_vocab(self, s: Sampling) -> None:
        """A 400 for logit_bias token ids and a top_k beyond the vocabulary."""
        if any(t >= self.vocab_size for t, _ in s.logit_bias):
            raise bad(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")
        if s.top_k > self.vocab_size:
            raise bad(f"top_k is {s.top_k}, above the model's {self.vocab_size} tokens; use -1 for "
                      "every token", "top_k")

    def _has_room(self, r: ReplicaView, rows: int = 1) -> bool:
        """Whether `r` takes another of this gateway's requests of `rows` batch rows (choices):
        within its --client-queue-limit (as its status reports it) with those this gateway has
        sent it and not had answered."""
        return r.client_limit is None or \
            sum(self.router.inflight(r.address).values()) + rows <= r.client_limit

    async def _room(self, candidates: list[ReplicaView], by: float) -> None:
        """Wait until a request to a replica ends (one of `candidates` may then have room), at
        the latest until `by` (time.monotonic(): --request-timeout after the request first
        waited); then 429, as the replicas would have answered."""
        waiter = asyncio.get_running_loop().create_future()
        self._room_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, max(0.0, by - time.monotonic()))
        except asyncio.TimeoutError:
            limits = sorted({r.client_limit for r in candidates if r.client_limit is not None})
            raise ApiError(429, f"every replica has had its --client-queue-limit "
                           f"({', '.join(map(str, limits))}) of this gateway's requests for "
                           f"{self.request_timeout_s:g} s (--request-timeout); retry later, or "
                           "raise the replicas' --client-queue-limit", code="overloaded")
        finally:
            if waiter in self._room_waiters:
                self._room_waiters.remove(waiter)

    def _room_freed(self) -> None:
        """A request to a replica ended: the requests waiting for room look again, in the
        order they came."""
        waiters, self._room_waiters = self._room_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _generate(self, address: str, args: dict[str, Any], watch: StopWatch | None,
                        seen: list[int], relay: Callable[[int, int, dict[str, Any]], None] | None,
                        on_result: Callable[[dict[str, Any]], None] | None
                        ) -> dict[str, Any]:
        """The replica's result; with `watch`, ended early (the request cancelled there) once
        a stop string is complete, its output then the tokens seen so far."""
        call = self.links.generate(address, args, connect_timeout_s=CONNECT_TIMEOUT_S,
                                   timeout_s=self.request_timeout_s, on_token=relay,
                                   on_result=on_result)
        if watch is None:
            return await call
        task = asyncio.ensure_future(call)
        try:
            either: set[asyncio.Future[Any]] = {task, watch.hit_future()}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if watch.hit is None or task.done():
                return await task
        finally:
            if not task.done():
                task.cancel()  # the replica is told to drop the request (ReplicaLinks)
        return {"output_ids": list(seen)}

    def stop_ids(self, s: Sampling) -> set[int]:
        """The tokens that end the output: `stop_token_ids`, and unless `ignore_eos` every eos
        id of the model (the tokenizer's, config.json's and generation_config.json's)."""
        stop_ids = set(s.stop_token_ids)
        if any(t >= self.vocab_size for t in stop_ids):
            raise bad(f"stop_token_ids must be in [0, {self.vocab_size})", "stop_token_ids")
        if not s.ignore_eos:
            stop_ids |= self.eos_ids
        if len(stop_ids) > MAX_STOP_TOKENS:
            raise bad(f"at most {MAX_STOP_TOKENS} stop token ids", "stop_token_ids")
        return stop_ids

    def _max_new(self, s: Sampling, prompt_len: int, max_len: int, chat: bool) -> int:
        room = max_len - prompt_len
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens; "
                           f"the prompt has {prompt_len}: shorten it", param="prompt",
                           code="context_length_exceeded")
        want = s.max_tokens or (room if chat else DEFAULT_MAX_TOKENS)
        if s.max_tokens is not None and want > room:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens; "
                           f"the prompt has {prompt_len} and max_tokens asks for {want}: "
                           f"lower max_tokens to {room} or shorten the prompt",
                           param="max_tokens", code="context_length_exceeded")
        if s.min_tokens > min(want, room):
            raise bad(f"min_tokens is {s.min_tokens}, above the {min(want, room)} tokens this "
                      "request may generate (max_tokens, or the context left)", "min_tokens")
        return min(want, room)

    def _finish(self, prompt: list[int], out: list[int], stop_ids: set[int], s: Sampling,
                replica: str, timings: dict[str, float] | None, *, grammar_done: bool = False,
                tools: Tools | None = None, stem: str | None = None) -> Output:
        if s.stop and s.rows > 1:  # to the token that completed its first stop string
            watch = StopWatch(self.codec, s.stop)
            for token in out:
                watch.push(token)
                if watch.hit is not None:
                    out = out[:watch.hit]
                    break
        ids, finish = out, "stop" if grammar_done else "length"
        if out and out[-1] in stop_ids:
            ids, finish = out[:-1], "stop"
        text = self.codec.decode(ids)
        end = StopStrings(s.stop).cut(text)
        if end < len(text):
            text, finish = text[:end], "stop"
        calls, source = None, None
        if tools is not None and self.tool_format is not None:
            # a marker that is a special token is in the text only with special tokens kept
            source = text if self.tool_marker_id is None else self.codec.decode_all(ids)
            content, found = self.tool_format.parse(source, stem, one=not tools.parallel)
            if found:
                text, calls, finish = content, found, "tool_calls"
        return Output(prompt_tokens=len(prompt), ids=ids, completion_tokens=len(out),
                      text=text, finish_reason=finish, replica=replica, timings=timings,
                      tool_calls=calls, tool_source=source)

