"""A replica that is still warming up (status `inference.state` "warming") gets nothing from the
gateway, and a request that finds no warm replica waits for one within its timeout instead of a
503 (real processes: statesvc, a replica whose warm-up a test-only fault holds open, the gateway)."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from shared.faults import SLOW_WARMUP_ENV
from statesvc.tools.example import ExampleAssets
from tests.helpers import WARMUP_TIMEOUT_S, Fleet
from testkit.fleet import Gateway, wait_for

HOLD_S = 8.0  # the warm-up stays open this long after its compiles (LORAPLANE_FAULT_SLOW_WARMUP_S)


def test_requests_wait_for_a_warming_replica_and_none_is_routed_to_it(tmp_path: Path,
                                                                       example: ExampleAssets) -> None:
    fleet = Fleet(tmp_path, example)
    fleet.statesvc.start()
    try:
        fleet.init(max_loras=2, max_rank=8)
        replica = fleet.replica("r1", args=("--max-batch", "2", "--max-len", "32"),
                                env={SLOW_WARMUP_ENV: str(HOLD_S)})
        wait_for(lambda: fleet.converged(replica), what="replica at head")
        assert replica.status()["inference"]["state"] == "warming"
        gateway = Gateway(example.model_dir, fleet.statesvc, log_file=tmp_path / "gateway.log")
        fleet.gateways.append(gateway)
        gateway.start()

        def health() -> httpx.Response:
            return httpx.get(gateway.url + "/health", timeout=10)
        wait_for(lambda: "warming up" in health().text, what="the gateway sees r1 warming")
        assert health().status_code == 503 and "r1" in health().json()["error"]["message"]

        answer: dict[str, Any] = {}

        def complete() -> None:
            res = httpx.post(gateway.url + "/v1/completions", timeout=WARMUP_TIMEOUT_S,
                             json={"model": example.model_dir.name, "prompt": [5, 17, 33], "max_tokens": 3})
            answer.update(status=res.status_code, body=res.json())
        sender = threading.Thread(target=complete)
        sender.start()
        try:
            # while r1 warms, the request waits in the gateway: r1's queue stays empty
            time.sleep(1.0)
            status = replica.status()["inference"]
            assert status["state"] == "warming" and status["waiting"] == 0 and status["running"] == 0, status
        finally:
            sender.join(WARMUP_TIMEOUT_S)
        assert answer["status"] == 200, answer
        assert answer["body"]["usage"]["completion_tokens"] == 3
        assert replica.status()["inference"]["state"] == "ready"
        assert health().status_code == 200
    finally:
        fleet.stop()
