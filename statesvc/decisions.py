"""The command decisions: `DECISIONS`, one row per write command, and the errors a command
is refused with.

`DECISIONS` is the seam between the service's batch (statesvc/service.py: event_ids,
`expect_head`, group commit) and what each write means. What may cross it: into a decider,
the state that the batch's earlier writes leave, the seq its event would take, the
validated args (shared/protocol.py) and a `Context` (the blob store, the adapter roots and
size limit, the progress callback); out of it, the event body to append (with the new
blob's bytes, for `load`), or the answer when the state already is what was asked (a dict,
nothing appended), or a CommandError (or another CodedError). A decider appends nothing,
publishes nothing, and sees neither the event store, the socket nor the actor; its one
write is `load`'s repair of a damaged stored blob (the same bytes under the same name).
The reducer (shared/reducer.py) then applies the event: the rules every replica applies
too live there, not here. Adding a command: docs/protocol.md, "Adding a command".
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shared.errors import CodedError
from shared.events import AdapterLoaded, AdapterUnloaded, Body, PoolConfigured, Replaced
from shared.fingerprint import ModelError, read_model, weights_digest
from shared.projections import MODULES
from shared.protocol import WRITE_COMMANDS
from shared.reducer import State, admit_load, require_pool
from statesvc.adapters import ANYWHERE, absolute_path, inspect_adapter, same_adapter
from statesvc.persistence.base import BlobStore
from statesvc.views import describe_pool, pool_view

log = logging.getLogger("statesvc")


class CommandError(CodedError):
    """A command the service refuses; the answer carries its code, message and field."""


def storage_error(why: str, *, write: bool = True) -> CommandError:
    """Retryable: a write resent with its event_id is recorded once, whatever happened; a
    read is simply asked again."""
    return CommandError("storage_error", f"{why}; retry with the same event_id (recorded "
                        "at most once)" if write else f"{why}; retry")


@dataclass(frozen=True)
class Context:
    """What the service lends a decider besides the state and the args."""

    blobs: BlobStore
    adapter_roots: tuple[Path, ...]  # empty: anywhere
    max_adapter_bytes: int
    # called now and then while a file is hashed (the server publishes its heartbeats)
    progress: Callable[[], None]


# the answer when nothing changes, or the event's body and, for `load`, the new blob's bytes
# (None: the blob store holds them already)
Decided = dict[str, Any] | tuple[Body, bytes | bytearray | None]


def pool_init(state: State, seq: int, args: dict[str, Any], ctx: Context) -> Decided:
    """`pool.init`: the PoolConfigured event, or the unchanged pool's answer. The model's
    weights are hashed (`progress` between chunks) so that replicas can check theirs."""
    path = absolute_path(args["model"], "args.model")
    try:
        model = read_model(path)
        weights = weights_digest(path, progress=ctx.progress)
    except ModelError as exc:
        raise CommandError("invalid_model", str(exc), "args.model") from None
    served = tuple(m for m in MODULES if m in model.module_dims)  # a MoE model's: attention only
    if args["targets"] != "all" and set(args["targets"]) - set(served):
        family = model.config.get("model_type")
        raise CommandError("bad_request", f"args.targets {', '.join(sorted(set(args['targets']) - set(served)))}: "
                           f"{family}'s MLP is a mixture of experts, and LoRA on experts is not served; "
                           f"its LoRA targets are {', '.join(served)}", "args.targets")
    targets = served if args["targets"] == "all" else tuple(m for m in served if m in args["targets"])
    body = PoolConfigured(model.fingerprint, model.config, model.num_layers,
                          model.module_dims, args["max_loras"], args["max_rank"], targets,
                          args["dtype"], log_id=str(uuid.uuid4()),
                          max_adapters=args["max_adapters"], weights_sha256=weights)
    if state.pool is not None:
        # a pool recorded before weights were hashed compares on the rest
        if (pool_view(state.pool) == pool_view(body)
                and state.pool.weights_sha256 in (None, weights)):
            return {"seq": 1, "created": False, **pool_view(state.pool)}
        differs = ("the same architecture with other weights"
                   if pool_view(state.pool) == pool_view(body) else "other settings")
        raise CommandError("already_configured", "the pool is already configured "
                           f"({describe_pool(state.pool)}; this asks for {differs}) and its "
                           "settings are immutable; to change them start a new state service "
                           "with a new --data-dir")
    return body, None


def unload(state: State, seq: int, args: dict[str, Any], ctx: Context) -> Decided:
    """`unload`: the AdapterUnloaded event."""
    require_pool(state)
    cur = state.adapters.get(args["name"])
    if cur is None:
        raise CommandError("not_found", f"adapter {args['name']!r} is not loaded; "
                           "`loractl list` shows the loaded adapters", "args.name")
    if cur.pinned and not args["force"]:
        raise CommandError("pinned", f"adapter {cur.name!r} is pinned; pass --force to "
                           "unload it anyway")
    return AdapterUnloaded(cur.name, cur.version), None


def load(state: State, seq: int, args: dict[str, Any], ctx: Context) -> Decided:
    """`load`: the AdapterLoaded event with the weights' bytes (None where the blob store
    holds them), or the unchanged adapter's answer."""
    pool, name = require_pool(state), args["name"]
    # the reducer's rules first (no pool, a bad name, a full registry, too many pinned): a
    # refusal reads no file
    old = admit_load(state, name, pin=args["pin"])
    path = absolute_path(args["path"], "args.path")
    roots = ctx.adapter_roots or ANYWHERE
    if ctx.adapter_roots and ".." in path.parts:
        raise CommandError("forbidden", f"{path}: '..' is not allowed in adapter paths; give "
                           f"the path under an --adapter-root "
                           f"({', '.join(map(str, roots))})", "args.path")
    # an unchanged directory whose weights are stored is not read again (adapters.py);
    # symlinks that lead out of the roots are refused as `forbidden` there
    cand = inspect_adapter(path, pool, max_bytes=ctx.max_adapter_bytes, roots=roots,
                           stored=ctx.blobs.has, progress=ctx.progress)
    if old is not None and same_adapter(old, cand, args["pin"]) and not ctx.blobs.verify(old.sha256):
        # a damaged stored copy: this load repairs it, with the bytes read now
        if cand.weights is None:
            cand = inspect_adapter(path, pool, max_bytes=ctx.max_adapter_bytes, roots=roots,
                                   progress=ctx.progress)
        if cand.weights is not None and same_adapter(old, cand, args["pin"]):
            log.warning("blob %s of %s was damaged; rewritten from %s", old.sha256[:12],
                        name, args["path"])
            ctx.blobs.put(cand.weights, cand.sha256, overwrite=True)
    if old is not None and same_adapter(old, cand, args["pin"]):
        return {"seq": old.version, "name": name, "version": old.version, "created": False}
    # other content under a loaded name without --replace: `apply` refuses it (`exists`)
    replaces = Replaced(old.version) if old is not None and args["replace"] else None
    body = AdapterLoaded(name, seq, cand.sha256, cand.size, cand.rank,
                         cand.alpha, cand.scaling, cand.use_rslora, cand.targets,
                         args["pin"], replaces)
    return body, cand.weights


@dataclass(frozen=True)
class Decision:
    """A write command's row: the type of the event it appends (a resend under its event_id
    must name the same), and its decider."""

    event: str
    decide: Callable[[State, int, dict[str, Any], Context], Decided]


# every write command (shared/protocol.py WRITE_COMMANDS), and nothing else
DECISIONS: dict[str, Decision] = {
    "pool.init": Decision(PoolConfigured.TYPE, pool_init),
    "load": Decision(AdapterLoaded.TYPE, load),
    "unload": Decision(AdapterUnloaded.TYPE, unload),
}
assert DECISIONS.keys() == WRITE_COMMANDS, "a write command without a decider, or the reverse"
