"""logprobs and echo through the official `openai` client against a real fleet (statesvc, one
replica and the gateway as subprocesses), equal to transformers + PEFT's log_softmax in float32:
the base model and adapters, one at a time and in mixed batches, streamed and not, with the prefix
cache on and prompts prefilled in 16-token chunks; on the native kernels, on XLA and on a
2-device tensor-parallel replica."""
from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from statesvc.tools.example import ExampleAssets
from tests.helpers import Fleet, xla_flags

pytest.importorskip("torch")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")
from tests.helpers import HFReference  # noqa: E402

pytestmark = pytest.mark.timeout(900)
ADAPTERS = {"chat": "attn-qv-r8", "code": "all-r2"}
TOL = 2e-3
NEW = 4
BACKENDS = {
    "native": {},
    "xla": {"LORAPLANE_LORA_KERNEL": "xla"},
    "tp2": {"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")},
}
# long enough for three 16-token chunks of prefill (--prefill-chunk 16)
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps"


class Setup:
    def __init__(self, fleet: Fleet, url: str, example: ExampleAssets, ref: HFReference) -> None:
        import transformers
        self.example, self.ref = example, ref
        self.base = example.model_dir.name
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.tok = transformers.AutoTokenizer.from_pretrained(str(example.model_dir))

    def adapter_dir(self, model: str) -> Path | None:
        return None if model == self.base else self.example.adapter_dirs[ADAPTERS[model]]

    def expected(self, model: str, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """(transformers' greedy tokens, log_softmax after each token of prompt + them)."""
        out = self.ref.greedy(self.adapter_dir(model), prompt, n)
        return out, self.ref.log_softmax(self.adapter_dir(model), prompt + out)


@pytest.fixture(scope="module")
def reference(example: ExampleAssets) -> HFReference:
    return HFReference(example.model_dir)


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          example: ExampleAssets, reference: HFReference) -> Iterator[Setup]:
    backend = request.param
    fleet = Fleet(tmp_path_factory.mktemp(f"logprobs-{backend}"), example)
    try:
        tp = ("--tensor-parallel", "2") if backend == "tp2" else ()
        # --no-warmup, as the other fleets' replicas (tests/helpers.py): each forward compiles when a
        # request first needs it, so only what these requests run compiles (docs/testing.md)
        fleet.serving(ADAPTERS, args=("--no-warmup", "--max-batch", "4", "--max-len", "64", "--prefill-chunk", "16",
                                      *tp), env=BACKENDS[backend], warm=True)
        yield Setup(fleet, fleet.gateway().url, example, reference)
    finally:
        fleet.stop()


def check_top(top: dict[str, float] | list[float], row: np.ndarray, k: int) -> None:
    """The top logprobs the gateway answered are the k largest of transformers' row (by value: two
    tokens may share a text, and the dict keeps the likelier)."""
    want = np.sort(row)[::-1][:k]
    got = sorted(top.values() if isinstance(top, dict) else top, reverse=True)
    if isinstance(top, dict):
        assert 1 <= len(got) <= k and all(np.abs(want - v).min() < TOL for v in got), (got, want)
    else:
        assert np.allclose(got, want, atol=TOL), (got, want)
    assert abs(got[0] - want[0]) < TOL


def check_completion(s: Setup, model: str, prompt: list[int], lp: Any, k: int, *, echo: bool,
                     new: int = NEW) -> None:
    out, lsm = s.expected(model, prompt, new)
    full = prompt + out
    first = 0 if echo else len(prompt)
    assert len(lp.token_logprobs) == len(full) - first
    assert lp.tokens == [s.tok.decode([t]) for t in full[first:]]
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs), first):
        if i == 0:
            assert value is None and top is None  # the first prompt token has no logprob
            continue
        assert abs(value - lsm[i - 1, full[i]]) < TOL, (model, i, value, lsm[i - 1, full[i]])
        if k:
            check_top(top, lsm[i - 1], k)


def completion(s: Setup, model: str, prompt: list[int], **kw: Any) -> Any:
    return s.client.completions.create(model=model, prompt=prompt, temperature=0, extra_body={"ignore_eos": True},
                                       **kw)


@pytest.mark.parametrize("model", ["BASE", "chat", "code"])
def test_echo_logprobs_equal_transformers_one_at_a_time(setup: Setup, model: str) -> None:
    model = model.replace("BASE", setup.base)
    prompt = setup.tok(TEXT).input_ids
    assert len(prompt) > 32
    # the prompt's blocks in the prefix cache first: echo still gets every prompt position
    completion(setup, model, prompt, max_tokens=1)
    res = completion(setup, model, prompt, max_tokens=NEW, logprobs=5, echo=True)
    choice = res.choices[0]
    out, _ = setup.expected(model, prompt, NEW)
    assert choice.text == setup.tok.decode(prompt + out, skip_special_tokens=True)
    check_completion(setup, model, prompt, choice.logprobs, 5, echo=True)
    plain = completion(setup, model, prompt, max_tokens=NEW, logprobs=0)
    check_completion(setup, model, prompt, plain.choices[0].logprobs, 0, echo=False)
    assert all(t == {} for t in plain.choices[0].logprobs.top_logprobs)


