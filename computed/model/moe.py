"""A sparse layer's MLP (Mixtral, Qwen3-MoE): top-k routing as transformers computes it, and the
experts run grouped by expert.

Routing (transformers 5's `MixtralTopKRouter` / `Qwen3MoeTopKRouter`): the router's logits in
the model dtype, softmax in float32, the top k, renormalised to sum to 1 (Mixtral always,
Qwen3-MoE when `norm_topk_prob`), and for Qwen3-MoE rounded to the model dtype. Each token's
output is the sum of its experts' outputs times their weights, each product rounded to the
model dtype and added in ascending expert order, as transformers' `index_add_` over the experts
adds them.

The experts: the token-expert assignments (tokens * k) are sorted by expert into a buffer in
which each expert's run is padded to whole windows of `window` rows, and each window is one
product with its expert's weights (read once per window, never gathered per token), its rows
taken by dynamic slice, as the XLA backend's LoRA window loop does for slots
(computed/model/lora.py). Up to SPLIT_MAX experts, each expert's weights are an array of their own
and a loop per expert runs that expert's windows (its trip count the windows its run takes,
often none); past it they are stacked and one loop over every window in use takes its
expert's weights by dynamic index, which XLA's CPU backend copies out of the stack before each
product: at Mixtral's proportions (4 experts of 1024 -> 2816, a decode batch of 32, top 2)
that loop took 2.0x the time of the loops per expert (median of 7 interleaved rounds, range
1.6-3.0x, on a 2-CPU AMD EPYC shared with other work), while a loop per
expert makes the graph grow with the experts (compile time: Qwen3-MoE's 128 a layer would
be thousands of loops). Every shape is static (the buffer holds the worst case), so a change
in routing never recompiles. XLA's `ragged_dot` is not used: on the CPU it lowers to a masked
product over every expert (8 experts, 64 assignments, 1024 -> 2816: 46 ms, against 10 ms for
the window loop). Both backends run the experts on XLA's dot: the native dense kernel's
panels are laid out per projection.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from computed.model.config import DecoderConfig
from computed.model.params import Experts

MAX_WINDOW = 64
SPLIT_MAX = 16  # up to this many experts a layer: an array and a loop per expert (Mixtral's 8)


def window(assignments: int, experts: int) -> int:
    """The rows of a window (static): the power of two at or below the mean run per expert,
    at most MAX_WINDOW: a decode step's few rows per expert pad little, a prompt's many take
    few windows."""
    mean = max(1, assignments // experts)
    return min(MAX_WINDOW, 1 << (mean.bit_length() - 1))


def route(x: jax.Array, router: jax.Array, config: DecoderConfig) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k], experts [T, k]) of tokens `x [T, hidden]`, each token's experts in
    ascending order."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, config.experts_per_tok)
    if config.norm_topk:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    if config.route_in_dtype:
        top = top.astype(x.dtype)
    order = jnp.argsort(idx, axis=-1)
    return jnp.take_along_axis(top, order, axis=-1), jnp.take_along_axis(idx, order, axis=-1)


def moe(h: jax.Array, experts: Experts, config: DecoderConfig,
        act: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """The mixture of experts' output for `h [..., hidden]` (act: the experts' activation, as the
    dense MLP's: `act(gate, up)`)."""
    lead, hidden = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, hidden)
    tokens, k, n_experts = x.shape[0], config.experts_per_tok, config.num_experts
    size = experts.down[0].shape[-2]  # an expert's [expert_size, hidden], stacked or not
    weights, idx = route(x, experts.router, config)

    m = tokens * k
    w = window(m, n_experts)
    rows = -(-(m + min(n_experts, m) * (w - 1)) // w) * w  # every expert's run padded: the worst case
    flat = idx.reshape(-1)  # assignment a is token a // k's (a % k)-th expert
    counts = jnp.bincount(flat, length=n_experts)
    padded = (counts + w - 1) // w * w
    ends = jnp.cumsum(padded)
    order = jnp.argsort(flat, stable=True)  # the assignments in expert order
    by_expert = flat[order]
    rank = jnp.arange(m) - (jnp.cumsum(counts) - counts)[by_expert]
    dest = jnp.zeros((m,), jnp.int32).at[order].set((ends - padded)[by_expert] + rank)
    buf = jnp.zeros((rows, hidden), x.dtype).at[dest].set(x[jnp.arange(m) // k])

    def window_of(gate_up: jax.Array, down: jax.Array) -> Callable[[jax.Array, jax.Array], jax.Array]:
        """The loop body that runs window i of `buf` through the expert of these weights."""
        def one_window(i: jax.Array, out: jax.Array) -> jax.Array:
            xs = jax.lax.dynamic_slice_in_dim(buf, i * w, w)
            g = xs @ gate_up
            return jax.lax.dynamic_update_slice_in_dim(out, act(g[:, :size], g[:, size:]) @ down, i * w, 0)
        return one_window

    out = jnp.zeros((rows, hidden), x.dtype)
    if isinstance(experts.gate_up, tuple) and isinstance(experts.down, tuple):
        for e, (gate_up, down) in enumerate(zip(experts.gate_up, experts.down)):
            out = jax.lax.fori_loop((ends[e] - padded[e]) // w, ends[e] // w, window_of(gate_up, down), out)
    else:
        stacked_gate_up, stacked_down = experts.gate_up, experts.down
        assert isinstance(stacked_gate_up, jax.Array) and isinstance(stacked_down, jax.Array)
        window_expert = jnp.searchsorted(ends, jnp.arange(rows // w) * w, side="right")

        def any_window(i: jax.Array, out: jax.Array) -> jax.Array:
            e = window_expert[i]
            return window_of(stacked_gate_up[e], stacked_down[e])(i, out)

        out = jax.lax.fori_loop(0, ends[-1] // w, any_window, out)
    ys = out[dest].reshape(tokens, k, hidden)
    parts = (ys.astype(jnp.float32) * weights[..., None].astype(jnp.float32)).astype(x.dtype)
    total = parts[:, 0]
    for j in range(1, k):  # in ascending expert order, rounded after each add, as index_add_
        total = total + parts[:, j]
    result: jax.Array = total.reshape(*lead, hidden)
    return result
