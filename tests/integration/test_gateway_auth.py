"""`computed gateway --auth`: only operators' bearer tokens load and unload, each event
records the operator who sent it, and no token reaches the gateway's log; the gateway, whose
requests all reach a replica as its one CURVE key, keeps within that replica's
--client-queue-limit instead of passing on its refusals; and an operator's key is refused as
the gateway's own without --auth. Against a real statesvc and replica running with CURVE keys
(the replica's listen socket too), all subprocesses."""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from shared.client import ControlClient, new_event_id
from shared.faults import SLOW_STEP_ENV
from shared.keys import ClientKeys, client_keys
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, Computed, Gateway, StateSvc, wait_for
from tests.helpers import make_keys, run

# a replica started with --no-warmup compiles on its first request: longer than httpx's 5 s
post = functools.partial(httpx.post, timeout=300.0)

pytestmark = pytest.mark.timeout(300)
TOKEN = "alice-s3cret-token"
CLIENT_LIMIT = 2  # the replica's --client-queue-limit: the gateway's one key gets this many


@dataclass
class Setup:
    svc: StateSvc
    replica: Computed
    gateway: Gateway
    alice: ClientKeys
    clients: Path  # the client key pairs
    server_key: str  # statesvc's server.key


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("auth")
    keydir, clients = make_keys(tmp, {"alice": "operators", "r1": "replicas",
                                      "gw": "replicas"})
    # the replica's listen socket has a key dir of its own, the gateway's key a client there
    replica_keys = tmp / "replica-keys"
    assert run("statesvc", "keys", "init", str(replica_keys)).returncode == 0
    shutil.copy(clients / "gw.key", replica_keys / "clients" / "gw.key")
    tokens = tmp / "tokens.json"
    tokens.write_text(json.dumps({"alice": {
        "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
        "key": str(clients / "alice.key_secret")}}))
    server = str(keydir / "server.key")
    svc = StateSvc(tmp / "data", extra_args=("--auth", str(keydir)))
    # slowed steps: each request still runs when the next ones arrive
    replica = Computed(example.model_dir, svc, tmp / "replicas" / "r1", replica_id="r1",
                       extra_args=("--no-warmup", "--key", str(clients / "r1.key_secret"),
                                   "--server-key", server, "--auth", str(replica_keys),
                                   "--client-queue-limit", str(CLIENT_LIMIT)),
                       env={SLOW_STEP_ENV: "0.02"})
    gateway = Gateway(example.model_dir, svc, log_file=tmp / "gateway.log",
                      extra_args=("--auth", str(tokens), "--key", str(clients / "gw.key_secret"),
                                  "--server-key", server, "--replica-server-key",
                                  str(replica_keys / "server.key")))
    alice = client_keys(str(clients / "alice.key_secret"), server)
    assert alice is not None
    try:
        svc.start()
        with ControlClient(svc.control, keys=alice) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 8, "targets": "all"})
        replica.start()
        gateway.start()
        wait_for(gateway.healthy, what="gateway healthy")
        yield Setup(svc, replica, gateway, alice, clients, server)
    finally:
        gateway.stop()
        replica.stop()
        svc.stop()


def test_only_operator_tokens_load_and_the_event_names_them(setup: Setup,
                                                             example: ExampleAssets) -> None:
    gateway = setup.gateway
    body = {"lora_name": "a", "lora_path": str(example.adapter_dirs["all-r2"])}
    url = gateway.url + "/v1/load_lora_adapter"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    r = post(gateway.url + "/v1/completions", json={
        "model": "a", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    r = post(gateway.url + "/v1/unload_lora_adapter", json={"lora_name": "a"},
             headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    with ControlClient(setup.svc.control, keys=setup.alice) as c:
        events = c.call("events", {"since": 0})["events"]
    assert [(e["type"], e["actor"]) for e in events] == [
        ("pool.configured", "operator:alice"), ("adapter.loaded", "operator:alice"),
        ("adapter.unloaded", "operator:alice")]
    assert TOKEN not in gateway.log.read_text()


def test_concurrent_requests_beyond_the_replicas_client_limit_wait_in_the_gateway(
        setup: Setup) -> None:
    """Four times --client-queue-limit requests at once, all under the gateway's one key: the
    replica would refuse all but CLIENT_LIMIT of them as `overloaded` (429); the gateway sends
    it at most that many at a time and serves every one."""
    def complete(i: int) -> httpx.Response:
        return post(setup.gateway.url + "/v1/completions", json={
            "model": "model", "prompt": f"Hello {i}", "max_tokens": 4, "temperature": 0})

    with ThreadPoolExecutor(4 * CLIENT_LIMIT) as pool:
        answers = list(pool.map(complete, range(4 * CLIENT_LIMIT)))
    assert [r.status_code for r in answers] == [200] * len(answers), \
        [r.text for r in answers if r.status_code != 200]


def test_an_operator_key_as_the_gateways_own_without_auth_is_refused(
        setup: Setup, example: ExampleAssets, tmp_path: Path) -> None:
    def head() -> int:
        with ControlClient(setup.svc.control, keys=setup.alice) as c:
            return int(c.call("status")["head_seq"])
    before = head()
    res = subprocess.run([str(BIN / "computed"), "gateway", "--model", str(example.model_dir),
                          "--state", setup.svc.control, "--port", "0",
                          "--key", str(setup.clients / "alice.key_secret"),
                          "--server-key", setup.server_key],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Error: --key is an operator key of statesvc" in res.stderr
    assert "--auth" in res.stderr and "READY" not in res.stdout
    assert head() == before  # asking statesvc appended nothing
    # a key of its own in statesvc's replicas/ (reads only) starts without --auth, as `make demo`'s
    own = Gateway(example.model_dir, setup.svc, log_file=tmp_path / "own-key.log",
                  extra_args=("--key", str(setup.clients / "gw.key_secret"), "--server-key", setup.server_key))
    try:
        assert own.start().ready.startswith("READY"), own.log.read_text()[-2000:]
    finally:
        own.stop()
