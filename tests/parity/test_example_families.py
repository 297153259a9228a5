"""`make_example(family=...)` writes, for every family of statesvc/tools/families.py, the checkpoint
and tokenizer transformers would: transformers loads it as its own (no missing or unexpected
key; saved again, the same config.json, generation_config.json and tensor names), `pool init`
accepts it and its adapter, and our model's logits on it are transformers + PEFT's. The chat
template of each family, rendered by shared/text.py (the gateway's), is what transformers'
apply_chat_template renders, text and token ids, error messages included."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from jinja2.exceptions import TemplateError  # noqa: E402

from computed.model import lora  # noqa: E402
from computed.model.loader import load_model  # noqa: E402
from computed.model.runner import forward_full  # noqa: E402
from computed.residency.pool import MemoryPool, PoolSpec  # noqa: E402
from shared.modelconfig import MOE_FAMILIES, SLIDING, Architecture, read_architecture  # noqa: E402
from shared.text import TextCodec  # noqa: E402
from statesvc.tools.example import (  # noqa: E402
    FAMILIES,
    TRANSFORMERS_VERSION,
    AdapterSpec,
    ExampleAssets,
    example_adapters,
    lora_targets,
    make_example,
)
from testkit.inproc import call, init_pool, open_service  # noqa: E402
from tests.helpers import adapter_weights, one_torch_thread  # noqa: E402,F401 (autouse)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

RTOL = 1e-4  # of the logit scale, as tests/parity/test_families.py
PROMPT = 12  # tokens: longer than the examples' sliding window of 8

# What each family's example sets away from Llama's, as our reader sees it: the example
# exercises the family's options, not just its name.
EXERCISED: dict[str, Callable[[Architecture], bool]] = {
    "llama": lambda a: a.norm == "llama" and not a.sliding_window,
    "qwen2": lambda a: a.qkv_bias and a.layer_types == ("full_attention", SLIDING) and a.sliding_window == 8,
    "qwen3": lambda a: a.qk_norm == "head",
    "mistral": lambda a: a.layer_types == (SLIDING, SLIDING) and a.sliding_window == 8,
    "gemma2": lambda a: a.norm == "gemma" and a.layout == "sandwich" and a.tie_word_embeddings
    and a.attn_softcap == 2.0 and a.final_softcap == 1.0 and a.query_scale == 32 ** -0.5
    and a.layer_types == (SLIDING, "full_attention"),
    "gemma3_text": lambda a: a.qk_norm == "head" and a.local_rope is not None
    and a.layer_types == (SLIDING, "full_attention") and a.tie_word_embeddings,
    "olmo2": lambda a: a.layout == "post" and a.qk_norm == "full",
    "granite": lambda a: (a.embed_multiplier, a.residual_multiplier, a.logits_scaling) == (12.0, 0.22, 4.0)
    and a.query_scale == 1 / 16,
    "mixtral": lambda a: (a.num_experts, a.experts_per_tok, a.expert_size) == (4, 2, 128) and not a.dense_layers
    and a.layer_types == (SLIDING, SLIDING) and a.sliding_window == 8,
    "qwen3_moe": lambda a: (a.num_experts, a.experts_per_tok, a.expert_size) == (4, 2, 32) and not a.dense_layers
    and a.norm_topk and a.qk_norm == "head",
}


def adapter_of(family: str) -> AdapterSpec:
    """The family's example adapter on every module it serves LoRA on, of rank 2."""
    return next(a for a in example_adapters(family)
                if a.r == 2 and set(a.target_modules) == set(lora_targets(family)))


_BUILT: dict[str, ExampleAssets] = {}


