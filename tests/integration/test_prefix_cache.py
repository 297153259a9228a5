"""The prefix cache and chunked prefill change no output: the same requests through an engine with
both on and one with both off give the same greedy tokens, over mixed adapters and the base
model, shared and unshared prefixes, a same-name replace and an unload + reload of other content;
and a cache entry is never used across adapter versions of other content. Real statesvc, real
replica (in process), real JAX."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from computed.model.loader import load_model
from computed.model.runner import Runner
from computed.serving.engine import Engine
from statesvc.tools.example import ExampleAssets
from statesvc.tools.processes import BIN, free_port
from tests.helpers import live_replica

MAX_LEN = 128


def prompts_of(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(5)
    system = [int(t) for t in rng.integers(0, vocab, 70)]  # 4 whole blocks and 6 tokens

    def turn(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, n)]
    return {"short": system + turn(5), "long": system + turn(21), "exact": system[:64],
            "alone": turn(37), "tiny": turn(3)}


def serve(engine: Engine, requests: list[tuple[str, str | None, list[int]]]) -> dict[str, list[int]]:
    """Submit every request at once and step the engine until all are done: outputs by id."""
    for req_id, adapter, prompt in requests:
        assert engine.submit(req_id, {"adapter": adapter, "input_ids": prompt, "max_new_tokens": 6}, None) is None
    out: dict[str, list[int]] = {}
    while engine.busy:
        for d in engine.step():
            assert d.error is None, d.error
            out[d.req_id] = d.result["output_ids"]
    return out


def test_outputs_with_the_prefix_cache_equal_outputs_without(tmp_path: Path, example: ExampleAssets) -> None:
    dirs = [example.adapter_dirs[n] for n in sorted(example.adapter_dirs)]
    with live_replica(tmp_path, example, max_loras=4) as (cmd, replica):
        config, params = load_model(example.model_dir)
        on = Engine(Runner(config, params, max_batch=4, max_len=MAX_LEN, extend=True), replica,
                    prefill_chunk=32, prefix_blocks=24)
        off = Engine(Runner(config, params, max_batch=4, max_len=MAX_LEN), replica)
        cache = on.prefills.cache
        assert cache is not None
        prompts = prompts_of(config.vocab_size)
        cmd("load", name="a", path=str(dirs[0]))
        cmd("load", name="b", path=str(dirs[1]))
        replica.catch_up()

        def round_(tag: str, adapters: list[str | None], keys: list[str] = list(prompts)) -> dict[str, Any]:
            requests = [(f"{tag}-{a}-{k}", a, prompts[k]) for a in adapters for k in keys]
            hit_before = cache.hit_tokens
            ours, theirs = serve(on, requests), serve(off, requests)
            assert ours == theirs, f"round {tag}: outputs differ with the prefix cache on"
            return {"hit": cache.hit_tokens - hit_before, "out": ours}

        first = round_("1", ["a", "b", None])  # rows run 4 at a time: later ones hit earlier ones'
        again = round_("2", ["a", "b", None])
        assert again["hit"] > first["hit"] > 0
        assert len(cache.blocks) <= cache.capacity

        # a's name now holds other content: none of its prompts may meet the old KV
        cmd("load", name="a", path=str(dirs[2]), replace=True)
        replica.catch_up()
        # (four requests: one step admits and prefills them all, before any of them is saved)
        replaced = round_("3", ["a"], ["short", "long", "exact", "alone"])
        assert replaced["hit"] == 0
        assert replaced["out"]["3-a-short"] != first["out"]["1-a-short"]  # the new weights serve

        # b unloaded and loaded again with a's first content: it meets a's old KV (same content)
        cmd("unload", name="b")
        cmd("load", name="b", path=str(dirs[0]))
        replica.catch_up()
        reloaded = round_("4", ["b"])
        assert reloaded["hit"] > 0
        assert reloaded["out"]["4-b-short"] == first["out"]["1-a-short"]



def test_chunked_prefill_lets_running_requests_decode_between_chunks(tmp_path: Path,
                                                                    example: ExampleAssets) -> None:
    """A 100-token prompt arriving while a request decodes is prefilled 32 tokens a step: the
    running request gets a token in every one of those steps, and the long one's first token
    comes after its last chunk."""
    with live_replica(tmp_path, example, max_loras=2) as (_, replica):
        config, params = load_model(example.model_dir)
        engine = Engine(Runner(config, params, max_batch=2, max_len=MAX_LEN, extend=True), replica,
                        prefill_chunk=32)
        rng = np.random.default_rng(9)
        assert engine.submit("run", {"input_ids": [int(t) for t in rng.integers(0, config.vocab_size, 8)],
                                     "max_new_tokens": 20}, None) is None
        engine.step()
        assert engine.submit("long", {"input_ids": [int(t) for t in rng.integers(0, config.vocab_size, 100)],
                                      "max_new_tokens": 4}, None) is None
        running = next(r for r in engine.rows if r is not None and r.req.req_id == "run")
        steps = 0
        while True:
            before = len(running.output)
            engine.step()
            steps += 1
            assert len(running.output) == before + 1  # never stalled by the long prompt
            long = next(r for r in engine.rows if r is not None and r.req.req_id == "long")
            if long.output:
                break
        assert steps == 4  # 32 + 32 + 32 + 4 tokens
        assert long.prefilled == 100


def test_replicas_with_and_without_the_cache_agree_and_keep_to_the_kv_budget(
        tmp_path: Path, example: ExampleAssets) -> None:
    """Two `computed serve` processes, one with the defaults (prefix cache and chunks on, a
    4 MiB KV budget) and one with `--no-prefix-cache --prefill-chunk 0`: the same requests give
    the same tokens; the first reports its cache in `status` within its budget, holding the
    shared prefix under the adapter's content root; a budget below the rows' cache is refused."""
    from shared.prefix import block_hashes, content_root
    from shared.replica_protocol import GENERATE, generate_args
    from shared.client import ControlClient
    from tests.helpers import Fleet
    from testkit.fleet import wait_for

    fleet = Fleet(tmp_path, example)
    try:
        fleet.statesvc.start()
        fleet.init(max_loras=2)
        on = fleet.replica("on", args=("--no-warmup", "--max-batch", "2", "--max-len", "128",
                                       "--kv-cache-mb", "4", "--prefill-chunk", "32"))
        off = fleet.replica("off", args=("--no-warmup", "--max-batch", "2", "--max-len", "128",
                                         "--no-prefix-cache", "--prefill-chunk", "0"))
        name = sorted(example.adapter_dirs)[0]
        fleet.load("a", name)
        wait_for(lambda: fleet.converged(on, off), what="replicas at a's load")
        with fleet.client() as c:
            row = next(a for a in c.call("list", {})["adapters"] if a["name"] == "a")
        prompts = prompts_of(example.shape.vocab_size)
        outs = {}
        for r in (on, off):
            with ControlClient(r.listen, timeout_s=60, retries=0) as c:
                outs[r.replica_id] = [c.call(GENERATE, generate_args(p, adapter=a, max_new_tokens=5))["output_ids"]
                                      for _ in range(2) for a in ("a", None) for p in prompts.values()]
        assert outs["on"] == outs["off"]
        status = on.status()["prefix_cache"]
        assert off.status()["prefix_cache"] is None
        assert status["hit_tokens"] > 0 and status["used_blocks"] <= status["capacity_blocks"]
        shape = example.shape  # float32 KV: 4 bytes a value
        block = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 16 * 4
        rows = 2 * (128 // 16) * block
        assert rows + status["capacity_blocks"] * block <= 4 * 2**20 < rows + (status["capacity_blocks"] + 1) * block
        root = content_root(row["sha256"], row["scaling"])
        assert block_hashes(root, prompts["short"])[0] in status["summary"]
        assert block_hashes(root, prompts["short"])[3] in status["summary"]  # depth 4
        assert block_hashes(root, prompts["short"])[2] not in status["summary"]  # depth 3: not reported
    finally:
        fleet.stop()
    too_small = subprocess.run(
        [str(BIN / "computed"), "serve", "--model", str(example.model_dir), "--listen", f"tcp://127.0.0.1:{free_port()}",
         "--cache-dir", str(tmp_path / "small"), "--max-batch", "1024", "--kv-cache-mb", "1"],
        capture_output=True, text=True, timeout=120)
    assert too_small.returncode == 2
    assert "--kv-cache-mb 1 does not hold the running rows' KV cache" in too_small.stderr
