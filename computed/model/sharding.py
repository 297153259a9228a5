"""Tensor parallelism: the one-axis mesh, and how the weights, the KV cache and the LoRA pool lie on it.

A replica started with `--tensor-parallel N` (N > 1) runs on a mesh of its first N local
devices, one axis named `tp` (docs/tensor-parallel.md). Megatron-style:

- column-parallel q, k, v, gate, up: W [in, out] split on `out` (each device computes its own
  heads and its own slice of the intermediate activations; no communication);
- row-parallel o, down: W [in, out] split on `in` (each device multiplies its slice of the
  heads or of the intermediate activations; one all-reduce of the partial sums per module);
- embeddings, lm_head, norms and row-parallel biases replicated; column-parallel biases split
  with their outputs;
- the KV cache split by KV head (axis 2 of K and V in both layouts);
- the LoRA pool to match, as sgl-jax does: column-parallel modules' B split on its output
  dimension and A replicated; row-parallel modules' A split on its input dimension and B
  replicated; scaling and rank replicated.

Why replicated embeddings and lm_head: logits come out whole on every device, ready for the
host's sampling, with no gather, and a token's embedding is a local row; the price is
2 * vocab * hidden per device, which a vocab-sharded lm_head would cut by N (not done).

Everything here is pure rules over shapes; the compute on the mesh is the tensor-parallel
backend's (computed/backend/tp.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from computed.model.config import DecoderConfig
from computed.model.kv_blocks import KVBlocks
from computed.model.kv_cache import KVCache
from computed.model.packed import PackedWeight
from computed.model.params import LayerParams, DecoderParams
from computed.residency.pool import LoraPool, PoolSpec

AXIS = "tp"
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split on the output dimension
ROW = ("o_proj", "down_proj")                                     # split on the input dimension


class TensorParallelError(ValueError):
    """A model or machine that cannot run with the asked tensor-parallel degree."""


def check(config: DecoderConfig, n: int, devices: int) -> None:
    """Refuse, naming the numbers, a degree `n` that does not divide the model's KV heads or
    intermediate size, or that exceeds the `devices` there are."""
    if n < 1:
        raise TensorParallelError(f"--tensor-parallel must be at least 1, got {n}")
    if config.num_experts and n > 1:
        raise TensorParallelError(f"--tensor-parallel {n} is not supported for mixture-of-experts models "
                                  f"({config.model_type}: no expert-parallel rules yet); serve it with "
                                  "--tensor-parallel 1")
    problems = []
    if config.num_kv_heads % n:
        problems.append(f"the model's {config.num_kv_heads} KV heads (num_key_value_heads)")
    if config.intermediate_size % n:
        problems.append(f"the model's intermediate_size {config.intermediate_size}")
    if problems:
        raise TensorParallelError(f"--tensor-parallel {n} does not divide {' or '.join(problems)}: "
                                  "pick a degree that divides both")
    if devices < n:
        raise TensorParallelError(
            f"--tensor-parallel {n} needs {n} devices and JAX sees {devices} here; use at most {devices} "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N splits the host into N devices)")


def make_mesh(n: int) -> Mesh:
    """The one-axis mesh over the first `n` local devices."""
    return Mesh(np.asarray(jax.local_devices()[:n]), (AXIS,))


def weight_spec(module: str) -> P:
    """The split of a projection W [in, out]: on `out` for column-parallel, on `in` for row."""
    if module in COLUMN:
        return P(None, AXIS)
    if module in ROW:
        return P(AXIS, None)
    raise ValueError(f"unknown projection {module!r}")


def is_row(modules: Sequence[str]) -> bool:
    """Whether `modules` (which read one x) are row-parallel; they are all of one kind."""
    kinds = {m in ROW for m in modules}
    if len(kinds) != 1:
        raise ValueError(f"{tuple(modules)} mix row- and column-parallel modules")
    return kinds.pop()


def pool_specs(modules: Sequence[str]) -> Any:
    """The pool's split (module docstring): A [layers, slots, rank, in], B [layers, slots, out, rank],
    as a LoraPool of PartitionSpecs."""
    whole, a_split, b_split = (cast(Any, s) for s in (P(), P(None, None, None, AXIS), P(None, None, AXIS, None)))
    return LoraPool(A={m: a_split if m in ROW else whole for m in modules},
                    B={m: whole if m in ROW else b_split for m in modules}, scaling=whole, rank=whole)


def pool_shardings(spec: PoolSpec, mesh: Mesh) -> LoraPool:
    """The pool's `NamedSharding`s on `mesh`, for `MemoryPool(spec, shardings=...)`."""
    for m, (n_in, n_out) in spec.module_dims.items():
        split = n_in if m in ROW else n_out
        if split % mesh.size:
            raise TensorParallelError(f"the pool's {m} splits a dimension of {split} over "
                                      f"{mesh.size} devices: it does not divide")
    return cast(LoraPool, jax.tree.map(lambda s: NamedSharding(mesh, s), pool_specs(spec.modules),
                                       is_leaf=lambda x: isinstance(x, P)))


