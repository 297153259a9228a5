"""The base model's weights digest (shared/fingerprint.py): what it covers and when it is
computed again. Real checkpoints written by the example writer and by safetensors."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from shared.fingerprint import ModelError, cached_weights_digest, read_model, weights_digest
from statesvc.tools.example import ExampleAssets, make_example


def _resharded(model_dir: Path, out: Path) -> Path:
    """The same tensors saved as two shards with an index, as Hugging Face splits a large
    checkpoint."""
    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, out / shard)
        weight_map.update({n: shard for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def test_the_digest_covers_the_weights_not_their_sharding(example: ExampleAssets,
                                                          tmp_path: Path) -> None:
    model = example.model_dir
    ours = weights_digest(model)
    assert weights_digest(_resharded(model, tmp_path / "sharded")) == ours
    other = make_example(tmp_path / "other", seed=7).model_dir
    # the fingerprint reads headers only: it cannot tell these two apart
    assert read_model(other).fingerprint == read_model(model).fingerprint
    assert weights_digest(other) != ours
    # one value of one tensor changed
    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    tensors = load_file(changed / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[0] += 1
    save_file(tensors, changed / "model.safetensors")
    assert weights_digest(changed) != ours


def test_a_truncated_shard_is_a_model_error(example: ExampleAssets, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(example.model_dir, model)
    shard = model / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(ModelError, match="could not be read"):
        weights_digest(model)


def test_the_cached_digest_is_kept_until_a_shard_changes(example: ExampleAssets,
                                                         tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(example.model_dir, model)
    cache = tmp_path / "cache" / "model-weights.json"
    first = cached_weights_digest(model, cache)
    assert first == weights_digest(model) and cache.is_file()
    # what the cache answers comes from the file while the shards are unchanged
    saved = json.loads(cache.read_text())
    cache.write_text(json.dumps({**saved, "digest": "0" * 64}))
    assert cached_weights_digest(model, cache) == "0" * 64
    # rewriting the shard (other weights) changes its stat: computed again
    other = make_example(tmp_path / "other", seed=7).model_dir
    shutil.copy(other / "model.safetensors", model / "model.safetensors")
    assert cached_weights_digest(model, cache) == weights_digest(other) != first
    # a cache that cannot be read is ignored
    cache.write_text("not json")
    assert cached_weights_digest(model, cache) == weights_digest(other)
