"""Llama as Hugging Face's `LlamaForCausalLM` defines it, in JAX, with multi-LoRA and a KV cache.

The model is pure functions over a parameter pytree (`LlamaParams`, whose
static `LlamaConfig` rides along as pytree metadata, so every entry point
takes just `params`). What it reproduces of transformers 5.24's
`modeling_llama.py`:

- RMSNorm computed in float32 and cast back before the weight multiplies it;
  eps from `rms_norm_eps`.
- RoPE (rotate-half form) with `rope_theta`, and the `linear` and `llama3`
  scalings; inverse frequencies computed in float32 as transformers does. Both
  config forms are read: transformers 5's `rope_parameters` and 4.x's
  top-level `rope_theta` plus `rope_scaling` (with `type` or `rope_type`).
- Grouped-query attention (query head h uses key/value head h // (heads /
  kv_heads)), an explicit `head_dim`, scores scaled by head_dim**-0.5, softmax
  in float32.
- SwiGLU MLP `down(silu(gate(x)) * up(x))`; optional attention and MLP biases.
- Tied (`lm_head` is the embedding) or untied output embeddings.

The projections and the lm_head are `x W` with W stored `[in, out]`, or,
for a float32 model where the native dense kernel runs (AVX-512 CPUs), packed
into column panels once at load (computed/dense.py, `with_layout`): the kernel
streams each weight once per decode step, where XLA's dot repacks it on every
call. Modules that read the same x share a call.

LoRA (computed/lora.py) is added to q, k, v, o, gate, up and down wherever the
pool has the module: `y = x W (+ bias) + scaling[s] * B[s] (A[s] x)`, as PEFT
does; slot -1 is the base model and adds nothing.

KV cache for continuous batching (`KVCache`): V `[layers, max_batch, kv_heads,
max_len, head_dim]` and K in blocks of 16 positions `[layers, max_batch,
kv_heads, blocks, head_dim, 16]` for the attention kernel, or positions-minor
`[layers, max_batch, kv_heads, head_dim, max_len]` for XLA's attention, in
the model dtype; each running sequence owns one batch row. Heads come before
positions so that attention reads the cache in place (with positions first,
XLA on CPU transposes every layer's K and V before each step's matmuls, and a
decode step takes about three times as long). Decode attention is the native kernel
(computed/kernels/attention.cc) for a float32 cache where it is built, each
row over its own positions; else XLA over a length bucket. Entry points, all
jitted, the first two donating the cache so it is updated in place:

- `prefill(params, lora_pool, cache, tokens[P], length, row, slot)`: one
  prompt padded to a bucket length P; writes K/V of positions [0, P) of row
  `row` (positions from `length` on hold padding, overwritten by decode before
  they are ever read) and returns the logits after token `length - 1`. One
  compile per P; `length`, `row` and `slot` are traced.
- `decode(params, lora_pool, cache, tokens[B], positions[B], slots[B], active[B])`:
  one step for every row; row b writes its K/V at positions[b] and attends to
  [0, positions[b]]. Inactive rows write nothing (their write index is pushed
  out of range and dropped) and their logits are meaningless. One compile per
  attention length and LoRA window (computed/lora.py); with the native
  kernels, one compile in all.
- `forward_full(params, lora_pool, tokens[B, T], slots[B])`: every position's
  logits, no cache (for tests and scoring).

Layers are a Python loop over per-layer parameters, unrolled at trace time:
in a CPU measurement of decode-sized matmuls, `lax.scan` over stacked layer
weights was markedly slower (it slices each layer out per iteration); the cost
is a compile time that grows with the number of layers.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import mmap
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from computed import kernels, lora
from computed.dense import PackedWeight, matmul, matmuls, pack, packing_panel, unpack
from computed.pool import LoraPool
from shared.config import MODULE_PARENT, MODULES
from shared.modelconfig import Architecture, ModelConfigError, Rope, check_tensors, read_architecture
from shared.tensorfile import TensorFileError, parse_header, to_float32

DTYPES = ("float32", "bfloat16")
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


class ModelLoadError(ValueError):
    """The checkpoint directory cannot be loaded as a Llama model."""


# --------------------------------------------------------------------------- config


RopeConfig = Rope  # rotary embedding parameters, normalised (shared/modelconfig.py)


@dataclass(frozen=True)
class LlamaConfig(Architecture):
    """The architecture, read from config.json; hashable (static under jit)."""

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Read a transformers 4.x or 5.x Llama config.json (as a dict), with the checks `pool
        init` makes (shared/modelconfig.py)."""
        try:
            arch = read_architecture(cfg)
        except ModelConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        return cls(**{f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)})


