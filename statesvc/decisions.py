"""What `pool.init` and `unload` decide against the state (pure: no store, no files but the
model's config), and the errors a command is refused with. `load`, which reads adapter files
and the blob store, is decided by the service (statesvc/service.py)."""
from __future__ import annotations

import uuid
from typing import Any, Callable

from shared.errors import CodedError
from shared.events import AdapterUnloaded, Body, PoolConfigured
from shared.fingerprint import ModelError, read_model, weights_digest
from shared.llama import MODULES
from shared.reducer import State, require_pool
from statesvc.adapters import absolute_path
from statesvc.views import describe_pool, pool_view


class CommandError(CodedError):
    """A command the service refuses; the answer carries its code, message and field."""


def storage_error(why: str, *, write: bool = True) -> CommandError:
    """Retryable: a write resent with its event_id is recorded once, whatever happened; a
    read is simply asked again."""
    return CommandError("storage_error", f"{why}; retry with the same event_id (recorded "
                        "at most once)" if write else f"{why}; retry")



def pool_init(state: State, args: dict[str, Any], *,
              progress: Callable[[], None] = lambda: None) -> dict[str, Any] | tuple[Body, None]:
    """`pool.init`: the PoolConfigured event, or the unchanged pool's answer. The model's
    weights are hashed (`progress` between chunks) so that replicas can check theirs."""
    path = absolute_path(args["model"], "args.model")
    try:
        model = read_model(path)
        weights = weights_digest(path, progress=progress)
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


def unload(state: State, args: dict[str, Any]) -> tuple[Body, None]:
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
