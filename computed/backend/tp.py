"""The tensor-parallel backend: the portable XLA backend on a one-axis mesh (`--tensor-parallel N`).

The weights, the KV cache and the LoRA pool lie on the mesh as computed/model/sharding.py says
(Megatron-style, the pool split to match). Each group of projections that read one x is one
`shard_map` over the mesh whose body is the XLA backend's own `project` on the local blocks:

- column-parallel (q, k, v; gate, up): x whole on every device; each device multiplies its
  columns of W and its rows of each slot's B (A whole), so its output columns are complete,
  LoRA included; no communication.
- row-parallel (o; down): x split on its last dimension, as the column-parallel modules and the
  attention left it; each device multiplies its rows of W and its columns of each slot's A (B
  whole): base product and LoRA term are partial sums of the same shape, added locally and
  all-reduced once (one `psum` per module, base and LoRA fused); the bias is added after.

The LoRA terms stay the segmented window loop (computed/model/lora.py): grouped by slot, each slot's
matrices read by dynamic slice of the device's own part of the pool; nothing is gathered per
token, and no pool array is gathered onto one device. Attention runs outside the `shard_map`,
left to GSPMD: q, k and v arrive split by KV head, the cache is split by KV head, so every
device attends over its own heads; the cache a step returns is constrained to that layout, so
donation updates it in place. The embedding, the final norm and the lm_head are replicated:
logits come out whole on every device.

The native CPU kernels stay single-device (computed/backend/native.py): they are XLA FFI calls
on one CPU's buffers and know nothing of a mesh, and on one CPU the forced host devices share
its cores anyway; a tensor-parallel replica always runs this backend.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from computed.backend.xla import XlaBackend
from computed.model import sharding
from computed.model.kv_blocks import KVBlocks
from computed.model.kv_cache import KVCache
from computed.model.packed import PackedWeight
from computed.residency.pool import LoraPool


@dataclass(frozen=True)
class TensorParallelBackend(XlaBackend):
    """XlaBackend on `mesh` (one axis, `sharding.AXIS`); hashable, so static under jit."""

    mesh: Mesh | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mesh is None or self.mesh.axis_names != (sharding.AXIS,):
            raise ValueError(f"TensorParallelBackend needs a one-axis mesh named {sharding.AXIS!r} "
                             "(computed.model.sharding.make_mesh)")

    @property
    def size(self) -> int:
        """Devices on the mesh (the tensor-parallel degree)."""
        assert self.mesh is not None
        return int(self.mesh.size)

    def project(self, x: jax.Array, modules: Sequence[str], weights: Sequence[jax.Array | PackedWeight],
                biases: Mapping[str, jax.Array], pool: LoraPool | None, batch: Any,
                layer: int) -> list[jax.Array]:
        row = sharding.is_row(modules)
        lead = (None,) * (x.ndim - 1)
        split = P(*lead, sharding.AXIS)
        local_biases = {} if row else dict(biases)  # a row-parallel bias is added once, after the sum
        pool_spec: Any = P() if pool is None else sharding.pool_specs(tuple(pool.A))

        def local(x: jax.Array, ws: list[jax.Array], bs: dict[str, jax.Array], pool: LoraPool | None,
                  batch: Any) -> list[jax.Array]:
            ys = XlaBackend.project(self, x, modules, ws, bs, pool, batch, layer)
            return [jax.lax.psum(y, sharding.AXIS) for y in ys] if row else ys

        run = jax.shard_map(
            local, mesh=self.mesh, check_vma=False,  # the window loop's carries start replicated
            in_specs=(split if row else P(), [sharding.weight_spec(m) for m in modules],
                      {m: P(sharding.AXIS) for m in local_biases}, pool_spec, P()),
            out_specs=[P() if row else split for _ in modules])
        ys: list[jax.Array] = run(x, cast(list[jax.Array], list(weights)), local_biases, pool, batch)
        return [y + biases[m] if row and m in biases else y for m, y in zip(modules, ys)]

    def shard_cache(self, cache: KVCache) -> KVCache:
        assert self.mesh is not None
        return sharding.shard_cache(cache, self.mesh)

    def shard_blocks(self, store: KVBlocks) -> KVBlocks:
        assert self.mesh is not None
        return sharding.shard_cache(store, self.mesh)
