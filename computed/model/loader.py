"""Loading a Hugging Face checkpoint of a served family (config.json + safetensors) into `DecoderParams`.

Weights are read from the memory-mapped shards (shared/checkpoint.py lists them, as the fingerprint
does), one tensor at a time, converted to the model dtype, and laid out for the backend chosen at
load (`computed.backend.select`, or the caller's) as they are read: packed into column panels for
the native dense kernel (a bfloat16 model's as bfloat16 bits), or `[in, out]` for XLA's dot
(`with_layout` changes the layout of a loaded model).
"""
from __future__ import annotations

import dataclasses
import json
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from computed.backend import Backend, TensorParallelBackend, select
from computed.model import moe, sharding
from computed.model.config import DTYPES, DecoderConfig, ModelLoadError
from computed.model.packed import PackedWeight, pack, pack_rows, unpack
from computed.model.params import Experts, LayerParams, DecoderParams
from shared.checkpoint import shard_paths
from shared.projections import MODULE_PARENT, MODULES
from shared.modelconfig import ModelConfigError, check_tensors
from shared.tensorfile import TensorFileError, parse_header, raw_bytes, to_float32


@contextmanager
def _open_shards(model_dir: Path) -> Iterator[dict[str, tuple[Any, Any, Any]]]:
    """Tensor name -> (buffer, header, info) over every shard, memory-mapped."""
    try:
        shards = shard_paths(model_dir)
    except (ModelConfigError, OSError, ValueError) as exc:  # a FileError is a ValueError
        raise ModelLoadError(str(exc)) from None
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


