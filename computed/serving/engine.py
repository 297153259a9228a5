"""Continuous batching: requests for any mix of adapters share one decode step.

A request is admitted when a batch row is free: the replica resolves its
adapter to the version registered at that moment, makes it resident in a slot
if it is not (a miss fills a slot; with none to be had the request waits in the
queue, docs/residency.md) and leases the slot
(so the slot is not overwritten until the request finishes; the admission
port, computed/serving/admission.py, is all the engine asks of the replica). Every
request admitted in a pass over the queue is prefilled at once, each into its
own KV-cache row with its own slot (one forward for any mix of adapters and
lengths, as the model's `prefill` buckets them), and from the next step on
decodes together with every other running request. It leaves the batch when it hits
max_new_tokens, a stop token or the cache's end. Sampling happens on the host
from each step's logits: greedy at temperature 0, else temperature and top-p
with the request's own seeded generator, so a request's output does not depend
on what else is in the batch; the sampling parameters a request sends (top_k,
min_p, penalties, logit_bias, min_tokens) shape its row's logits first
(computed/serving/sampling.py), and a row without them pays nothing. A request
of n (best_of) choices takes a row per choice: its prompt is prefilled once and
forked into the other rows (computed/serving/prefill.py `Prefills.fork`), each
choice sampling from its own generator, and it is answered when its last
choice ends. A request with a grammar (structured outputs, forced tool calls) waits
in the queue until its grammar is compiled, off the loop; its row's logits are masked to
what the grammar allows before sampling (each choice with its own matcher), and it ends
when the grammar is done (computed/serving/grammar.py). A request that asks for `logprobs`
gets each token's from the raw logits, before the grammar, the sampling parameters and the
temperature (computed/model/scores.py), and with `prompt_logprobs` its prompt's from
prefill (computed/serving/prefill.py); the rows that did not ask pay nothing.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from computed.serving.logprobs import scored
from computed.serving.admission import (AdmissionPort, Fetching, GenerateError, LoraPool,
                                NotReady, SlotDraining)
from computed.serving import grammar
from computed.serving.grammar import Grammars
from computed.serving.prefill import Prefills
from computed.serving.rows import Done, Request, Running
from computed.serving.sampling import Shaping
from shared.grammar import Grammar
from shared.protocol import ProtocolError, validate
from shared.replica_protocol import (Choice, GenerateResult, InferenceStatus,
                                     generate_schema)


class Model(Protocol):
    vocab_size: int
    max_len: int
    max_batch: int

    def new_cache(self) -> Any: ...

    def prefill(self, pool: LoraPool, cache: Any, prompts: list[list[int]], rows: list[int],
                slots: list[int]) -> tuple[np.ndarray, Any]: ...

    def copy_row(self, cache: Any, src: int, dst: int) -> Any: ...

    def decode(self, pool: LoraPool, cache: Any, tokens: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, Any]: ...

    def warmup(self, pool: LoraPool, cache: Any, *, stop: Callable[[], bool] = lambda: False,
               ready: Callable[[], None] | None = None) -> None: ...


NUCLEUS_CANDIDATES = 256  # the first candidate set of top-p sampling (grown 8x while too small)


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator,
           shaping: Shaping | None = None) -> int:
    """Greedy at temperature 0; else temperature, then nucleus (top-p) sampling: the smallest
    prefix of the tokens by descending probability (ties in id order) whose mass reaches top_p,
    drawn from renormalised. At top_p 1 every token is kept and the draw is over them in id order.

    Sorting a 152k-token vocabulary took 25-30 ms a row (a batch of 32 sampled rows: most of a
    second a step); the nucleus is found among the largest probabilities instead: the tokens at
    or above the k-th largest (all its ties) are sorted, and where their mass reaches top_p the
    nucleus is exactly the one a sort of every token gives, drawn the same way (the same
    probabilities in the same order). Otherwise k grows, up to every token.

    A row's `shaping` (computed/serving/sampling.py: logit_bias, min_tokens and the penalties
    before greedy; top_k and min_p after the temperature) is None for a row that sends none of
    those parameters, and this is then what it always was."""
    if shaping is not None:
        logits = shaping.logits(logits)
    if temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if shaping is not None and shaping.truncates:
        z = shaping.truncate(z)
        kept = np.flatnonzero(z > -np.inf)  # top_k, min_p: the draw is among these alone (the
        if len(kept) < len(z):  # dropped tokens' zeros would all tie at the nucleus's edge)
            return int(kept[_draw(z[kept], top_p, rng)])
    return _draw(z, top_p, rng)


def _draw(z: np.ndarray, top_p: float, rng: np.random.Generator) -> int:
    """The index drawn from tempered logits `z` with nucleus `top_p` (`sample`)."""
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p >= 1.0:  # by the inverse of the cumulative distribution (rng.choice checks p first: 1.5 ms)
        cdf = np.cumsum(p)
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))
    k = min(NUCLEUS_CANDIDATES, len(p))
    while True:
        if k >= len(p):
            order = np.argsort(-p, kind="stable")
        else:
            threshold = np.partition(p, len(p) - k)[len(p) - k]
            candidates = np.flatnonzero(p >= threshold)  # ascending ids: ties stay in id order
            order = candidates[np.argsort(-p[candidates], kind="stable")]
        mass = np.cumsum(p[order])
        if k >= len(p) or mass[-1] >= top_p:  # the nucleus ends within these candidates
            break
        k *= 8
    kept = order[mass - p[order] < top_p]  # the smallest prefix reaching top_p
    q = p[kept] / p[kept].sum()
    return int(kept[rng.choice(len(kept), p=q)])


class Engine:
    def __init__(self, model: Model, replica: AdmissionPort, *, queue_limit: int = 256,
                 min_seq_wait_s: float = 10.0, client_limit: int = 64,
                 fetch_wait: float = 0.5, prefill_chunk: int = 0, prefix_blocks: int = 0,
                 grammars: Grammars | None = None) -> None:
        self.model = model
        self.grammars = grammars  # None: requests with a grammar are refused
        self.replica = replica
        self.queue_limit = queue_limit
        self.client_limit = client_limit
        self.min_seq_wait_s = min_seq_wait_s
        self.schema = generate_schema(model.vocab_size, model.max_len)
        self.waiting: deque[Request] = deque()
        self.rows: list[Running | None] = [None] * model.max_batch
        self.cache = model.new_cache()
        # prompts not yet in their rows; the prefix cache (computed/serving/prefill.py)
        self.prefills = Prefills(model, chunk=prefill_chunk, prefix_blocks=prefix_blocks)
        self._budget: int | None = None  # prefill tokens left in this step (None: no limit)
        self.warm = False
        # what the warm-up took (its caller's measure: seconds, compiles, cache hits); None before
        self.warmup_report: dict[str, Any] | None = None
        self.tickets = 0
        self.cancelled = 0
        # a step may wait for a queued miss's fetch up to `fetch_wait` x the last decode
        # step's time (`_admit`; 0: never)
        self.fetch_wait, self.decode_s = fetch_wait, 0.0
        self._fetch: Fetching | None = None  # a request of this pass waits for its fetch
        # called with (request, index, token, choice, scores) for each token of a request that
        # asked for `stream` (the daemon sends it on at once); the final reply is the usual Done.
        # `scores`: the token's where it asked for logprobs (the first with its prompt's too)
        self.on_token: Callable[[Request, int, int, int, dict[str, Any] | None], None] | None = None

    def warmup(self, *, stop: Callable[[], bool] = lambda: False,
               pause: Callable[[Callable[[], bool]], None] | None = None,
               ready: Callable[[], None] | None = None) -> None:
        """Compile every shape serving uses, once the pool exists (its shapes are inputs).
        `stop()` true ends it between two compiles (the replica is stopping), still cold.
        With `ready` the engine is warm (and `ready()` called) as soon as every request can run,
        and the rest compiles after it (computed/model/warmup.py); `pause(stop)` runs just before
        the engine says it is warm (a test-only fault: shared/faults.py)."""
        shapes = None if self.warm else self.replica.pool_shapes()
        if shapes is None:
            return

        def warm() -> None:
            if pause is not None:
                pause(stop)
            self.warm = not stop()
            if self.warm and ready is not None:
                ready()
        # from the pool's shapes alone, without holding it: diffs keep applying while it
        # compiles (seconds per bucket and window)
        store = self.prefills.store
        self.model.warmup(shapes, self.cache, stop=stop, **({} if store is None else {"store": store}),
                          **({} if ready is None else {"ready": warm}))
        if not self.warm:
            warm()

    # ---- intake ----------------------------------------------------------------

    def submit(self, req_id: str, raw_args: Any, reply_to: Any, *,
               client: Hashable = None) -> Done | None:
        """Validate and queue a request from `client`; an immediate error comes back as a
        Done. At most `client_limit` requests of one client wait or run at once."""
        try:
            args = validate(self.schema, raw_args, "args")
        except ProtocolError as exc:
            return Done(reply_to, req_id, error=GenerateError(exc.code, str(exc), exc.field))
        prompt = len(args["input_ids"])
        if prompt + args["max_new_tokens"] > self.model.max_len:
            return Done(reply_to, req_id, error=GenerateError(
                "prompt_too_long", f"{prompt} prompt tokens + max_new_tokens "
                f"{args['max_new_tokens']} exceed this replica's context of {self.model.max_len} "
                "tokens; shorten the prompt or ask for fewer tokens", "args.input_ids"))
        if (problem := self._choices(args)) is not None:
            return Done(reply_to, req_id, error=problem)
        rows = args["best_of"]  # a request of best_of choices needs that many batch rows
        mine = sum(r.args["best_of"] for r in self.waiting if r.client == client) + sum(
            r is not None and r.req.client == client for r in self.rows)
        if mine + rows > self.client_limit:
            held = f"already has {mine} requests waiting or running" if rows == 1 else \
                f"has {mine} batch rows waiting or running and asks for {rows} (one per choice)"
            return Done(reply_to, req_id, error=GenerateError(
                "overloaded", f"this client {held} (the per-client limit is {self.client_limit}); "
                "wait for replies first"))
        if len(self.waiting) >= self.queue_limit:
            return Done(reply_to, req_id, error=GenerateError(
                "overloaded", f"{len(self.waiting)} requests are already queued (the limit is "
                f"{self.queue_limit}); retry later or send to another replica"))
        compiling: Future[Any] | None = None
        if args["grammar"] is not None:
            if self.grammars is None:
                return Done(reply_to, req_id, error=GenerateError(
                    "bad_request", "this replica's model has no tokenizer.json that llguidance "
                    "reads, which a grammar is compiled against; send the request without "
                    "args.grammar",
                    "args.grammar"))
            compiling = self.grammars.compile(Grammar(**args["grammar"]))
        self.tickets += 1
        self.waiting.append(Request(req_id, args, reply_to, client, self.tickets,
                                    grammar=compiling))
        self.replica.want(args["adapter"])  # a missing adapter's fetch starts now, not at admit
        return None

    def _choices(self, args: dict[str, Any]) -> GenerateError | None:
        """Fills in `best_of` (n by default); the error when n, best_of, min_tokens and stream
        do not go together or the choices need more rows than the batch has."""
        n = args["n"]
        best_of = args["best_of"] = n if args["best_of"] is None else args["best_of"]
        if best_of < n:
            return GenerateError("bad_request", f"best_of {best_of} is below n {n}: best_of "
                                 "choices are generated and the n best returned", "args.best_of")
        if best_of > self.model.max_batch:
            return GenerateError("bad_request", f"{best_of} choices need {best_of} batch rows; this "
                                 f"replica has {self.model.max_batch} (--max-batch)",
                                 "args.best_of" if best_of > n else "args.n")
        if best_of > n and args["stream"]:
            return GenerateError("bad_request", "best_of above n cannot stream: the n best are known "
                                 "only at the end", "args.best_of")
        if args["min_tokens"] > args["max_new_tokens"]:
            return GenerateError("bad_request", f"min_tokens {args['min_tokens']} is above "
                                 f"max_new_tokens {args['max_new_tokens']}", "args.min_tokens")
        return None

    def cancel(self, req_id: str, client: Hashable) -> Done | None:
        """Drop `client`'s request `req_id`, waiting or running: its row and its slot lease
        are free at once. The Done (error `cancelled`) is its last reply; None when `client`
        has no such request (it finished, or it is another client's)."""
        gone = GenerateError("cancelled", "cancelled by its client")
        for i, req in enumerate(self.waiting):
            if req.req_id == req_id and req.client == client:
                del self.waiting[i]
                self.replica.withdraw(req.ticket)
                self.cancelled += 1
                return Done(req.reply_to, req_id, error=gone)
        for r in self.rows:
            if r is not None and r.req.req_id == req_id and r.req.client == client:
                self._free(r)
                self.cancelled += 1
                return Done(r.req.reply_to, req_id, error=gone)
        return None

    def _free(self, r: Running) -> None:
        """Every row of `r`'s request (each choice's) and its slot lease, at once."""
        for c in r.group or [r]:
            self.prefills.drop(c)
            if self.rows[c.row] is c:
                self.rows[c.row] = None
        r.grant.release()

    @property
    def busy(self) -> bool:
        return any(r is not None for r in self.rows) or bool(self.waiting)

    def stats(self) -> InferenceStatus:
        """What `status` reports of inference."""
        return {"warm": self.warm, "state": "ready" if self.warm else "warming",
                "warmup": self.warmup_report, "running": sum(r is not None for r in self.rows),
                "waiting": len(self.waiting), "max_batch": self.model.max_batch,
                "max_len": self.model.max_len, "cancelled": self.cancelled,
                "client_limit": self.client_limit}

    def adapter_requests(self) -> dict[str, dict[str, int]]:
        """Per adapter, the requests running on it (their grant's adapter) and waiting for it
        (the adapter their args name): what `status` reports to routers. Requests for the
        base model are not in it."""
        out: dict[str, dict[str, int]] = {}
        for r in self.rows:
            if r is not None and r.grant.name is not None:
                out.setdefault(r.grant.name, {"running": 0, "waiting": 0})["running"] += 1
        for req in self.waiting:
            if (name := req.args["adapter"]) is not None:
                out.setdefault(name, {"running": 0, "waiting": 0})["waiting"] += 1
        return out

    # ---- one step ----------------------------------------------------------------

    def step(self, intake: Callable[[], object] | None = None) -> list[Done]:
        """Admit what can be admitted, then run one decode step for every running request.

        `intake`, called after each prefill, may `submit` what arrived meanwhile: those
        requests are admitted in this step too, so a burst that lands while the first of it is
        prefilled decodes in step with it instead of finishing a step behind (the replica passes
        its socket's non-blocking read)."""
        done: list[Done] = []
        waiting = self.prefills.waiting
        # prefill runs whole prompts unless rows are decoding, which it would stall
        self._budget = self.prefills.chunk or None if any(
            r is not None and r.live for r in self.rows) else None
        self._admit(done, intake)
        if waiting:  # prompts still waiting: earlier steps' chunks, in what the budget leaves
            self._prefill([], done)
        active = [r for r in self.rows if r is not None and r.live]
        if not active:
            return done
        m = self.model
        tokens = np.zeros(m.max_batch, np.int32)
        positions = np.zeros(m.max_batch, np.int32)
        slots = np.full(m.max_batch, -1, np.int32)
        mask = np.zeros(m.max_batch, bool)
        for r in active:
            tokens[r.row], positions[r.row], slots[r.row], mask[r.row] = \
                r.next_token, r.position, r.grant.slot, True
        t0 = time.perf_counter()
        with self.replica.reading() as arrays:
            logits, self.cache = m.decode(arrays, self.cache, tokens, positions, slots, mask)
        logits = np.asarray(logits)
        self.decode_s = time.perf_counter() - t0
        for r in active:
            r.position += 1
            self._emit(r, logits[r.row], done)
        return done

    def _emit(self, r: Running, logits: np.ndarray, done: list[Done]) -> None:
        """Record the token sampled from `logits`; finish the request when it is done."""
        a = r.req.args
        masked = logits if r.matcher is None else grammar.mask(r.matcher, logits)
        token = sample(masked, a["temperature"], a["top_p"], r.rng, r.shaping)
        if r.shaping is not None:
            r.shaping.push(token)
        if r.logprob is not None:  # the model's own log-probability of the token
            top = float(logits.max())  # the raw logits: the model's own distribution
            r.logprob += float(logits[token]) - top - float(np.log(np.exp(
                logits.astype(np.float64) - top).sum()))
        if a["logprobs"] is not None:  # the raw logits too (sample and mask never write them)
            r.scores.append(scored(logits, token, a["logprobs"]))
        r.output.append(token)
        r.next_token = token
        if r.matcher is not None:
            r.grammar_done = grammar.advance(r.matcher, token)
        if a["stream"] and self.on_token is not None:
            self.on_token(r.req, len(r.output) - 1, token, r.choice, self._token_scores(r))
        if (len(r.output) >= a["max_new_tokens"] or token in a["stop_token_ids"]
                or r.position >= self.model.max_len or r.grammar_done):
            self._finish(r, done)

    @staticmethod
    def _token_scores(r: Running) -> dict[str, Any] | None:
        """What a streamed token frame carries besides the token (docs/protocol.md §13b): its
        scores where the request asked for logprobs, and with the first its prompt's."""
        out: dict[str, Any] = {}
        if r.req.args["logprobs"] is not None:
            out.update(r.scores[-1])
        if len(r.output) == 1 and r.prompt_scores is not None:
            out["prompt_logprobs"] = r.prompt_scores
        return out or None

    def _finish(self, r: Running, done: list[Done]) -> None:
        """`r`'s row is free; its request is done when every choice of it is."""
        self.rows[r.row] = None
        r.finished = True
        if r.group is not None and not all(c.finished for c in r.group):
            return
        r.grant.release()
        r = r if r.group is None else r.group[0]  # the times are the request's
        now = time.perf_counter()
        g = r.grant
        result: GenerateResult = {
            "id": r.req.req_id, "output_ids": r.output,
            "adapter": None if g.name is None else {"name": g.name, "version": g.version},
            "seq": g.seq,
            "timings": {"queue_ms": (r.admitted - r.req.arrived) * 1e3,
                        "prefill_ms": r.prefill_s * 1e3,
                        "decode_ms": (now - r.admitted - r.prefill_s) * 1e3,
                        "total_ms": (now - r.req.arrived) * 1e3,
                        "residency_ms": r.residency_s * 1e3}}
        if r.group is None and r.grammar_done:
            result["finish"] = "grammar"
        if r.req.args["logprobs"] is not None:
            result["logprobs"] = r.scores
        if r.prompt_scores is not None:
            result["prompt_logprobs"] = r.prompt_scores
        if r.group is not None:
            a = r.req.args
            # best_of > n: the n of the highest cumulative logprob (ties: the lower choice first)
            best = sorted(r.group, key=lambda c: -(c.logprob or 0.0))[:a["n"]]
            result["choices"] = []
            for c in best:
                one: Choice = {"output_ids": c.output, "cumulative_logprob": c.logprob}
                if c.grammar_done:
                    one["finish"] = "grammar"
                if a["logprobs"] is not None:
                    one["logprobs"] = c.scores
                result["choices"].append(one)
            result["output_ids"] = best[0].output
            if a["logprobs"] is not None:
                result["logprobs"] = best[0].scores
            if best[0].grammar_done:
                result["finish"] = "grammar"
        done.append(Done(r.req.reply_to, r.req.req_id, result=result))

    def _admit(self, done: list[Done], intake: Callable[[], object] | None = None) -> None:
        """Admit the waiting requests in order and prefill those admitted together; those that
        must wait stay in the queue, where the limits `submit` checks count them while `intake`
        runs. Then again for what `intake` brought, until a pass admits nothing.

        A pass that leaves a request waiting for its adapter's fetch (a miss, a few ms) waits
        for that fetch, at most `fetch_wait` (half) of the last decode step, and passes again,
        so the miss is prefilled with the requests admitted beside it instead of after their
        prefill or this step's decode, at the cost of that wait to them (docs/residency.md).
        The passes after each prefill and `intake` have that budget afresh: a miss that came
        during a prefill (its fetch started then) is not left to the next step because the
        prefill spent the first pass's budget."""
        while True:
            budget = time.perf_counter() + self.decode_s * self.fetch_wait
            admitted = self._pass(done)
            while (fetch := self._fetch) is not None and fetch.wait is not None \
                    and (left := budget - time.perf_counter()) > 0 and fetch.wait(left):
                admitted += self._pass(done)  # its weights are in the host tier now
            if not admitted:
                return
            self._prefill(admitted, done)
            if intake is None:
                return
            intake()  # what came meanwhile joins the queue's end, and the next pass

    def _pass(self, done: list[Done]) -> list[Running]:
        """One pass over the queue: the requests admitted into rows (not yet prefilled);
        `_fetch` is then the oldest left waiting for its adapter's fetch, if any."""
        admitted: list[Running] = []
        self._fetch = None
        i = 0
        while i < len(self.waiting):
            req = self.waiting[i]
            try:
                run = self._try_admit(req)
            except GenerateError as exc:
                del self.waiting[i]
                self.replica.withdraw(req.ticket)  # e.g. a waiter's not_ready: its slot goes
                done.append(Done(req.reply_to, req.req_id, error=exc))
                continue
            if run is None:
                i += 1
                continue
            del self.waiting[i]
            for c in run.group or [run]:
                self.rows[c.row] = c
            admitted.append(run)
        return admitted

    def _try_admit(self, req: Request) -> Running | None:
        """Admit `req` into a free row (not yet prefilled); None to keep it waiting."""
        a = req.args
        if req.grammar is not None:  # its compile first: it holds no row or slot meanwhile
            if not req.grammar.done():
                return None
            problem = req.grammar.exception()
            if problem is not None:
                raise GenerateError("bad_request", f"args.grammar does not compile against "
                                    f"this model's tokenizer: {problem}", "args.grammar")
        free = [i for i, r in enumerate(self.rows) if r is None][:a["best_of"]]
        row = free[0] if len(free) == a["best_of"] else None  # a row for each choice, or none
        tried = time.perf_counter()
        try:
            # without a free row only the wait for min_seq can end now: ask as for the base
            # model, which holds nothing
            grant = self.replica.admit(a["adapter"] if row is not None else None, a["min_seq"],
                                       req.ticket)
        except NotReady as exc:
            if time.perf_counter() - req.arrived < self.min_seq_wait_s:
                return None
            raise GenerateError(exc.code, f"{exc} within {self.min_seq_wait_s:g} s", exc.field)
        except SlotDraining as exc:
            if isinstance(exc, Fetching) and self._fetch is None:
                self._fetch = exc  # the oldest such request of this pass
            if row is not None and req.eligible is None:
                req.eligible = tried  # from here on, it waits for residency alone
            # its slot is being rewritten, its weights are being fetched (Fetching), or no slot
            # can hold its adapter now (NoSlot): admit later; requests whose adapters are
            # resident go ahead meanwhile
            return None
        if row is None:
            return None
        granted = time.perf_counter()
        run = Running(req, row, grant, np.random.default_rng(a["seed"]), len(a["input_ids"]), 0,
                      shaping=Shaping.of(a))
        if a["best_of"] > 1:  # choice c draws from its own stream: the seed and c
            run.group = [run] + [Running(req, at, grant, np.random.default_rng([a["seed"], c]),
                                         run.position, 0, choice=c,
                                         shaping=None if run.shaping is None else run.shaping.fork())
                                 for c, at in enumerate(free[1:], 1)]
            for c in run.group:
                c.group = run.group
                c.logprob = 0.0 if a["best_of"] > a["n"] else None
        if req.grammar is not None:  # each choice its own matcher
            for c in run.group or [run]:
                c.matcher = grammar.start(req.grammar.result())
        run.admitted = time.perf_counter()
        # what residency added: the wait since it first had a row, or this admission's own
        # slot write (a host-tier hit), or next to nothing (resident); to the grant (making
        # the request's sampler is not residency)
        run.residency_s = granted - (tried if req.eligible is None else req.eligible)
        return run

    def _prefill(self, runs: list[Running], done: list[Done]) -> None:
        """Queue the admitted `runs` for prefill (a prefix-cache hit copied into their rows) and
        prefill what this step's budget allows, each into its row with its slot; sample the first
        token of each prompt that is now whole in its row. If the model fails, the rows and leases
        of every request still prefilling are freed first."""
        prefills = self.prefills
        try:
            for r in runs:
                self.cache = prefills.admit(r, self.cache)
            with self.replica.reading() as arrays:
                finished, self.cache, spent = prefills.run(arrays, self.cache, self._budget)
        except BaseException:
            for r in list(prefills.waiting) + [r for r in runs if r not in prefills.waiting]:
                self._free(r)
            raise
        if self._budget is not None:
            self._budget -= spent
        now = time.perf_counter()
        for r, row_logits in finished:
            r.prefill_s = now - r.admitted
            if r.group is not None:  # the other choices' rows get its KV
                self.cache = prefills.fork(r, self.cache)
            for c in r.group or [r]:
                c.live = True
                self._emit(c, np.asarray(row_logits), done)