@pytest.fixture(scope="module", params=list(FAMILIES))
def example_of(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ExampleAssets:
    name = request.param
    if name not in _BUILT:
        _BUILT[name] = make_example(tmp_path_factory.mktemp(name), family=name, seed=1,
                                    adapters=(adapter_of(name),))
    return _BUILT[name]


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _names(path: Path) -> list[str]:
    with safe_open(str(path), "np") as f:
        return sorted(f.keys())


def test_example_loads_in_transformers_pool_init_and_our_model(example_of: ExampleAssets, tmp_path: Path) -> None:
    ex = example_of
    family, adapter = ex.family, ex.adapters[0]
    cfg = _json(ex.model_dir / "config.json")
    assert cfg["model_type"] == family and cfg["architectures"] == [FAMILIES[family].architecture]
    assert EXERCISED[family](read_architecture(cfg)), family

    # transformers loads it as its own, and writes the same files back (a MoE's experts as
    # modeling_*.py writes them, a loop over the experts: tests/parity/test_families.py)
    moe = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ex.model_dir, output_loading_info=True, attn_implementation="eager", **moe)
    assert not any(info.values()), info
    model.save_pretrained(tmp_path / "resaved")
    again = _json(tmp_path / "resaved" / "config.json")
    assert again.pop("transformers_version") == transformers.__version__
    if family == "llama":  # written with the 4.x keys too, which transformers 5 drops
        for key in ("torch_dtype", "rope_theta", "rope_scaling"):
            cfg.pop(key)
    assert {**again, "transformers_version": TRANSFORMERS_VERSION} == cfg
    gen, gen_again = (_json(d / "generation_config.json") for d in (ex.model_dir, tmp_path / "resaved"))
    gen_again["transformers_version"] = TRANSFORMERS_VERSION
    assert gen == gen_again
    if isinstance(gen["eos_token_id"], list):  # not derived from config.json: the family's own
        own = {k: v for k, v in gen.items() if k != "transformers_version"}
        transformers.GenerationConfig(**own).save_pretrained(tmp_path / "own")
        assert {**_json(tmp_path / "own" / "generation_config.json"),
                "transformers_version": TRANSFORMERS_VERSION} == gen
    assert _names(tmp_path / "resaved" / "model.safetensors") == _names(ex.model_dir / "model.safetensors")

    # pool init takes the checkpoint, and a load takes its adapter
    service = open_service(tmp_path / "data")
    init_pool(service, ex.model_dir, max_rank=adapter.r)
    call(service, "load", name=adapter.name, path=str(ex.adapter_dirs[adapter.name]), pin=False,
         replace=False, expect_head=None)

    # our logits, base and adapter, are transformers + PEFT's
    ref = peft.PeftModel.from_pretrained(model, ex.adapter_dirs[adapter.name], adapter_name=adapter.name).eval()
    tokens = np.random.default_rng(3).integers(0, cfg["vocab_size"], (2, PROMPT))
    with torch.no_grad():
        want = ref(torch.tensor(tokens), adapter_names=["__base__", adapter.name]).logits.float().numpy()
    config, params = load_model(ex.model_dir)
    assert config.model_type == family
    pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims, slots=2,
                               max_rank=adapter.r, dtype="float32"))
    assert pool.write_slot(1, adapter_weights(ex.adapter_dirs[adapter.name], 1))
    got = np.asarray(forward_full(params, pool.arrays, tokens, [lora.BASE, 1]), np.float32)
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= RTOL * scale, family
    assert float(np.abs(want[1] - want[0]).max()) > 100 * RTOL * scale  # the adapter is in there
    # and it moves the next token: a random model whose tokens' own embeddings outweigh the blocks
    # predicts its input token back whatever the adapter (a demo of six equal outputs)
    top = want.argmax(-1)
    assert np.mean(top == tokens) < 0.5 and np.any(top[1] != top[0]), (family, top)


# --------------------------------------------------------------------------- chat templates

SYSTEM = {"role": "system", "content": "Be brief."}
USER, AGAIN = {"role": "user", "content": " Grüße 🎉 "}, {"role": "user", "content": "And now?"}
ANSWER = {"role": "assistant", "content": "<think>\nfirst\n</think>\n\nHello!"}
CHATS = {
    "user": [USER],
    "system": [SYSTEM, USER],
    "multi-turn": [USER, ANSWER, AGAIN],
    "system, multi-turn": [SYSTEM, USER, ANSWER, AGAIN],
    "roles out of turn": [USER, AGAIN],
    "a tool turn": [USER, {"role": "tool", "content": "42"}],
}
# where a family's template refuses a chat (raise_exception), as the family's does
REFUSED = {
    "gemma2": {"system": "System role not supported",
               "system, multi-turn": "System role not supported",
               "roles out of turn": "Conversation roles must alternate"},
    "gemma3_text": {"roles out of turn": "Conversation roles must alternate"},
    # a tool turn is Mistral's [TOOL_RESULTS] (docs/structured-outputs.md, "Tool calls")
    "mistral": {"roles out of turn": "conversation roles must alternate"},
}
# what generation_config.json's eos_token_id lists after eos, as the family's checkpoints do
# (Gemma 2 and 3: [1, 107] and [1, 106]; Qwen2.5, Qwen3 and Qwen3-MoE: [151645, 151643])
ALSO_EOS = {"gemma2": ["<end_of_turn>"], "gemma3_text": ["<end_of_turn>"],
            **{f: ["<|endoftext|>"] for f in ("qwen2", "qwen3", "qwen3_moe")}}
# the family's own marks, in the rendering of [SYSTEM, USER] (Gemma 2: of [USER])
MARKS = {
    "llama": "<s><|system|>\nBe brief.</s>\n",
    "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n",
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n",
    "mistral": "<s>[INST] Be brief.\n\n Grüße 🎉  [/INST]",
    "gemma2": "<bos><start_of_turn>user\nGrüße 🎉<end_of_turn>\n<start_of_turn>model\n",
    "gemma3_text": "<bos><start_of_turn>user\nBe brief.\n\nGrüße 🎉<end_of_turn>\n<start_of_turn>model\n",
    "olmo2": "<|endoftext|><|system|>\nBe brief.\n<|user|>\n",
    "granite": "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n",
}


