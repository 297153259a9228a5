"""Separate hosts: PostgreSQL, two statesvc instances, two replicas and the client, each in a
network namespace of its own on one bridge (tests/netns.py; addresses of this test's own
choosing, 10.77.0.0/24, inside the namespaces only), every socket with CURVE (statesvc binds
non-loopback addresses only with --auth). The whole flow across them, then statesvc a's host
cut off the network (its bridge port down: packets dropped, no RST, no FIN: a pulled cable)
and restored.

Needs root (namespaces, veth pairs, setns); skipped with the reason where they cannot be
made or the PostgreSQL binaries are missing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq

from shared.client import ControlClient, Unavailable, new_event_id
from statesvc.tools.example import ExampleAssets
from testkit.fleet import Computed, Endpoints, StateSvc, wait_for
from testkit.pg import PgServer
from tests.helpers import fleet_keys
from tests.netns import SUBNET, Hosts

WAIT_S = 120.0  # a guard against hanging, never a pass/fail threshold


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    why = Hosts.missing() or PgServer.missing()
    if why is not None:
        pytest.skip(why)
    made = Hosts()
    try:
        yield made
    finally:
        made.close()


def test_the_whole_flow_across_hosts_with_a_link_cut_and_restored(
        hosts: Hosts, example: ExampleAssets, tmp_path: Path) -> None:
    ip = {name: hosts.add(name) for name in ("pg", "a", "b", "r1", "r2", "client")}
    keydir, keys, key_args = fleet_keys(tmp_path)
    pg = PgServer(host=ip["pg"], trust=f"{SUBNET}.0/24", wrapper=hosts.wrapper("pg"))
    with hosts.entered("client"):
        pg.start()
        url = pg.database()  # reached from the client's host
    a, b = (StateSvc(tmp_path / n, control=f"tcp://{ip[n]}:7100", publish=f"tcp://{ip[n]}:7101",
                     extra_args=("--db", url, "--auth", str(keydir)), wrapper=hosts.wrapper(n))
            for n in ("a", "b"))
    ab = Endpoints(f"{a.control},{b.control}", f"{a.publish},{b.publish}")
    ba = Endpoints(f"{b.control},{a.control}", f"{b.publish},{a.publish}")
    replicas = {n: Computed(example.model_dir, addrs, tmp_path / n, replica_id=n,
                            extra_args=("--no-warmup", "--no-inference", *key_args),
                            wrapper=hosts.wrapper(n))
                for n, addrs in (("r1", ab), ("r2", ba))}
    adapters = example.adapter_dirs
    with hosts.entered("client"):
        ctx: zmq.Context[Any] = zmq.Context()  # its I/O thread starts here, in the client host
        client = ControlClient(ab.control, timeout_s=2, retries=0, keys=keys, context=ctx)

        def write(cmd: str, via: ControlClient = client, **args: Any) -> int:
            return int(via.call(cmd, {"event_id": new_event_id(), **args})["seq"])

        def status(svc: StateSvc) -> dict[str, Any] | None:
            try:
                with ControlClient(svc.control, timeout_s=2, retries=0, keys=keys,
                                   context=ctx) as c:
                    return dict(c.call("status"))
            except Unavailable:
                return None

        def converged(head: int, where: dict[str, StateSvc]) -> bool:
            """Each replica listed ACTIVE at `head`, agreeing, by the instance it follows."""
            for rid, svc in where.items():
                st = status(svc)
                row = {r["id"]: r for r in (st or {}).get("replicas", [])}.get(rid)
                if not (st and st["head_seq"] == head and row and row["state"] == "ACTIVE"
                        and row["applied_seq"] == head and row["agrees"]):
                    return False
            return True

        try:
            a.start()
            b.start()
            for r in replicas.values():
                r.start()
            assert write("pool.init", model=str(example.model_dir), max_loras=4, max_rank=16,
                         targets="all") == 1
            assert write("load", name="x", path=str(adapters["attn-qv-r8"])) == 2
            wait_for(lambda: converged(2, {"r1": a, "r2": b}), timeout=WAIT_S,
                     what="r1 through a and r2 through b at seq 2")

            hosts.cut("a")  # statesvc a's host off the network: the client and r1 move to b
            assert write("load", name="y", path=str(adapters["mlp-only-r16"])) == 3
            assert client.address == b.control
            assert write("unload", name="x") == 4
            wait_for(lambda: converged(4, {"r1": b, "r2": b}), timeout=WAIT_S,
                     what="both replicas at seq 4 through b")
            assert status(a) is None  # cut off: silent, not refusing

            hosts.restore("a")  # a reads what b recorded meanwhile, and takes writes again
            wait_for(lambda: (status(a) or {}).get("head_seq") == 4, timeout=WAIT_S,
                     what="a caught up with the log")
            with ControlClient(a.control, timeout_s=10, retries=0, keys=keys,
                               context=ctx) as only_a:
                assert write("load", via=only_a, name="x", path=str(adapters["all-r2"])) == 5
            wait_for(lambda: converged(5, {"r1": b, "r2": b}), timeout=WAIT_S,
                     what="both replicas at seq 5")
            digests = {(status(s) or {}).get("digest") for s in (a, b)}
            assert len(digests) == 1 and None not in digests
        finally:
            client.close()
            for r in replicas.values():
                r.stop()
            a.stop()
            b.stop()
            pg.stop()
            ctx.term()
