"""The OpenAI-compatible gateway with the official `openai` client, against a real gateway,
statesvc and two replicas (subprocesses); greedy outputs checked against transformers + PEFT
on the same text, tokenized by the same tokenizer."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from shared.faults import SLOW_STEP_ENV
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Gateway, wait_for
from tests.helpers import Fleet, dealer

pytest.importorskip("torch")
openai = pytest.importorskip("openai")
from tests.helpers import HFReference  # noqa: E402

# a replica started with --no-warmup compiles on its first request: longer than httpx's 5 s
post = functools.partial(httpx.post, timeout=300.0)

pytestmark = pytest.mark.timeout(600)
ADAPTERS = {"chat": "attn-qv-r8", "code": "all-r2"}
NEW = 8


class Setup:
    def __init__(self, fleet: Fleet, gateway: Gateway, example: ExampleAssets) -> None:
        import transformers
        self.fleet, self.gateway, self.example = fleet, gateway, example
        self.base = example.model_dir.name
        self.client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=300)
        self.tok = transformers.AutoTokenizer.from_pretrained(str(example.model_dir))
        self.ref = HFReference(example.model_dir)

    def adapter_dir(self, model: str) -> Path | None:
        name = model.split(":")[-1]
        return None if name == self.base else self.example.adapter_dirs[ADAPTERS[name]]

    def expected(self, model: str, ids: list[int], n: int = NEW) -> tuple[str, str, int]:
        """(text, finish_reason, completion_tokens) of transformers + PEFT, greedy."""
        out = self.ref.greedy(self.adapter_dir(model), ids, n)
        eos = self.tok.eos_token_id
        if eos in out:
            out = out[:out.index(eos) + 1]
            return self.tok.decode(out, skip_special_tokens=True), "stop", len(out)
        return self.tok.decode(out, skip_special_tokens=True), "length", len(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("gateway")
    fleet = Fleet(tmp, example)
    try:
        fleet.statesvc.start()
        fleet.init()
        for name, adapter in ADAPTERS.items():
            fleet.load(name, adapter)
        # r1 pauses 20 ms a step (a test-only fault switch): its streams are still running
        # when test_a_replica_killed_mid_stream kills it
        replicas = [fleet.replica("r1", env={SLOW_STEP_ENV: "0.02"}), fleet.replica("r2")]
        wait_for(lambda: fleet.converged(*replicas), what="replicas at head")
        # a request timeout past this module's test timeout: a stream on the killed replica
        # that waited it out instead of seeing the disconnect would fail its test as a hang
        yield Setup(fleet, fleet.gateway("--request-timeout", "3600"), example)
    finally:
        fleet.stop()


def test_models_lists_the_base_and_every_adapter(setup: Setup) -> None:
    models = {m.id: m for m in setup.client.models.list().data}
    assert set(models) == {setup.base, *ADAPTERS}
    assert models[setup.base].model_extra["parent"] is None
    assert all(models[a].model_extra["parent"] == setup.base for a in ADAPTERS)


@pytest.mark.parametrize("model", ["BASE", "chat", "BASE:code"])
def test_completions_equal_transformers_with_and_without_streaming(setup: Setup,
                                                                   model: str) -> None:
    model = model.replace("BASE", setup.base)
    prompt = "The capital of France is"
    ids = setup.tok(prompt).input_ids
    text, finish, n = setup.expected(model, ids)
    res = setup.client.completions.create(model=model, prompt=prompt, max_tokens=NEW,
                                          temperature=0)
    assert (res.choices[0].text, res.choices[0].finish_reason) == (text, finish)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ids), n)
    chunks = list(setup.client.completions.create(model=model, prompt=prompt, max_tokens=NEW,
                                                  temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish
    # one chunk per token (an eos that ends the output has no text), then the finish chunk
    assert len(chunks) == n - (finish == "stop") + 1
    by_ids = setup.client.completions.create(model=model, prompt=ids, max_tokens=NEW,
                                             temperature=0)
    assert by_ids.choices[0].text == text


@pytest.mark.parametrize("model", ["BASE", "code"])
def test_chat_renders_the_template_as_transformers_does(setup: Setup, model: str) -> None:
    model = model.replace("BASE", setup.base)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Write a short poem about the sea."}]
    ids = setup.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    text, finish, n = setup.expected(model, ids)
    res = setup.client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=NEW, temperature=0)
    assert res.choices[0].message.role == "assistant"
    assert (res.choices[0].message.content, res.choices[0].finish_reason) == (text, finish)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ids), n)
    stream = setup.client.chat.completions.create(
        model=model, messages=messages, max_tokens=NEW, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n


def test_stop_strings_cut_the_text(setup: Setup) -> None:
    prompt = "Once upon a time"
    full = setup.client.completions.create(model=setup.base, prompt=prompt, max_tokens=NEW,
                                           temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop
    # the request ends on its replica (cancelled) at the token that completes the stop
    # string: usage counts the tokens to that one, streamed or not
    ref = setup.ref.greedy(None, setup.tok(prompt).input_ids, NEW)
    kept = next(k for k in range(1, NEW + 1)
                if stop in setup.tok.decode(ref[:k], skip_special_tokens=True))
    for stream in (False, True):
        res = setup.client.completions.create(
            model=setup.base, prompt=prompt, max_tokens=NEW, temperature=0, stop=[stop],
            extra_body={"ignore_eos": True}, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(res)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-2].choices[0].finish_reason
            usage = chunks[-1].usage
        else:
            text, finish = res.choices[0].text, res.choices[0].finish_reason
            usage = res.usage
        assert (text, finish) == (full[:full.index(stop)], "stop")
        assert usage is not None and usage.completion_tokens == kept < NEW, (stream, usage)


def test_errors_are_openai_shaped(setup: Setup) -> None:
    c = setup.client
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        c.completions.create(model=setup.base, prompt="hi", temperature="hot")  # type: ignore[arg-type]
    assert br.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model=setup.base, prompt=[5] * 300, max_tokens=2)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as none:
        c.completions.create(model=setup.base, prompt="hi", n=0)
    assert none.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=setup.base, messages=[])
    for body in (b"{not json", b"\xff\xfe", b"[1]", b"[" * 100000):
        r = post(setup.gateway.url + "/v1/completions", content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "code"}
    r = post(setup.gateway.url + "/v1/completions", content=b" " * (2 << 20))
    assert r.status_code == 413
    assert httpx.get(setup.gateway.url + "/health").status_code == 200  # still up


def test_hostile_fields_are_400_naming_the_field_and_change_nothing(setup: Setup) -> None:
    """Thousands of stop strings or stop ids, an over-long stop string or model name, a
    huge prompt: 400 in OpenAI's shape naming the field (docs/security.md's limits), the
    log untouched, and the gateway serves on."""
    head = setup.fleet.head()
    ok = {"model": setup.base, "prompt": "hi", "max_tokens": 2}
    for field, value in (("stop", ["x"] * 5000), ("stop", ["y" * 5000]),
                         ("stop_token_ids", list(range(5000))), ("stop_token_ids", [10 ** 9]),
                         ("model", "m" * 300_000), ("prompt", "p" * 300_000),
                         ("max_tokens", 10 ** 12), ("seed", 2 ** 70)):
        r = post(setup.gateway.url + "/v1/completions", json={**ok, field: value})
        assert r.status_code == 400, (field, r.status_code, r.text[:200])
        error = r.json()["error"]
        assert set(error) >= {"message", "type", "code"} and error["param"] == field, error
        assert len(r.content) < 4096  # the refusal does not echo the input back
    with pytest.raises(openai.BadRequestError) as many:
        setup.client.chat.completions.create(model=setup.base, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}] * 5000)
    assert many.value.param == "messages"
    assert setup.fleet.head() == head
    assert setup.client.completions.create(**ok).usage.completion_tokens >= 1


def test_loractl_generate_takes_text(setup: Setup) -> None:
    import json
    import subprocess

    from testkit.fleet import BIN
    prompt = "Grüße aus München"
    ids = setup.tok(prompt).input_ids
    res = subprocess.run([str(BIN / "loractl"), "generate", "--replica",
                          setup.fleet.replicas[0].listen, "--prompt", prompt, "--model",
                          str(setup.example.model_dir), "--max-new-tokens", str(NEW), "--json"],
                         capture_output=True, text=True, check=True, timeout=120)
    out = json.loads(res.stdout)
    assert out["output_ids"] == setup.ref.greedy(None, ids, NEW)
    assert out["text"] == setup.tok.decode(out["output_ids"], skip_special_tokens=True)


def _samples(setup: Setup) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(setup.gateway.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_the_requests_per_adapter(setup: Setup) -> None:
    before = _samples(setup)
    tokens = 0
    for model in ("chat", "chat", setup.base):
        res = setup.client.completions.create(model=model, prompt="Hello", max_tokens=3,
                                              temperature=0)
        tokens += res.usage.completion_tokens if model == "chat" else 0
    with pytest.raises(openai.NotFoundError):
        setup.client.completions.create(model="nope", prompt="Hello", max_tokens=3)
    after = _samples(setup)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    req = "loraplane_gateway_requests_total"
    assert delta(req, model="chat", endpoint="/v1/completions", status="200") == 2
    assert delta(req, model=setup.base, endpoint="/v1/completions", status="200") == 1
    assert delta(req, model="", endpoint="/v1/completions", status="404") == 1
    assert delta("loraplane_gateway_generation_tokens_total", model="chat") == tokens
    assert delta("loraplane_gateway_request_seconds_count", model="chat") == 2
    info = [dict(labels) for (name, labels) in after if name == "vllm:lora_requests_info"]
    assert sorted(i["replica"] for i in info) == ["r1", "r2"]
    assert all(i["max_lora"] == "6" for i in info)


def test_load_and_unload_through_the_vllm_endpoints(setup: Setup) -> None:
    url, adapter = setup.gateway.url, setup.example.adapter_dirs["mlp-only-r16"]
    r = post(url + "/v1/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    # read-your-writes: the very next request is served by the new adapter
    ids = setup.tok("Hello there").input_ids
    res = setup.client.completions.create(model="late", prompt="Hello there", max_tokens=NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
    want = setup.ref.greedy(adapter, ids, NEW)
    assert res.choices[0].text == setup.tok.decode(want, skip_special_tokens=True)
    assert "late" in {m.id for m in setup.client.models.list().data}
    with setup.fleet.client() as c:
        last = c.call("events", {"since": 0})["events"][-1]
    assert (last["type"], last["actor"]) == ("adapter.loaded", "local")
    r = post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        setup.client.completions.create(model="late", prompt="Hello", max_tokens=2)
    for path, body, status in [
            ("/v1/unload_lora_adapter", {"lora_name": "late"}, 404),
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "relative/dir"}, 400),
            ("/v1/load_lora_adapter", {"lora_name": 5, "lora_path": str(adapter)}, 400),
            ("/v1/load_lora_adapter", {"lora_name": setup.base, "lora_path": str(adapter)},
             400)]:
        r = post(url + path, json=body)
        assert r.status_code == status and "message" in r.json()["error"], (body, r.text)
    with setup.fleet.client() as c:
        assert c.call("events", {"since": 0})["events"][-1]["type"] == "adapter.unloaded"


def test_replicas_stream_tokens_to_clients_that_ask(setup: Setup) -> None:
    """docs/protocol.md §13b: `generate` with `stream: true` answers one frame per token, then
    the usual reply; without it, one reply as before."""
    from shared.protocol import encode_request, unpack
    from shared.replica_protocol import generate_args

    ids = setup.tok("Hello").input_ids
    sock = dealer(setup.fleet.replicas[1].listen, timeout_ms=60_000)
    try:
        frames = []
        for stream in (True, False):
            sock.send(encode_request(f"s{stream}", "generate", generate_args(
                ids, max_new_tokens=NEW, stream=stream)))
            while True:
                frames.append(unpack(sock.recv()))
                if "result" in frames[-1]:
                    break
        streamed, final, whole = frames[:NEW], frames[NEW], frames[NEW + 1]
        assert [f["token"] for f in streamed] == [
            {"index": i, "id": t} for i, t in enumerate(final["result"]["output_ids"])]
        assert all(f["ok"] and f["id"] == "sTrue" for f in streamed + [final])
        assert len(frames) == NEW + 2 and whole["id"] == "sFalse"
        assert whole["result"]["output_ids"] == final["result"]["output_ids"]
        assert final["result"]["output_ids"] == setup.ref.greedy(None, ids, NEW)
    finally:
        sock.close(0)


def test_a_replica_killed_mid_stream(setup: Setup) -> None:
    """Runs last: it kills r1 while streams run through the gateway. Streams that had
    started on r1 end with an error event (their text so far correct); those on r2 finish;
    requests sent after the kill are served by r2; nothing hangs; the gateway stays up."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = "Once upon a time"
    ids = setup.tok(prompt).input_ids
    n = 256 - len(ids)  # the whole context: r1's streams run 5 s at least (its slow steps)
    expected = setup.tok.decode(setup.ref.greedy(None, ids, n), skip_special_tokens=True)

    def start() -> Any:  # returns once the first token has reached the gateway
        return setup.client.completions.create(model=setup.base, prompt=prompt, max_tokens=n,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})

    def read(stream: Any) -> tuple[str, str | None]:
        text = ""
        try:
            for c in stream:
                text += c.choices[0].text
        except openai.APIError as exc:
            return text, str(exc.code)
        return text, None

    def whole() -> str:  # not streamed: a replica that dies under it is retried unseen
        return setup.client.completions.create(
            model=setup.base, prompt=prompt, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(10) as pool:
        started = [start() for _ in range(4)]  # routed to r1 and r2 in turn
        unstreamed = [pool.submit(whole) for _ in range(2)]
        setup.fleet.replicas[0].kill()
        later = [pool.submit(lambda: read(start())) for _ in range(4)]
        ended = list(pool.map(read, started))
        assert [f.result() for f in later] == [(expected, None)] * 4
        assert [f.result() for f in unstreamed] == [expected] * 2
    failed = [text for text, code in ended if code is not None]
    assert {code for _, code in ended} == {None, "replica_failed"}, ended
    assert all(expected.startswith(text) and text != expected for text in failed)
    assert all(text == expected for text, code in ended if code is None)
    wait_for(lambda: httpx.get(setup.gateway.url + "/health").json()["replicas"] == ["r2"],
             what="the gateway to drop r1")


def test_after_the_kill_requests_go_to_the_other_replica(setup: Setup) -> None:
    """Runs after the kill above: r2 serves, the gateway stays up."""
    prompt, n = "Once upon a time", 200
    ids = setup.tok(prompt).input_ids
    expected = setup.tok.decode(setup.ref.greedy(None, ids, n), skip_special_tokens=True)
    res = setup.client.completions.create(model=setup.base, prompt=prompt, max_tokens=n,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert res.choices[0].text == expected
