"""The decoder every served family is, in JAX, with multi-LoRA and a KV cache: Hugging Face's
`LlamaForCausalLM` with what each family's config changes (shared/modelconfig.py `DecoderConfig`).

The model is pure functions over a parameter pytree (`DecoderParams`, whose static `DecoderConfig`
and backend ride along as pytree metadata, so every entry point takes just `params`). What it
reproduces of transformers 5.24's `modeling_llama.py`:

- RMSNorm computed in float32 and cast back before the weight multiplies it; eps from
  `rms_norm_eps`.
- RoPE (rotate-half form) with `rope_theta`, and the `linear` and `llama3` scalings
  (computed/model/config.py `inv_freq`).
- Grouped-query attention (computed/model/attention.py), softmax in float32.
- SwiGLU MLP `down(silu(gate(x)) * up(x))`; optional attention and MLP biases.
- Tied (`lm_head` is the embedding) or untied output embeddings.

The projections and the lm_head are `x W`, by the backend (computed/backend): XLA's dot, or the
native dense kernel over weights packed at load. Modules that read the same x share a call.
LoRA is added to q, k, v, o, gate, up and down wherever the pool has the module (the backend's `project`):
`y = x W (+ bias) + scaling[s] * B[s] (A[s] x)`, as PEFT does; slot -1 is the base model and adds
nothing. Rows that mix slots take the backend's terms (its `prepare` groups their tokens by slot).

Entry points (jitted; computed/model/runner.py checks their arguments on the host), the first two
donating the cache so it is updated in place:

- `prefill_jit(params, lora_pool, cache, tokens[n, P], lengths[n], rows[n], slots[n])`: n prompts
  padded to one bucket length P, prompt i with LoRA slot `slots[i]`; writes K/V of positions
  [0, P) of cache row `rows[i]` (positions from `lengths[i]` on hold padding, overwritten by
  decode before they are ever read) and returns each prompt's logits after its token
  `lengths[i] - 1`, and the final normed hidden states of every position `[n, P, hidden]` (for
  prompt logprobs, computed/model/scores.py; unread, they cost a buffer, not a transfer). The LoRA terms group the n * P tokens by slot, as a decode step's rows.
- `extend_jit(params, lora_pool, cache, tokens[n, C], starts[n], lengths[n], rows[n], slots[n])`:
  chunks that continue rows from positions starts[i] (multiples of 16): after a prefix-cache hit,
  and for the second and later chunks of a long prompt (computed/serving/prefill.py).
- `decode_jit(params, lora_pool, cache, tokens[B], positions[B], slots[B], active[B], tables, ...)`:
  one step for every row; row b writes its K/V at positions[b] and attends to [0, positions[b]]
  by the backend's decode attention. Inactive rows write nothing. With `rows[n]` the step runs
  over n entries instead, entry i for cache row rows[i]: the projections, the bulk of a step,
  cost what n rows cost, not what max_batch rows do (computed/model/runner.py picks n).
- `forward_full_jit(params, lora_pool, tokens[B, T], slots[B])`: every position's logits, no cache.

Layers are a Python loop over per-layer parameters, unrolled at trace time: in a CPU measurement
of decode-sized matmuls, `lax.scan` over stacked layer weights was markedly slower (it slices
each layer out per iteration); the cost is a compile time that grows with the number of layers.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from computed.backend.base import Backend
from computed.model import attention, kv_cache, moe
from computed.model import rope as rope_lib
from computed.model.config import DecoderConfig
from computed.model.kv_cache import KVCache
from computed.model.packed import PackedWeight
from computed.model.params import LayerParams, DecoderParams
from computed.residency.pool import LoraPool


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, config: DecoderConfig) -> jax.Array:
    """RMSNorm as the family computes it: Llama casts back before the weight multiplies; Gemma
    and OLMo multiply in float32 and cast once (a Gemma weight is stored as 1 + w in float32,
    computed/model/loader.py)."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    if config.norm == "llama":
        return weight * h.astype(x.dtype)
    return (weight.astype(jnp.float32) * h).astype(x.dtype)


RopeTables = tuple[tuple[jax.Array, jax.Array], ...]  # (cos, sin) for each of the config's `ropes`


