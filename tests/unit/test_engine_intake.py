"""A burst of requests that lands while the engine prefills the first of it decodes in step with
it: the engine takes what arrived between prefills (`step(intake=...)`) into the same step."""
from __future__ import annotations

from typing import Any

import numpy as np

from computed.serving.engine import Engine
from computed.serving.rows import Done
from shared.replica_protocol import generate_args
from testkit.ports import BaseOnly


class CountingModel:
    """The engine's `Model` as pure logic: the next token is always 1; counts the calls."""

    vocab_size, max_len, max_batch = 16, 32, 4

    def __init__(self) -> None:
        self.prefills = 0  # prompts prefilled
        self.batches: list[list[int]] = []  # the rows of each prefill call
        self.decodes = 0

    def new_cache(self) -> Any:
        return None

    def prefill(self, pool: Any, cache: Any, prompts: list[list[int]], rows: list[int],
                slots: list[int]) -> tuple[np.ndarray, Any]:
        self.prefills += len(prompts)
        self.batches.append(list(rows))
        return np.tile(np.eye(self.vocab_size, dtype=np.float32)[1], (len(prompts), 1)), cache

    def decode(self, pool: Any, cache: Any, tokens: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, Any]:
        self.decodes += 1
        return np.tile(np.eye(self.vocab_size, dtype=np.float32)[1], (self.max_batch, 1)), cache

    def warmup(self, pool: Any, cache: Any, *, stop: Any = None) -> None:
        pass


def submit(engine: Engine, i: int, new_tokens: int = 4) -> None:
    assert engine.submit(f"r{i}", generate_args([1, 2, 3], max_new_tokens=new_tokens), i) is None


def test_requests_taken_in_between_prefills_join_the_same_step() -> None:
    model = CountingModel()
    engine = Engine(model, BaseOnly())
    submit(engine, 0)
    arrivals = [[1, 2], [3], [4]]  # what each intake finds; 4 waits: the batch has 4 rows

    def intake() -> None:
        for i in arrivals.pop(0) if arrivals else []:
            submit(engine, i)

    done: list[Done] = engine.step(intake=intake)
    # each pass over the queue prefills what it admitted in one call
    assert model.prefills == 4 and model.batches == [[0], [1, 2], [3]] and model.decodes == 1
    assert [r.req.req_id for r in engine.rows if r is not None] == ["r0", "r1", "r2", "r3"]
    assert [r.req_id for r in engine.waiting] == ["r4"]  # queued, counted by submit's limits
    assert engine.stats()["waiting"] == 1
    while len(done) < 4:
        done += engine.step()
    # the four finished together, in the step that gave each its 4th token
    assert model.decodes == 3 and [d.req_id for d in done] == ["r0", "r1", "r2", "r3"]
    assert all(d.result is not None and d.result["output_ids"] == [1] * 4 for d in done)


def test_without_intake_a_burst_arriving_during_prefill_waits_a_step() -> None:
    model = CountingModel()
    engine = Engine(model, BaseOnly())
    submit(engine, 0)
    engine.step()
    submit(engine, 1)
    done: list[Done] = []
    while len(done) < 2:
        done += engine.step()
    assert [d.req_id for d in done] == ["r0", "r1"] and model.decodes == 4


def test_requests_waiting_together_are_prefilled_in_one_call() -> None:
    model = CountingModel()
    engine = Engine(model, BaseOnly())
    for i in range(6):
        submit(engine, i)
    engine.step()
    # one prefill for the four rows; the other two wait for a free row
    assert model.batches == [[0, 1, 2, 3]] and model.decodes == 1
    assert [r.req_id for r in engine.waiting] == ["r4", "r5"]
