"""`Engine.cancel`: a client drops its own request, waiting or running; its row and its place
in the queue are free at once, nobody else's request is touched, and the request's last
reply is the `cancelled` error (the replica's `cancel`, docs/protocol.md §13b)."""
from __future__ import annotations

from computed.serving.engine import Engine
from computed.serving.rows import Done
from shared.replica_protocol import generate_args
from tests.unit.test_engine_intake import BaseOnly, CountingModel


class Withdrawals(BaseOnly):
    def __init__(self) -> None:
        self.withdrawn: list[int] = []

    def withdraw(self, ticket: int) -> None:
        self.withdrawn.append(ticket)


def test_a_client_cancels_its_own_requests_only() -> None:
    port = Withdrawals()
    engine = Engine(CountingModel(), port)
    for i in range(5):  # 4 rows: r4 waits
        assert engine.submit(f"r{i}", generate_args([1, 2, 3], max_new_tokens=8), f"to{i}",
                             client=f"c{i}") is None
    engine.step()
    assert [r.req_id for r in engine.waiting] == ["r4"]

    assert engine.cancel("r1", "c0") is None  # another client's request: untouched
    assert engine.cancel("nope", "c1") is None
    gone = engine.cancel("r1", "c1")
    assert isinstance(gone, Done) and gone.reply_to == "to1" and gone.req_id == "r1"
    assert gone.error is not None and gone.error.code == "cancelled" and gone.result is None
    assert [r.req.req_id for r in engine.rows if r is not None] == ["r0", "r2", "r3"]

    waiting = engine.cancel("r4", "c4")
    assert waiting is not None and waiting.error is not None and not engine.waiting
    assert port.withdrawn == [5]  # r4's ticket: it no longer waits for a slot
    assert engine.stats()["cancelled"] == 2 and engine.stats()["running"] == 3
    assert engine.cancel("r1", "c1") is None  # already gone

    finished: list[Done] = []
    while engine.busy:
        finished += engine.step()
    assert sorted(d.req_id for d in finished) == ["r0", "r2", "r3"]
    assert all(d.result is not None and len(d.result["output_ids"]) == 8 for d in finished)
