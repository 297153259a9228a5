"""vLLM's runtime LoRA endpoints, POST /v1/load_lora_adapter and /v1/unload_lora_adapter,
as events appended through statesvc (its `load` and `unload`), so every replica follows and
the change outlives any of them. After a load answers, the gateway routes the adapter at once
(read-your-writes: requests carry its load seq as `min_seq`)."""
from __future__ import annotations

import re
from typing import Any

from gateway.errors import ApiError, bad
from gateway.routing import Router
from shared.client import ControlClient, RemoteError, Unavailable, new_event_id
from shared.keys import ClientKeys

# statesvc's error codes (docs/protocol.md §5) as HTTP statuses; any other is 400
STATESVC_STATUS = {"not_found": 404, "forbidden": 403, "exists": 409, "conflict": 409,
                   "not_configured": 503, "registry_full": 507, "storage_error": 500,
                   "internal_error": 500, "invalid": 500}


def _name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise bad("lora_name must be an adapter name of 1 to 64 characters", "lora_name")
    return name


def _call(router: Router, keys: ClientKeys | None, cmd: str,
          args: dict[str, Any]) -> dict[str, Any]:
    try:
        with ControlClient(router.state, timeout_s=10.0, retries=2, keys=keys) as c:
            return dict(c.call(cmd, {"event_id": new_event_id(), **args}))
    except Unavailable as exc:
        raise ApiError(503, f"statesvc: {exc}", code="not_ready")
    except RemoteError as exc:
        raise ApiError(STATESVC_STATUS.get(exc.code, 400), str(exc), code=exc.code,
                       param="lora_path" if exc.field and "path" in exc.field else None)


def load(router: Router, keys: ClientKeys | None, served_name: str,
         body: dict[str, Any]) -> str:
    """`keys`: the caller's operator key under --auth, else the gateway's own (or None)."""
    name = _name(body)
    if name == served_name:
        raise bad(f"{name!r} is the base model's name; choose another lora_name", "lora_name")
    path = body.get("lora_path")
    if not isinstance(path, str) or not path or len(path) > 4096:
        raise bad("lora_path must be the absolute path of a PEFT adapter directory on "
                  "statesvc's host", "lora_path")
    inplace = body.get("load_inplace", False)  # vLLM's field: statesvc's `replace`
    if not isinstance(inplace, bool):
        raise bad("load_inplace must be true or false", "load_inplace")
    args = {"name": name, "path": path, "pin": False, "replace": inplace}
    try:
        res = _call(router, keys, "load", args)
    except ApiError as exc:
        if exc.code != "exists":
            raise
        # statesvc's advice is loractl's --replace; an HTTP caller's is vLLM's load_inplace
        said = re.split(r"; pass --replace| \(loractl load --replace\)", exc.message)[0]
        advice = ("another load replaced it meanwhile; send this one again" if inplace
                  else 'send "load_inplace": true to record a new version')
        raise ApiError(409, f"{said}; {advice}", param="load_inplace", code="exists")
    router.learn(name, int(res["version"]), int(res["seq"]))
    return f"Success: LoRA adapter '{name}' added successfully."


def unload(router: Router, keys: ClientKeys | None, body: dict[str, Any]) -> str:
    name = _name(body)
    res = _call(router, keys, "unload", {"name": name, "force": False})
    router.learn(name, None, int(res["seq"]))
    return f"Success: LoRA adapter '{name}' removed successfully."
