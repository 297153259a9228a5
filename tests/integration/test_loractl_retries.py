"""loractl when statesvc cannot answer for a while: a write answered `storage_error` is resent
under the same event id (--event-id resends it by hand, recorded at most once), and
`events --follow` waits for statesvc to come back and goes on from the last seq it printed."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, StateSvc, loractl
from tests.unit.test_adapter_files import _without_dac_override

EVENT_ID = "0b7e4f9e-3c1a-4f7e-9a52-1f0c2d3e4b5a"


def pool_init(svc: StateSvc, example: ExampleAssets) -> None:
    loractl(svc, "pool", "init", "--model", str(example.model_dir), "--max-loras", "2",
            "--max-rank", "16", "--targets", "all")


def events(svc: StateSvc) -> list[dict[str, object]]:
    return list(json.loads(loractl(svc, "events", "--json").stdout))


def test_event_id_given_twice_records_one_event(tmp_path: Path, example: ExampleAssets) -> None:
    svc = StateSvc(tmp_path / "data").start()
    try:
        pool_init(svc, example)
        qv = str(example.adapter_dirs["attn-qv-r8"])
        first = loractl(svc, "load", "a", qv, "--event-id", EVENT_ID)
        again = loractl(svc, "load", "a", qv, "--event-id", EVENT_ID)
        assert "loaded a version 2 (seq 2)" in first.stdout
        assert again.stdout == first.stdout  # the original answer, nothing recorded
        unloaded = loractl(svc, "unload", "a", "--event-id", EVENT_ID, check=False)
        assert unloaded.returncode == 1, unloaded  # one id, another write: refused
        assert [e["event_id"] for e in events(svc)][1:] == [EVENT_ID]
    finally:
        svc.stop()


@pytest.mark.parametrize("value", ["nope", EVENT_ID.upper(), EVENT_ID + "0", ""])
def test_malformed_event_id_is_a_usage_error(tmp_path: Path, value: str) -> None:
    res = subprocess.run([str(BIN / "loractl"), "unload", "a", "--event-id", value],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "Invalid value for '--event-id'" in res.stderr and "lowercase UUID" in res.stderr


def test_a_storage_error_is_resent_under_the_same_event_id(tmp_path: Path,
                                                           example: ExampleAssets) -> None:
    """The blob store's directory made read-only (a real storage_error for load): loractl resends
    until it is writable again, recorded once; left read-only, loractl gives up naming the
    command that retries under the same id, and that command records it once."""
    svc = StateSvc(tmp_path / "data", wrapper=_without_dac_override()).start()
    tmp = tmp_path / "data" / "blobs" / "tmp"
    argv = [str(BIN / "loractl"), "--state", svc.control, "load", "a",
            str(example.adapter_dirs["attn-qv-r8"])]
    try:
        pool_init(svc, example)
        tmp.chmod(0o500)
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:
            assert proc.stderr is not None
            first = proc.stderr.readline()  # the first resend: the disk is fixed meanwhile
            tmp.chmod(0o755)
            out, rest = proc.communicate(timeout=60)
        assert "load: storage_error (" in first and "resending in 0.5 s" in first, first
        assert proc.returncode == 0 and "loaded a version 2 (seq 2)" in out, (out, rest)
        assert len(events(svc)) == 2

        tmp.chmod(0o500)
        argv[4:] = ["b", str(example.adapter_dirs["mlp-only-r16"])]  # other weights
        gave_up = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        tmp.chmod(0o755)
        assert gave_up.returncode == 1, gave_up
        assert gave_up.stderr.count("resending in") == 3, gave_up.stderr
        retry = gave_up.stderr.split("retry with: ")[1].split()
        assert retry[:2] == ["loractl", "--state"] and retry[-2] == "--event-id"
        event_id = retry[-1]
        assert all(event_id in line for line in gave_up.stderr.splitlines()[:3])
        assert len(events(svc)) == 2  # nothing recorded
        retried = subprocess.run([str(BIN / "loractl"), *retry[1:]], capture_output=True,
                                 text=True, timeout=60)
        assert "loaded b version 3 (seq 3)" in retried.stdout, retried
        assert [e["event_id"] for e in events(svc)][2:] == [event_id]
    finally:
        tmp.chmod(0o755)
        svc.stop()


def test_follow_waits_for_statesvc_and_goes_on_from_the_last_seq(
        tmp_path: Path, example: ExampleAssets) -> None:
    svc = StateSvc(tmp_path / "data").start()
    follow = None
    try:
        pool_init(svc, example)
        follow = subprocess.Popen([str(BIN / "loractl"), "--state", svc.control, "--timeout",
                                   "0.5", "events", "--follow", "--json", "--diffs",
                                   svc.publish], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert follow.stdout is not None and follow.stderr is not None
        assert json.loads(follow.stdout.readline())["seq"] == 1
        svc.stop()
        assert "asking again until it answers (after seq 1)" in follow.stderr.readline()
        svc.start()  # the same data dir and addresses
        assert "answers again; following on after seq 1" in follow.stderr.readline()
        loractl(svc, "load", "a", str(example.adapter_dirs["attn-qv-r8"]))
        assert json.loads(follow.stdout.readline())["seq"] == 2
        assert follow.poll() is None
    finally:
        if follow is not None:
            follow.terminate()
            follow.wait(timeout=30)
        svc.stop()
