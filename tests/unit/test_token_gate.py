"""The gateway's token gate (gateway/streaming.py `TokenGate`): streams waiting for
tokens are woken `per_turn` a turn of the event loop, first come first served, while an
output or an error wakes its stream at once; every item still reaches its stream in order."""
from __future__ import annotations

import asyncio

from gateway.streaming import Inbox, Item, TokenGate


async def _read(name: str, inbox: Inbox, log: list[tuple[int, str, Item]],
                turn: list[int]) -> None:
    while True:
        item = await inbox.get()
        log.append((turn[0], name, item))
        if item[0] != "token":
            return


async def _turns(turn: list[int], n: int) -> None:
    """Counts the loop's turns: one increment per turn."""
    for _ in range(n):
        turn[0] += 1
        await asyncio.sleep(0)


def test_tokens_wake_one_stream_a_turn_and_an_output_goes_first() -> None:
    async def main() -> list[tuple[int, str, Item]]:
        gate = TokenGate(per_turn=1)
        inboxes = {name: Inbox(gate) for name in "abcd"}
        log: list[tuple[int, str, Item]] = []
        turn = [0]
        readers = [asyncio.create_task(_read(n, q, log, turn)) for n, q in inboxes.items()]
        await asyncio.sleep(0)  # every reader waits
        counter = asyncio.create_task(_turns(turn, 50))
        for name in "abcd":  # one decode step: a token for every stream
            inboxes[name].put(("token", ord(name)))
        inboxes["d"].put(("done", "out"))  # d's answer ended in that step
        while len(log) < 5:  # d's two items and a, b and c's tokens
            await asyncio.sleep(0)
        for name in "abc":
            inboxes[name].put(("done", "out"))
        await asyncio.gather(*readers)
        counter.cancel()
        return log

    log = asyncio.run(main())
    firsts: dict[str, int] = {}
    for t, name, _ in log:
        firsts.setdefault(name, t)
    # d's output woke it at once, ahead of the tokens queued at the gate, and its token
    # came with it, in order
    assert [item for _, name, item in log if name == "d"] == [("token", ord("d")), ("done", "out")]
    assert firsts["d"] < firsts["a"] < firsts["b"] < firsts["c"]
    # one stream woken for its token per turn of the loop
    assert len({firsts[n] for n in "abc"}) == 3
    assert all(item == ("token", ord(name)) for _, name, item in log
               if name != "d" and item[0] == "token")
