"""The JAX Llama with multi-LoRA gives what transformers + PEFT give, through its KV cache too.

References are Hugging Face transformers and PEFT on the same checkpoint and
adapter files (float32, eager attention). Each case checks the logits of every
step within 1e-4 of the logit scale (max |ours - ref| <= 1e-4 * max |ref|) and
the greedy continuation token for token: for single requests (prefill, then
decode through the cache) and for a continuous batch where rows use different
adapters or the base model, have different prompt lengths and buckets, join
late and finish early. Two checkpoints: the example one (GQA, untied, explicit
head_dim) and one with tied embeddings, llama3 rope scaling, full multi-head
attention, a head_dim that is not hidden/heads, and an rsLoRA adapter.
"""
from __future__ import annotations

import json
from functools import partial
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from computed.model import lora  # noqa: E402
from computed.backend import NativeBackend, XlaBackend, native, select  # noqa: E402
from computed.backend.native import attention_kernel, dense_matmuls, lora_sgmv  # noqa: E402
from computed.model.config import DecoderConfig  # noqa: E402
from computed.model.kv_cache import KV_BLOCK, KVCache  # noqa: E402
from computed.model.loader import load_model, with_layout  # noqa: E402
from computed.model.packed import PackedWeight, pack, unpack  # noqa: E402
from computed.model.params import DecoderParams  # noqa: E402
from computed.model.runner import (Runner, decode, forward_full, init_cache, prefill,  # noqa: E402
                                   prefill_batch)
from computed.residency.pool import MemoryPool, PoolSpec, SlotWeights  # noqa: E402
from shared.projections import ATTN_MODULES, MODULES  # noqa: E402
from statesvc.tools.example import (  # noqa: E402
    AdapterSpec,
    ExampleAssets,
    ModelShape,
    make_example,
    model_config,
)
from testkit.jaxcount import counting_compiles  # noqa: E402
from tests.helpers import adapter_weights, one_torch_thread  # noqa: E402,F401 (autouse)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' own deprecations

RTOL = 1e-4        # of the logit scale, float32
BF16_RTOL = 5e-2   # bfloat16 weights and activations against the float32 reference
NEW_TOKENS = 8
BUCKETS = (16, 32, 64)
MAX_BATCH = 6
MAX_LEN = 64

OTHER_SHAPE = ModelShape(
    vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True,
    rope_theta=500000.0, rms_norm_eps=1e-6,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
OTHER_ADAPTERS = (
    AdapterSpec("rslora-all-r8", r=8, lora_alpha=16, target_modules=MODULES, use_rslora=True),
    AdapterSpec("attn-r4", r=4, lora_alpha=8, target_modules=ATTN_MODULES),
)


def bucket(n: int) -> int:
    return next(b for b in BUCKETS if b >= n)


def padded(prompt: list[int]) -> np.ndarray:
    out = np.zeros(bucket(len(prompt)), np.int32)
    out[:len(prompt)] = prompt
    return out


def close(ours: Any, ref: np.ndarray, rtol: float = RTOL) -> float:
    """Assert max |ours - ref| <= rtol * max |ref|; return the ratio for the message."""
    ours = np.asarray(ours, np.float32)
    diff = float(np.abs(ours - ref).max()) / float(np.abs(ref).max())
    assert diff <= rtol, f"logits differ by {diff:.2e} of the logit scale (limit {rtol:.0e})"
    return diff


# --------------------------------------------------------------------------- fixtures


class Reference:
    """transformers + PEFT with every adapter of a checkpoint loaded; greedy decoding."""

    def __init__(self, assets: ExampleAssets, dtype: str = "float32") -> None:
        from peft import PeftModel
        from transformers import LlamaForCausalLM

        base = LlamaForCausalLM.from_pretrained(assets.model_dir, dtype=getattr(torch, dtype),
                                                attn_implementation="eager")
        names = [a.name for a in assets.adapters]
        model = PeftModel.from_pretrained(base, assets.adapter_dirs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(assets.adapter_dirs[name], adapter_name=name)
        self.model = model.eval()
        self._cache: dict[tuple[tuple[int, ...], str | None], tuple[list[int], np.ndarray]] = {}

    def logits(self, tokens: np.ndarray, adapters: list[str | None]) -> np.ndarray:
        """[B, T, vocab] with PEFT's mixed-batch inference (None: the base model)."""
        names = ["__base__" if a is None else a for a in adapters]
        with torch.no_grad():
            return self.model(torch.tensor(np.asarray(tokens), dtype=torch.long),
                              adapter_names=names).logits.float().numpy()

    def greedy(self, prompt: list[int], adapter: str | None) -> tuple[list[int], np.ndarray]:
        """NEW_TOKENS greedy tokens and the logits [NEW_TOKENS, vocab] each was chosen from."""
        key = (tuple(prompt), adapter)
        if key not in self._cache:
            seq, steps = list(prompt), []
            for _ in range(NEW_TOKENS):
                last = self.logits(np.array([seq]), [adapter])[0, -1]
                steps.append(last)
                seq.append(int(np.argmax(last)))
            self._cache[key] = (seq[len(prompt):], np.stack(steps))
        return self._cache[key]


@dataclass
class Setup:
    assets: ExampleAssets
    config: DecoderConfig
    params: DecoderParams
    pool: MemoryPool
    slots: dict[str, int]            # adapter name -> pool slot
    ref: Reference
    xla_params: DecoderParams | None = None

    def unpacked(self) -> DecoderParams:
        """The parameters as a replica without the native kernels holds them: [in, out], for XLA."""
        if self.xla_params is None:
            self.xla_params = with_layout(self.params, XlaBackend())
        return self.xla_params

    def slot(self, adapter: str | None) -> int:
        return lora.BASE if adapter is None else self.slots[adapter]


def fill_pool(assets: ExampleAssets, config: DecoderConfig, dtype: str = "float32") -> tuple[MemoryPool, dict[str, int]]:
    """A pool with every adapter of `assets`, written as a replica writes them."""
    spec = PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                    slots=len(assets.adapters) + 2, max_rank=32, dtype=dtype)
    pool, slots = MemoryPool(spec), {}
    for i, spec_ in enumerate(assets.adapters):
        slot = i + 1  # leave slot 0 empty: a base row must not pick up slot 0's weights
        assert pool.write_slot(slot, adapter_weights(assets.adapter_dirs[spec_.name], i + 1))
        slots[spec_.name] = slot
    return pool, slots


def make_setup(assets: ExampleAssets) -> Setup:
    config, params = load_model(assets.model_dir)
    pool, slots = fill_pool(assets, config)
    return Setup(assets, config, params, pool, slots, Reference(assets))


@pytest.fixture(scope="module")
def example_setup(example: ExampleAssets) -> Setup:
    return make_setup(example)


@pytest.fixture(scope="module")
def other_assets(tmp_path_factory: pytest.TempPathFactory) -> ExampleAssets:
    return make_example(tmp_path_factory.mktemp("other"), seed=3, shape=OTHER_SHAPE, adapters=OTHER_ADAPTERS)


@pytest.fixture(scope="module")
def other_setup(other_assets: ExampleAssets) -> Setup:
    return make_setup(other_assets)


@pytest.fixture(scope="module", params=["example", "tied-llama3-mha"])
def setup(request: pytest.FixtureRequest) -> Setup:
    name = "example_setup" if request.param == "example" else "other_setup"
    return request.getfixturevalue(name)


def prompt_of(setup: Setup, seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, setup.config.vocab_size, length)]


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", ["native", "xla"])
def test_forward_full_matches_peft_mixed_batch(setup: Setup, backend: str) -> None:
    """Through the native LoRA kernel and through the XLA window loop."""
    adapters: list[str | None] = [None] + [a.name for a in setup.assets.adapters] + [None]
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, setup.config.vocab_size, (len(adapters), 11))
    ref = setup.ref.logits(tokens, adapters)
    params = setup.params if backend == "native" else setup.unpacked()
    ours = forward_full(params, setup.pool.arrays, tokens, [setup.slot(a) for a in adapters])
    close(ours, ref)
    # A LoRA term that is really there: base and adapter rows differ far beyond the tolerance.
    assert np.abs(ref[1] - setup.ref.logits(tokens[1:2], [None])[0]).max() > 100 * RTOL * np.abs(ref).max()