# K and V, either layout: [layers, rows, kv_heads, ...]; the prefix cache's blocks alike:
# [blocks, layers, kv_heads, ...] (computed/model/kv_blocks.py)
CACHE_SPEC = P(None, None, AXIS)

Cache = TypeVar("Cache", KVCache, KVBlocks)


def shard_cache(cache: Cache, mesh: Mesh) -> Cache:
    """`cache` (the KV cache, or the prefix cache's blocks) split by KV head: placed (outside
    jit) or constrained (inside)."""
    sharding = NamedSharding(mesh, CACHE_SPEC)
    return cast(Cache, jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding), cache))


def shard_params(params: DecoderParams, mesh: Mesh) -> DecoderParams:
    """`params` placed on `mesh` by the module docstring's rules; weights must be [in, out] (XLA's)."""
    def put(a: Any, spec: P) -> Any:
        if isinstance(a, PackedWeight):
            raise TensorParallelError("packed weights belong to the native backend, which is single-device")
        return jax.device_put(a, NamedSharding(mesh, spec))

    layers = tuple(LayerParams(
        norms={n: put(w, P()) for n, w in layer.norms.items()},
        weights={m: put(w, weight_spec(m)) for m, w in layer.weights.items()},
        biases={m: put(b, P() if m in ROW else P(AXIS)) for m, b in layer.biases.items()})
        for layer in params.layers)
    return dataclasses.replace(
        params, layers=layers, norm=put(params.norm, P()),
        embed=None if params.embed is None else put(params.embed, P()),
        lm_head=None if params.lm_head is None else put(params.lm_head, P()))


def device_bytes(tree: Any) -> dict[str, int]:
    """Bytes each device holds of the arrays of `tree`, measured from their addressable shards."""
    out: dict[str, int] = {}
    for a in jax.tree.leaves(tree):
        for shard in a.addressable_shards:
            out[str(shard.device)] = out.get(str(shard.device), 0) + shard.data.nbytes
    return out


def expected_param_bytes(params: DecoderParams, n: int) -> int:
    """What each of `n` devices should hold of the weights by the rules above, from the shapes
    alone: 1/n of every projection and column-parallel bias, all of everything else."""
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize
                for a in (params.embed, params.lm_head, params.norm) if a is not None)
    for layer in params.layers:
        total += sum(w.nbytes for w in layer.norms.values())
        total += sum(int(np.prod(w.shape)) * w.dtype.itemsize // n for w in layer.weights.values())
        total += sum(b.nbytes if m in ROW else b.nbytes // n for m, b in layer.biases.items())
    return total


def expected_pool_bytes(spec: PoolSpec, n: int, itemsize: int) -> int:
    """What each of `n` devices should hold of a pool of `spec` (A and B of `itemsize` bytes):
    the split A or B at 1/n, the other whole, and scaling and rank whole."""
    total = spec.slots * 8  # scaling float32 and rank int32
    for m, (n_in, n_out) in spec.module_dims.items():
        a = spec.num_layers * spec.slots * spec.max_rank * n_in * itemsize
        b = spec.num_layers * spec.slots * spec.max_rank * n_out * itemsize
        total += a // n + b if m in ROW else a + b // n
    return total