@functools.lru_cache(maxsize=None)
def inv_freq(config: LlamaConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2], float32, computed as transformers computes them."""
    rope, dim = config.rope, config.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    freq = (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    if rope.type == "linear":
        freq = (freq / np.float32(rope.factor)).astype(np.float32)
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = (np.float32(2 * math.pi) / freq).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, freq / np.float32(rope.factor), freq).astype(np.float32)
        smooth = ((old / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return freq


# --------------------------------------------------------------------------- parameters


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerParams:
    """One decoder layer. Projection weights are stored [in, out] (HF stores [out, in]), or packed
    for the dense kernel (computed/dense.py)."""

    input_norm: jax.Array           # [hidden]
    post_attention_norm: jax.Array  # [hidden]
    weights: dict[str, jax.Array | PackedWeight]  # module -> [in, out]
    biases: dict[str, jax.Array]    # module -> [out]; empty without attention/mlp bias


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["embed", "layers", "norm", "lm_head"], meta_fields=["config"])
@dataclass(frozen=True)
class LlamaParams:
    config: LlamaConfig
    embed: jax.Array | None         # [vocab, hidden]; None when tied and packed (lm_head holds it)
    layers: tuple[LayerParams, ...]
    norm: jax.Array                 # [hidden]
    # [hidden, vocab] (as the projections); None when tied to embed, unless packed: a tied model's
    # packed lm_head is the embedding's only copy, and lookups read its columns (`_embed`)
    lm_head: jax.Array | PackedWeight | None

    @property
    def dtype(self) -> jnp.dtype:
        if self.embed is None:
            assert isinstance(self.lm_head, PackedWeight)
            return self.lm_head.panels.dtype
        return self.embed.dtype


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """V [layers, max_batch, kv_heads, max_len, head_dim]; K in one of two layouts, by what attends:

    - blocked, for the attention kernel: K [layers, max_batch, kv_heads, ceil(max_len / 16),
      head_dim, 16], positions in blocks of KV_BLOCK (block j, dimension e, lane c is position
      16j + c). A row's first positions lie together; with K wholly positions-minor, a short row
      touched head_dim scattered cache lines per (row, head), and the kernel spent its time
      waiting on them. Positions past max_len in the last block are never read.
    - positions-minor, for XLA's attention: K [layers, max_batch, kv_heads, head_dim, max_len],
      so a step's scores are a [g, d] x [d, L] product per row and head (measured about 30%
      cheaper than K laid out like V). XLA read the blocked layout markedly slower deep in a
      long cache.

    Within a block positions are minor too, so both give the kernel and XLA sixteen positions per
    vector."""

    k: jax.Array
    v: jax.Array

    @property
    def max_batch(self) -> int:
        return int(self.v.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.v.shape[3])

    @property
    def blocked(self) -> bool:
        """Whether K is in blocks of positions (the attention kernel's layout)."""
        return self.k.ndim == 6


KV_BLOCK = 16  # positions per block of K (KVCache); computed/kernels/attention.cc assumes it


def _blocks(positions: int) -> int:
    return -(-positions // KV_BLOCK)


def init_cache(config: LlamaConfig, max_batch: int, max_len: int, dtype: str | jnp.dtype = "float32", *,
               blocked: bool | None = None) -> KVCache:
    """A zeroed cache of `max_batch` rows of `max_len` positions, in the model's dtype; K blocked
    for the attention kernel (`blocked` None: a float32 cache where the kernels are available) or
    positions-minor for XLA's attention (KVCache)."""
    if blocked is None:
        blocked = jnp.dtype(dtype) == jnp.float32 and kernels.available()
    lead = (config.num_layers, max_batch, config.num_kv_heads)
    k_shape = (_blocks(max_len), config.head_dim, KV_BLOCK) if blocked else (config.head_dim, max_len)
    return KVCache(k=jnp.zeros(lead + k_shape, dtype), v=jnp.zeros(lead + (max_len, config.head_dim), dtype))


# --------------------------------------------------------------------------- loading


@contextmanager
def _open_shards(model_dir: Path) -> Iterator[dict[str, tuple[Any, Any, Any]]]:
    """Tensor name -> (buffer, header, info) over every shard, memory-mapped."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        shards = [single]
    elif index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from None
        for n in names:
            if not isinstance(n, str) or "/" in n or "\\" in n or n.startswith("."):
                raise ModelLoadError(f"{index}: shard name {n!r} must be a file in the same directory")
        shards = [model_dir / n for n in names]
    else:
        raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    maps: list[mmap.mmap] = []
    try:
        tensors: dict[str, tuple[Any, Any, Any]] = {}
        for path in shards:
            with path.open("rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            maps.append(buf)
            try:
                header = parse_header(buf, len(buf))
            except TensorFileError as exc:
                raise ModelLoadError(f"{path}: {exc}") from None
            for name, info in header.tensors.items():
                tensors[name] = (buf, header, info)
        yield tensors
    finally:
        for m in maps:
            m.close()


def load_model(model_dir: str | Path, dtype: str = "float32", *,
               packed: bool | None = None) -> tuple[LlamaConfig, LlamaParams]:
    """Load a Hugging Face Llama checkpoint (config.json + safetensors) in `dtype`.

    The projections and the lm_head are packed for the native dense kernel where it can run
    (`packed` None: a float32 model on a CPU with the kernels and AVX-512, computed/dense.py);
    `packed=False` keeps them [in, out] for XLA."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model_dir = Path(model_dir)
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{model_dir}: no config.json") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{model_dir}/config.json: invalid JSON ({exc})") from None
    try:
        config = LlamaConfig.from_hf(raw)
    except ModelLoadError as exc:  # the text `pool init` gives (shared/fingerprint.py)
        raise ModelLoadError(f"{model_dir}/{exc}") from None
    jdt = jnp.dtype(dtype)

    with _open_shards(model_dir) as tensors:
        try:
            check_tensors(config, {name: info.shape for name, (_, _, info) in tensors.items()})
        except ModelConfigError as exc:
            raise ModelLoadError(f"{model_dir}: {exc}") from None

        def get(name: str, *, transpose: bool = False) -> jax.Array:
            buf, header, info = tensors[name]  # present, in this shape: check_tensors
            try:
                arr = to_float32(buf, header, info)
            except TensorFileError as exc:
                raise ModelLoadError(f"{model_dir}: {exc}") from None
            if transpose:
                arr = arr.T
            return jnp.asarray(np.ascontiguousarray(arr), dtype=jdt)

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}"
            weights, biases = {}, {}
            for m in MODULES:
                stem = f"{p}.{MODULE_PARENT[m]}.{m}"
                weights[m] = get(f"{stem}.weight", transpose=True)
                if (config.attention_bias and m in ATTN_MODULES) or (config.mlp_bias and m in MLP_MODULES):
                    biases[m] = get(f"{stem}.bias")
            layers.append(LayerParams(input_norm=get(f"{p}.input_layernorm.weight"),
                                      post_attention_norm=get(f"{p}.post_attention_layernorm.weight"),
                                      weights=weights, biases=biases))
        params = LlamaParams(
            config=config,
            embed=get("model.embed_tokens.weight"),
            layers=tuple(layers),
            norm=get("model.norm.weight"),
            # stored [hidden, vocab]: XLA's CPU product x @ W ran 1.2x faster than x @ W.T here
            lm_head=None if config.tie_word_embeddings else get("lm_head.weight", transpose=True),
        )
    if packed is None:
        packed = packing_panel(dtype) > 0
    return config, with_layout(params, packed=packed)


