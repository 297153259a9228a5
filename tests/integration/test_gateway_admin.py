"""vLLM's load endpoint's `load_inplace`, an adapter named like the base model, and bodies
that are valid JSON but not text, against a real statesvc and gateway (subprocesses; no
replica: nothing here generates)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from statesvc.tools.example import ExampleAssets
from testkit.fleet import Gateway, wait_for
from tests.helpers import Fleet


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return dict(error)


def test_load_inplace_names_clash_and_lone_surrogates(fleet: Fleet, example: ExampleAssets,
                                                      tmp_path: Path) -> None:
    fleet.init()
    gateway = Gateway(example.model_dir, fleet.statesvc, log_file=tmp_path / "gateway.log")
    fleet.gateways.append(gateway)
    gateway.start()
    url, base = gateway.url, example.model_dir.name
    first, other = (str(example.adapter_dirs[a]) for a in ("attn-qv-r8", "all-r2"))

    def load(**body: Any) -> httpx.Response:
        return httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=30)

    def versions() -> dict[str, Any]:
        data = httpx.get(url + "/v1/models").json()["data"]
        ids = [m["id"] for m in data]
        assert len(ids) == len(set(ids)), ids  # each id once
        return {m["id"]: m.get("version") for m in data}

    assert load(lora_name="x", lora_path=first).status_code == 200
    v1 = versions()["x"]
    head = fleet.head()
    # other content under a loaded name: 409 with advice an HTTP caller can follow
    error = error_of(load(lora_name="x", lora_path=other), 409)
    assert (error["code"], error["param"]) == ("exists", "load_inplace")
    assert error["message"].startswith("adapter 'x' is already loaded as version ")
    assert error["message"].endswith('; send "load_inplace": true to record a new version')
    assert "--replace" not in error["message"] and fleet.head() == head
    error = error_of(load(lora_name="x", lora_path=other, load_inplace="true"), 400)
    assert error["param"] == "load_inplace" and fleet.head() == head
    # ... which records a new version, routed at once; on a new name it is a plain load
    assert load(lora_name="x", lora_path=other, load_inplace=True).status_code == 200
    assert load(lora_name="y", lora_path=first, load_inplace=True).status_code == 200
    assert versions()["x"] > v1 and "y" in versions()
    with fleet.client() as c:
        loaded = [e for e in c.call("events", {"since": 0})["events"]
                  if e["type"] == "adapter.loaded" and e["payload"]["name"] == "x"]
    assert [e["payload"]["replaces"] for e in loaded] == [None, {"version": v1}]

    # `loractl load BASE DIR`: statesvc allows the name; the gateway lists `base` once, as
    # the base model, and BASE:BASE addresses the adapter (no replica: 503, not 404)
    fleet.load(base, "all-r2")

    def status_of(model: str) -> int:
        return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi",
                                                         "max_tokens": 2}).status_code

    wait_for(lambda: status_of(f"{base}:{base}") == 503, what="the gateway's poll")
    assert status_of(f"{base}:nope") == 404
    data = httpx.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(base, None), ("x", base), ("y", base)]

    # a lone surrogate: 400 naming the field, nothing appended, counted, the gateway serves on
    head = fleet.head()
    body = '{"lora_name": "z", "lora_path": "/tmp/\\ud800"}'.encode()
    error = error_of(httpx.post(url + "/v1/load_lora_adapter", content=body,
                                headers={"content-type": "application/json"}), 400)
    assert error["param"] == "lora_path" and "lone surrogate (\\ud800)" in error["message"]
    body = f'{{"model": "{base}", "prompt": "\\ud800", "max_tokens": 2}}'.encode()
    error = error_of(httpx.post(url + "/v1/completions", content=body), 400)
    assert error["message"] == ("prompt contains a lone surrogate (\\ud800), which is not "
                                "valid Unicode text; send UTF-8 text")
    assert fleet.head() == head
    counted = {tuple(sorted(s.labels.items())): s.value
               for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for s in fam.samples if s.name == "loraplane_gateway_requests_total"}
    assert counted[(("endpoint", "/v1/completions"), ("model", ""), ("status", "400"))] == 1
    assert set(versions()) == {base, "x", "y"}
