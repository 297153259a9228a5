"""Grammar-constrained rows (structured outputs, forced tool calls): a request's grammar
compiled against the model's tokenizer off the serving loop, cached by grammar, and the token
mask applied to its row's logits before sampling (docs/structured-outputs.md).

The engine asks three things of a grammar row: `mask(matcher, logits)` before its token is
sampled, `advance(matcher, token)` after, and whether the grammar is done. Rows without a
grammar never reach this module. Compiles run on one worker thread (llguidance drops the GIL
while it builds a grammar); a request waits in the queue, without a row, until its compile is
done, so a long compile holds up no other request.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from shared.grammar import Grammar, llguidance_grammar
from shared.threadname import name_os_thread

log = logging.getLogger("computed.grammar")
CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped)


class GrammarError(ValueError):
    """A grammar that does not compile against this model's tokenizer."""


class Grammars:
    """The compiled grammars of one replica's model: `compile(g)` a future of a matcher in its
    start state (shared by every request with that grammar: each takes a `start()` copy)."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_ids: Sequence[int],
                 cached: int = CACHED_GRAMMARS) -> None:
        from llguidance import LLTokenizer

        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self.vocab_size = vocab_size
        self.cached = cached
        self._cache: OrderedDict[Grammar, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar",
                                          initializer=name_os_thread)
        self.compile_s: list[float] = []  # each compile's seconds, for benchmarks

    @classmethod
    def load(cls, model_dir: Path, *, vocab_size: int) -> Grammars | None:
        """The grammars of the checkpoint in `model_dir`; None when it has no tokenizer.json
        or llguidance cannot read it (a request with a grammar is then refused: the replica
        serves everything else)."""
        from shared.text import NoTokenizer, TextCodec

        try:
            codec = TextCodec.load(model_dir)
        except NoTokenizer:
            return None
        eos = sorted(t for t in codec.eos_token_ids if 0 <= t < vocab_size)
        try:
            return cls((Path(model_dir) / "tokenizer.json").read_text(), vocab_size=vocab_size,
                       eos_ids=eos)
        except Exception as exc:  # llguidance's reason; the replica still serves
            log.warning("no structured outputs: llguidance cannot read %s/tokenizer.json: %s",
                        model_dir, exc)
            return None

    def compile(self, g: Grammar) -> Future[Any]:
        with self._lock:
            fut = self._cache.get(g)
            if fut is not None:
                self._cache.move_to_end(g)
                return fut
            fut = self._worker.submit(self._build, g)
            self._cache[g] = fut
            while len(self._cache) > self.cached:
                self._cache.popitem(last=False)
            return fut

    def _build(self, g: Grammar) -> Any:
        import time

        from llguidance import LLMatcher

        t0 = time.perf_counter()
        try:
            grammar = llguidance_grammar(g)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        self.compile_s.append(time.perf_counter() - t0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def start(compiled: Any) -> Any:
    """A request's own matcher, in the grammar's start state."""
    return compiled.deep_copy()


def mask(matcher: Any, logits: np.ndarray) -> np.ndarray:
    """`logits` with every token the grammar forbids next at -inf (a copy)."""
    allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                            bitorder="little", count=logits.shape[-1]).view(bool)
    return np.where(allowed, logits, logits.dtype.type(-np.inf))


def advance(matcher: Any, token: int) -> bool:
    """Move the matcher past `token`; True when the grammar is done (nothing may follow) or
    broken (an error state: the row ends rather than run on unconstrained)."""
    if not matcher.consume_token(token):
        log.warning("grammar refused a sampled token %d: %s", token, matcher.get_error())
        return True
    return bool(matcher.is_stopped())
