"""A request ends on every id the checkpoint names as eos, as transformers' generate and vLLM end
it: the tokenizer's eos and each id of the `eos_token_id` of config.json and of
generation_config.json (an id or a list; Gemma's lists <eos> and <end_of_turn>). Real
statesvc, replica and gateway (subprocesses) on a Gemma 2 example whose generation_config.json
also lists a token the model generates greedily for the chat: the answer stops there, where
transformers' generate stops."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from shared.client import ControlClient
from shared.replica_protocol import GENERATE, generate_args
from shared.text import TextCodec
from statesvc.tools.example import ExampleAssets, make_example
from testkit.fleet import Computed
from tests.helpers import Fleet, one_torch_thread  # noqa: F401 (autouse)

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(600)
NEW = 12
MESSAGES: list[Any] = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Computed]]:
    tmp = tmp_path_factory.mktemp("eos")
    example = make_example(tmp / "example", family="gemma2", adapters=())
    fleet = Fleet(tmp, example)
    try:
        replica = fleet.serving()
        yield fleet, replica
    finally:
        fleet.stop()


def greedy(replica: Computed, ids: list[int]) -> list[int]:
    """The replica's greedy answer of NEW tokens, no stop token asked for."""
    with ControlClient(replica.listen, timeout_s=300, retries=0) as c:
        out = c.call(GENERATE, generate_args(ids, max_new_tokens=NEW))["output_ids"]
    assert len(out) == NEW
    return list(out)


def test_an_id_only_generation_config_lists_ends_the_answer(
        fleet: tuple[Fleet, Computed]) -> None:
    fl, replica = fleet
    example: ExampleAssets = fl.example
    model = example.model_dir
    codec = TextCodec.load(model)
    gen_path = model / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    # the example lists Gemma's <eos> and <end_of_turn>, as Gemma's checkpoints do
    end_of_turn = codec.tokenizer.token_to_id("<end_of_turn>")
    assert gen["eos_token_id"] == [codec.eos_token_id, end_of_turn]
    assert json.loads((model / "config.json").read_text())["eos_token_id"] == codec.eos_token_id

    ids = codec.encode_chat(MESSAGES)
    out = greedy(replica, ids)
    assert not set(out) & set(gen["eos_token_id"]), out  # the random model never ends a turn
    # a token new to the answer at k (so nothing before k ends it), with text before it
    k = next(i for i in range(1, NEW) if out[i] not in out[:i] and codec.decode(out[:i]))
    gen_path.write_text(json.dumps({**gen, "eos_token_id": [*gen["eos_token_id"], out[k]]}))

    # transformers' generate, which reads the same file, ends there too
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager")
    with torch.no_grad():
        seq = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    assert seq[0, len(ids):].tolist() == out[:k + 1]

    gateway = fl.gateway()  # reads generation_config.json at start
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    res = client.chat.completions.create(model=model.name, messages=MESSAGES,
                                         max_tokens=NEW, temperature=0)
    # ended at that token, which counts in usage but is not in the text
    assert res.choices[0].finish_reason == "stop"
    assert res.choices[0].message.content == codec.decode(out[:k])
    assert res.usage is not None and res.usage.completion_tokens == k + 1
    chunks = list(client.chat.completions.create(model=model.name, messages=MESSAGES,
                                                 max_tokens=NEW, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == codec.decode(out[:k])
    assert chunks[-1].choices[0].finish_reason == "stop"
    # ignore_eos turns every eos id off: the whole greedy answer
    res = client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=NEW,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert (res.choices[0].message.content, res.choices[0].finish_reason) \
        == (codec.decode(out), "length")
    # and a request's stop_token_ids still add to the model's: the earlier of the two ends it
    res = client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=NEW,
                                         temperature=0, extra_body={"stop_token_ids": [out[0]]})
    assert (res.choices[0].message.content, res.choices[0].finish_reason) == ("", "stop")
    assert res.usage is not None and res.usage.completion_tokens == 1