def rope_tables(positions: Any, config: DecoderConfig, seq_lens: Any = None) -> RopeTables:
    """cos and sin `[..., 1, head_dim // 2]` float32 for `positions [...]`, one pair per distinct
    RoPE of the layers (`config.ropes`): in the graph for a traced array, on the host for a numpy
    one. Decode passes host tables in: computed in the graph, XLA fused cos and sin into every
    layer's RoPE and evaluated them once per element of q and k. `seq_lens` (dynamic RoPE only):
    each row's sequence length, by default position + 1 (a decode step's; computed/model/rope.py)."""
    if seq_lens is None and any(r.type == "dynamic" for r in config.ropes):
        seq_lens = positions + 1
    return tuple(rope_lib.rope_tables(positions, r, config.head_dim, seq_lens=seq_lens) for r in config.ropes)


def rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate `x [..., heads, head_dim]` by the positions of `tables` (rotate-half form, as HF)."""
    cos, sin = (t.astype(x.dtype) for t in tables)
    # HF's x * cos + rotate_half(x) * sin on the two halves: the same products and sums
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos + -x2 * sin, x2 * cos + x1 * sin], axis=-1)


class _Projections:
    """How one forward pass computes `x W (+ bias) (+ LoRA)`: the backend's `project`, with LoRA
    for each token's own slot (`batch`, the backend's `prepare`)."""

    def __init__(self, backend: Backend, pool: LoraPool | None, batch: Any = None) -> None:
        self.backend, self.pool, self.batch = backend, pool, batch

    def __call__(self, x: jax.Array, layer: LayerParams, index: int, modules: tuple[str, ...]) -> list[jax.Array]:
        """`x W (+ bias) (+ LoRA)` for each of `modules`, which all read `x` (their products share a
        call of the dense kernel, their LoRA terms one of the LoRA kernel)."""
        return self.backend.project(x, modules, [layer.weights[m] for m in modules], layer.biases,
                                    self.pool, self.batch, index)


def _qkv(x: jax.Array, tables: RopeTables, layer: LayerParams, index: int, project: _Projections,
         config: DecoderConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., kv_heads, group, head_dim], k and v [..., kv_heads, head_dim], q/k norms and RoPE applied."""
    lead, hd, kvh, eps = x.shape[:-1], config.head_dim, config.num_kv_heads, config.rms_norm_eps
    q, k, v = project(x, layer, index, ("q_proj", "k_proj", "v_proj"))
    if config.qk_norm == "full":  # OLMo 2: over the whole projection
        q, k = rms_norm(q, layer.norms["q_norm"], eps, config), rms_norm(k, layer.norms["k_norm"], eps, config)
    q, k = q.reshape(*lead, config.num_heads, hd), k.reshape(*lead, kvh, hd)
    if config.qk_norm == "head":  # Qwen3, Gemma 3: per head
        q, k = rms_norm(q, layer.norms["q_norm"], eps, config), rms_norm(k, layer.norms["k_norm"], eps, config)
    cos_sin = tables[config.rope_index(index)]
    q, k = rope(q, cos_sin), rope(k, cos_sin)
    return q.reshape(*lead, kvh, config.num_heads // kvh, hd), k, v.reshape(*lead, kvh, hd)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up as torch computes it in their dtype: silu in float32, rounded once, then the
    product. (jax.nn.silu on bfloat16 rounds after each of its steps, which XLA on the CPU runs as
    float32 ops between converts: about 1.7x the time of this, and further from torch.)"""
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up


def gelu_tanh_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gelu_pytorch_tanh(gate) * up, the activation in float32 and rounded once, as torch does."""
    return jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype) * up


def _mlp(x: jax.Array, layer: LayerParams, index: int, project: _Projections, config: DecoderConfig) -> jax.Array:
    act = silu_mul if config.act == "silu" else gelu_tanh_mul
    if layer.experts is not None:  # a sparse layer: no LoRA on the experts (docs/adapters.md)
        return moe.moe(x, layer.experts, config, act)
    gate, up = project(x, layer, index, ("gate_proj", "up_proj"))
    return project(act(gate, up), layer, index, ("down_proj",))[0]


def _scaled(x: jax.Array, factor: float) -> jax.Array:
    """x * a Python float, computed in float32 and rounded once (torch's scalar multiply)."""
    return x if factor == 1.0 else (x.astype(jnp.float32) * factor).astype(x.dtype)