def test_single_requests_prefill_then_decode(setup: Setup) -> None:
    adapters: list[str | None] = [None] + [a.name for a in setup.assets.adapters]
    cache = init_cache(setup.config, MAX_BATCH, MAX_LEN)
    for n, adapter in enumerate(adapters):
        prompt = prompt_of(setup, n, 5 + 4 * n)
        want_tokens, want_logits = setup.ref.greedy(prompt, adapter)
        row, slot = n % MAX_BATCH, setup.slot(adapter)
        logits, cache = prefill(setup.params, setup.pool.arrays, cache, padded(prompt), len(prompt), row, slot)
        close(logits, want_logits[0])
        got = [int(np.argmax(logits))]
        active = np.arange(MAX_BATCH) == row
        for step in range(1, NEW_TOKENS):
            tokens = np.where(active, got[-1], 0)
            positions = np.where(active, len(prompt) + step - 1, 0)
            slots = np.where(active, slot, lora.BASE)
            logits, cache = decode(setup.params, setup.pool.arrays, cache, tokens, positions, slots, active)
            close(logits[row], want_logits[step])
            got.append(int(np.argmax(logits[row])))
        assert got == want_tokens, f"adapter {adapter}: greedy continuation differs"


@dataclass
class Request:
    adapter: str | None
    prompt: list[int]
    joins_at: int           # decode step at which it is prefilled
    row: int = -1
    out: list[int] | None = None
    checked: int = 0

    @property
    def done(self) -> bool:
        return self.out is not None and len(self.out) == NEW_TOKENS


@pytest.mark.parametrize("impl", ["kernels", "xla", "xla-blocked"])
def test_continuous_batch_of_mixed_adapters(setup: Setup, impl: str) -> None:
    """Decode through the native kernels (dense, LoRA and attention), and through XLA alone (unpacked
    weights, the LoRA window loop with each step's window, attention over length buckets), on K
    positions-minor as a replica without the kernels keeps it, and on the kernel's blocked K."""
    names = [a.name for a in setup.assets.adapters]
    params = setup.params if impl == "kernels" else setup.unpacked()
    requests = [
        Request(None, prompt_of(setup, 10, 5), joins_at=0),
        Request(names[0], prompt_of(setup, 11, 12), joins_at=0),
        Request(names[-1], prompt_of(setup, 12, 17), joins_at=0),        # bucket 32
        Request(names[0], prompt_of(setup, 13, 3), joins_at=0),          # shares a slot with row 1
        Request(names[1 % len(names)], prompt_of(setup, 14, 9), joins_at=3),   # joins mid-flight
        Request(None, prompt_of(setup, 15, 40), joins_at=2),              # bucket 64, base
        Request(names[-1], prompt_of(setup, 16, 6), joins_at=5),          # reuses a finished row
    ]
    cache = init_cache(setup.config, MAX_BATCH, MAX_LEN, blocked=impl != "xla")
    free = list(range(MAX_BATCH))
    running: list[Request] = []
    step = 0
    while any(not r.done for r in requests):
        for r in requests:
            if r.joins_at == step and r.out is None and free:
                r.row = free.pop(0)
                logits, cache = prefill(params, setup.pool.arrays, cache, padded(r.prompt),
                                        len(r.prompt), r.row, setup.slot(r.adapter))
                close(logits, setup.ref.greedy(r.prompt, r.adapter)[1][0])
                r.out = [int(np.argmax(logits))]
                running.append(r)
            elif r.joins_at == step and r.out is None:
                r.joins_at += 1  # no free row yet: wait
        tokens = np.zeros(MAX_BATCH, np.int32)
        positions = np.full(MAX_BATCH, MAX_LEN - 1, np.int32)  # inactive rows: anything
        slots = np.full(MAX_BATCH, 2, np.int32)                 # inactive rows: any slot
        active = np.zeros(MAX_BATCH, bool)
        for r in running:
            assert r.out is not None
            tokens[r.row], positions[r.row] = r.out[-1], len(r.prompt) + len(r.out) - 1
            slots[r.row], active[r.row] = setup.slot(r.adapter), True
        if active.any():
            window = (None if impl == "kernels" else
                      lora.choose_window(np.where(active, slots, lora.BASE), lora.loop_windows(MAX_BATCH)))
            longest = int(positions[active].max()) + 1
            logits, cache = decode(params, setup.pool.arrays, cache, tokens, positions, slots, active,
                                   attend_len=next(b for b in (16, 32, 64, MAX_LEN) if b >= longest),
                                   window=window)
            for r in running:
                assert r.out is not None
                close(logits[r.row], setup.ref.greedy(r.prompt, r.adapter)[1][len(r.out)])
                r.out.append(int(np.argmax(logits[r.row])))
                r.checked += 1
        for r in [r for r in running if r.done]:
            running.remove(r)
            free.append(r.row)
        step += 1
    for r in requests:
        assert r.out == setup.ref.greedy(r.prompt, r.adapter)[0], f"{r.adapter} row {r.row}: greedy differs"
        assert r.checked == NEW_TOKENS - 1


