"""shared/threadname.py: a thread's Python name is its OS name too (Linux), cut to 15 bytes."""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from shared.threadname import name_os_thread
from testkit.fleet import thread_cpu


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc: Linux")
@pytest.mark.parametrize(("name", "shown"), [("blob-writer", "blob-writer"),
                                             ("a-name-longer-than-15", "a-name-longer-t")])
def test_the_os_shows_the_threads_name(name: str, shown: str) -> None:
    seen: list[str] = []

    def run() -> None:
        name_os_thread()
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    assert seen == [shown]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc: Linux")
def test_thread_cpu_sums_by_name() -> None:
    """testkit/fleet.py `thread_cpu`, what bench_pg splits a service's CPU with."""
    named, done = threading.Event(), threading.Event()

    def run() -> None:
        name_os_thread()
        named.set()
        done.wait(10)

    threads = [threading.Thread(target=run, name="measured") for _ in range(2)]
    for t in threads:
        t.start()
    named.wait(10)
    try:
        got = thread_cpu(os.getpid())
    finally:
        done.set()
        for t in threads:
            t.join()
    assert "measured" in got and all(v >= 0 for v in got.values())
    assert thread_cpu(2**22 + 7) == {}  # no such process
