"""What the gateway answers to bodies it cannot serve, before any statesvc or replica is
asked (gateway/requests.py `parse_json`, app.py `answering` and `error_response`):
a lone surrogate anywhere in a body is OpenAI's 400 naming the field; a bug in a handler is
OpenAI's 500, counted in /metrics, never Starlette's plain-text page; the model list
names each id once; a field of the wrong type is a 400 naming it; a prompt that no context
can hold is refused before it is tokenized; and /health answers as routing would. The app runs in-process (Starlette's TestClient) over a Router that is
not started, its view set here."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

from gateway import admin
from gateway.app import build_app, error_response
from gateway.errors import ApiError
from gateway.requests import parse_json
from gateway.routing import FleetView, ReplicaView, Router
from gateway.service import Gateway
from statesvc.tools.example import ExampleAssets

BASE = "base"
LONE = "\\ud800"  # JSON's escape of a lone surrogate, as a client writes it in the body


@pytest.fixture
def gw(example: ExampleAssets) -> Gateway:
    router = Router("tcp://127.0.0.1:1")  # never asked: each case is answered before that
    router.view = FleetView(ok=True, error="", adapters={"chat": 3})
    return Gateway(router, example.model_dir, served_name=BASE, request_timeout_s=10)


@pytest.fixture
def client(gw: Gateway) -> Iterator[TestClient]:
    with TestClient(build_app(gw), raise_server_exceptions=False) as c:
        yield c


def error_of(r: Any, status: int) -> dict[str, Any]:
    """The OpenAI-shaped error of a response that must have `status`."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return dict(error)


def requests_counted(client: TestClient, model: str, endpoint: str, status: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name == "loraplane_gateway_requests_total" and s.labels == {
                    "model": model, "endpoint": endpoint, "status": status}:
                return float(s.value)
    return 0.0


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", f'{{"model": "{BASE}", "prompt": "{LONE}", "max_tokens": 2}}',
     "prompt"),
    ("/v1/completions", f'{{"model": "{LONE}", "prompt": "x", "max_tokens": 2}}', "model"),
    ("/v1/completions", f'{{"model": "{BASE}", "prompt": ["a{LONE}b"]}}', "prompt[0]"),
    ("/v1/completions", f'{{"model": "{BASE}", "prompt": "x", "stop": ["ok", "{LONE}"]}}',
     "stop[1]"),
    ("/v1/chat/completions", f'{{"model": "{BASE}", "messages": [{{"role": "user", '
     f'"content": "{LONE}"}}]}}', "messages[0].content"),
    ("/v1/chat/completions", f'{{"model": "{BASE}", "messages": [{{"role": "user", '
     f'"content": [{{"type": "text", "text": "{LONE}"}}]}}]}}',
     "messages[0].content[0].text"),
    ("/v1/load_lora_adapter", f'{{"lora_name": "z1", "lora_path": "/tmp/{LONE}"}}',
     "lora_path"),
    ("/v1/unload_lora_adapter", f'{{"lora_name": "{LONE}"}}', "lora_name"),
    ("/v1/completions", f'{{"model": "{BASE}", "prompt": "x", "x{LONE}": 1}}', None),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(client: TestClient, path: str,
                                                              body: str, param: str | None
                                                              ) -> None:
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    error = error_of(r, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    where = "a key of the body" if param is None else param
    assert error["message"] == (f"{where} contains a lone surrogate (\\ud800), which is not "
                                "valid Unicode text; send UTF-8 text")


def test_the_refusal_is_counted_and_the_gateway_answers_on(client: TestClient) -> None:
    body = f'{{"model": "{BASE}", "prompt": "{LONE}"}}'.encode()
    before = requests_counted(client, "", "/v1/completions", "400")
    error_of(client.post("/v1/completions", content=body), 400)
    assert requests_counted(client, "", "/v1/completions", "400") == before + 1
    # the model of a 404 is quoted in its message: text that JSON can carry renders
    error = error_of(client.post("/v1/completions", json={"model": "Grüße 😀", "prompt": "x"}),
                     404)
    assert error["code"] == "model_not_found" and "`Grüße 😀`" in error["message"]


def test_surrogate_pairs_are_text_and_escaped_backslashes_are_not_escapes() -> None:
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}
    assert parse_json(b'{"prompt": "\\\\ud800"}') == {"prompt": "\\ud800"}
    deep = b'{"a": ' + b"[" * 500 + b'"\\udfff"' + b"]" * 500 + b"}"
    with pytest.raises(ApiError) as err:
        parse_json(deep)
    assert err.value.status == 400 and err.value.param == "a" + "[0]" * 500