def _render(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except TemplateError as exc:
        return ("refused", str(exc))


def test_chat_template_renders_as_transformers(example_of: ExampleAssets) -> None:
    ex = example_of
    tok = transformers.AutoTokenizer.from_pretrained(ex.model_dir)
    codec = TextCodec.load(ex.model_dir)
    cfg, gen = _json(ex.model_dir / "config.json"), _json(ex.model_dir / "generation_config.json")
    # the ids config.json and generation_config.json name are the tokenizer's
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert (gen.get("bos_token_id"), eos[0]) == (tok.bos_token_id, tok.eos_token_id)
    # then the tokens that end a turn, as the family's checkpoints list them; the gateway
    # stops on each
    assert tok.convert_ids_to_tokens(eos[1:]) == ALSO_EOS.get(ex.family, [])
    assert codec.eos_token_id == tok.eos_token_id and codec.eos_token_ids == set(eos)
    # a family with another's tokenizer renders as that one (Mixtral as Mistral, Qwen3-MoE as Qwen3)
    own = next(f for f in FAMILIES if FAMILIES[f].tokenizer is FAMILIES[ex.family].tokenizer)
    refused = REFUSED.get(own, {})
    for name, chat in CHATS.items():
        want = _render(lambda: tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        got = _render(lambda: codec.render_chat(chat))
        if ex.family == "granite" and got != want:  # today's date in it: midnight may have passed
            got = _render(lambda: codec.render_chat(chat))
        assert got == want, (ex.family, name)
        if name in refused:
            assert isinstance(got, tuple) and refused[name] in got[1], (ex.family, name, got)
            continue
        assert isinstance(got, str), (ex.family, name, got)
        ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert codec.encode_chat(chat) == ids, (ex.family, name)
    shown = codec.render_chat([USER] if ex.family == "gemma2" else [SYSTEM, USER])
    assert MARKS[own] in shown, shown
    if ex.family == "qwen2":  # Qwen2.5's default system turn when the chat has none
        assert codec.render_chat([USER]).startswith(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")
    if ex.family == "granite":  # a default system turn with today's date (strftime_now)
        assert "Today's Date: " in codec.render_chat([USER])
    for text in ("Hello, world!", "12345 apples", "<s> and <|im_start|> are special, </s> too"):
        assert codec.encode(text) == tok(text).input_ids, (ex.family, text)


# A template that uses what transformers' environment adds to jinja2's: loop controls, a
# {% generation %} block, tojson without HTML escaping, dict, namespace, strftime_now, and
# the named special tokens (pad_token, unk_token) as variables.
FEATURES = """\
{%- set ns = namespace(n=0) %}
{%- for message in messages %}
{%- if message['role'] == 'stop' %}{% break %}{% endif %}
{%- if message['role'] == 'skip' %}{% continue %}{% endif %}
{%- set ns.n = ns.n + 1 %}
{{- message['role'] | upper }}: {% generation %}{{ message['content'] }}{% endgeneration %}
{{ dict(role=message['role'], n=ns.n) | tojson }}
{% endfor %}
{{- 'pad=' + (pad_token if pad_token is defined else '-') + ' unk=' + (unk_token if unk_token is defined else '-') }}
{{- ' year=' + strftime_now('%Y') }}
{%- if add_generation_prompt %} >{% endif %}
"""


def test_template_environment_is_transformers(tmp_path: Path) -> None:
    ex = make_example(tmp_path, family="gemma2", adapters=())  # a pad and an unk token
    tok = transformers.AutoTokenizer.from_pretrained(ex.model_dir)
    codec = TextCodec.load(ex.model_dir)
    codec.chat_template = FEATURES
    chat = [{"role": "user", "content": "<b>&'\"</b> 🎉"}, {"role": "skip", "content": "no"},
            {"role": "assistant", "content": "yes", "name": None}, {"role": "stop", "content": ""},
            {"role": "user", "content": "never"}]
    want = tok.apply_chat_template(chat, chat_template=FEATURES, tokenize=False, add_generation_prompt=True)
    got = codec.render_chat(chat)
    assert got == want
    assert '{"role": "user", "n": 1}' in got and "never" not in got and "<b>&'\"</b>" in got
    bad = "{% set ns = namespace(_secret=1) %}x"
    codec.chat_template = bad
    with pytest.raises(Exception) as ours:
        codec.render_chat(chat)
    with pytest.raises(Exception) as theirs:
        tok.apply_chat_template(chat, chat_template=bad, tokenize=False)
    assert type(ours.value).__name__ == type(theirs.value).__name__ == "SecurityError"
