"""A log that lost events, or a damaged database file, is refused at start with what to do;
nothing in the data dir is changed, and no blob is deleted."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from shared.client import ControlClient, new_event_id
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, StateSvc
from testkit.inproc import call, init_pool, open_service

pytestmark = pytest.mark.timeout(240)


def blob_files(data_dir: Path) -> set[str]:
    return {p.name for p in (data_dir / "blobs").glob("??/*")}


def refused_start(svc: StateSvc) -> str:
    """Start `svc`, which must exit with an error; returns its log."""
    with pytest.raises(RuntimeError, match="did not start"):
        svc.start()
    text = svc.log.read_text()
    assert "Traceback" not in text, text
    return text


def test_a_lost_wal_is_refused_and_no_blob_is_deleted(tmp_path: Path,
                                                      example: ExampleAssets) -> None:
    data = tmp_path / "data"
    svc = StateSvc(data).start()
    try:
        with ControlClient(svc.control) as c:
            c.call("pool.init", {"event_id": new_event_id(), "model": str(example.model_dir),
                                 "max_loras": 4, "max_rank": 32, "targets": "all"})
            for name, adapter in (("a", "attn-qv-r8"), ("b", "mlp-only-r16"), ("c", "all-r2")):
                c.call("load", {"event_id": new_event_id(), "name": name,
                                "path": str(example.adapter_dirs[adapter])})
        blobs = blob_files(data)
        assert len(blobs) == 3 and (data / "state.db-wal").exists()
        (data / "state.db-wal").unlink()  # under the running service
        assert svc.proc is not None
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(10)
        db_before = (data / "state.db").read_bytes()

        log = refused_start(svc)
        assert "ends at seq 0, but it held events up to seq 4" in log
        assert "state.db-wal" in log and "--data-dir" in log and "--cache-dir" in log
        assert blob_files(data) == blobs  # no blob taken for an orphan
        assert (data / "state.db").read_bytes() == db_before  # not even migrated
    finally:
        svc.stop()


def test_a_database_file_of_garbage_is_refused_with_a_message(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    garbage = b"this is not a database" * 1000
    (data / "state.db").write_bytes(garbage)
    svc = StateSvc(data)
    try:
        log = refused_start(svc)
        assert "is not a readable SQLite database" in log and "file is not a database" in log
        assert "from a backup" in log
        migrate = subprocess.run([str(BIN / "statesvc"), "migrate", "--data-dir", str(data)],
                                 capture_output=True, text=True, timeout=60)
        assert migrate.returncode == 1 and "Traceback" not in migrate.stderr
        assert "is not a readable SQLite database" in migrate.stderr
        assert (data / "state.db").read_bytes() == garbage
    finally:
        svc.stop()


def test_a_damaged_page_of_the_log_is_refused_with_a_message(tmp_path: Path,
                                                            example: ExampleAssets) -> None:
    data = tmp_path / "data"
    svc = open_service(data, snapshot_every=1)
    init_pool(svc, example.model_dir)
    svc.store.close()  # checkpointed into state.db
    db = sqlite3.connect(data / "state.db")
    [(root,)] = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'snapshots'")
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with (data / "state.db").open("r+b") as f:  # the header and the log itself still read
        f.seek((root - 1) * page_size)
        f.write(b"\x77" * page_size)
    damaged = (data / "state.db").read_bytes()
    restarted = StateSvc(data)
    try:
        log = refused_start(restarted)
        assert "is damaged (database disk image is malformed)" in log and "from a backup" in log
        assert (data / "state.db").read_bytes() == damaged
    finally:
        restarted.stop()


def test_orphan_blobs_are_swept_only_under_a_high_water_mark(tmp_path: Path,
                                                             example: ExampleAssets) -> None:
    data = tmp_path / "data"
    svc = open_service(data)
    init_pool(svc, example.model_dir)
    call(svc, "load", name="a", path=str(example.adapter_dirs["attn-qv-r8"]))
    svc.store.close()
    kept = blob_files(data)
    orphan = "ab" * 32  # a crash between a blob's write and its event's commit
    (data / "blobs" / "ab").mkdir()
    (data / "blobs" / "ab" / orphan).write_bytes(b"orphan")
    head_file = data / "state.db.head"
    assert int(head_file.read_text()) == 2

    # a mark left empty by a power loss, or a data dir from before high-water marks: nothing
    # shows that no event was lost
    head_file.write_bytes(b"\0" * 21)
    open_service(data).store.close()
    assert blob_files(data) == kept | {orphan}
    head_file.unlink()
    open_service(data).store.close()
    assert blob_files(data) == kept | {orphan}
    # the mark is written again by the next commit; from then on orphans are swept
    svc = open_service(data)
    call(svc, "unload", name="a")
    svc.store.close()
    assert int(head_file.read_text()) == 3
    open_service(data).store.close()
    assert blob_files(data) == kept
