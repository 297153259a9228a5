"""How loractl prints what statesvc and the replicas answer: rich tables and summaries, every
value from the wire through `terminal_safe`."""
from __future__ import annotations

from typing import Any

from rich.table import Table

from statesvc.console import out, terminal_safe

EVENT_KEYS = ("seq", "event_id", "type", "payload", "recorded_at", "actor")
AGREES = {True: "[green]yes[/]", False: "[bold red]NO[/]",
          None: "[yellow]behind[/]"}  # None: at a seq older than statesvc's recent heads


def short_targets(targets: list[str]) -> str:
    """q_proj,v_proj -> q,v: what a table cell has room for."""
    return ",".join(t.removesuffix("_proj") for t in targets)


def adapters_table(res: dict[str, Any], adapters: list[dict[str, Any]]) -> Table:
    """`list`'s answer `res` (its pool configured) and the adapters fetched."""
    pool_ = res["pool"]
    shown_ = "" if len(adapters) == res["count"] else f"{len(adapters)} shown, "
    table = Table(title=terminal_safe(f"{shown_}{res['count']} of {pool_['max_adapters']} "
                                      f"adapters registered ({pool_['max_loras']} slots per "
                                      f"replica), head seq {res['head_seq']}"))
    for col in ("name", "version", "rank", "alpha", "scaling", "targets", "sha256", "pinned"):
        table.add_column(col, justify="right" if col in ("version", "rank") else "left")
    for a in adapters:
        table.add_row(*map(terminal_safe, (a["name"], a["version"], a["rank"],
                                           f"{a['alpha']:g}", f"{a['scaling']:.4g}")),
                      terminal_safe(short_targets(a["targets"])),
                      terminal_safe(a["sha256"][:12]), "yes" if a["pinned"] else "")
    return table


def event_summary(ev: dict[str, Any]) -> str:
    """What an event did, in a table cell."""
    p = ev["payload"]
    if ev["type"] == "pool.configured":
        return (f"{p['max_loras']} slots, max rank {p['max_rank']}, "
                f"{short_targets(p['targets'])}, {p['dtype']}")
    if ev["type"] == "adapter.loaded":
        rep = f", replaces v{p['replaces']['version']}" if p.get("replaces") else ""
        return f"{p['name']} v{p['version']} (r={p['rank']}{rep})"
    return f"{p['name']} v{p['version']}"


def print_events(evs: list[dict[str, Any]]) -> None:
    table = Table()
    for col in ("seq", "recorded_at", "type", "what", "actor", "event_id"):
        table.add_column(col)
    for e in evs:
        table.add_row(*map(terminal_safe, (e["seq"], e["recorded_at"][:23], e["type"],
                                           event_summary(e), e["actor"], e["event_id"][:8])))
    out.print(table)


def replicas_table(replicas: list[dict[str, Any]]) -> Table:
    """`status`'s replicas, and whether each agrees with the log."""
    table = Table()
    for col in ("replica", "address", "state", "applied", "logical", "pool", "agrees"):
        table.add_column(col)
    for r in replicas:
        address = r["address"] + (f" (was {r['previous_address']})"
                                   if r.get("previous_address") else "")
        table.add_row(*map(terminal_safe, (r["id"], address, r["state"], r["applied_seq"],
                                           r["logical_digest"][:12], r["pool_digest"][:12])),
                      AGREES[r["agrees"]])
    return table