def load_model(model_dir: str | Path, dtype: str = "float32", *, backend: Backend | None = None,
               tensor_parallel: int = 1) -> tuple[DecoderConfig, DecoderParams]:
    """Load a Hugging Face checkpoint of a served family (config.json + safetensors) in `dtype`, laid out for
    `backend` (None: `computed.backend.select(dtype)`, the one this machine runs best).

    `tensor_parallel` N > 1: on a mesh of the first N local devices, by the tensor-parallel
    backend (computed/backend/tp.py; `backend` must be None), placed as
    computed/model/sharding.py says; `sharding.TensorParallelError` (before any weight is read)
    where N does not divide the KV heads or the intermediate size, or exceeds the devices."""
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
        config = DecoderConfig.from_hf(raw)
    except ModelLoadError as exc:  # the text `pool init` gives (shared/fingerprint.py)
        raise ModelLoadError(f"{model_dir}/{exc}") from None
    jdt = jnp.dtype(dtype)
    if tensor_parallel > 1:
        if backend is not None:
            raise ValueError("tensor_parallel > 1 runs the tensor-parallel backend: pass no backend")
        sharding.check(config, tensor_parallel, len(jax.local_devices()))
        backend = TensorParallelBackend(mesh=sharding.make_mesh(tensor_parallel))

    with _open_shards(model_dir) as tensors:
        try:
            check_tensors(config, {name: info.shape for name, (_, _, info) in tensors.items()})
        except ModelConfigError as exc:
            raise ModelLoadError(f"{model_dir}: {exc}") from None

        if backend is None:
            backend = select(dtype)
        panel = backend.panel_for(jdt)
        # on a mesh the weights stay on the host until `shard_params` sends each device its part
        to_device: Any = (lambda a: a) if tensor_parallel > 1 else jnp.asarray

        def host(name: str) -> np.ndarray:
            buf, header, info = tensors[name]  # present, in this shape: check_tensors
            if info.dtype == "BF16" and jdt == jnp.bfloat16 and tensor_parallel == 1:
                # its bits, as stored: a view of the map, which every caller copies before the
                # shards close (widening to float32 and back took 5.6 s of a 0.5B model's load)
                bits: np.ndarray = np.frombuffer(raw_bytes(buf, header, info), "<u2").view(jnp.bfloat16)
                return bits.reshape(info.shape)
            try:
                return to_float32(buf, header, info).astype(jdt, copy=False)  # one tensor at a time
            except TensorFileError as exc:
                raise ModelLoadError(f"{model_dir}: {exc}") from None

        def get(name: str) -> jax.Array:
            return cast(jax.Array, to_device(host(name)))

        def weight(name: str) -> jax.Array | PackedWeight:
            """A projection as the backend multiplies it: packed as it is read (no second copy of the
            model, however briefly), or transposed to [in, out] for XLA."""
            wt = host(name)  # [out, in], as HF stores it
            return pack_rows(wt, panel) if panel else to_device(np.ascontiguousarray(wt.T))

        def norm(name: str) -> jax.Array:
            """A norm's weight; a Gemma norm as 1 + w in float32, as Gemma's RMSNorm computes it."""
            if config.norm != "gemma":
                return get(name)
            buf, header, info = tensors[name]
            w = to_float32(buf, header, info).astype(jdt).astype(np.float32) + np.float32(1.0)
            return cast(jax.Array, to_device(w))

        def experts(i: int) -> Experts:
            """Layer i's router and experts, each expert's weights [in, out]: an array each, or
            stacked past moe.SPLIT_MAX experts."""
            router, names = config.moe_names(i)
            gate_up = [np.concatenate([host(g).T, host(u).T], axis=1) for g, u, _ in names]
            down = [np.ascontiguousarray(host(d).T) for _, _, d in names]
            router_w = cast(jax.Array, to_device(np.ascontiguousarray(host(router).T)))
            if len(names) <= moe.SPLIT_MAX:
                return Experts(router=router_w, gate_up=tuple(cast(jax.Array, to_device(w)) for w in gate_up),
                               down=tuple(cast(jax.Array, to_device(w)) for w in down))
            return Experts(router=router_w, gate_up=cast(jax.Array, to_device(np.stack(gate_up))),
                           down=cast(jax.Array, to_device(np.stack(down))))

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}"
            weights: dict[str, jax.Array | PackedWeight] = {}
            biases = {}
            sparse = config.sparse(i)
            for m in MODULES:
                if sparse and MODULE_PARENT[m] == "mlp":
                    continue
                stem = f"{p}.{MODULE_PARENT[m]}.{m}"
                weights[m] = weight(f"{stem}.weight")
                if m in config.bias_modules:
                    biases[m] = get(f"{stem}.bias")
            norms = {n: norm(f"{p}.self_attn.{n}.weight" if n in ("q_norm", "k_norm") else f"{p}.{n}.weight")
                     for n in config.layer_norms()}
            layers.append(LayerParams(norms=norms, weights=weights, biases=biases,
                                      experts=experts(i) if sparse else None))
        tied_packed = config.tie_word_embeddings and panel and tensor_parallel == 1
        params = DecoderParams(
            config=config,
            backend=backend,
            # tied and packed: the packed lm_head is the embedding's one copy (`with_layout`), made
            # here from the checkpoint's [vocab, hidden] rows
            embed=None if tied_packed else get("model.embed_tokens.weight"),
            layers=tuple(layers),
            norm=norm("model.norm.weight"),
            # stored [hidden, vocab]: XLA's CPU product x @ W ran 1.2x faster than x @ W.T here
            lm_head=pack_rows(host("model.embed_tokens.weight"), panel) if tied_packed else
            None if config.tie_word_embeddings else weight("lm_head.weight"),
        )
    params = with_layout(params, backend)
    if isinstance(backend, TensorParallelBackend):
        assert backend.mesh is not None
        params = sharding.shard_params(params, backend.mesh)
    return config, params


def with_layout(params: DecoderParams, backend: Backend) -> DecoderParams:
    """`params` for `backend`: every projection and the lm_head packed in the backend's panels
    (`backend.panel_for` its dtype), or unpacked to [in, out] for XLA where it has none; host work,
    once per model. A tied model keeps one copy: packed, its lm_head is the embedding's transpose and
    `embed` is None (lookups read the lm_head's columns). A bfloat16 model packs its weights'
    bits (computed/model/packed.py `pack`)."""
    panel = backend.panel_for(params.dtype)

    def convert(w: jax.Array | PackedWeight) -> jax.Array | PackedWeight:
        if isinstance(w, PackedWeight):
            if w.panel == panel:
                return w
            w = unpack(w)
        return pack(w, panel) if panel else w

    layers = tuple(dataclasses.replace(layer, weights={m: convert(w) for m, w in layer.weights.items()})
                   for layer in params.layers)
    embed, lm_head = params.embed, params.lm_head
    if params.config.tie_word_embeddings:  # one copy: the embedding, or its packed transpose
        if embed is None:
            assert isinstance(lm_head, PackedWeight)
            if lm_head.panel != panel:
                embed = unpack(lm_head).T
        if embed is not None:
            embed, lm_head = (None, pack(embed.T, panel)) if panel else (embed, None)
    elif lm_head is not None:
        lm_head = convert(lm_head)
    return dataclasses.replace(params, backend=backend, embed=embed, layers=layers, lm_head=lm_head)
