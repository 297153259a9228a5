"""CURVE authentication and roles on statesvc, key dirs with bad files, the audit trail,
contained adapter sources, loopback-only default."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from shared.client import ControlClient, RemoteError, Unavailable, new_event_id
from shared.keys import ClientKeys, client_keys
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, Computed, StateSvc, free_port, loractl, wait_for
from tests.helpers import make_keys, run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[StateSvc, Path, Path]]:
    keydir, clients = make_keys(tmp_path, {"alice": "operators", "r1": "replicas", "mallory": None})
    svc = StateSvc(tmp_path / "data", extra_args=("--auth", str(keydir)))
    try:
        yield svc.start(), keydir, clients
    finally:
        svc.stop()


def keys(keydir: Path, clients: Path, name: str) -> ClientKeys:
    k = client_keys(str(clients / f"{name}.key_secret"), str(keydir / "server.key"))
    assert k is not None
    return k


def test_only_allowed_keys_connect_and_only_operators_append(
        keyed: tuple[StateSvc, Path, Path], example: ExampleAssets, tmp_path: Path) -> None:
    svc, keydir, clients = keyed
    for who in [None, keys(keydir, clients, "mallory")]:  # no key, an unknown key
        with ControlClient(svc.control, timeout_s=1.0, retries=0, keys=who) as c:
            with pytest.raises(Unavailable):
                c.call("status")
    alice = ControlClient(svc.control, keys=keys(keydir, clients, "alice"))
    with alice:
        alice.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 8, "targets": "all"})
        alice.call("load", {"event_id": new_event_id(), "name": "a",
                            "path": str(example.adapter_dirs["all-r2"])})
        with ControlClient(svc.control, keys=keys(keydir, clients, "r1")) as replica_key:
            with pytest.raises(RemoteError) as refused:
                replica_key.call("load", {"event_id": new_event_id(), "name": "b",
                                          "path": str(example.adapter_dirs["attn-qv-r8"])})
            assert refused.value.code == "forbidden" and "replica:r1" in str(refused.value)
            events = replica_key.call("events", {"since": 0})["events"]  # reading is allowed
        assert [e["actor"] for e in events] == ["operator:alice", "operator:alice"]
        assert alice.call("status")["head_seq"] == 2
    # loractl with keys from the environment, and a replica on its own key
    env = {**os.environ, "LORAPLANE_KEY": str(clients / "alice.key_secret"),
           "LORAPLANE_SERVER_KEY": str(keydir / "server.key")}
    res = subprocess.run([str(BIN / "loractl"), "--state", svc.control, "list", "--json"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0 and [a["name"] for a in json.loads(res.stdout)] == ["a"]
    replica = Computed(example.model_dir, svc, tmp_path / "replicas" / "r1", replica_id="r1",
                       extra_args=("--no-warmup", "--key", str(clients / "r1.key_secret"),
                                   "--server-key", str(keydir / "server.key")))
    try:
        replica.start()
        wait_for(lambda: replica.status()["applied_seq"] == 2, what="the keyed replica")
        with ControlClient(svc.control, keys=keys(keydir, clients, "alice")) as c:
            wait_for(lambda: [r["agrees"] for r in c.call("status")["replicas"]] == [True],
                     what="its heartbeat")
    finally:
        replica.stop()


def test_a_replica_refused_once_comes_back_when_its_key_is_put_back(
        keyed: tuple[StateSvc, Path, Path], example: ExampleAssets, tmp_path: Path) -> None:
    """statesvc restarted while the replica's key was out of replicas/: libzmq stops redialling
    a server that refused a CURVE key, so the replica's diff and heartbeat sockets stayed dead
    after the key came back (it followed by polling alone and never heartbeat again). A silent
    diff stream now opens them anew."""
    svc, keydir, clients = keyed
    with ControlClient(svc.control, keys=keys(keydir, clients, "alice")) as alice:
        alice.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 8, "targets": "all"})
    replica = Computed(example.model_dir, svc, tmp_path / "replicas" / "r1", replica_id="r1",
                       extra_args=("--no-inference", "--key", str(clients / "r1.key_secret"),
                                   "--server-key", str(keydir / "server.key")))

    def heartbeats(c: ControlClient) -> list[tuple[str, int]]:
        return [(r["id"], r["applied_seq"]) for r in c.call("status")["replicas"]]

    try:
        replica.start()
        wait_for(lambda: replica.status()["state"] == "ACTIVE", what="the keyed replica")
        key = keydir / "replicas" / "r1.key"
        aside = tmp_path / "r1.key.aside"
        key.rename(aside)
        svc.stop()
        svc.start()  # the same addresses: the replica's sockets redial it and are refused
        with ControlClient(svc.control, keys=keys(keydir, clients, "alice")) as alice:
            wait_for(lambda: "no word from statesvc" in replica.log.read_text(),
                     what="the refused replica noticing")
            assert heartbeats(alice) == []
            aside.rename(key)
            seq = alice.call("load", {"event_id": new_event_id(), "name": "a",
                                      "path": str(example.adapter_dirs["all-r2"])})["seq"]
            wait_for(lambda: heartbeats(alice) == [("r1", seq)], what="its heartbeat back")
        assert "reconnecting to" in replica.log.read_text()
        # and its diff stream: statesvc's heartbeats (every second) reach the new SUB
        wait_for(lambda: "speaks again" in replica.log.read_text(), what="the diff stream back")
    finally:
        replica.stop()


def test_malformed_key_files_are_skipped_and_every_good_key_still_connects(
        tmp_path: Path) -> None:
    keydir, clients = make_keys(tmp_path, {"alice": "operators", "bob": None})
    ops = keydir / "operators"
    (ops / "garbage.key").write_bytes(os.urandom(300))
    (ops / "no-equals.key").write_text("public-key\n")
    (ops / "short.key").write_text('public-key = "abc"\n')
    (ops / "alphabet.key").write_text('public-key = "' + "~" * 40 + '"\n')
    (ops / "empty.key").write_text("")
    (ops / "huge.key").write_text("#" * (1 << 17))
    (ops / "a-directory.key").mkdir()
    os.mkfifo(ops / "fifo.key")
    (ops / "dangling.key").symlink_to(tmp_path / "nowhere")
    svc = StateSvc(tmp_path / "data", extra_args=("--auth", str(keydir))).start()
    try:
        for _ in range(3):  # keys are read again for each connection
            with ControlClient(svc.control, timeout_s=5, retries=0,
                               keys=keys(keydir, clients, "alice")) as c:
                assert c.call("status")["head_seq"] == 0
        shutil.copy(clients / "bob.key", ops / "bob.key")  # added while serving: still read
        with ControlClient(svc.control, timeout_s=5, retries=0,
                           keys=keys(keydir, clients, "bob")) as c:
            assert c.call("status")["head_seq"] == 0
    finally:
        svc.stop()
    logged = svc.log.read_text()
    for name in ("garbage", "no-equals", "short", "alphabet", "empty", "huge", "a-directory",
                 "fifo", "dangling"):
        assert logged.count(f"skipping key file {ops / name}.key") == 1, name


def test_events_show_who_recorded_them(keyed: tuple[StateSvc, Path, Path],
                                       example: ExampleAssets) -> None:
    svc, keydir, clients = keyed
    as_alice = ("--key", str(clients / "alice.key_secret"), "--server-key",
                str(keydir / "server.key"))
    loractl(svc, *as_alice, "pool", "init", "--model", str(example.model_dir), "--max-loras",
            "2", "--max-rank", "8", "--targets", "all")
    [event] = json.loads(loractl(svc, *as_alice, "events", "--json").stdout)
    assert event["actor"] == "operator:alice"
    table = subprocess.run([str(BIN / "loractl"), "--state", svc.control, *as_alice, "events"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"}).stdout
    assert "actor" in table and "operator:alice" in table



def test_without_keys_statesvc_binds_loopback_only(tmp_path: Path) -> None:
    res = run("statesvc", "serve", "--data-dir", str(tmp_path / "d"), "--control",
              f"tcp://0.0.0.0:{free_port()}", "--publish", f"tcp://127.0.0.1:{free_port()}")
    assert res.returncode != 0
    assert "refusing to bind tcp://0.0.0.0" in res.stderr and "--auth" in res.stderr


@pytest.fixture
def rooted(tmp_path: Path) -> Iterator[tuple[StateSvc, Path]]:
    root = tmp_path / "adapters"
    root.mkdir()
    svc = StateSvc(tmp_path / "data", extra_args=("--adapter-root", str(root)))
    try:
        yield svc.start(), root
    finally:
        svc.stop()


def test_adapter_paths_must_stay_under_the_roots(rooted: tuple[StateSvc, Path],
                                                 example: ExampleAssets, tmp_path: Path) -> None:
    svc, root = rooted
    outside = tmp_path / "outside"
    shutil.copytree(example.adapter_dirs["all-r2"], outside)
    shutil.copytree(example.adapter_dirs["all-r2"], root / "good")
    (root / "escape-dir").symlink_to(outside)
    (root / "escape-file").mkdir()
    shutil.copy(outside / "adapter_config.json", root / "escape-file")
    (root / "escape-file" / "adapter_model.safetensors").symlink_to(
        outside / "adapter_model.safetensors")
    with ControlClient(svc.control) as c:
        c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                             "max_loras": 2, "max_rank": 8, "targets": "all"})
        cases = {f"{root}/../outside": "'..' is not allowed",
                 str(outside): "is outside the adapter roots",
                 str(root / "escape-dir"): "resolves to",
                 str(root / "escape-file"): "adapter_model.safetensors is outside"}
        for path, why in cases.items():
            with pytest.raises(RemoteError) as refused:
                c.call("load", {"event_id": new_event_id(), "name": "x", "path": path})
            assert refused.value.code == "forbidden" and why in str(refused.value), path
            assert "--adapter-root" in str(refused.value)
        assert c.call("status")["head_seq"] == 1
        assert not list((svc.data_dir / "blobs").glob("??/*"))
        ok = c.call("load", {"event_id": new_event_id(), "name": "x",
                             "path": str(root / "good")})
        assert ok["seq"] == 2


def test_inference_socket_with_curve_admits_only_allowed_clients(
        tmp_path: Path, example: ExampleAssets) -> None:
    keydir, clients = make_keys(tmp_path, {"app": "clients", "stranger": None})
    svc = StateSvc(tmp_path / "data").start()
    replica = Computed(example.model_dir, svc, tmp_path / "replicas" / "r", replica_id="r",
                       extra_args=("--no-warmup", "--max-len", "64", "--auth", str(keydir)))
    try:
        with ControlClient(svc.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 2, "max_rank": 8, "targets": "all"})
        replica.start()
        args = {"adapter": None, "input_ids": [1, 2, 3], "max_new_tokens": 2, "min_seq": 1}
        for who in (None, "stranger"):
            k = None if who is None else keys(keydir, clients, who)
            with ControlClient(replica.listen, timeout_s=1.0, retries=0, keys=k) as c:
                with pytest.raises(Unavailable):
                    c.call("generate", args)
        with ControlClient(replica.listen, timeout_s=60, retries=0,
                           keys=keys(keydir, clients, "app")) as c:
            assert len(c.call("generate", args)["output_ids"]) == 2
        res = run("loractl", "--key", str(clients / "app.key_secret"), "generate", "--replica",
                  replica.listen, "--replica-server-key", str(keydir / "server.key"),
                  "--input-ids", "1,2,3", "--max-new-tokens", "2", "--json")
        assert res.returncode == 0, res.stderr
        assert len(json.loads(res.stdout)["output_ids"]) == 2
    finally:
        replica.stop()
        svc.stop()