def with_layout(params: LlamaParams, *, packed: bool) -> LlamaParams:
    """`params` with every projection and the lm_head packed for the dense kernel
    (computed/dense.py), or unpacked to [in, out] for XLA; host work, once per model. A tied
    model keeps one copy: packed, its lm_head is the embedding's transpose and `embed` is None
    (lookups read the lm_head's columns). Packing needs a float32 model and the kernel
    (ValueError otherwise)."""
    panel = packing_panel(params.dtype) if packed else 0
    if packed and not panel:
        raise ValueError(f"packed weights need a float32 model and the native dense kernel (AVX-512); this is "
                         f"a {params.dtype} model and the kernel's panel width here is "
                         f"{kernels.dense_panel()} ({kernels.unavailable_reason() or 'no AVX-512'})")

    def convert(w: jax.Array | PackedWeight) -> jax.Array | PackedWeight:
        if isinstance(w, PackedWeight):
            w = unpack(w)
        return pack(w, panel) if panel else w

    layers = tuple(dataclasses.replace(layer, weights={m: convert(w) for m, w in layer.weights.items()})
                   for layer in params.layers)
    embed, lm_head = params.embed, params.lm_head
    if params.config.tie_word_embeddings:  # one copy: the embedding, or its packed transpose
        if embed is None:
            assert isinstance(lm_head, PackedWeight)
            embed = unpack(lm_head).T
        embed, lm_head = (None, pack(embed.T, panel)) if panel else (embed, None)
    elif lm_head is not None:
        lm_head = convert(lm_head)
    return dataclasses.replace(params, embed=embed, layers=layers, lm_head=lm_head)


# --------------------------------------------------------------------------- building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


RopeTables = tuple[jax.Array, jax.Array]


def rope_tables(positions: Any, config: LlamaConfig) -> RopeTables:
    """cos and sin `[..., 1, head_dim // 2]` float32 for `positions [...]`: in the graph for a traced
    array, on the host for a numpy one. Decode passes host tables in: computed in the graph, XLA
    fused cos and sin into every layer's RoPE and evaluated them once per element of q and k."""
    xp: Any = np if isinstance(positions, np.ndarray) else jnp
    freqs = positions.astype(np.float32)[..., None, None] * xp.asarray(inv_freq(config))
    return xp.cos(freqs).astype(np.float32), xp.sin(freqs).astype(np.float32)