@pytest.mark.parametrize("impl", ["kernels", "xla", "runner"])
def test_batched_prefill_of_mixed_adapters_lengths_and_base(setup: Setup, impl: str) -> None:
    """One prefill forward holds prompts of different adapters, lengths and the base model, each
    into its own cache row (out of order, the forward padded with copies); every row's first
    logits, and the greedy continuation decoded from the cache it wrote, equal PEFT's. "runner":
    the engine's `Runner.prefill`, which groups prompts by length bucket and, here, splits a
    group over forwards of at most 64 tokens."""
    names = [a.name for a in setup.assets.adapters]
    adapters: list[str | None] = [names[0], None, names[-1], names[0], None, names[1 % len(names)]]
    lengths = [5, 12, 17, 3, 30, 9] if impl != "runner" else [5, 12, 40, 3, 9, 7]
    prompts = [prompt_of(setup, 30 + i, n) for i, n in enumerate(lengths)]
    rows = [4, 0, 2, 5, 1, 3]
    slots = [setup.slot(a) for a in adapters]
    params = setup.params if impl != "xla" else setup.unpacked()
    cache = init_cache(setup.config, MAX_BATCH, MAX_LEN, blocked=impl != "xla")
    if impl == "runner":
        runner = Runner(setup.config, params, max_batch=MAX_BATCH, max_len=MAX_LEN, prefill_tokens=64)
        assert runner.prefill_shapes == ((1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 64))
        first, cache = runner.prefill(setup.pool.arrays, cache, prompts, rows, slots)
    else:
        tokens = np.zeros((len(prompts), 32), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        first, cache = prefill_batch(params, setup.pool.arrays, cache, tokens, lengths, rows, slots, pad_to=8)
    want = [setup.ref.greedy(p, a) for p, a in zip(prompts, adapters)]
    assert np.asarray(first).shape == (len(prompts), setup.config.vocab_size)
    for i in range(len(prompts)):
        close(first[i], want[i][1][0])
    out = [[int(np.argmax(first[i]))] for i in range(len(prompts))]
    row_slots = np.zeros(MAX_BATCH, np.int32)
    row_slots[rows] = slots
    for step in range(1, NEW_TOKENS):
        tokens_ = np.zeros(MAX_BATCH, np.int32)
        positions = np.zeros(MAX_BATCH, np.int32)
        for i, r in enumerate(rows):
            tokens_[r], positions[r] = out[i][-1], lengths[i] + step - 1
        window = None if impl != "xla" else lora.choose_window(row_slots, lora.loop_windows(MAX_BATCH))
        logits, cache = decode(params, setup.pool.arrays, cache, tokens_, positions, row_slots,
                               np.ones(MAX_BATCH, bool), window=window)
        for i, r in enumerate(rows):
            close(logits[r], want[i][1][step])
            out[i].append(int(np.argmax(logits[r])))
    for i in range(len(prompts)):
        assert out[i] == want[i][0], f"{adapters[i]} row {rows[i]}: greedy differs from PEFT"


def k_blocks(k: np.ndarray) -> np.ndarray:
    """K [..., d, max_len] in the cache's layout [..., ceil(max_len / 16), d, 16] (KVCache), padded with NaN:
    a kernel that read past max_len would show it."""
    *lead, d, n = k.shape
    nb = -(-n // KV_BLOCK)
    padded = np.full((*lead, d, nb * KV_BLOCK), np.nan, k.dtype)
    padded[..., :n] = k
    return np.ascontiguousarray(np.moveaxis(padded.reshape(*lead, d, nb, KV_BLOCK), -2, -3))


def k_positions(k: np.ndarray, max_len: int) -> np.ndarray:
    """The cache's K back to [..., d, max_len]."""
    *lead, nb, d, c = k.shape
    return np.moveaxis(k, -3, -2).reshape(*lead, d, nb * c)[..., :max_len]


@pytest.mark.parametrize("groups,head_dim,max_len", [(2, 64, 256), (3, 80, 40), (1, 12, 37), (6, 8, 16)])
def test_the_attention_kernel_reads_each_rows_own_positions(groups: int, head_dim: int, max_len: int) -> None:
    """Against a float64 reference: the step's K and V written at each row's last position and
    nothing else touched; lengths from 1 to max_len (a partial last block, and one that ends at
    the row's end); inactive rows (length 0) write nothing and get zeros; other layers unread;
    head_dim with and without the vector path (multiples of 16), one query head left over from the
    pairs; scores far apart."""
    rng = np.random.default_rng(groups)
    layers, rows, kv = 3, 7, 2
    q = rng.standard_normal((rows, kv, groups, head_dim)).astype(np.float32)
    q[6] *= 40  # scores hundreds apart: weights far below float32's range must come out 0, not NaN
    k = rng.standard_normal((layers, rows, kv, head_dim, max_len)).astype(np.float32)
    v = rng.standard_normal((layers, rows, kv, max_len, head_dim)).astype(np.float32)
    lengths = np.array([1, max_len, 0, 17 % max_len + 1, max_len - 1, 5, max_len // 2], np.int32)
    k_new = rng.standard_normal((rows, kv, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((rows, kv, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    out, k_after, v_after = attention_kernel(jnp.asarray(q), jnp.asarray(k_blocks(k)), jnp.asarray(v),
                                             jnp.asarray(lengths), jnp.asarray(k_new), jnp.asarray(v_new), 1, scale)
    got, k_after, v_after = np.asarray(out), k_positions(np.asarray(k_after), max_len), np.asarray(v_after)
    for b, n in enumerate(lengths):  # the step's K and V land at position n - 1 of layer 1, nothing else moves
        if n:
            k[1, b, :, :, n - 1], v[1, b, :, n - 1] = k_new[b], v_new[b]
    np.testing.assert_array_equal(k_after, k)
    np.testing.assert_array_equal(v_after, v)
    for b, n in enumerate(lengths):
        for h in range(kv):
            if n == 0:
                np.testing.assert_array_equal(got[b, h], 0.0)
                continue
            scores = scale * q[b, h].astype(np.float64) @ k[1, b, h, :, :n]
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            want = (p / p.sum(axis=-1, keepdims=True)) @ v[1, b, h, :n]
            np.testing.assert_allclose(got[b, h], want, rtol=2e-5, atol=2e-6)


def test_inactive_rows_leave_the_cache_alone(example_setup: Setup) -> None:
    s = example_setup
    cache = init_cache(s.config, MAX_BATCH, MAX_LEN)
    prompt = prompt_of(s, 20, 10)
    _, cache = prefill(s.params, s.pool.arrays, cache, padded(prompt), len(prompt), 2, 1)
    before_k, before_v = np.array(cache.k), np.array(cache.v)
    active = np.zeros(MAX_BATCH, bool)
    _, cache = decode(s.params, s.pool.arrays, cache, np.arange(MAX_BATCH), np.full(MAX_BATCH, 3),
                      np.full(MAX_BATCH, 1), active)
    np.testing.assert_array_equal(np.array(cache.k), before_k)
    np.testing.assert_array_equal(np.array(cache.v), before_v)


def test_a_step_of_few_rows_computes_only_them(example_setup: Setup) -> None:
    """The runner runs a step whose active rows are few (2 of 8, with holes) over the smallest of
    the backend's `decode_rows` that holds them: its logits and cache are, bit for bit, those of
    the step over every row, and its inactive rows' logits are zero."""
    s = example_setup
    rows = 8  # the smallest batch the native backend splits into quarters
    runner = Runner(s.config, s.params, max_batch=rows, max_len=MAX_LEN)
    if runner.decode_rows == (rows,):
        pytest.skip("this backend computes every row of every step (decode_rows)")
    assert runner.decode_rows[0] < 3
    names = [a.name for a in s.assets.adapters]
    prompts = [prompt_of(s, 30 + i, 5 + i) for i in range(rows)]
    row_slots = [s.slot(names[i % len(names)]) if i % 3 else lora.BASE for i in range(rows)]
    _, cache = runner.prefill(s.pool.arrays, runner.new_cache(), prompts, list(range(rows)), row_slots)
    twin = jax.tree.map(jnp.copy, cache)
    active = np.isin(np.arange(rows), [1, 4])
    tokens = np.array([p[-1] for p in prompts], np.int32)
    positions = np.array([len(p) for p in prompts], np.int32)
    slots = np.array(row_slots, np.int32)
    few, cache = runner.decode(s.pool.arrays, cache, tokens, positions, slots, active)
    every, twin = decode(s.params, s.pool.arrays, twin, tokens, positions, slots, active)
    np.testing.assert_array_equal(few[active], np.asarray(every)[active])
    np.testing.assert_array_equal(few[~active], 0.0)
    np.testing.assert_array_equal(np.asarray(cache.k), np.asarray(twin.k))
    np.testing.assert_array_equal(np.asarray(cache.v), np.asarray(twin.v))


def test_decode_refuses_rows_that_name_a_cache_row_twice_or_none(example_setup: Setup) -> None:
    s = example_setup
    cache = init_cache(s.config, MAX_BATCH, MAX_LEN)
    two = np.zeros(2, np.int32)
    for rows, message in (([1, 1], "distinct cache rows"), ([1, MAX_BATCH], "distinct cache rows"),
                          ([[1, 2]], "must be \\[n\\]")):
        with pytest.raises(ValueError, match=message):
            decode(s.params, s.pool.arrays, cache, two, two, np.full(2, lora.BASE), np.ones(2, bool),
                   rows=np.array(rows))


def test_base_rows_ignore_an_adapter_in_slot_zero(example: ExampleAssets) -> None:
    """A base row (-1) gets no LoRA term even with slot 0, which -1 is clamped to for indexing, in use."""
    config, params = load_model(example.model_dir)
    empty_zero, _ = fill_pool(example, config)
    full_zero, _ = fill_pool(example, config)
    assert full_zero.write_slot(0, adapter_weights(example.adapter_dirs[example.adapters[0].name], 1))
    tokens = [[1, 2, 3, 4], [5, 6, 7, 8]]
    base = [lora.BASE, lora.BASE]
    # Same program, same shapes: a base row's logits are bit for bit those with slot 0 empty.
    with_empty = np.asarray(forward_full(params, empty_zero.arrays, tokens, base))
    with_full = np.asarray(forward_full(params, full_zero.arrays, tokens, base))
    mixed = np.asarray(forward_full(params, full_zero.arrays, tokens, [lora.BASE, 0]))
    np.testing.assert_array_equal(with_full, with_empty)
    np.testing.assert_array_equal(mixed[0], with_empty[0])
    assert np.abs(mixed[1] - with_empty[1]).max() > 1e-2  # while the slot-0 row does change
    close(with_empty, np.asarray(forward_full(params, None, tokens, base)))
    cache = init_cache(config, 2, 16)
    prompt = np.array(tokens[0] + [0] * 12)
    first, cache = prefill(params, empty_zero.arrays, cache, prompt, 4, 0, lora.BASE)
    second, cache = prefill(params, full_zero.arrays, cache, prompt, 4, 0, lora.BASE)
    np.testing.assert_array_equal(np.asarray(second), np.asarray(first))
    close(first, with_empty[0, 3])


@pytest.mark.parametrize("window", [1, 3, 8])
def test_segmented_lora_matches_a_per_row_reference(window: int) -> None:
    """Runs of one slot longer than a window, base rows anywhere, any mix: one compile for all."""
    rng = np.random.default_rng(window)
    S, r, n_in, n_out, n = 5, 4, 12, 10, 13
    A = rng.standard_normal((S, r, n_in)).astype(np.float32)
    B = rng.standard_normal((S, n_out, r)).astype(np.float32)
    scaling = rng.uniform(0.5, 2.0, S).astype(np.float32)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    f = jax.jit(lambda x, slots: lora.segmented(x, jnp.asarray(A), jnp.asarray(B), jnp.asarray(scaling),
                                                lora.segments(slots, S, window=window)))
    mixes = [np.full(n, lora.BASE), np.full(n, 2), rng.integers(-1, S, n), np.arange(n) % S,
             np.where(np.arange(n) < 9, 4, lora.BASE), np.sort(rng.integers(-1, S, n))[::-1]]
    f(x, np.zeros(n, np.int32)).block_until_ready()
    with counting_compiles() as compiles:
        for slots in mixes:
            got = np.asarray(f(x, slots.astype(np.int32)))
            want = np.stack([np.zeros(n_out, np.float32) if s < 0 else scaling[s] * (B[s] @ (A[s] @ row))
                             for row, s in zip(x, slots)])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert compiles == []


def test_every_decode_window_and_the_per_token_gather_give_the_same_lora_terms() -> None:
    """Each window decode may pick, with q/k/v-style modules sharing one loop, and the benchmark's gather."""
    rng = np.random.default_rng(7)
    S, r, n_in, n = 6, 4, 12, 8
    outs = (10, 5)  # two modules reading the same input, as q and k do
    A = [rng.standard_normal((S, r, n_in)).astype(np.float32) for _ in outs]
    B = [rng.standard_normal((S, o, r)).astype(np.float32) for o in outs]
    scaling = rng.uniform(0.5, 2.0, S).astype(np.float32)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    pairs = [(jnp.asarray(a), jnp.asarray(b)) for a, b in zip(A, B)]
    mixes = [np.full(n, lora.BASE), np.full(n, 3), np.arange(n) % 4, np.arange(n) % S, rng.integers(-1, S, n),
             np.array([5, 5, 5, 5, 5, 0, lora.BASE, 2])]
    # each path one program (a window, a module), as a replica compiles them
    windowed = jax.jit(lambda slots, w: lora.segmented_group(jnp.asarray(x), pairs, jnp.asarray(scaling),
                                                             lora.segments(slots, S, window=w, rows=2 * n)),
                       static_argnums=1)
    gathered = jax.jit(lambda slots, i: lora.gather(jnp.asarray(x), *pairs[i], jnp.asarray(scaling), slots),
                       static_argnums=1)
    kernel = jax.jit(lambda slots: lora_sgmv(jnp.asarray(x), [(a[None], b[None]) for a, b in pairs],
                                             jnp.asarray(scaling), jnp.full(S, r, jnp.int32), slots, 0))
    for slots in (m.astype(np.int32) for m in mixes):
        want = [np.stack([np.zeros(b.shape[1], np.float32) if s < 0 else scaling[s] * (b[s] @ (a[s] @ row))
                          for row, s in zip(x, slots)]) for a, b in zip(A, B)]
        fits = [w for w in lora.loop_windows(n) if lora.padded_rows(slots, w) <= 2 * n]
        assert lora.choose_window(slots, lora.loop_windows(n)) in fits
        for w in fits:
            got = windowed(jnp.asarray(slots), w)
            for g, wnt in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), wnt, rtol=1e-5, atol=1e-5)
        for i, wnt in enumerate(want):
            got = gathered(jnp.asarray(slots), i)
            np.testing.assert_allclose(np.asarray(got), wnt, rtol=1e-5, atol=1e-5)
        got = kernel(jnp.asarray(slots))
        for g, wnt in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), wnt, rtol=1e-5, atol=1e-5)
    # a batch on one adapter takes one window of the whole batch; pairs of rows on 4 adapters, windows of 2
    assert lora.choose_window(np.full(n, 3, np.int32), lora.loop_windows(n)) == n
    assert lora.choose_window((np.arange(n) % 4).astype(np.int32), lora.loop_windows(n)) == 2
    backend = select("float32")  # the kernel is built here, and takes any mix: no window
    assert isinstance(backend, NativeBackend) and backend.windows(n) == (None,)
    assert backend.window((np.arange(n) % 4).astype(np.int32), None) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [11, 46])
def test_the_kernel_stops_at_each_slots_rank_and_handles_every_tail(dtype: str, rows: int) -> None:
    """Pool-shaped A and B with slots of ranks 16, 9, 4 and an empty one; an input width that is no
    multiple of 16, outputs that are no multiple of 8 and span several column blocks; several layers.
    11 rows: a decode step's few rows per slot; 46: a prefill's many (slots of 23, 10 and 9 rows, so
    the expand's blocks of 6 rows end in every tail)."""
    rng = np.random.default_rng(3)
    dims = {"q_proj": (37, 1030), "k_proj": (37, 13), "v_proj": (37, 45)}
    spec = PoolSpec(num_layers=2, module_dims=dims, slots=5, max_rank=16, dtype=dtype)
    pool = MemoryPool(spec)
    ranks = {0: 16, 1: 9, 2: 4, 4: 1}  # slot 3 stays empty
    host: dict[tuple[int, int, str], tuple[np.ndarray, np.ndarray]] = {}
    for slot, r in ranks.items():
        pairs = {(layer, m): (rng.standard_normal((r, n_in)).astype(np.float32),
                              rng.standard_normal((n_out, r)).astype(np.float32))
                 for layer in range(2) for m, (n_in, n_out) in dims.items()}
        if dtype == "bfloat16":
            pairs = {k: tuple(np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)) for w in ab)
                     for k, ab in pairs.items()}
        pool.write_slot(slot, SlotWeights(scaling=0.25 * (slot + 1), rank=r, pairs=pairs))
        host.update({(slot, layer, m): ab for (layer, m), ab in pairs.items()})
    a = pool.arrays
    x = rng.standard_normal((rows, 37)).astype(np.float32)
    # many slots: an item per (slot, module); one slot: too few items, so columns split in blocks
    mixes = [np.array([0, 2, lora.BASE, 1, 4, 2, 0, 0, 1, 3, 4], np.int32), np.where(np.arange(11) % 4, 1, -1)]
    if rows != 11:
        mixes = [rng.permutation(np.repeat(np.array([0, 1, 2, 4, lora.BASE, 3], np.int32), [23, 10, 9, 1, 2, 1])),
                 np.where(np.arange(rows) % 7, 1, -1).astype(np.int32)]
    for layer, slots in ((layer, slots) for layer in range(2) for slots in mixes):
        got = lora_sgmv(jnp.asarray(x), [(a.A[m], a.B[m]) for m in dims], a.scaling, a.rank,
                                jnp.asarray(slots.astype(np.int32)), layer)
        for m, g in zip(dims, got):
            want = np.stack([np.zeros(dims[m][1], np.float32) if s not in ranks
                             else 0.25 * (s + 1) * (host[(s, layer, m)][1] @ (host[(s, layer, m)][0] @ row))
                             for row, s in zip(x, slots)])
            np.testing.assert_allclose(np.asarray(g), want, rtol=2e-5, atol=2e-5)


def test_a_bfloat16_pool_gives_the_lora_terms_of_its_rounded_weights_exactly() -> None:
    """A bfloat16 pool keeps uint16 bits (computed/residency/pool.py); every LoRA path widens them exactly."""
    rng = np.random.default_rng(11)
    dims = {"q_proj": (12, 10)}
    spec = PoolSpec(num_layers=2, module_dims=dims, slots=3, max_rank=4, dtype="bfloat16")
    pool16 = MemoryPool(spec)
    pool32 = MemoryPool(replace(spec, dtype="float32"))
    for slot in range(3):
        pairs = {(layer, "q_proj"): (rng.standard_normal((4, 12)).astype(np.float32),
                                     rng.standard_normal((10, 4)).astype(np.float32)) for layer in (0, 1)}
        rounded = {k: tuple(np.asarray(jnp.asarray(m).astype(jnp.bfloat16).astype(jnp.float32)) for m in ab)
                   for k, ab in pairs.items()}
        pool16.write_slot(slot, SlotWeights(scaling=0.5 + slot, rank=4, pairs=pairs))
        pool32.write_slot(slot, SlotWeights(scaling=0.5 + slot, rank=4, pairs=rounded))
    assert pool16.arrays.A["q_proj"].dtype == jnp.uint16
    assert pool16.read_slot(1).A["q_proj"].dtype == jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((6, 12)).astype(np.float32))
    slots = jnp.asarray(np.array([0, 2, lora.BASE, 1, 1, 2], np.int32))

    @partial(jax.jit, static_argnames="layer")  # each path one program, as a replica compiles it
    def terms(A: jax.Array, B: jax.Array, scaling: jax.Array, rank: jax.Array, layer: int) -> list[jax.Array]:
        return [lora.segmented(x, A, B, scaling, lora.segments(slots, 3, window=2), layer),
                lora.gather(x, A, B, scaling, slots, layer), lora.single(x, A, B, scaling, jnp.int32(2), layer),
                *lora_sgmv(x, [(A, B)], scaling, rank, slots, layer)]

    for layer in (0, 1):
        got, want = (terms(p.arrays.A["q_proj"], p.arrays.B["q_proj"], p.arrays.scaling, p.arrays.rank, layer=layer)
                     for p in (pool16, pool32))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_dense_kernel_matches_a_float64_product_for_every_row_count_and_tail(dtype: str) -> None:
    """Row counts around the kernel's chunks of one and two vectors of rows (8 and 16 on AVX2, 16 and 32 on
    AVX-512; on AVX2 a bfloat16 panel's blocks of 6 rows), a prefill's row blocks (256 rows, then 44),
    inputs of odd width, outputs that end mid-panel; and the packing round trip. A bfloat16 W
    is packed as its bits in pairs of k and multiplies x rounded to bfloat16, as transformers' bfloat16
    Linear does (a bfloat16 model's x already is): the float64 product of those values, to float32
    rounding, whether VDPBF16PS or the widened float32 loop computes it."""
    panel = native.dense_panel(bfloat16=dtype == "bfloat16")
    if not panel:
        pytest.skip(f"no dense kernel here: {native.unavailable_reason() or 'neither AVX-512 nor AVX2+FMA'}")
    rng = np.random.default_rng(5)
    wdt = np.dtype(jnp.dtype(dtype))

    def weight(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32).astype(wdt)

    def want(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if dtype == "bfloat16":
            x = x.astype(wdt)  # the kernel's rounding of x, to nearest even
        return x.astype(np.float64) @ w.astype(np.float64)

    for n_in, out in ((48, 96), (37, 13), (100, 2 * panel + 1), (16, 1)):
        w = weight(n_in, out)
        packed = pack(w, panel)
        assert packed.shape == (n_in, out) and packed.dtype == wdt
        assert packed.panels.shape == ((-(-out // panel), -(-n_in // 2), panel, 2) if dtype == "bfloat16" else
                                       (-(-out // panel), n_in, panel))
        assert packed.panels.dtype == (np.uint16 if dtype == "bfloat16" else np.float32)
        np.testing.assert_array_equal(np.asarray(unpack(packed)), w)
        product = jax.jit(lambda x, packed=packed: dense_matmuls(x, [packed])[0])  # one program a shape
        for rows in (1, 5, 8, 9, 16, 17, 32, 33, 70, 300):
            x = rng.standard_normal((rows, n_in)).astype(np.float32)
            got = np.asarray(product(jnp.asarray(x)))
            np.testing.assert_allclose(got, want(x, w), rtol=1e-5, atol=1e-5 * np.sqrt(n_in))
    # several weights that read one x share a call; an unpacked one among them goes to XLA
    x = rng.standard_normal((33, 37)).astype(np.float32).astype(wdt).astype(np.float32)
    ws = [weight(37, out) for out in (13, 24, 7)]
    got = dense_matmuls(jnp.asarray(x), [pack(ws[0], panel), jnp.asarray(ws[1].astype(np.float32)),
                                         pack(ws[2], panel)])
    for g, w in zip(got, ws):
        np.testing.assert_allclose(np.asarray(g), want(x, w), rtol=1e-5, atol=1e-4)
    x3 = rng.standard_normal((2, 3, 37)).astype(np.float32)  # leading dimensions are kept
    w = weight(37, 13)
    np.testing.assert_allclose(np.asarray(dense_matmuls(jnp.asarray(x3), [pack(w, panel)])[0]), want(x3, w),
                               rtol=1e-5, atol=1e-4)
    if dtype == "bfloat16":  # a bfloat16 x keeps its dtype: the float32 sums rounded once
        xb = jnp.asarray(x3).astype(jnp.bfloat16)
        got = dense_matmuls(xb, [pack(w, panel)])[0]
        assert got.dtype == jnp.bfloat16
        exact = want(np.asarray(xb.astype(jnp.float32)), w)
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), exact, rtol=2 ** -8, atol=1e-6)


def test_a_float32_model_packs_its_weights_where_the_kernel_runs(example_setup: Setup,
                                                                 other_assets: ExampleAssets) -> None:
    """load_model packs for the dense kernel where it can run; with_layout goes both ways, exactly."""
    params = example_setup.params
    packed = isinstance(params.layers[0].weights["q_proj"], PackedWeight)
    assert packed == (native.dense_panel() > 0)
    _, plain = load_model(example_setup.assets.model_dir, backend=XlaBackend())
    assert not isinstance(plain.layers[0].weights["q_proj"], PackedWeight)
    again = with_layout(with_layout(plain, params.backend), XlaBackend())
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, tied = load_model(other_assets.model_dir)  # a tied model keeps one copy of its embedding
    assert tied.config.tie_word_embeddings
    assert (tied.embed is None and isinstance(tied.lm_head, PackedWeight)) == packed
    _, tied_plain = load_model(other_assets.model_dir, backend=XlaBackend())
    assert tied_plain.lm_head is None
    for a, b in zip(jax.tree.leaves(with_layout(tied, XlaBackend())), jax.tree.leaves(tied_plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a bfloat16 model packs its weights' bits, as it reads them, and with_layout goes both ways exactly
    _, bf16 = load_model(example_setup.assets.model_dir, "bfloat16")
    _, bf16_plain = load_model(example_setup.assets.model_dir, "bfloat16", backend=XlaBackend())
    q = bf16.layers[0].weights["q_proj"]
    assert isinstance(q, PackedWeight) == packed and bf16.dtype == jnp.bfloat16
    if packed:
        assert isinstance(q, PackedWeight) and q.panels.dtype == jnp.uint16
    for a, b in zip(jax.tree.leaves(with_layout(bf16, XlaBackend())), jax.tree.leaves(bf16_plain), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("shape", [ModelShape(), OTHER_SHAPE], ids=["example", "tied-llama3-mha"])
def test_config_reads_transformers_4_and_5_forms(shape: ModelShape) -> None:
    forms = {style: DecoderConfig.from_hf(model_config(shape, style=style)) for style in ("v4", "v5", "both")}
    assert forms["v4"] == forms["v5"] == forms["both"]
    config = forms["both"]
    assert (config.head_dim, config.num_kv_heads, config.tie_word_embeddings) == (
        shape.head_dim, shape.num_key_value_heads, shape.tie_word_embeddings)
    assert config.rope.type == (shape.rope_scaling or {}).get("rope_type", "default")


def test_sharded_checkpoint_loads_the_same(example: ExampleAssets, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    tensors = load_file(str(example.model_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    (tmp_path / "config.json").write_text((example.model_dir / "config.json").read_text())
    _, whole = load_model(example.model_dir)
    _, sharded = load_model(tmp_path)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- bfloat16


@pytest.fixture(scope="module")
def bf16_assets(tmp_path_factory: pytest.TempPathFactory) -> ExampleAssets:
    return make_example(tmp_path_factory.mktemp("bf16"), seed=0, dtype="bfloat16")


def test_bfloat16_checkpoint_in_float32_is_exact(bf16_assets: ExampleAssets) -> None:
    """bf16 files widen exactly: loaded in float32 they match transformers' float32 load of them."""
    s = make_setup(bf16_assets)
    names = [a.name for a in bf16_assets.adapters]
    tokens = np.random.default_rng(1).integers(0, s.config.vocab_size, (3, 9))
    adapters = [None, names[0], names[3]]
    close(forward_full(s.params, s.pool.arrays, tokens, [s.slot(a) for a in adapters]),
          s.ref.logits(tokens, adapters))


def test_bfloat16_model_runs_close_to_float32(bf16_assets: ExampleAssets) -> None:
    config, params = load_model(bf16_assets.model_dir, dtype="bfloat16")
    assert params.embed is not None and params.embed.dtype == jnp.bfloat16
    assert all(w.dtype in (jnp.bfloat16, jnp.uint16) for w in jax.tree.leaves(params))  # uint16: packed bits
    pool, slots = fill_pool(bf16_assets, config, dtype="bfloat16")
    ref = Reference(bf16_assets)
    cache = init_cache(config, MAX_BATCH, MAX_LEN, dtype="bfloat16")
    assert cache.k.dtype == params.backend.cache_dtype("bfloat16")
    names = [a.name for a in bf16_assets.adapters]
    rows = [(None, list(range(3, 14))), (names[3], list(range(40, 47)))]
    for row, (adapter, prompt) in enumerate(rows):
        slot = lora.BASE if adapter is None else slots[adapter]
        logits, cache = prefill(params, pool.arrays, cache, padded(prompt), len(prompt), row, slot)
        assert logits.dtype == jnp.float32
        close(logits, ref.greedy(prompt, adapter)[1][0], BF16_RTOL)
    # one decode step for both rows, fed the reference's first token
    active = np.arange(MAX_BATCH) < 2
    tokens = np.zeros(MAX_BATCH, np.int32)
    positions = np.zeros(MAX_BATCH, np.int32)
    slot_ids = np.full(MAX_BATCH, lora.BASE, np.int32)
    for row, (adapter, prompt) in enumerate(rows):
        tokens[row], positions[row] = ref.greedy(prompt, adapter)[0][0], len(prompt)
        slot_ids[row] = lora.BASE if adapter is None else slots[adapter]
    logits, cache = decode(params, pool.arrays, cache, tokens, positions, slot_ids, active)
    for row, (adapter, prompt) in enumerate(rows):
        close(logits[row], ref.greedy(prompt, adapter)[1][1], BF16_RTOL)


# --------------------------------------------------------------------------- compiles


def test_no_recompiles_across_slots_rows_lengths_and_mixes(example_setup: Setup) -> None:
    s = example_setup
    cache = init_cache(s.config, MAX_BATCH, MAX_LEN)
    arrays = s.pool.arrays
    tokens16 = np.arange(16, dtype=np.int32)
    _, cache = prefill(s.params, arrays, cache, tokens16, 5, 0, lora.BASE)  # warm: one compile
    tokens4x16 = np.tile(tokens16, (4, 1))
    _, cache = prefill_batch(s.params, arrays, cache, tokens4x16, [5] * 4, [0, 1, 2, 3], [lora.BASE] * 4)
    for window in s.params.backend.windows(MAX_BATCH):  # warm: one compile per LoRA window
        _, cache = decode(s.params, arrays, cache, np.zeros(MAX_BATCH, int), np.zeros(MAX_BATCH, int),
                          np.full(MAX_BATCH, lora.BASE), np.zeros(MAX_BATCH, bool), window=window)
    rng = np.random.default_rng(0)
    with counting_compiles() as compiles:
        for length, row, slot in [(16, 5, 1), (1, 3, 4), (9, 0, lora.BASE), (12, 2, 5)]:
            _, cache = prefill(s.params, arrays, cache, tokens16, length, row, slot)
        _, cache = prefill(s.params, arrays, cache, list(range(16)), np.int64(3), np.int32(1), 2)
        # a batched prefill's shape is (prompts, length): any rows, lengths and mix of slots
        _, cache = prefill_batch(s.params, arrays, cache, tokens4x16, [16, 1, 9, 4], [5, 0, 3, 1], [1, 1, 4, 2])
        _, cache = prefill_batch(s.params, arrays, cache, tokens4x16[:3], [2, 3, 4], [2, 4, 0],
                                 [lora.BASE, 5, 0], pad_to=4)
        for mix in ([lora.BASE] * MAX_BATCH, [1] * MAX_BATCH, [1, 2, 3, 4, 5, lora.BASE], [5, 5, 1, 1, 0, 0]):
            _, cache = decode(s.params, arrays, cache, rng.integers(0, 256, MAX_BATCH),
                              rng.integers(0, MAX_LEN, MAX_BATCH), mix, rng.random(MAX_BATCH) < 0.7)
    assert compiles == [], f"{len(compiles)} compiles within one bucket and the warmed-up LoRA windows"
    with counting_compiles() as compiles:
        _, cache = prefill(s.params, arrays, cache, np.arange(24), 20, 1, 1)  # a length no other test uses
    assert len(compiles) == 1, "a new bucket length compiles prefill once"


def test_cache_is_updated_in_place(example_setup: Setup) -> None:
    s = example_setup
    cache = init_cache(s.config, MAX_BATCH, MAX_LEN)
    pointers = [cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()]
    _, cache = prefill(s.params, s.pool.arrays, cache, np.arange(16), 7, 1, 1)
    _, cache = decode(s.params, s.pool.arrays, cache, np.zeros(MAX_BATCH, int), np.full(MAX_BATCH, 7),
                      np.full(MAX_BATCH, 1), np.ones(MAX_BATCH, bool))
    assert isinstance(cache, KVCache)
    assert [cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()] == pointers


def test_errors_name_the_limit(example_setup: Setup) -> None:
    s = example_setup
    cache = init_cache(s.config, 2, 16)
    ok = np.zeros(16, np.int32)
    with pytest.raises(ValueError, match="max_len 16"):
        prefill(s.params, None, cache, np.zeros(32, np.int32), 3, 0, lora.BASE)
    with pytest.raises(ValueError, match="length 17"):
        prefill(s.params, None, cache, ok, 17, 0, lora.BASE)
    with pytest.raises(ValueError, match="row 2 is outside the cache's 2 rows"):
        prefill(s.params, None, cache, ok, 3, 2, lora.BASE)
    with pytest.raises(ValueError, match="no LoRA pool was given"):
        prefill(s.params, None, cache, ok, 3, 0, 0)
    with pytest.raises(ValueError, match=r"slot 9 is outside \[-1, 7\)"):
        prefill(s.params, s.pool.arrays, cache, ok, 3, 0, 9)
    vocab = s.config.vocab_size
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {vocab}\)"):
        prefill(s.params, None, cache, ok + vocab, 3, 0, lora.BASE)
    with pytest.raises(TypeError, match="tokens must be integers"):
        prefill(s.params, None, cache, ok.astype(np.float32), 3, 0, lora.BASE)
    zeros = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match=r"max_batch"):
        decode(s.params, None, cache, np.zeros(3, np.int32), zeros, zeros, np.ones(2, bool))
    with pytest.raises(ValueError, match=r"positions in \[0, 16\)"):
        decode(s.params, None, cache, zeros, np.array([3, 16]), zeros - 1, np.ones(2, bool))
    # an inactive row's position and slot are not checked: they are ignored
    _, cache = decode(s.params, None, cache, zeros, np.array([3, 99]), np.array([-1, 99]), np.array([True, False]))
    wrong = PoolSpec(num_layers=s.config.num_layers, module_dims={"q_proj": (32, 64)}, slots=2,
                     max_rank=4, dtype="float32")
    with pytest.raises(ValueError, match="configure the pool for this model"):
        forward_full(s.params, MemoryPool(wrong).arrays, [[1, 2]], [0])

