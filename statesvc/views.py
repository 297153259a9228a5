"""What the state service's answers show of the log: write results, the pool, list pages."""
from __future__ import annotations

import bisect
from typing import Any

from shared.events import AdapterLoaded, AdapterUnloaded, Body, PoolConfigured
from shared.reducer import State


def result_of(event_type: str, seq: int, body: Body) -> dict[str, Any]:
    if isinstance(body, PoolConfigured):
        return {"seq": seq, "created": True, **pool_view(body)}
    assert isinstance(body, (AdapterLoaded, AdapterUnloaded))
    out: dict[str, Any] = {"seq": seq, "name": body.name, "version": body.version}
    if isinstance(body, AdapterLoaded):
        out["created"] = True
    return out


def pool_view(pool: PoolConfigured) -> dict[str, Any]:
    return {"fingerprint": pool.fingerprint, "max_loras": pool.max_loras,
            "max_adapters": pool.max_adapters, "max_rank": pool.max_rank,
            "targets": list(pool.targets), "dtype": pool.dtype, "num_layers": pool.num_layers}


def adapter_view(a: AdapterLoaded) -> dict[str, Any]:
    return {"name": a.name, "version": a.version, "rank": a.rank,
            "alpha": a.alpha, "scaling": a.scaling, "targets": list(a.targets),
            "sha256": a.sha256, "pinned": a.pinned}


def list_page(state: State, after: str | None, limit: int) -> dict[str, Any]:
    """One page of the registry by name: the adapters after `after`, at most `limit`;
    `next_after` is the last one's name while more follow (else null)."""
    names = sorted(state.adapters)
    start = 0 if after is None else bisect.bisect_right(names, after)
    page = names[start:start + limit]
    more = start + limit < len(names)
    return {"head_seq": state.seq,
            "pool": None if state.pool is None else pool_view(state.pool),
            "count": len(names), "next_after": page[-1] if more and page else None,
            "adapters": [adapter_view(state.adapters[n]) for n in page]}


def describe_pool(pool: PoolConfigured) -> str:
    return (f"max_loras={pool.max_loras}, max_adapters={pool.max_adapters}, "
            f"max_rank={pool.max_rank}, targets={','.join(pool.targets)}, dtype={pool.dtype}, "
            f"model {pool.fingerprint[:12]}")