def test_mixed_batch_of_adapters_with_and_without_logprobs(setup: Setup) -> None:
    """Requests for every adapter at once, some asking for logprobs, some echo, some neither: each
    gets its own, and the ones that did not ask get none."""
    words = TEXT.split()
    jobs = [(model, setup.tok(" ".join(words[i:i + 6 + 3 * i])).input_ids, kind)
            for i, (model, kind) in enumerate([(setup.base, "echo"), ("chat", "echo"), ("code", "plain"),
                                               ("chat", "none"), ("code", "echo"), (setup.base, "plain")])]

    def run(job: tuple[str, list[int], str]) -> Any:
        model, prompt, kind = job
        kw: dict[str, Any] = {} if kind == "none" else {"logprobs": 3, "echo": kind == "echo"}
        return completion(setup, model, prompt, max_tokens=NEW, **kw)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(run, jobs))
    for (model, prompt, kind), res in zip(jobs, answers):
        lp = res.choices[0].logprobs
        if kind == "none":
            assert lp is None
            continue
        check_completion(setup, model, prompt, lp, 3, echo=kind == "echo")


def test_echo_with_max_tokens_0_answers_the_prompt_alone(setup: Setup) -> None:
    """What lm-eval's loglikelihood may send: the prompt's logprobs, no generated token."""
    prompt = setup.tok(TEXT[:60]).input_ids
    res = completion(setup, "code", prompt, max_tokens=0, logprobs=1, echo=True)
    _, lsm = setup.expected("code", prompt, 0)
    lp = res.choices[0].logprobs
    assert res.usage.completion_tokens == 0 and len(lp.tokens) == len(prompt)
    assert lp.token_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:], [lsm[i - 1, prompt[i]] for i in range(1, len(prompt))], atol=TOL)
    assert res.choices[0].text == setup.tok.decode(prompt, skip_special_tokens=True)


def test_streamed_logprobs_equal_the_whole_answers(setup: Setup) -> None:
    prompt = setup.tok(TEXT[:80]).input_ids
    whole = completion(setup, "chat", prompt, max_tokens=NEW, logprobs=2, echo=True).choices[0].logprobs
    chunks = [c for c in completion(setup, "chat", prompt, max_tokens=NEW, logprobs=2, echo=True, stream=True)
              if c.choices and c.choices[0].logprobs is not None]
    got = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert [c for c in got if c is None] == [None] and got[0] is None
    assert np.allclose(got[1:], whole.token_logprobs[1:], atol=1e-6)
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == whole.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == whole.text_offset
    # the prompt alone, streamed: one chunk with its text and logprobs, then the finish
    alone = list(completion(setup, "chat", prompt, max_tokens=0, logprobs=2, echo=True, stream=True))
    assert alone[0].choices[0].text == setup.tok.decode(prompt, skip_special_tokens=True)
    assert alone[0].choices[0].logprobs.token_logprobs == whole.token_logprobs[:len(prompt)]
    assert "".join(c.choices[0].text for c in alone if c.choices) == alone[0].choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_transformers(setup: Setup, stream: bool) -> None:
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = setup.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    kw: dict[str, Any] = dict(model="code", messages=messages, max_tokens=NEW, temperature=0, logprobs=True,
                              top_logprobs=3, extra_body={"ignore_eos": True})
    if stream:
        content = [e for c in setup.client.chat.completions.create(stream=True, **kw)
                   if c.choices and c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    else:
        content = setup.client.chat.completions.create(**kw).choices[0].logprobs.content
    out, lsm = setup.expected("code", ids, NEW)
    assert [e.token for e in content] == [setup.tok.decode([t]) for t in out]
    for i, (e, t) in enumerate(zip(content, out)):
        row = lsm[len(ids) - 1 + i]
        assert abs(e.logprob - row[t]) < TOL
        assert e.bytes == list(e.token.encode("utf-8"))
        check_top([x.logprob for x in e.top_logprobs], row, 3)


def test_logprobs_out_of_range_are_refused_naming_the_field(setup: Setup) -> None:
    for kw, field in (({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            setup.client.completions.create(model=setup.base, prompt="hi", **kw)
        assert err.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as err:
        setup.client.chat.completions.create(model=setup.base, messages=[{"role": "user", "content": "hi"}],
                                             top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
