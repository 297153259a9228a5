"""Each test's CPU seconds, so the suite's cost can be read where wall time cannot: under two
xdist workers and the processes they start, a test's wall time says as much about what ran
beside it as about the test. With LORAPLANE_TEST_CPU_REPORT=FILE, every test's user + system
CPU (the pytest process's own, plus every child process it waited for: replicas, statesvc,
workers, their children that were waited for in turn) is appended to FILE as one JSON line
`{"test": nodeid, "cpu_s": ...}`, set-up and teardown included (a module fixture's falls on its
module's first and last test). `python -m tests.cpu_report FILE` sums it per module and lists
the slowest tests (docs/testing.md)."""
from __future__ import annotations

import json
import os
import resource
import sys
from collections import defaultdict
from typing import Any, Iterator

import pytest

REPORT = "LORAPLANE_TEST_CPU_REPORT"


def _cpu() -> float:
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    path = os.environ.get(REPORT)
    before = _cpu()
    yield
    if path:
        with open(path, "a") as f:  # one short line per write: the two workers' lines never interleave
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu() - before, 2)}) + "\n")


def main(path: str, most: int = 20) -> None:
    tests = [json.loads(line) for line in open(path)]
    modules: dict[str, float] = defaultdict(float)
    for t in tests:
        modules[t["test"].split("::")[0]] += t["cpu_s"]
    total = sum(modules.values())
    print(f"{len(tests)} tests, {total:.0f} s CPU")
    for name, cpu in sorted(modules.items(), key=lambda kv: -kv[1]):
        print(f"{cpu:8.1f}  {100 * cpu / total:4.1f}%  {name}")
    print(f"\nthe {most} slowest tests")
    for t in sorted(tests, key=lambda t: -t["cpu_s"])[:most]:
        print(f"{t['cpu_s']:8.1f}  {t['test']}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
