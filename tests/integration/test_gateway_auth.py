"""`computed gateway --auth`: only operators' bearer tokens load and unload, each event
records the operator who sent it, and no token reaches the gateway's log; against a real
statesvc and replica running with CURVE keys."""
from __future__ import annotations

import functools

import hashlib
import json
from pathlib import Path

import httpx
import pytest

from shared.client import ControlClient, new_event_id
from shared.keys import client_keys
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, Gateway, StateSvc, wait_for
from tests.helpers import make_keys

# a replica started with --no-warmup compiles on its first request: longer than httpx's 5 s
post = functools.partial(httpx.post, timeout=300.0)

pytestmark = pytest.mark.timeout(300)
TOKEN = "alice-s3cret-token"


def test_only_operator_tokens_load_and_the_event_names_them(tmp_path: Path,
                                                             example: ExampleAssets) -> None:
    keydir, clients = make_keys(tmp_path, {"alice": "operators", "r1": "replicas",
                                           "gw": "replicas"})
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": {
        "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),
        "key": str(clients / "alice.key_secret")}}))
    server = str(keydir / "server.key")
    svc = StateSvc(tmp_path / "data", extra_args=("--auth", str(keydir)))
    replica = Computed(example.model_dir, svc, tmp_path / "replicas" / "r1", replica_id="r1",
                       extra_args=("--no-warmup", "--key", str(clients / "r1.key_secret"),
                                   "--server-key", server))
    gateway = Gateway(example.model_dir, svc, log_file=tmp_path / "gateway.log",
                      extra_args=("--auth", str(tokens), "--key", str(clients / "gw.key_secret"),
                                  "--server-key", server))
    alice = client_keys(str(clients / "alice.key_secret"), server)
    try:
        svc.start()
        with ControlClient(svc.control, keys=alice) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 8, "targets": "all"})
        replica.start()
        gateway.start()
        wait_for(gateway.healthy, what="gateway healthy")
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
        with ControlClient(svc.control, keys=alice) as c:
            events = c.call("events", {"since": 0})["events"]
        assert [(e["type"], e["actor"]) for e in events] == [
            ("pool.configured", "operator:alice"), ("adapter.loaded", "operator:alice"),
            ("adapter.unloaded", "operator:alice")]
    finally:
        gateway.stop()
        replica.stop()
        svc.stop()
    assert TOKEN not in gateway.log.read_text()
