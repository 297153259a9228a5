"""The compute backends, and the one choice of them a model makes when it loads (`select`).

`base.Backend` is what the forward pass asks; `xla.XlaBackend` runs on any JAX device,
`native.NativeBackend` on the CPU kernels (computed/backend/kernels), `tp.TensorParallelBackend`
XLA on a mesh of devices (`--tensor-parallel N`). See computed/backend/base.py.
"""
from __future__ import annotations

import jax.numpy as jnp

from computed.backend import native
from computed.backend.base import Backend
from computed.backend.native import NativeBackend
from computed.backend.tp import TensorParallelBackend
from computed.backend.xla import XlaBackend


def select(dtype: str | jnp.dtype) -> Backend:
    """The backend a model of `dtype` runs on here, chosen once at load: the native kernels where
    they are built and loaded (not with LORAPLANE_LORA_KERNEL=xla, not off the CPU), packing the
    weights for the dense kernel where it runs (a bfloat16 model's as their bits) and attending
    with the attention kernel over a float32 cache (`Backend.cache_dtype`); else XLA alone. The
    reason the kernels are unavailable is logged once (computed/backend/kernels)."""
    jnp.dtype(dtype)  # a TypeError for a name that is no dtype
    if not native.available():
        return XlaBackend()
    return NativeBackend()


__all__ = ["Backend", "NativeBackend", "TensorParallelBackend", "XlaBackend", "select"]