def _embed(params: DecoderParams, tokens: jax.Array) -> jax.Array:
    """The embeddings of `tokens`: rows of `embed`, or for a tied packed model columns of its
    lm_head; times the family's embedding multiplier."""
    config = params.config
    if params.embed is not None:
        h = params.embed[tokens]
    else:
        assert isinstance(params.lm_head, PackedWeight)
        h = params.lm_head.columns(tokens)  # [*tokens.shape, hidden]
    if config.embed_multiplier_in_dtype:  # Gemma: sqrt(hidden) rounded to the model dtype first
        return h * jnp.asarray(config.embed_multiplier, h.dtype)
    return _scaled(h, config.embed_multiplier)


def _logits(params: DecoderParams, h: jax.Array) -> jax.Array:
    """The LM head over final normed hidden states `h [..., hidden]`: float32 logits [..., vocab]."""
    config = params.config
    if params.lm_head is None:
        logits = jnp.einsum("...h,vh->...v", h, params.embed)
    else:
        logits = params.backend.matmuls(h, [params.lm_head])[0]
    if config.logits_scaling != 1.0:
        logits = _scaled(logits, 1.0 / config.logits_scaling)
    logits = logits.astype(jnp.float32)
    if config.final_softcap:
        logits = jnp.tanh(logits / config.final_softcap) * config.final_softcap
    return logits


Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def attention_options(config: DecoderConfig, layer: int) -> dict[str, Any]:
    """The keyword options of layer `layer`'s attention (computed/model/attention.py)."""
    return dict(scale=config.query_scale, window=config.window(layer), softcap=config.attn_softcap)


def _decoder(params: DecoderParams, tokens: jax.Array, positions: jax.Array, project: _Projections,
             attend: Attend, tables: RopeTables | None = None, seq_lens: Any = None) -> jax.Array:
    """Embed, run every decoder layer, apply the final norm; `attend(layer, q, k, v)` is the
    attention; RoPE by `tables` (else computed from `positions`)."""
    config = params.config
    eps, r = config.rms_norm_eps, config.residual_multiplier
    h = _embed(params, tokens)
    if tables is None:
        tables = rope_tables(positions, config, seq_lens)
    for i, layer in enumerate(params.layers):
        norms = layer.norms

        def block(x: jax.Array, pre: str, post: str, run: Callable[[jax.Array], jax.Array]) -> jax.Array:
            if config.layout != "post":
                x = rms_norm(x, norms[pre], eps, config)
            y = run(x)
            if config.layout != "pre":
                y = rms_norm(y, norms[post], eps, config)
            return y

        def attn(x: jax.Array, i: int = i, layer: LayerParams = layer) -> jax.Array:
            q, k, v = _qkv(x, tables, layer, i, project, config)
            return project(attend(i, q, k, v), layer, i, ("o_proj",))[0]

        def mlp(x: jax.Array, i: int = i, layer: LayerParams = layer) -> jax.Array:
            return _mlp(x, layer, i, project, config)

        pre_mlp = "post_attention_layernorm" if config.layout == "pre" else "pre_feedforward_layernorm"
        h = h + _scaled(block(h, "input_layernorm", "post_attention_layernorm", attn), r)
        h = h + _scaled(block(h, pre_mlp, "post_feedforward_layernorm", mlp), r)
    return rms_norm(h, params.norm, eps, config)


def _prefill(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, tokens: jax.Array,
             lengths: jax.Array, rows: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array, KVCache]:
    n, p = tokens.shape

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        nonlocal cache
        cache = kv_cache.write_prompts(cache, i, rows, k, v)
        return attention.causal(q, k, v, **attention_options(params.config, i))

    # every token of prompt i reads slot i: windows of P tokens, one per prompt (XLA's window loop)
    token_slots = jnp.broadcast_to(slots[:, None], (n, p)).reshape(-1)
    batch = None if lora_pool is None else params.backend.prepare(token_slots, lora_pool.scaling.shape[0],
                                                                  params.backend.prefill_window(p))
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
    h = _decoder(params, tokens, positions, _Projections(params.backend, lora_pool, batch), attend,
                 seq_lens=lengths)
    last = h[jnp.arange(n), lengths - 1]  # [n, hidden]
    return _logits(params, last), h, params.backend.shard_cache(cache)


