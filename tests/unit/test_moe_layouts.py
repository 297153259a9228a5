"""computed/model/moe.py's two layouts of the experts' weights give the same output, and the
output a token-by-token reference gives: an array and a loop per expert (up to SPLIT_MAX
experts: what the loader builds for Mixtral and the parity tests' checkpoints) and one stacked
array with a loop over every window (past it: Qwen3-MoE's 128), which only this test runs.

Batches of a decode step's size (a few rows an expert: one window each) and of a prompt's
(several windows an expert, some experts with none), float32 on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from computed.model import moe
from computed.model.params import Experts

HIDDEN, SIZE = 24, 20


@dataclass(frozen=True)
class Routing:
    """The config fields `moe.moe` reads."""

    num_experts: int
    experts_per_tok: int
    norm_topk: bool = True
    route_in_dtype: bool = False


def act(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def reference(x: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray,
              config: Routing) -> np.ndarray:
    """Token by token: softmax over the router's logits, the top k renormalised, each chosen
    expert's SwiGLU output times its weight, summed."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = row @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[:config.experts_per_tok]
        weights = probs[top] / probs[top].sum() if config.norm_topk else probs[top]
        for e, wt in zip(top, weights):
            g = row @ gate_up[e]
            h = g[:SIZE] / (1 + np.exp(-g[:SIZE])) * g[SIZE:]
            out[t] += wt * (h @ down[e])
    return out


@pytest.mark.parametrize("experts,k,tokens", [(4, 2, 8), (6, 3, 5), (4, 2, 64), (20, 2, 48)])
def test_split_and_stacked_experts_give_the_reference_output(experts: int, k: int, tokens: int) -> None:
    rng = np.random.default_rng(experts * 100 + tokens)
    router = rng.normal(size=(HIDDEN, experts)).astype(np.float32)
    gate_up = (rng.normal(size=(experts, HIDDEN, 2 * SIZE)) / np.sqrt(HIDDEN)).astype(np.float32)
    down = (rng.normal(size=(experts, SIZE, HIDDEN)) / np.sqrt(SIZE)).astype(np.float32)
    x = rng.normal(size=(tokens, HIDDEN)).astype(np.float32)
    config = Routing(num_experts=experts, experts_per_tok=k)
    run = jax.jit(lambda h, ex: moe.moe(h, ex, config, act))  # type: ignore[arg-type]
    stacked = Experts(router=jnp.asarray(router), gate_up=jnp.asarray(gate_up), down=jnp.asarray(down))
    split = Experts(router=jnp.asarray(router), gate_up=tuple(jnp.asarray(w) for w in gate_up),
                    down=tuple(jnp.asarray(w) for w in down))
    want = reference(x, router, gate_up, down, config)
    scale = np.abs(want).max()
    for experts_of in (stacked, split):
        got = np.asarray(run(jnp.asarray(x), experts_of))
        assert np.abs(got - want).max() <= 1e-5 * scale, type(experts_of.gate_up)
    assert np.abs(np.asarray(run(jnp.asarray(x), stacked)) - np.asarray(run(jnp.asarray(x), split))).max() \
        <= 1e-6 * scale

