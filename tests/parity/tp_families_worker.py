"""Every dense family on N forced host devices, in one process
(`python -m tests.parity.tp_families_worker N ROOT OUT ADAPTERS FAMILY...`): what
tests/parity/test_tensor_parallel.py compares per family with transformers + PEFT, written to
OUT/FAMILY.npz and .json.

ROOT/FAMILY holds `model/` and one directory per adapter of ADAPTERS (comma-separated), as
tests/parity/test_families.py `write_family` saves them with transformers and PEFT. The caller
sets XLA_FLAGS=--xla_force_host_platform_device_count=N (JAX fixes the device count when it
starts). One process for every family, since JAX's start and the compiles dominate. The test
compares each family's outputs with PEFT's directly, not with a one-device run of ours (which
tests/parity/test_families.py checks against PEFT on both backends): that run compiled every
family's model a second time, half the worker's time (docs/testing.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from computed.model import lora
from computed.model import sharding
from computed.model.loader import load_model
from computed.model.runner import Runner, forward_full
from computed.residency.pool import MemoryPool, PoolSpec
from tests.helpers import adapter_weights
from tests.parity.tp_worker import MAX_BATCH, NEW_TOKENS, greedy, shard_report

# one attention bucket (16) for every prompt and its NEW_TOKENS, so each family compiles few
# shapes: prefill of 4 prompts and of 1, decode over 16 positions; the prompts of 8 and 9
# tokens run past every test family's sliding window (5 or 6)
MAX_LEN = 16
LENGTHS = (5, 9, 8, 3)
assert max(LENGTHS) + NEW_TOKENS - 1 <= MAX_LEN


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in LENGTHS]


def outputs(model_dir: Path, adapter_dirs: list[Path], n: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The model of `model_dir` on the n-device mesh: a mixed-adapter batch's forward over every
    position, its greedy tokens and logits through the KV cache decoded together and each request
    alone, and how its arrays lie on the mesh."""
    config, params = load_model(model_dir, tensor_parallel=n)
    spec = PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                    slots=len(adapter_dirs) + 1, max_rank=8, dtype="float32")
    mesh = getattr(params.backend, "mesh", None)
    pool = MemoryPool(spec, shardings=None if mesh is None else sharding.pool_shardings(spec, mesh))
    for i, d in enumerate(adapter_dirs):
        assert pool.write_slot(i + 1, adapter_weights(d, i + 1))
    slot_of: dict[str | None, int] = {None: lora.BASE, **{d.name: i + 1 for i, d in enumerate(adapter_dirs)}}
    names = [d.name for d in adapter_dirs]
    mixed: list[str | None] = [None, *names, names[0]][:MAX_BATCH]
    slots = [slot_of[a] for a in mixed]
    # one sequence on every row: the rows differ only by their adapters
    tokens = np.tile(np.random.default_rng(7).integers(0, config.vocab_size, (1, 11)), (len(mixed), 1))
    runner = Runner(config, params, max_batch=MAX_BATCH, max_len=MAX_LEN)
    batch = prompts(config.vocab_size)[:len(mixed)]
    mixed_tokens, mixed_logits = greedy(runner, pool, batch, slots)
    singles = [greedy(runner, pool, [batch[i]], [s]) for i, s in enumerate(slots)]
    arrays = {"forward": np.asarray(forward_full(params, pool.arrays, tokens, slots)), "tokens": tokens,
              "mixed_tokens": mixed_tokens, "mixed_logits": mixed_logits,
              "single_tokens": np.stack([t[:, 0] for t, _ in singles]),
              "single_logits": np.stack([lg[:, 0] for _, lg in singles])}
    info: dict[str, Any] = {"model_type": config.model_type, "mixed": mixed, "prompts": batch,
                            "bad_shards": (shard_report(params, n) + shard_report(pool.arrays, n)
                                           + shard_report(runner.new_cache(), n)),
                            "bytes": {"weights": sharding.device_bytes(params),
                                      "pool": sharding.device_bytes(pool.arrays),
                                      "weights_formula": sharding.expected_param_bytes(params, n),
                                      "pool_formula": sharding.expected_pool_bytes(spec, n, 4)}}
    return arrays, info


def main(n: int, root: Path, out: Path, adapters: list[str], families: list[str]) -> None:
    assert len(jax.devices()) == n > 1, f"XLA_FLAGS gave {len(jax.devices())} devices; want N = {n} > 1"
    out.mkdir(parents=True, exist_ok=True)
    for family in families:
        model_dir, adapter_dirs = root / family / "model", [root / family / a for a in adapters]
        split, info = outputs(model_dir, adapter_dirs, n)
        np.savez(out / f"{family}.npz", **split)
        (out / f"{family}.json").write_text(json.dumps({"n": n, **info}))
        print(f"{family}: done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4].split(","), sys.argv[5:])