def test_an_error_that_quotes_a_lone_surrogate_still_renders() -> None:
    r = error_response(ApiError(404, "The model `\ud800` does not exist", param="model",
                                code="model_not_found"))
    assert r.status_code == 404
    assert json.loads(bytes(r.body))["error"]["message"] == "The model `\ud800` does not exist"


def test_a_bug_in_a_handler_is_an_openai_500_and_counted(client: TestClient, gw: Gateway,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    async def broken_run(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("TextInputSequence must be str")

    def broken_load(*args: Any) -> str:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(gw, "run", broken_run)
    monkeypatch.setattr(admin, "load", broken_load)
    before = requests_counted(client, BASE, "/v1/completions", "500")
    for stream in (False, True):
        r = client.post("/v1/completions", json={"model": BASE, "prompt": "x",
                                                 "stream": stream})
        error = error_of(r, 500)
        assert (error["type"], error["message"]) == ("server_error", "internal error: TypeError")
    assert requests_counted(client, BASE, "/v1/completions", "500") == before + 2
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    error = error_of(r, 500)
    assert (error["type"], error["message"]) == ("server_error",
                                                 "internal error: UnicodeEncodeError")


def test_load_inplace_must_be_true_or_false(client: TestClient) -> None:
    for value in ("yes", 1, None, [True]):
        r = client.post("/v1/load_lora_adapter",
                        json={"lora_name": "a", "lora_path": "/a", "load_inplace": value})
        error = error_of(r, 400)
        assert error["param"] == "load_inplace", error
        assert error["message"] == "load_inplace must be true or false"


def test_an_adapter_named_like_the_base_model_is_listed_once(client: TestClient,
                                                             gw: Gateway) -> None:
    gw.router.view = FleetView(ok=True, error="", adapters={BASE: 7, "chat": 3})
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(BASE, None), ("chat", BASE)]
    # `base` is the base model; `base:base` is the adapter
    assert gw.resolve(BASE).adapter is None
    assert (gw.resolve(f"{BASE}:{BASE}").adapter, gw.resolve(f"{BASE}:{BASE}").min_seq) == (
        BASE, 7)


def test_include_usage_must_be_true_or_false(client: TestClient) -> None:
    for value in ("no", 1, [True], {}):
        r = client.post("/v1/completions", json={"model": BASE, "prompt": "x", "stream": True,
                                                 "stream_options": {"include_usage": value}})
        error = error_of(r, 400)
        assert error["param"] == "stream_options.include_usage", error
        assert error["message"] == "stream_options.include_usage must be true or false"


def test_a_prompt_no_context_holds_is_refused_before_it_is_tokenized(
        client: TestClient, gw: Gateway, example: ExampleAssets,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tokenized: list[int] = []
    encode = gw.codec.encode

    def counted(text: str, **kw: Any) -> list[int]:
        tokenized.append(len(text))
        return encode(text, **kw)

    monkeypatch.setattr(gw.codec, "encode", counted)
    context = gw.context_tokens()  # no replica in view: the model's max_position_embeddings
    assert context == json.loads((example.model_dir / "config.json").read_text())[
        "max_position_embeddings"]
    limit = context * gw.chars_per_token
    error = error_of(client.post("/v1/completions", json={"model": BASE,
                                                          "prompt": "x" * (limit + 1)}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert f"no text of more than {limit} characters fits it" in error["message"]
    assert tokenized == []
    # a prompt within the bound is tokenized (and finds no replica to serve it)
    error_of(client.post("/v1/completions", json={"model": BASE, "prompt": "x" * limit}), 503)
    assert tokenized == [limit]
    # with replicas in view, the largest --max-len is the context
    gw.router.view = FleetView(ok=True, error="", adapters={"chat": 3}, replicas=(
        replica_view("r1", max_len=32), replica_view("r2", max_len=64)))
    error = error_of(client.post("/v1/chat/completions", json={"model": BASE, "messages": [
        {"role": "user", "content": "x" * (64 * gw.chars_per_token + 1)}]}), 400)
    assert error["param"] == "messages" and "is 64 tokens" in error["message"]
    assert tokenized == [limit]


def test_health_answers_as_routing_would(client: TestClient, gw: Gateway) -> None:
    r1 = replica_view("r1")
    gw.router.view = FleetView(ok=True, error="", replicas=(r1,))
    assert client.get("/health").json()["replicas"] == ["r1"]
    gw.router.failed(r1.address)  # a request found it gone: the next poll drops it
    assert gw.router.candidates(None, 0) == []
    assert error_of(client.get("/health"), 503)["code"] == "not_ready"


def replica_view(name: str, max_len: int = 256) -> ReplicaView:
    return ReplicaView(id=name, address=f"tcp://127.0.0.1:{9000 + int(name[1:])}",
                       applied_seq=0, queued=0,
                       resident=frozenset(), max_len=max_len)
