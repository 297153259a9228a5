"""n, best_of, the sampling parameters and the refusal of unsupported fields (issue 49), with the
official `openai` client against a real gateway, statesvc and replica (subprocesses): greedy
choices forked from one prefill equal the single choice, seeded choices repeat, streamed chunks
carry each choice's index, usage counts every choice, repetition_penalty and min_tokens equal
transformers' generate, and every field the gateway does not take is a 400 naming it."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator

import httpx
import pytest

from statesvc.tools.example import ExampleAssets
from testkit.fleet import Gateway
from tests.helpers import Fleet

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(600)
PROMPT = "The capital of France is"
NEW = 8


class Setup:
    def __init__(self, fleet: Fleet, gateway: Gateway, example: ExampleAssets) -> None:
        import transformers
        self.gateway, self.base = gateway, example.model_dir.name
        self.client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=300)
        self.tok = transformers.AutoTokenizer.from_pretrained(str(example.model_dir))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(example.model_dir), dtype=torch.float32).eval()

    def complete(self, **kw: Any) -> Any:
        return self.client.completions.create(model=self.base, prompt=PROMPT, max_tokens=NEW, **kw)

    def refused(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The error of a 400 answer to `body` (the base model's, with a prompt or messages)."""
        base: dict[str, Any] = {"model": self.base}
        base.update({"prompt": PROMPT} if path == "/v1/completions" else
                    {"messages": [{"role": "user", "content": "hi"}]})
        r = httpx.post(self.gateway.url + path, json={**base, **body}, timeout=60)
        assert r.status_code == 400, (body, r.status_code, r.text)
        error: dict[str, Any] = r.json()["error"]
        return error


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, example: ExampleAssets) -> Iterator[Setup]:
    fleet = Fleet(tmp_path_factory.mktemp("choices"), example)
    try:
        fleet.serving()
        yield Setup(fleet, fleet.gateway(), example)
    finally:
        fleet.stop()


def test_greedy_choices_are_the_single_choice_forked(setup: Setup) -> None:
    one = setup.complete(temperature=0)
    two = setup.complete(temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2
    assert [c.finish_reason for c in two.choices] == [one.choices[0].finish_reason] * 2
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    single = setup.client.chat.completions.create(model=setup.base, messages=chat,  # type: ignore[arg-type]
                                                  max_tokens=NEW, temperature=0)
    three = setup.client.chat.completions.create(model=setup.base, messages=chat,  # type: ignore[arg-type]
                                                 max_tokens=NEW, temperature=0, n=3)
    assert [c.message.content for c in three.choices] == [single.choices[0].message.content] * 3
    assert three.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_seeded_choices_repeat_and_differ_from_each_other(setup: Setup) -> None:
    first = setup.complete(temperature=1.0, seed=7, n=3)
    again = setup.complete(temperature=1.0, seed=7, n=3)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1  # each choice has its own seed stream
    # choice 0 draws from the request's seed as a single choice does
    assert setup.complete(temperature=1.0, seed=7).choices[0].text == texts[0]
    assert [c.text for c in setup.complete(temperature=1.0, seed=8, n=3).choices] != texts


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_choices_carry_their_index(setup: Setup, chat: bool) -> None:
    kw: dict[str, Any] = {"model": setup.base, "max_tokens": NEW, "temperature": 1.0, "seed": 3,
                          "n": 2, "stream_options": {"include_usage": True}}
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    if chat:
        whole = setup.client.chat.completions.create(messages=messages, **kw)  # type: ignore[arg-type]
        chunks = list(setup.client.chat.completions.create(messages=messages, stream=True, **kw))  # type: ignore[arg-type]
        want = [c.message.content for c in whole.choices]
    else:
        whole = setup.client.completions.create(prompt=PROMPT, **kw)
        chunks = list(setup.client.completions.create(prompt=PROMPT, stream=True, **kw))
        want = [c.text for c in whole.choices]
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == want and set(texts) == {0, 1}
    assert finishes == {i: c.finish_reason for i, c in enumerate(whole.choices)}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_the_likeliest_of_its_choices(setup: Setup) -> None:
    every = [c.text for c in setup.complete(temperature=1.0, seed=11, n=4).choices]
    best = setup.complete(temperature=1.0, seed=11, n=1, best_of=4)
    assert len(best.choices) == 1 and best.choices[0].text in every
    two = setup.complete(temperature=1.0, seed=11, n=2, best_of=4)
    assert len({c.text for c in two.choices} & set(every)) == len({c.text for c in two.choices})
    assert two.choices[0].text == best.choices[0].text  # the likeliest first


def test_repetition_penalty_and_min_tokens_equal_transformers(setup: Setup) -> None:
    ids = setup.tok(PROMPT).input_ids
    with torch.no_grad():
        ref = setup.hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW, repetition_penalty=1.8,
                                pad_token_id=setup.tok.eos_token_id)[0, len(ids):].tolist()
    plain = setup.hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                              min_new_tokens=NEW, pad_token_id=setup.tok.eos_token_id)
    assert plain[0, len(ids):].tolist() != ref  # the penalty changes the greedy output
    got = setup.complete(temperature=0, extra_body={"repetition_penalty": 1.8, "min_tokens": NEW})
    assert got.choices[0].text == setup.tok.decode(ref, skip_special_tokens=True)
    assert got.usage.completion_tokens == NEW


def test_logit_bias_and_top_k_steer_the_output(setup: Setup) -> None:
    token = setup.tok(" Paris").input_ids[-1]
    got = setup.complete(temperature=0, logit_bias={str(token): 100})
    assert got.choices[0].text == setup.tok.decode([token] * NEW)
    # top_k 1 at any temperature is greedy
    greedy = setup.complete(temperature=0).choices[0].text
    assert setup.complete(temperature=1.5, seed=5, extra_body={"top_k": 1}).choices[0].text == greedy
    sampled = setup.complete(temperature=1.5, seed=5, presence_penalty=1.0, frequency_penalty=0.5,
                             extra_body={"min_p": 0.05})
    assert sampled.usage.completion_tokens >= 1


def test_fields_openai_clients_send_keep_working(setup: Setup) -> None:
    res = setup.complete(temperature=0, n=1, user="someone", logprobs=None, stream=False)
    assert res.choices[0].text
    chat = setup.client.chat.completions.create(
        model=setup.base, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        user="someone", logprobs=False, n=1, stream=True, stream_options={"include_usage": True})
    assert list(chat)[-1].usage.completion_tokens >= 1


def test_a_field_the_gateway_does_not_take_is_refused_by_name(setup: Setup) -> None:
    for path, field in (("/v1/completions", "suffix"), ("/v1/completions", "frobnicate"),
                        ("/v1/chat/completions", "best_of"), ("/v1/chat/completions", "echo"),
                        ("/v1/chat/completions", "prompt")):
        error = setup.refused(path, {field: 1})
        assert (error["param"], error["code"]) == (field, "unsupported_parameter"), error
    with pytest.raises(openai.BadRequestError) as info:
        setup.complete(extra_body={"mirostat_tau": 5.0})
    assert info.value.body["param"] == "mirostat_tau"  # type: ignore[index]


@pytest.mark.parametrize("body,param", [
    ({"top_k": -2}, "top_k"), ({"top_k": 10**6}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"), ({"logit_bias": {str(10**6): 1}}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"min_tokens": 17}, "min_tokens"),
    ({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"), ({"n": 200}, "n"),
])
def test_bad_values_are_refused_naming_the_field(setup: Setup, body: dict[str, Any],
                                                 param: str) -> None:
    error = setup.refused("/v1/completions", body)
    assert error["param"] == param, error
