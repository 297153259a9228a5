"""What the engine keeps per request and per row: a request as it arrives (`Request`), each of
its rows while it runs (`Running`, one per choice) and its answer (`Done`). Their own module, so
that the engine and the prefill planner (computed/serving/prefill.py) both import them and
neither imports the other."""
from __future__ import annotations

import time
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from computed.serving.admission import AdmittedAdapter, GenerateError
from computed.serving.prefix_cache import Hit
from computed.serving.sampling import Shaping
from shared.replica_protocol import GenerateResult, TokenScores


@dataclass
class Request:
    req_id: str
    args: dict[str, Any]
    reply_to: Any  # opaque to the engine: where the daemon sends the answer
    client: Hashable  # who sent it, for the per-client limit
    ticket: int = 0  # arrival order: the oldest waiter reserves the next slot (residency.py)
    arrived: float = field(default_factory=time.perf_counter)
    # when it first had a row but not its adapter's slot (a fill, a full set of slots)
    eligible: float | None = None
    grammar: Future[Any] | None = None  # its grammar's compile (computed/serving/grammar.py)


@dataclass(eq=False)  # compared by identity: the engine finds a request in its lists
class Running:
    req: Request
    row: int
    grant: AdmittedAdapter
    rng: np.random.Generator
    position: int  # where the next token's KV goes
    next_token: int
    output: list[int] = field(default_factory=list)
    admitted: float = 0.0
    prefilled: int = 0  # prompt tokens whose KV is in its row (computed/serving/prefill.py)
    hit: Hit | None = None  # its prompt's prefix-cache lookup, until its blocks are saved
    prefill_s: float = 0.0
    residency_s: float = 0.0  # from first having a row to holding its slot (Request.eligible)
    shaping: Shaping | None = None  # its sampling parameters' state; None: plain sampling
    live: bool = False  # its prompt's KV is in its row: it decodes
    # a request of best_of > 1 choices has a row per choice: `choice` its index, `group` all of
    # them (the first, choice 0, is prefilled and forked: computed/serving/prefill.py)
    choice: int = 0
    group: list[Running] | None = None
    finished: bool = False
    logprob: float | None = None  # its sampled tokens' cumulative logprob, where best_of > n ranks
    matcher: Any = None  # its grammar's state (llguidance), None without a grammar
    grammar_done: bool = False  # the grammar ended it
    # what a request that asked for logprobs gets (computed/model/scores.py): each output
    # token's, and its prompt's (the first token's None) once prefilled
    scores: list[TokenScores] = field(default_factory=list)
    prompt_scores: list[TokenScores | None] | None = None
    hidden: list[np.ndarray] = field(default_factory=list)  # its prompt's hidden states so far


@dataclass(frozen=True)
class Done:
    reply_to: Any
    req_id: str
    result: GenerateResult | None = None
    error: GenerateError | None = None