def rope(x: jax.Array, tables: RopeTables) -> jax.Array:
    """Rotate `x [..., heads, head_dim]` by the positions of `tables` (rotate-half form, as HF)."""
    cos, sin = (t.astype(x.dtype) for t in tables)
    # HF's x * cos + rotate_half(x) * sin on the two halves: the same products and sums
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos + -x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _softmax(scores: jax.Array, mask: jax.Array, dtype: jnp.dtype) -> jax.Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


class _Lora:
    """How one forward pass adds LoRA: one slot for all tokens (`slot`), rows grouped by slot by the
    native kernel (`rows`: each row's slot) or by the window loop (`seg`), or (benchmarks only) a
    per-row gather (`gather`)."""

    def __init__(self, pool: LoraPool | None, config: LlamaConfig, *, slot: jax.Array | None = None,
                 seg: lora.Segments | None = None, rows: jax.Array | None = None,
                 gather: jax.Array | None = None) -> None:
        if pool is not None:
            _check_pool(pool, config)
        self.pool, self.slot, self.seg, self.rows, self.gather = pool, slot, seg, rows, gather

    def deltas(self, x: jax.Array, layer: int, modules: tuple[str, ...]) -> dict[str, jax.Array]:
        """The LoRA terms of `modules`, which all read `x`, for those the pool has."""
        if self.pool is None:
            return {}
        pool = self.pool
        present = [m for m in modules if m in pool.A]  # all layers: sliced inside, see lora._take
        if not present:
            return {}
        if self.slot is not None:
            return {m: lora.single(x, pool.A[m], pool.B[m], pool.scaling, self.slot, layer) for m in present}
        flat = x.reshape(-1, x.shape[-1])
        if self.rows is not None:
            ys = lora.kernel_group(flat, [(pool.A[m], pool.B[m]) for m in present], pool.scaling, pool.rank,
                                   self.rows, layer)
        elif self.seg is not None:
            ys = lora.segmented_group(flat, [(pool.A[m], pool.B[m]) for m in present], pool.scaling,
                                      self.seg, layer)
        else:
            assert self.gather is not None
            ys = [lora.gather(flat, pool.A[m], pool.B[m], pool.scaling, self.gather, layer) for m in present]
        return {m: y.reshape(*x.shape[:-1], -1) for m, y in zip(present, ys)}


def _check_pool(pool: LoraPool, config: LlamaConfig) -> None:
    dims = config.module_dims
    for m, a in pool.A.items():
        n_in, n_out = dims[m]
        b = pool.B[m]
        if a.shape[0] != config.num_layers or a.shape[-1] != n_in or b.shape[-2] != n_out:
            raise ValueError(f"the LoRA pool's {m} has A {a.shape} and B {b.shape}; the model needs "
                             f"[{config.num_layers}, slots, rank, {n_in}] and "
                             f"[{config.num_layers}, slots, {n_out}, rank]: configure the pool for this model")


def _project(x: jax.Array, layer: LayerParams, index: int, modules: tuple[str, ...],
             adapters: _Lora) -> list[jax.Array]:
    """`x W (+ bias) (+ LoRA)` for each of `modules`, which all read `x` (their products share a call
    of the dense kernel, their LoRA terms one of the LoRA kernel)."""
    deltas = adapters.deltas(x, index, modules)
    out = []
    for m, y in zip(modules, matmuls(x, [layer.weights[m] for m in modules])):
        if m in layer.biases:
            y = y + layer.biases[m]
        d = deltas.get(m)
        out.append(y if d is None else (y + d).astype(x.dtype))
    return out


def _mlp(x: jax.Array, layer: LayerParams, index: int, adapters: _Lora) -> jax.Array:
    gate, up = _project(x, layer, index, ("gate_proj", "up_proj"), adapters)
    return _project(jax.nn.silu(gate) * up, layer, index, ("down_proj",), adapters)[0]