def _extend(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, tokens: jax.Array,
            starts: jax.Array, lengths: jax.Array, rows: jax.Array, slots: jax.Array
            ) -> tuple[jax.Array, jax.Array, KVCache]:
    """Prompt chunks that continue rows already holding KV: chunk i (`tokens [n, C]`, its first
    `lengths[i]` real) goes to positions [starts[i], starts[i] + C) of row rows[i] and attends
    over the row's cache up to each token's position (the positions before starts[i] hold a
    prefix-cache hit or earlier chunks). The whole cache length is read (one compile per (n, C)).
    Returns (logits [n, vocab] after each chunk's token lengths[i] - 1, the hidden states, the cache)."""
    n, c = tokens.shape
    positions = starts[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        nonlocal cache
        cache = kv_cache.write_prompts(cache, i, rows, k, v, starts)
        keys, values = kv_cache.read(cache, i, cache.max_len, rows)
        return attention.chunk(q, keys, values, positions, **attention_options(params.config, i))

    token_slots = jnp.broadcast_to(slots[:, None], (n, c)).reshape(-1)
    batch = None if lora_pool is None else params.backend.prepare(token_slots, lora_pool.scaling.shape[0],
                                                                  params.backend.prefill_window(c))
    h = _decoder(params, tokens, positions, _Projections(params.backend, lora_pool, batch), attend,
                 seq_lens=starts + lengths)
    last = h[jnp.arange(n), lengths - 1]
    return _logits(params, last), h, params.backend.shard_cache(cache)


def _decode(params: DecoderParams, lora_pool: LoraPool | None, cache: KVCache, tokens: jax.Array,
            positions: jax.Array, slots: jax.Array, active: jax.Array, tables: RopeTables, attend_len: int,
            window: int | None, rows: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """One decode step. `attend_len` (static) bounds the positions a bucket attention reads (one
    compile per length bucket); `window` (static) is the LoRA window where the backend has them.
    `rows [n]`: entry i is cache row rows[i] (the others attend as inactive rows; an entry of
    `max_batch` is padding), so the projections run over n rows, not the cache's max_batch."""
    backend = params.backend

    def attend(i: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        # q [B, kv, g, d]; k and v [B, kv, d], written at position positions[b] of row b
        nonlocal cache
        if rows is None:
            out, cache = backend.decode_attention(q, k, v, cache, i, positions, active, attend_len,
                                                 **attention_options(params.config, i))
            return out

        def spread(x: jax.Array) -> jax.Array:  # entry i to cache row rows[i]; padding dropped
            return jnp.zeros((cache.max_batch, *x.shape[1:]), x.dtype).at[rows].set(x, mode="drop")
        out, cache = backend.decode_attention(spread(q), spread(k), spread(v), cache, i, spread(positions),
                                              spread(active), attend_len, **attention_options(params.config, i))
        return jnp.take(out, rows, axis=0, mode="clip")

    batch = None if lora_pool is None else backend.prepare(slots, lora_pool.scaling.shape[0], window)
    h = _decoder(params, tokens, positions, _Projections(backend, lora_pool, batch), attend, tables)
    return _logits(params, h), backend.shard_cache(cache)


def _forward_full(params: DecoderParams, lora_pool: LoraPool | None, tokens: jax.Array,
                  slots: jax.Array) -> jax.Array:
    n_rows, t = tokens.shape
    token_slots = jnp.broadcast_to(slots[:, None], (n_rows, t)).reshape(-1)
    batch = None if lora_pool is None else params.backend.prepare(token_slots, lora_pool.scaling.shape[0], None)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n_rows, t))
    h = _decoder(params, tokens, positions, _Projections(params.backend, lora_pool, batch),
                 lambda i, q, k, v: attention.causal(q, k, v, **attention_options(params.config, i)),
                 seq_lens=jnp.full((n_rows,), t, jnp.int32))
    return _logits(params, h)


prefill_jit = jax.jit(_prefill, donate_argnames="cache")
extend_jit = jax.jit(_extend, donate_argnames="cache")
decode_jit = jax.jit(_decode, donate_argnames="cache", static_argnames=("attend_len", "window"))
forward_full_jit = jax.jit(_forward_full)
logits_of = _logits  # the LM head, for prompt logprobs (computed/model/scores.py)
