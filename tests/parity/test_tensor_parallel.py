"""Tensor-parallel replicas (`--tensor-parallel N`) on 2 and 4 forced host devices give the 1-device
replica's and transformers + PEFT's outputs, hold 1/N of every split array, write slots in place,
and keep the pool digest and the drill's meaning.

Each N runs in its own process (tests/parity/tp_worker.py), since JAX fixes the device count
when it starts (XLA_FLAGS=--xla_force_host_platform_device_count=N). The checkpoint is the
parity tests' second one (4 KV heads, intermediate size 96, tied embeddings, llama3 RoPE, an
rsLoRA adapter on every module and one on attention): N = 2 and 4 divide it.

Every other dense family (issue 38) runs on 2 forced devices too: its checkpoint and two adapters
as transformers and PEFT save them (tests/parity/test_families.py `write_family`, 2 KV heads), all
of them in one worker process (tests/parity/tp_families_worker.py), which runs each model on the
mesh: greedy tokens equal PEFT's, logits within test_families' limit of PEFT's, every array split
as the rules say.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from computed.cli import main as computed_main
from computed.model import sharding
from computed.model.config import DecoderConfig
from statesvc.tools.example import ExampleAssets, make_example
from testkit.fleet import wait_for
from tests.helpers import Fleet, xla_flags
from tests.parity.test_families import ADAPTERS as FAMILY_ADAPTERS
from tests.parity.test_families import FAMILIES, peft_greedy, peft_logits, write_family
from tests.parity.test_families import reference as peft_reference
from tests.parity.test_families import close as family_close
from tests.parity.test_model_parity import OTHER_ADAPTERS, OTHER_SHAPE, Reference, close
from tests.parity.tp_worker import ADAPTERS, NEW_TOKENS

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::FutureWarning")]
ROOT = Path(__file__).resolve().parents[2]


def forced(n: int) -> dict[str, str]:
    """The environment of a process that sees n host devices."""
    return {**os.environ, "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={n}"),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> ExampleAssets:
    assert tuple(a.name for a in OTHER_ADAPTERS) == ADAPTERS
    return make_example(tmp_path_factory.mktemp("tp"), seed=3, shape=OTHER_SHAPE, adapters=OTHER_ADAPTERS)


@pytest.fixture(scope="module")
def runs(assets: ExampleAssets, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict[str, Any], Any]]:
    """The worker's results for N = 1, 2 and 4, the three processes side by side, not one after
    another (docs/testing.md)."""
    out_dir = tmp_path_factory.mktemp("tp-runs")
    procs: dict[int, subprocess.Popen[str]] = {}
    try:
        for n in (1, 2, 4):
            log = (out_dir / f"n{n}.log").open("w")
            procs[n] = subprocess.Popen([sys.executable, "-m", "tests.parity.tp_worker", str(n), str(assets.root),
                                         str(out_dir / f"n{n}")], env=forced(n), cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT, text=True)
            log.close()  # the child holds its own descriptor
        for n, proc in procs.items():
            assert proc.wait(timeout=500) == 0, (out_dir / f"n{n}.log").read_text()[-4000:]
    finally:
        for proc in procs.values():  # stopped by pid when one failed or hung
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {n: (json.loads((out_dir / f"n{n}.json").read_text()), np.load(out_dir / f"n{n}.npz"))
            for n in (1, 2, 4)}


# the dense families of test_families (Llama is the example above); a mixture-of-experts family
# joins once the sharding rules (computed/model/sharding.py) place its experts
TP_FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "olmo2", "granite")
TP_FAMILY_DEGREE = 2  # divides test_families' 2 KV heads, 6 heads and intermediate size 72


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Any, Any]]:
    """tp_families_worker's results per family and transformers + PEFT's model of it (float32, both
    adapters loaded): one worker process for them all (its start and the compiles are most of the
    time)."""
    assert set(TP_FAMILIES) <= set(FAMILIES)
    root, out = tmp_path_factory.mktemp("tp-families"), tmp_path_factory.mktemp("tp-families-runs")
    written = {family: write_family(root / family, family) for family in TP_FAMILIES}
    log_path = out / "worker.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.parity.tp_families_worker", str(TP_FAMILY_DEGREE),
                                 str(root), str(out), ",".join(FAMILY_ADAPTERS), *TP_FAMILIES],
                                env=forced(TP_FAMILY_DEGREE), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
    try:
        assert proc.wait(timeout=500) == 0, log_path.read_text()[-4000:]
    finally:
        if proc.poll() is None:  # stopped by pid when it hung
            proc.kill()
            proc.wait()
    return {f: (json.loads((out / f"{f}.json").read_text()), np.load(out / f"{f}.npz"),
                peft_reference(*written[f], torch.float32)) for f in TP_FAMILIES}


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_each_family_sharded_gives_the_peft_outputs(family_runs: dict[str, tuple[dict[str, Any], Any, Any]],
                                                    family: str) -> None:
    info, got, ref = family_runs[family]
    assert info["model_type"] == family and info["n"] == TP_FAMILY_DEGREE
    mixed: list[str | None] = info["mixed"]
    assert set(mixed) == {None, *FAMILY_ADAPTERS}  # the base model and both adapters in one batch
    # forward over every position, the mixed batch
    family_close(got["forward"], peft_logits(ref, got["tokens"], mixed))
    # greedy through the KV cache: the mixed batch decoded together, and each request alone
    for i, (prompt, adapter) in enumerate(zip(info["prompts"], mixed)):
        want_tokens, want_logits = peft_greedy(ref, prompt, adapter, NEW_TOKENS)
        assert got["mixed_tokens"][:, i].tolist() == want_tokens, f"mixed batch row {i} ({adapter}): greedy differs"
        assert got["single_tokens"][i].tolist() == want_tokens, f"request {i} ({adapter}) alone: greedy differs"
        for step in range(NEW_TOKENS):  # the last position's logits, step by step
            family_close(got["mixed_logits"][step, i], want_logits[step])
            family_close(got["single_logits"][i, step], want_logits[step])
    # the same sequence on every row: each adapter changes the logits, and row 3 repeats row 1's adapter
    forward = got["forward"]
    for row in (1, 2):
        assert np.abs(forward[row] - forward[0]).max() > 1e-2 * np.abs(forward[0]).max(), info["mixed"][row]
    close(forward[3], forward[1])
    # every weight, pool and cache array split 1/N per device or whole, the bytes the formula gives
    assert info["bad_shards"] == []
    sizes = info["bytes"]
    assert len(sizes["weights"]) == TP_FAMILY_DEGREE and set(sizes["weights"].values()) == {sizes["weights_formula"]}
    assert len(sizes["pool"]) == TP_FAMILY_DEGREE and set(sizes["pool"].values()) == {sizes["pool_formula"]}


@pytest.fixture(scope="module")
def reference(assets: ExampleAssets) -> Reference:
    return Reference(assets)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_sharded_outputs_equal_one_device_and_peft(runs: dict[int, tuple[dict[str, Any], Any]],
                                                   reference: Reference, n: int) -> None:
    info, got = runs[n]
    _, one = runs[1]
    mixed: list[str | None] = info["mixed"]
    # forward over every position, a batch mixing the base model and both adapters
    close(got["forward"], one["forward"])
    close(got["forward"], reference.logits(got["tokens"], mixed))
    # greedy through the KV cache: one batch of every request, and each request alone
    assert (got["mixed_tokens"] == one["mixed_tokens"]).all()
    if n == 2:  # in chunks, and from the prefix cache's store: the same tokens as whole prompts
        assert (got["chunk_tokens"][:, :3] == got["mixed_tokens"][:, :3]).all()
        assert (got["chunk_tokens"][:, 3] == got["mixed_tokens"][:, 2]).all()  # the longest (17 tokens)
    assert (got["single_tokens"] == one["single_tokens"]).all()
    from tests.parity.tp_worker import prompts
    for i, (prompt, adapter) in enumerate(zip(prompts(OTHER_SHAPE.vocab_size), mixed)):
        want_tokens, want_logits = reference.greedy(prompt, adapter)
        assert got["mixed_tokens"][:, i].tolist() == want_tokens, f"row {i} ({adapter})"
        assert got["single_tokens"][i].tolist() == want_tokens, f"request {i} ({adapter}) alone"
        for step in range(NEW_TOKENS):  # the last position's logits, step by step
            close(got["mixed_logits"][step, i], want_logits[step])
            close(got["single_logits"][i, step], want_logits[step])
            close(got["mixed_logits"][step, i], one["mixed_logits"][step, i])


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_each_device_holds_its_part_and_slot_writes_stay_in_place(runs: dict[int, tuple[dict[str, Any], Any]],
                                                                 n: int) -> None:
    info, _ = runs[n]
    assert info["bad_shards"] == []  # every weight, pool and cache array: 1/n per device or whole
    sizes = info["bytes"]
    assert len(sizes["weights"]) == n and set(sizes["weights"].values()) == {sizes["weights_formula"]}
    assert len(sizes["pool"]) == n and set(sizes["pool"].values()) == {sizes["pool_formula"]}
    assert info["write"] == {"compiles": 0, "in_place": True, "others_unchanged": True}
    assert info["compiles_after_warmup"] == 0  # the warm-up compiled every shape serving runs, on the mesh
    assert info["pool_digest"] == runs[1][0]["pool_digest"]  # same contents, same digest


def test_serve_refuses_a_degree_the_model_or_machine_cannot_take(example: ExampleAssets,
                                                                 assets: ExampleAssets, tmp_path: Path) -> None:
    """Before loading anything, naming the numbers (the example model has 2 KV heads)."""
    def serve(model: Path, n: int) -> Any:
        return CliRunner().invoke(computed_main, ["serve", "--model", str(model), "--tensor-parallel", str(n),
                                                  "--cache-dir", str(tmp_path / "c")])
    res = serve(example.model_dir, 4)
    assert res.exit_code == 2 and "--tensor-parallel 4 does not divide the model's 2 KV heads" in res.output
    res = serve(assets.model_dir, 3)
    assert res.exit_code == 2 and "does not divide the model's 4 KV heads" in res.output
    res = serve(assets.model_dir, 2)  # this process sees one device
    assert res.exit_code == 2 and "needs 2 devices and JAX sees 1" in res.output
    config = DecoderConfig.from_hf(json.loads((assets.model_dir / "config.json").read_text()))
    with pytest.raises(sharding.TensorParallelError, match="does not divide the model's intermediate_size 90"):
        sharding.check(dataclasses.replace(config, intermediate_size=90), 4, devices=4)


@pytest.mark.slow
def test_a_four_device_replica_agrees_with_a_one_device_one_in_the_drill(assets: ExampleAssets,
                                                                        tmp_path: Path) -> None:
    from testkit.fleet import loractl
    fleet = Fleet(tmp_path, assets)
    fleet.statesvc.start()
    try:
        # tp_worker's pool (4 slots, rank 32): the four-device replica's warm-up then compiles what
        # the `runs` fixture's N = 4 worker compiled, and reads it from the session's JAX cache
        # (whole prompts, as that worker runs them: chunks and the store are checked on N = 2)
        fleet.init(max_loras=4, max_rank=32)
        fleet.cmd("load", name="every", path=str(assets.adapter_dirs["rslora-all-r8"]))
        fleet.cmd("load", name="attn", path=str(assets.adapter_dirs["attn-r4"]))
        whole = ("--no-prefix-cache", "--prefill-chunk", "0")
        one = fleet.replica("one", args=("--max-batch", "4", "--max-len", "32", *whole))
        four = fleet.replica("four", args=("--max-batch", "4", "--max-len", "32", "--tensor-parallel", "4", *whole),
                             env={"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4")})
        wait_for(lambda: fleet.converged(one, four), timeout=240, what="both replicas at the head")
        s1, s4 = one.status(), four.status()
        assert s1["pool_digest"] == s4["pool_digest"] and s1["logical_digest"] == s4["logical_digest"]
        res = loractl(fleet.statesvc, "drill", "--diffs", fleet.statesvc.publish, "--json",
                      check=False, timeout=400)
        report = json.loads(res.stdout) if res.stdout else {}
        assert res.returncode == 0, res.stderr[-3000:]
        assert report["ok"] is True and all(c["ok"] for c in report["checks"])
        checks = {(c["replica"], c["check"]) for c in report["checks"]}
        # the drill compared both live replicas, their probe outputs included, with its fresh ones
        assert {("one", "probe:every"), ("four", "probe:every"), ("four", "probe:attn"),
                ("four", "probe:(base)"), ("four", "logical_digest")} <= checks
    finally:
        fleet.stop()
