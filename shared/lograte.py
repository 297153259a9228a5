"""Repeated log lines, rate-limited: what a client can make a service log once per request
(a malformed request, a refused connection) must not let it write the log as fast as it
sends. A warning per malformed request wrote 1.2 MB of the gateway's log in 5 s."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

DEFAULT_BURST = 5  # records of one kind let through per window
DEFAULT_WINDOW_S = 10.0
MAX_KINDS = 1024  # kinds remembered (a message built before logging is a kind of its own)


class RepeatLimit(logging.Filter):
    """Lets through at most `burst` records of one kind per `window_s` seconds; the kind is
    the logger, the level and the message before its arguments are filled in, so "replica
    %s failed" is one kind whatever the replica. The first record of a kind after a window
    that dropped some says how many were dropped."""

    def __init__(self, burst: int = DEFAULT_BURST, window_s: float = DEFAULT_WINDOW_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if burst < 1 or window_s <= 0:
            raise ValueError(f"burst {burst} and window_s {window_s} must be positive")
        self.burst, self.window_s, self.clock = burst, window_s, clock
        # kind -> [window start, records let through in it, records dropped in it]
        self._kinds: OrderedDict[tuple[str, int, str], list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is None:
                seen = self._kinds[kind] = [now, 0, 0]
                if len(self._kinds) > MAX_KINDS:
                    self._kinds.popitem(last=False)
            self._kinds.move_to_end(kind)
            dropped = 0
            if now - seen[0] >= self.window_s:
                dropped = int(seen[2])
                seen[:] = [now, 0, 0]
            if seen[1] >= self.burst:
                seen[2] += 1
                return False
            seen[1] += 1
        if dropped:
            record.msg = (f"{record.getMessage()} ({dropped} more like this were not logged "
                          f"in the {self.window_s:g} s before)")
            record.args = None
        return True


def limit_repeats(*loggers: str, burst: int = DEFAULT_BURST,
                  window_s: float = DEFAULT_WINDOW_S) -> RepeatLimit:
    """One RepeatLimit on each of the named loggers (a filter on a logger sees the records
    logged to that logger itself, not those its children propagate)."""
    limit = RepeatLimit(burst, window_s)
    for name in loggers:
        logging.getLogger(name).addFilter(limit)
    return limit
