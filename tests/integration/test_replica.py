"""Replicas as real subprocesses against a real statesvc: convergence, recovery, bad bytes."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from shared.client import new_event_id
from shared.fingerprint import read_model
from shared.peft import parse_lora_name
from statesvc.tools.example import ExampleAssets, ModelShape, make_example
from testkit.fleet import Computed, loractl, wait_for
from tests.helpers import Fleet, held, slot_holding

pytestmark = pytest.mark.timeout(240)


def assert_slot_matches_file(replica: Computed, slot: int, adapter_dir: Path,
                             scaling: float, rank: int) -> None:
    got = replica.call("slot", slot=slot)
    assert got["rank"] == rank and got["scaling"] == pytest.approx(scaling)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    seen = set()
    for module in got["A"]:
        A = np.frombuffer(got["A"][module]["data"], np.float32).reshape(got["A"][module]["shape"])
        B = np.frombuffer(got["B"][module]["data"], np.float32).reshape(got["B"][module]["shape"])
        for layer in range(A.shape[0]):
            prefix = f"base_model.model.model.layers.{layer}"
            names = [n for n in tensors if n.startswith(prefix + ".") and f".{module}." in n]
            if not names:  # a module the adapter lacks is zero
                assert not A[layer].any() and not B[layer].any()
                continue
            a = tensors[[n for n in names if "lora_A" in n][0]]
            b = tensors[[n for n in names if "lora_B" in n][0]]
            np.testing.assert_array_equal(A[layer, :rank], a)
            np.testing.assert_array_equal(B[layer, :, :rank], b)
            assert not A[layer, rank:].any() and not B[layer, :, rank:].any()  # rank padding
            seen.update(names)
    assert seen == set(tensors)
    assert all(parse_lora_name(n) for n in seen)


def test_two_replicas_agree_with_statesvc_and_the_files(fleet: Fleet) -> None:
    r1, r2 = fleet.replica("r1"), fleet.replica("r2")
    fleet.init()
    fleet.load("chat", "attn-qv-r8")
    fleet.load("sql", "mlp-only-r16")
    fleet.load("code", "all-r32-rslora")
    fleet.load("chat", "all-r2", replace=True)     # new slot, old slot cleared
    fleet.cmd("unload", name="sql")
    fleet.load("summ", "attn-all-r4")              # takes sql's freed slot
    wait_for(lambda: fleet.converged(r1, r2), what="both replicas at the head")

    status = json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
    wait_for(lambda: all(r["applied_seq"] == status["head_seq"] for r in json.loads(
        loractl(fleet.statesvc, "status", "--json").stdout)["replicas"]), what="heartbeats")
    status = json.loads(loractl(fleet.statesvc, "status", "--json").stdout)
    reps = {r["id"]: r for r in status["replicas"]}
    assert set(reps) == {"r1", "r2"}
    for r in reps.values():
        assert set(r) == {"id", "address", "state", "applied_seq", "logical_digest",
                          "pool_digest", "agrees"}
        assert r["agrees"] and r["logical_digest"] == status["digest"]
    assert reps["r1"]["pool_digest"] == reps["r2"]["pool_digest"]

    listed = {a["name"]: a for a in json.loads(loractl(fleet.statesvc, "list", "--json").stdout)}
    dirs = {"chat": "all-r2", "code": "all-r32-rslora", "summ": "attn-all-r4"}
    assert set(listed) == set(dirs)
    for name, adapter in dirs.items():
        a = listed[name]
        for r in (r1, r2):
            assert_slot_matches_file(r, slot_holding(r.status(), name),
                                     fleet.example.adapter_dirs[adapter], a["scaling"], a["rank"])
    freed = {0, 1, 2, 3, 4, 5} - {slot_holding(r1.status(), name) for name in listed}
    for slot in freed:  # unloaded and replaced slots are zero
        got = r1.call("slot", slot=slot)
        assert got["rank"] == 0 and got["scaling"] == 0
        assert not any(np.frombuffer(m["data"], np.float32).any() for m in got["A"].values())


def test_killed_replica_converges_and_cold_replica_fetches_only_live_blobs(fleet: Fleet) -> None:
    r1 = fleet.replica("r1")
    fleet.init()
    fleet.load("a", "attn-qv-r8")
    wait_for(lambda: fleet.converged(r1), what="r1")
    r1.kill()
    fleet.load("b", "all-r2")
    fleet.cmd("unload", name="a")
    r1.start()  # warm cache: its local state and blobs
    wait_for(lambda: fleet.converged(r1), what="r1 after SIGKILL")

    # 1,000 events of churn over five adapters, ending with two live
    adapters = sorted(fleet.example.adapter_dirs)
    with fleet.client() as c:
        i = 0
        while fleet.head() < 1000 - 2:
            name = f"n{i % 4}"
            c.call("load", {"event_id": new_event_id(), "name": name,
                            "path": str(fleet.example.adapter_dirs[adapters[i % 5]])})
            c.call("unload", {"event_id": new_event_id(), "name": name})
            i += 1
        c.call("load", {"event_id": new_event_id(), "name": "live1",
                        "path": str(fleet.example.adapter_dirs["mlp-only-r16"])})
        c.call("unload", {"event_id": new_event_id(), "name": "b"})
    assert fleet.head() >= 1000
    with fleet.client() as c:
        live = {a["sha256"] for a in c.call("list")["adapters"]}
    r3 = fleet.replica("r3")
    wait_for(lambda: fleet.converged(r1, r3), what="cold replica after 1,000 events")
    s1, s3 = r1.status(), r3.status()
    # from statesvc, or from r1 when its heartbeat already said it applied live1
    assert s3["blob_fetches"] + s3["peer_blob_fetches"] == len(live) == 1
    assert (s3["logical_digest"], s3["pool_digest"]) == (s1["logical_digest"], s1["pool_digest"])


def test_lost_diffs_are_detected_and_repaired(tmp_path: Path, example: ExampleAssets) -> None:
    f = Fleet(tmp_path, example, env={"LORAPLANE_FAULT_DROP_DIFFS": "3,5-6,9"})
    f.statesvc.start()
    try:
        r1 = f.replica("r1")
        f.init()
        for i, adapter in enumerate(["attn-qv-r8", "all-r2", "attn-all-r4", "mlp-only-r16"]):
            f.load(f"x{i}", adapter)
        f.cmd("unload", name="x0")
        f.cmd("unload", name="x1")
        f.load("x0", "all-r32-rslora")
        f.cmd("unload", name="x3")  # seq 9: the last diff is lost too; the heartbeat tells
        assert f.head() == 9
        wait_for(lambda: f.converged(r1), what="repair of the lost diffs")
        with f.client() as c:
            assert r1.status()["logical_digest"] == c.call("digest", {"seq": 9})["digest"]
        assert "left unpublished" in f.statesvc.log.read_text()
    finally:
        f.stop()


def test_replicas_keep_their_pool_while_statesvc_is_down(fleet: Fleet) -> None:
    r1 = fleet.replica("r1")
    fleet.init()
    fleet.load("a", "attn-qv-r8")
    wait_for(lambda: fleet.converged(r1), what="r1")
    before = r1.status()
    fleet.statesvc.stop()
    wait_for(lambda: r1.status()["last_error"] is not None, what="r1 noticing", timeout=30)
    during = r1.status()
    assert (during["state"], during["applied_seq"], during["pool_digest"]) == \
        (before["state"], before["applied_seq"], before["pool_digest"])
    fleet.statesvc.start()
    fleet.load("b", "all-r2")
    wait_for(lambda: fleet.converged(r1), what="r1 catching up by itself")
    assert r1.status()["last_error"] is None


def test_bad_blob_bytes_leave_the_pool_unchanged_and_are_retried(fleet: Fleet) -> None:
    r1 = fleet.replica("r1")
    fleet.init()
    fleet.load("a", "attn-qv-r8")
    wait_for(lambda: fleet.converged(r1), what="r1")
    r1.stop()
    sha = fleet.load("b", "all-r2") and _sha(fleet.example.adapter_dirs["all-r2"])
    blob = fleet.statesvc.data_dir / "blobs" / sha[:2] / sha
    good = blob.read_bytes()
    for bad in (good[:-100], bytes([good[0] ^ 1]) + good[1:]):  # truncated, flipped
        fleet.statesvc.stop()  # a running statesvc serves a new blob from memory
        blob.write_bytes(bad)
        fleet.statesvc.start()
        r1.start()
        wait_for(lambda: r1.status()["last_error"] is not None, what="the bad blob noticed")
        s = r1.status()
        assert s["applied_seq"] == 2 and "hashes to" in s["last_error"]
        assert held(s) == {"0": {"name": "a", "version": 2}}
        r1.stop()
    blob.write_bytes(good)
    # and a damaged blob in the replica's own cache is fetched again
    cached = r1.cache_dir / "blobs" / _sha(fleet.example.adapter_dirs["attn-qv-r8"])
    cached.write_bytes(b"garbage")
    r1.start()
    wait_for(lambda: fleet.converged(r1), what="r1 after the blob is repaired")
    s = r1.status()
    assert s["last_error"] is None and s["blob_fetches"] == 2  # b, and a fetched again


def test_replica_refuses_another_model(fleet: Fleet, tmp_path: Path) -> None:
    fleet.init()
    other = make_example(tmp_path / "other", shape=ModelShape(num_hidden_layers=3)).model_dir
    log = _refused_at_start(fleet, Computed(other, fleet.statesvc, tmp_path / "replicas" / "wrong"))
    assert "configured for" in log and "num_hidden_layers" in log


def _refused_at_start(fleet: Fleet, r: Computed) -> str:
    """Start `r`, which must exit 2 before it is ready; its log."""
    fleet.replicas.append(r)
    with pytest.raises(RuntimeError):
        r.start()
        assert r.proc is not None
        r.proc.wait(60)
        raise RuntimeError("exited")
    assert r.proc is not None and r.proc.wait(60) == 2
    return r.log.read_text()


def test_replica_refuses_the_same_architecture_with_other_weights(fleet: Fleet,
                                                                  tmp_path: Path) -> None:
    """Same config.json and tensor shapes, other weights (as a base model and its instruct
    fine-tune): the fingerprint agrees, the weights' digest does not. A serving replica
    refuses to start; a pool-only one (`--no-inference`) serves no weights and follows."""
    fleet.init()
    other = make_example(tmp_path / "other", seed=7).model_dir
    assert read_model(other).fingerprint == read_model(fleet.example.model_dir).fingerprint
    log = _refused_at_start(fleet, Computed(other, fleet.statesvc, tmp_path / "replicas" / "wrong",
                                            extra_args=("--no-warmup",)))
    assert "other weights" in log and "--model pointing at the pool's base model" in log
    pool_only = Computed(other, fleet.statesvc, tmp_path / "replicas" / "pool-only",
                         extra_args=("--no-inference",))
    fleet.replicas.append(pool_only)
    pool_only.start()
    wait_for(lambda: fleet.converged(pool_only), what="the pool-only replica")


def test_a_replica_stopped_while_it_warms_up_exits_cleanly(fleet: Fleet) -> None:
    """SIGTERM during the warm-up's compiles: the process used to end with the compiling
    thread inside XLA, and the interpreter's shutdown aborted it (exit -6, "terminate called
    after throwing an instance of ''"). The warm-up now stops before its next compile and the
    daemon joins it."""
    fleet.init()
    r = fleet.replica("warming", args=())  # with its warm-up
    wait_for(lambda: r.status()["state"] == "ACTIVE", what="the replica active")
    time.sleep(1.0)  # into its first compiles (a stop before any had begun always exited)
    assert r.status()["inference"]["warm"] is False  # still compiling (seconds per bucket)
    assert r.proc is not None
    os.kill(r.proc.pid, signal.SIGTERM)
    assert r.proc.wait(60) == 0
    log = r.log.read_text()
    assert "terminate called" not in log and "stopped" in log


def _sha(adapter_dir: Path) -> str:
    return hashlib.sha256((adapter_dir / "adapter_model.safetensors").read_bytes()).hexdigest()
