"""Issue 16's Done-when test: more distinct adapters requested at once than the replica has
slots, through a real `computed serve`, every reply checked against transformers + PEFT."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from statesvc.tools.example import EXAMPLE_ADAPTERS, EXAMPLE_BASE_MODEL_NAME, write_adapter
from testkit.fleet import wait_for
from tests.helpers import WARMUP_TIMEOUT_S, Fleet

pytest.importorskip("torch")
pytest.importorskip("peft")
from tests.helpers import HFReference  # noqa: E402
from tests.parity.test_serving import Client, generate  # noqa: E402

pytestmark = pytest.mark.timeout(600)
SLOTS, ADAPTERS = 4, 12
PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 200, 12, 9, 81]]


def test_twelve_adapters_on_four_slots_all_match_peft(fleet: Fleet, tmp_path: Path) -> None:
    fleet.init(max_loras=SLOTS, max_rank=32)
    # 12 adapters with weights of their own (seeds 1..12) over the example's shapes
    dirs = {f"ad{i}": write_adapter(tmp_path / f"ad{i}", EXAMPLE_ADAPTERS[i % 5],
                                    fleet.example.shape, seed=i + 1,
                                    base_model_name_or_path=EXAMPLE_BASE_MODEL_NAME)
            for i in range(ADAPTERS)}
    replica = fleet.replica("r1", args=("--max-batch", "8", "--max-len", "64",
                                        "--queue-limit", "128"))
    for name, path in dirs.items():
        fleet.cmd("load", name=name, path=str(path))
    wait_for(lambda: fleet.converged(replica), what="the registry applied")
    wait_for(lambda: replica.status()["inference"]["warm"], what="warm-up",
             timeout=WARMUP_TIMEOUT_S)
    reference = HFReference(fleet.example.model_dir)
    client = Client(replica.listen)
    try:
        asked = {}
        for round_ in range(2):  # every adapter twice and the base model between, all at once
            for i, name in enumerate([*dirs, None, None, None]):
                prompt = PROMPTS[(i + round_) % 2]
                n = 4 + (i + round_) % 5
                asked[client.send("generate", generate(name, prompt, n=n))] = (name, prompt, n)
        replies = client.gather(list(asked))
    finally:
        client.close()
    for rid, (name, prompt, n) in asked.items():
        r = replies[rid]
        assert r["ok"], r  # waiting for a slot is not an error
        assert (r["result"]["adapter"] or {}).get("name") == name
        want = reference.greedy(None if name is None else dirs[name], prompt, n)
        assert r["result"]["output_ids"] == want, (name, prompt)
    status = replica.status()
    res = status["residency"]
    assert res["slots"] == SLOTS and len(status["slots"]) <= SLOTS
    assert res["misses"] >= ADAPTERS - SLOTS and res["evictions"] >= ADAPTERS - SLOTS
    assert res["hits"] + res["misses"] >= 2 * ADAPTERS
    assert status["inference"]["running"] == status["inference"]["waiting"] == 0


def test_a_resident_adapter_is_served_while_another_fetch_is_blocked(fleet: Fleet) -> None:
    """statesvc stopped (SIGSTOP): the fetch of a missing adapter hangs on it, and a request
    for a resident adapter, sent after it, completes meanwhile; once statesvc runs again the
    waiting request is served too, and both equal transformers + PEFT."""
    fleet.init(max_loras=2, max_rank=32)
    replica = fleet.replica("r1", args=("--max-batch", "4", "--max-len", "64"))
    dirs = fleet.example.adapter_dirs
    chosen = {"hot": "attn-qv-r8", "other": "all-r2", "cold": "mlp-only-r16"}
    for name, adapter in chosen.items():
        fleet.load(name, adapter)
    wait_for(lambda: fleet.converged(replica), what="the registry applied")
    wait_for(lambda: replica.status()["inference"]["warm"], what="warm-up",
             timeout=WARMUP_TIMEOUT_S)
    # the loads fill the two free slots (the newest two when they are applied together)
    held = {h["name"] for h in replica.status()["slots"].values()}
    assert len(held) == 2
    cold_name, hot_name = ({*chosen} - held).pop(), sorted(held)[0]
    reference = HFReference(fleet.example.model_dir)
    client = Client(replica.listen)
    os.kill(fleet.statesvc.pid, signal.SIGSTOP)
    try:
        cold = client.send("generate", generate(cold_name, PROMPTS[0], n=4))
        hot = client.send("generate", generate(hot_name, PROMPTS[1], n=4))
        first = client.recv()
        assert first["id"] == hot and first["ok"], first  # cold's fetch is still blocked
        assert replica.status()["inference"]["waiting"] == 1
    finally:
        os.kill(fleet.statesvc.pid, signal.SIGCONT)
    try:
        second = client.recv()
    finally:
        client.close()
    assert second["id"] == cold and second["ok"], second
    for reply, name, prompt in ((first, hot_name, PROMPTS[1]), (second, cold_name, PROMPTS[0])):
        want = reference.greedy(dirs[chosen[name]], prompt, 4)
        assert reply["result"]["output_ids"] == want, name
    res = replica.status()["residency"]
    assert res["host_misses"] == 1 and res["fill_ms"]["miss"]["n"] == 1