def _qkv(x: jax.Array, tables: RopeTables, layer: LayerParams, index: int, adapters: _Lora,
         config: LlamaConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., kv_heads, group, head_dim], k and v [..., kv_heads, head_dim], RoPE applied."""
    lead, hd, kvh = x.shape[:-1], config.head_dim, config.num_kv_heads
    q, k, v = _project(x, layer, index, ("q_proj", "k_proj", "v_proj"), adapters)
    q, k = q.reshape(*lead, config.num_heads, hd), k.reshape(*lead, kvh, hd)
    q, k = rope(q, tables), rope(k, tables)
    return q.reshape(*lead, kvh, config.num_heads // kvh, hd), k, v.reshape(*lead, kvh, hd)


def _heads_first(x: jax.Array, dtype: jnp.dtype, *, positions_minor: bool = False) -> jax.Array:
    """[P, kv, d] -> [1, 1, kv, P, d] (V's layout for one layer and row), or with
    `positions_minor` [1, 1, kv, d, P] (positions-minor K's)."""
    x = jnp.transpose(x, (1, 2, 0) if positions_minor else (1, 0, 2))
    return x[None, None].astype(dtype)


def _k_blocks(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """[P, kv, d] -> [1, 1, kv, ceil(P / 16), d, 16]: K's layout, for one layer and row; positions
    past P in the last block are zero."""
    p, kv, d = x.shape
    nb = _blocks(p)
    x = jnp.pad(x, ((0, nb * KV_BLOCK - p), (0, 0), (0, 0))).reshape(nb, KV_BLOCK, kv, d)
    return jnp.transpose(x, (2, 0, 3, 1))[None, None].astype(dtype)


def _embed(params: LlamaParams, tokens: jax.Array) -> jax.Array:
    """The embeddings of `tokens`: rows of `embed`, or for a tied packed model columns of its lm_head."""
    if params.embed is not None:
        return params.embed[tokens]
    assert isinstance(params.lm_head, PackedWeight)
    panels = params.lm_head.panels
    width = panels.shape[2]
    return panels[tokens // width, :, tokens % width]  # [*tokens.shape, hidden]


def _logits(params: LlamaParams, h: jax.Array) -> jax.Array:
    if params.lm_head is None:
        return jnp.einsum("...h,vh->...v", h, params.embed).astype(jnp.float32)
    return matmul(h, params.lm_head).astype(jnp.float32)


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, config: LlamaConfig) -> jax.Array:
    """q [..., T, kv, g, d], k and v [..., T, kv, d] -> [..., T, heads * d], causal."""
    t = q.shape[-4]
    scores = jnp.einsum("...qkgd,...skd->...kgqs", q, k) * (config.head_dim ** -0.5)
    mask = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    probs = _softmax(scores, mask, q.dtype)
    out = jnp.einsum("...kgqs,...skd->...qkgd", probs, v)
    return out.reshape(*out.shape[:-3], -1)


# --------------------------------------------------------------------------- entry points


Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _decoder(params: LlamaParams, tokens: jax.Array, positions: jax.Array, adapters: _Lora,
             attend: Attend, tables: RopeTables | None = None) -> jax.Array:
    """Embed, run every decoder layer, apply the final norm; `attend(layer, q, k, v)` is the
    attention; RoPE by `tables` (else computed from `positions`)."""
    config = params.config
    h = _embed(params, tokens)
    if tables is None:
        tables = rope_tables(positions, config)
    for i, layer in enumerate(params.layers):
        q, k, v = _qkv(rms_norm(h, layer.input_norm, config.rms_norm_eps), tables, layer, i, adapters, config)
        h = h + _project(attend(i, q, k, v), layer, i, ("o_proj",), adapters)[0]
        h = h + _mlp(rms_norm(h, layer.post_attention_norm, config.rms_norm_eps), layer, i, adapters)
    return rms_norm(h, params.norm, config.rms_norm_eps)


def _prefill(params: LlamaParams, lora_pool: LoraPool | None, cache: KVCache, tokens: jax.Array,
             length: jax.Array, row: jax.Array, slot: jax.Array) -> tuple[jax.Array, KVCache]:
    config = params.config
    k_cache, v_cache = cache.k, cache.v

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        nonlocal k_cache, v_cache
        # k [P, kv, d] goes to [kv, P / 16, d, 16] or [kv, d, P], v to [kv, P, d], of layer i, row `row`
        if cache.blocked:
            k_cache = jax.lax.dynamic_update_slice(k_cache, _k_blocks(k, k_cache.dtype), (i, row, 0, 0, 0, 0))
        else:
            k_cache = jax.lax.dynamic_update_slice(k_cache, _heads_first(k, k_cache.dtype, positions_minor=True),
                                                   (i, row, 0, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, _heads_first(v, v_cache.dtype), (i, row, 0, 0, 0))
        return _causal_attention(q, k, v, config)

    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    h = _decoder(params, tokens, positions, _Lora(lora_pool, config, slot=slot), attend)
    last = jax.lax.dynamic_index_in_dim(h, length - 1, 0, keepdims=False)
    return _logits(params, last), KVCache(k_cache, v_cache)


def attention_kernel(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, k: jax.Array,
                     v: jax.Array, layer: int, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step's attention of layer `layer` by the native kernel (computed/kernels/attention.cc):
    writes `k` and `v` [B, kv, d] at position lengths[b] - 1 of row b of the caches (rows with
    length 0 write nothing), then attends q [B, kv, g, d] over each row's first lengths[b]
    positions, read in place. Returns (out [B, kv, g, d] float32, k_cache, v_cache); the caches are
    updated in place (the kernel's results alias them)."""
    kernels.require()
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
              jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(kernels.ATTENTION, shapes, input_output_aliases={1: 1, 2: 2})
    out, k_cache, v_cache = call(q.astype(jnp.float32), k_cache, v_cache, lengths, k.astype(jnp.float32),
                                 v.astype(jnp.float32), layer=np.int64(layer), scale=np.float32(scale))
    return out, k_cache, v_cache


def _decode(params: LlamaParams, lora_pool: LoraPool | None, cache: KVCache, tokens: jax.Array,
            positions: jax.Array, slots: jax.Array, active: jax.Array, tables: RopeTables, attend_len: int,
            window: int,
            lora_impl: str = "segmented", attention: str = "xla") -> tuple[jax.Array, KVCache]:
    """One decode step. With `attention` "xla", attention reads the first `attend_len` cache
    positions (static: one compile per length bucket), so a step costs what the longest running
    sequence needs, not what the cache could hold; with "kernel", each row reads its own positions
    in place (`attend_len` unused). `window` (static) is the LoRA window (lora.choose_window);
    `lora_impl` "gather" swaps in the per-token gather, for benchmarks."""
    config = params.config
    n_rows, max_len = tokens.shape[0], cache.max_len
    rows = jnp.arange(n_rows)
    write_at = jnp.where(active, positions, max_len)  # out of range: dropped, the cache is untouched
    visible = (jnp.arange(attend_len)[None, :] <= positions[:, None])[:, None, None, :]
    lengths = jnp.where(active, positions + 1, 0).astype(jnp.int32)
    k_cache, v_cache = cache.k, cache.v

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        # q [B, kv, g, d]; k and v [B, kv, d], written at position positions[b] of row b
        nonlocal k_cache, v_cache
        if attention == "kernel":  # writes k and v too
            out, k_cache, v_cache = attention_kernel(q, k_cache, v_cache, lengths, k, v, i, config.head_dim ** -0.5)
            return out.astype(q.dtype).reshape(n_rows, -1)
        if cache.blocked:  # the kernel's layout, read by XLA (tests, comparisons)
            block_at = jnp.where(active, positions // KV_BLOCK, cache.k.shape[3])  # out of range: dropped
            k_cache = k_cache.at[i, rows, :, block_at, :, positions % KV_BLOCK].set(k.astype(k_cache.dtype),
                                                                                   mode="drop")
            keys = jax.lax.slice_in_dim(k_cache[i], 0, _blocks(attend_len), axis=2)  # [B, kv, L / 16, d, 16]
            keys = jnp.swapaxes(keys, 2, 3).reshape(*keys.shape[:2], keys.shape[3], -1)[..., :attend_len]
        else:
            k_cache = k_cache.at[i, rows, :, :, write_at].set(k.astype(k_cache.dtype), mode="drop")
            keys = jax.lax.slice_in_dim(k_cache[i], 0, attend_len, axis=3)  # [B, kv, d, L]
        v_cache = v_cache.at[i, rows, :, write_at].set(v.astype(v_cache.dtype), mode="drop")
        values = jax.lax.slice_in_dim(v_cache[i], 0, attend_len, axis=2)  # [B, kv, L, d]
        scores = jnp.einsum("bkgd,bkds->bkgs", q, keys) * (config.head_dim ** -0.5)
        probs = _softmax(scores, visible, q.dtype)
        return jnp.einsum("bkgs,bksd->bkgd", probs, values).reshape(n_rows, -1)

    if lora_pool is None:
        adapters = _Lora(None, config)
    elif lora_impl == "gather":
        adapters = _Lora(lora_pool, config, gather=slots)
    elif window == lora.KERNEL:
        adapters = _Lora(lora_pool, config, rows=slots)
    else:
        adapters = _Lora(lora_pool, config, seg=lora.segments(slots, lora_pool.scaling.shape[0], window=window,
                                                              rows=2 * n_rows))
    h = _decoder(params, tokens, positions, adapters, attend, tables)
    return _logits(params, h), KVCache(k_cache, v_cache)


def _forward_full(params: LlamaParams, lora_pool: LoraPool | None, tokens: jax.Array,
                  slots: jax.Array, kernel: bool) -> jax.Array:
    config = params.config
    n_rows, t = tokens.shape
    token_slots = jnp.broadcast_to(slots[:, None], (n_rows, t)).reshape(-1)
    if lora_pool is None:
        adapters = _Lora(None, config)
    elif kernel:
        adapters = _Lora(lora_pool, config, rows=token_slots)
    else:
        adapters = _Lora(lora_pool, config, seg=lora.segments(token_slots, lora_pool.scaling.shape[0]))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n_rows, t))
    h = _decoder(params, tokens, positions, adapters,
                 lambda i, q, k, v: _causal_attention(q, k, v, config))
    return _logits(params, h)


prefill_jit = jax.jit(_prefill, donate_argnames="cache")
decode_jit = jax.jit(_decode, donate_argnames="cache",
                     static_argnames=("attend_len", "window", "lora_impl", "attention"))
forward_full_jit = jax.jit(_forward_full, static_argnames="kernel")


def _host_i32(x: Any, name: str) -> np.ndarray:
    """A host int32 array: Python ints, numpy ints and int32 arrays all trace alike (no recompile)."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu" and arr.dtype != np.bool_:
        raise TypeError(f"{name} must be integers, got {arr.dtype}")
    return arr.astype(np.int32)


def _check_tokens(tokens: np.ndarray, config: LlamaConfig) -> None:
    if tokens.size and not (0 <= tokens.min() and tokens.max() < config.vocab_size):
        raise ValueError(f"token ids must be in [0, {config.vocab_size}) (vocab_size); "
                         f"got {tokens.min()}..{tokens.max()}")


def _check_slots(slots: np.ndarray, lora_pool: LoraPool | None) -> None:
    limit = 0 if lora_pool is None else int(lora_pool.scaling.shape[0])
    bad = slots[(slots < lora.BASE) | (slots >= limit)]
    if bad.size:
        raise ValueError(f"slot {int(bad[0])} is outside [-1, {limit}): -1 is the base model"
                         + ("; no LoRA pool was given" if lora_pool is None else
                            f", the pool has {limit} slots (max_loras)"))


def prefill(params: LlamaParams, lora_pool: LoraPool | None, cache: KVCache, tokens: Any, length: int,
            row: int, slot: int) -> tuple[jax.Array, KVCache]:
    """Run one prompt (`tokens [P]`, the first `length` real, the rest padding) into cache row `row`.

    Returns (logits [vocab] float32 after token length - 1, the updated cache);
    `cache` is donated. `slot` is the request's LoRA slot, or -1 for the base model.
    One compile per P (bucket the prompt lengths).
    """
    tokens = _host_i32(tokens, "tokens")
    if tokens.ndim != 1 or not 1 <= tokens.shape[0] <= cache.max_len:
        raise ValueError(f"prefill takes tokens [P] with 1 <= P <= the cache's max_len {cache.max_len}; "
                         f"got shape {tokens.shape}")
    _check_tokens(tokens, params.config)
    length_, row_, slot_ = (_host_i32(v, n) for v, n in ((length, "length"), (row, "row"), (slot, "slot")))
    if not 1 <= length_ <= tokens.shape[0]:
        raise ValueError(f"length {int(length_)} must be in [1, {tokens.shape[0]}] (the padded prompt's length)")
    if not 0 <= row_ < cache.max_batch:
        raise ValueError(f"row {int(row_)} is outside the cache's {cache.max_batch} rows (max_batch)")
    _check_slots(slot_.reshape(1), lora_pool)
    return prefill_jit(params, lora_pool, cache, tokens, length_, row_, slot_)


def decode(params: LlamaParams, lora_pool: LoraPool | None, cache: KVCache, tokens: Any, positions: Any,
           slots: Any, active: Any, attend_len: int | None = None, *, window: int | None = None,
           lora_impl: str = "segmented", attention: str | None = None) -> tuple[jax.Array, KVCache]:
    """One decode step for every cache row: each argument `[max_batch]`. Returns (logits [B, vocab] f32, cache).

    Row b appends `tokens[b]` at `positions[b]` (< max_len) and attends to
    [0, positions[b]] with LoRA slot `slots[b]` (-1: base). Rows with
    `active[b]` False write nothing to the cache and their other entries are
    ignored. `cache` is donated. `window` is the LoRA window, one compile per
    size: by default `lora.choose_window` picks one of `lora.windows_for(max_batch)`
    for this mix, which is `lora.KERNEL` (the native kernel) where it is available;
    a size from `lora.loop_windows` forces the window loop. `lora_impl="gather"` gathers A
    and B per row instead (BGMV-style, for benchmarks; serving never does). `attention`
    "kernel" reads each row's own positions of the cache in place (the native kernel; then
    `attend_len` is only checked, and one compile serves every length), "xla" the first
    `attend_len` positions of every row; by default `attention_impl(cache)`.
    """
    tokens, positions, slots = (_host_i32(tokens, "tokens"), _host_i32(positions, "positions"),
                                _host_i32(slots, "slots"))
    active = np.asarray(active, np.bool_)
    b = cache.max_batch
    for name, arr in (("tokens", tokens), ("positions", positions), ("slots", slots), ("active", active)):
        if arr.shape != (b,):
            raise ValueError(f"decode takes {name} of shape [{b}] (the cache's max_batch); got {arr.shape}")
    live = positions[active]
    if live.size and not (0 <= live.min() and live.max() < cache.max_len):
        raise ValueError(f"active rows need positions in [0, {cache.max_len}) (the cache's max_len); "
                         f"got {live.min()}..{live.max()}")
    _check_tokens(tokens[active], params.config)
    tokens = np.where(active, tokens, 0).astype(np.int32)
    slots = np.where(active, slots, lora.BASE).astype(np.int32)  # inactive rows compute no LoRA term
    _check_slots(slots, lora_pool)
    positions = np.where(active, positions, 0).astype(np.int32)
    if attend_len is None:
        attend_len = cache.max_len
    if not (live.size == 0 or live.max() < attend_len <= cache.max_len):
        raise ValueError(f"attend_len {attend_len} must exceed every active position and be at "
                         f"most the cache's max_len {cache.max_len}")
    if lora_impl not in ("segmented", "gather"):
        raise ValueError(f"lora_impl must be 'segmented' or 'gather', got {lora_impl!r}")
    if attention is None:
        attention = attention_impl(cache)
    elif attention not in ("kernel", "xla"):
        raise ValueError(f"attention must be 'kernel' or 'xla', got {attention!r}")
    if attention == "kernel" and not _kernel_layout(cache):
        raise ValueError("attention='kernel' needs a float32 cache with K in blocks: init_cache(..., blocked=True)")
    if attention == "kernel":
        attend_len = cache.max_len  # unused by the kernel: one compile for every length
    if lora_pool is None or lora_impl == "gather":
        window = 0  # unused: one compile whatever the caller passed
    elif window is None:
        window = lora.choose_window(slots, lora.windows_for(b))
    elif window == lora.KERNEL:
        if not kernels.available():
            raise ValueError(f"window lora.KERNEL needs the native LoRA kernel, which is unavailable here "
                             f"({kernels.unavailable_reason()}); leave window unset to use the window loop")
    elif not 1 <= window <= b or lora.padded_rows(slots, window) > 2 * b:
        raise ValueError(f"window {window} does not fit this mix of slots in {2 * b} rows (twice max_batch); "
                         "leave window unset to have lora.choose_window pick one")
    return decode_jit(params, lora_pool, cache, tokens, positions, slots, active,
                      rope_tables(positions, params.config),
                      attend_len=attend_len, window=window, lora_impl=lora_impl, attention=attention)


def attention_impl(cache: KVCache) -> str:
    """How decode attends by default: "kernel" (computed/kernels/attention.cc) for a float32 cache
    with K blocked (init_cache's default where the native kernels are available), else "xla"."""
    return "kernel" if _kernel_layout(cache) and kernels.available() else "xla"


def _kernel_layout(cache: KVCache) -> bool:
    """Whether the attention kernel can read `cache`: float32, K in blocks."""
    return cache.blocked and cache.k.dtype == jnp.float32


def compile_serving(params: LlamaParams, lora_pool: LoraPool | None, cache: KVCache, *,
                    prompt_lengths: tuple[int, ...], attend_lens: tuple[int, ...],
                    windows: tuple[int, ...]) -> None:
    """Compile, ahead of time and into jit's caches, every prefill and decode that serving calls:
    one per prompt length, and one per attention length (only one with the attention kernel) and
    LoRA window. Only the shapes and dtypes of `lora_pool` and `cache` are used (nothing is read
    or donated), so a replica can warm up while diffs keep writing its pool."""
    def shapes(tree: Any) -> Any:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

    pool_s, cache_s = shapes(lora_pool), shapes(cache)
    scalar = np.zeros((), np.int32)
    for p in prompt_lengths:  # as `prefill` calls it
        prefill_jit.lower(params, pool_s, cache_s, np.zeros(p, np.int32), scalar, scalar, scalar).compile()
    rows = np.zeros(cache.max_batch, np.int32)
    attention = attention_impl(cache)
    for attend_len in attend_lens if attention == "xla" else (cache.max_len,):  # as `decode` calls it
        for window in (windows if lora_pool is not None else (0,)):
            decode_jit.lower(params, pool_s, cache_s, rows, rows, rows, np.zeros(cache.max_batch, np.bool_),
                             rope_tables(rows, params.config), attend_len=attend_len, window=window, lora_impl="segmented",
                             attention=attention).compile()


def forward_full(params: LlamaParams, lora_pool: LoraPool | None, tokens: Any, slots: Any, *,
                 lora_impl: str | None = None) -> jax.Array:
    """Logits [B, T, vocab] float32 for `tokens [B, T]`, row b with LoRA slot `slots[b]`; no cache.

    The LoRA terms come from the native kernel where it is available, else the window loop;
    `lora_impl` "kernel" or "loop" picks one."""
    if lora_impl not in (None, "kernel", "loop"):
        raise ValueError(f"lora_impl must be 'kernel' or 'loop', got {lora_impl!r}")
    tokens, slots = _host_i32(tokens, "tokens"), _host_i32(slots, "slots")
    if tokens.ndim != 2 or slots.shape != tokens.shape[:1]:
        raise ValueError(f"forward_full takes tokens [B, T] and slots [B]; got {tokens.shape} and {slots.shape}")
    _check_tokens(tokens, params.config)
    _check_slots(slots, lora_pool)
    return forward_full_jit(params, lora_pool, tokens, slots,
                            kernel=lora_impl == "kernel" or (lora_impl is None and kernels.available()))


__all__ = [
    "KVCache", "LayerParams", "LlamaConfig", "LlamaParams", "ModelLoadError", "RopeConfig",
    "attention_impl", "attention_kernel", "decode", "forward_full", "init_cache", "inv_freq", "load_model", "prefill", "rms_norm", "rope",
    "with_layout",
]
