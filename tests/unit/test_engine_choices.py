"""The engine's bookkeeping of a request of several choices (n, best_of), as pure logic: a row per
choice taken at once, the prompt prefilled once and forked, the per-client limit counting rows,
the request answered once its last choice ends, cancel freeing every row."""
from __future__ import annotations

from typing import Any

from computed.serving.engine import Engine
from shared.replica_protocol import generate_args
from tests.unit.test_engine_intake import BaseOnly, CountingModel


class ForkingModel(CountingModel):
    """CountingModel with the KV fork: records each (src, dst) row copy."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[int, int]] = []

    def copy_row(self, cache: Any, src: int, dst: int) -> Any:
        self.copies.append((src, dst))
        return cache


def engine(client_limit: int = 64) -> tuple[Engine, ForkingModel]:
    model = ForkingModel()
    return Engine(model, BaseOnly(), client_limit=client_limit), model  # type: ignore[arg-type]


def run(e: Engine) -> list[Any]:
    done = []
    while e.busy:
        done += e.step()
    return done


def test_choices_share_one_prefill_and_answer_together() -> None:
    e, model = engine()
    assert e.submit("a", generate_args([1, 2, 3], max_new_tokens=3, n=3), None) is None
    done = run(e)
    assert model.prefills == 1 and model.copies == [(0, 1), (0, 2)]
    assert len(done) == 1 and done[0].error is None
    result = done[0].result
    assert [c["output_ids"] for c in result["choices"]] == [[1, 1, 1]] * 3
    assert result["output_ids"] == [1, 1, 1]
    assert all(c["cumulative_logprob"] is None for c in result["choices"])  # nothing to rank


def test_best_of_ranks_and_returns_n() -> None:
    e, _ = engine()
    assert e.submit("a", generate_args([1, 2], max_new_tokens=2, n=2, best_of=4), None) is None
    (done,) = run(e)
    choices = done.result["choices"]
    assert len(choices) == 2 and all(isinstance(c["cumulative_logprob"], float) for c in choices)


def test_a_request_waits_for_a_row_per_choice() -> None:
    e, model = engine()  # 4 rows
    assert e.submit("one", generate_args([1], max_new_tokens=5), None) is None
    e.step()  # "one" holds row 0
    assert e.submit("four", generate_args([1], max_new_tokens=1, n=4), None) is None
    e.step()
    assert [r.req_id for r in e.waiting] == ["four"]  # 3 rows free: it waits
    done = run(e)
    assert {d.req_id for d in done} == {"one", "four"} and model.copies[-3:] == [(0, 1), (0, 2), (0, 3)]


def test_the_client_limit_counts_rows_and_cancel_frees_them_all() -> None:
    e, _ = engine(client_limit=4)
    assert e.submit("a", generate_args([1], max_new_tokens=9, n=3), None, client="c") is None
    refused = e.submit("b", generate_args([1], max_new_tokens=9, n=2), None, client="c")
    assert refused is not None and refused.error is not None
    assert refused.error.code == "overloaded" and "asks for 2" in str(refused.error)
    e.step()
    assert sum(r is not None for r in e.rows) == 3
    gone = e.cancel("a", "c")
    assert gone is not None and all(r is None for r in e.rows)
    assert e.submit("b", generate_args([1], max_new_tokens=9, n=2), None, client="c") is None


def test_choices_that_cannot_go_together_are_refused_by_field() -> None:
    e, _ = engine()
    for args, field in ((generate_args([1], n=3, best_of=2), "args.best_of"),
                        (generate_args([1], n=5), "args.n"),
                        (generate_args([1], n=1, best_of=5), "args.best_of"),
                        (generate_args([1], n=1, best_of=2, stream=True), "args.best_of"),
                        (generate_args([1], max_new_tokens=3, min_tokens=4), "args.min_tokens")):
        done = e.submit("x", args, None)
        assert done is not None and done.error is not None and done.error.field == field, args
