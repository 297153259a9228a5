"""Defaults both services and the CLI agree on: addresses, limits, names."""
from __future__ import annotations

import re

DEFAULT_CONTROL = "tcp://127.0.0.1:7100"
DEFAULT_PUBLISH = "tcp://127.0.0.1:7101"
DEFAULT_REPLICA_LISTEN = "tcp://127.0.0.1:7200"
DEFAULT_DATA_DIR = "./var"
STATE_ENV = "LORAPLANE_STATE"

PROTOCOL_VERSION = 1
# Largest frame the control socket answers; larger ones get a `too_large` error.
MAX_FRAME_BYTES = 1 << 20
# Hard ceiling set on the sockets (ZMQ_MAXMSGSIZE): libzmq drops the peer beyond it.
MAX_WIRE_BYTES = 16 << 20
# Per connection to a serving ROUTER (statesvc's control socket, a replica's listen socket):
# replies libzmq keeps for a peer that does not read them (ZMQ_SNDHWM; beyond it, replies to
# that peer are dropped), and requests it reads ahead of the service (ZMQ_RCVHWM; beyond it,
# it stops reading that peer's stream). Counted in messages: libzmq has no byte limit.
MAX_UNREAD_REPLIES = 8
MAX_QUEUED_REQUESTS = 8
# Replies a service holds itself for one connection whose libzmq queue is full (a burst, or a
# peer that does not read); beyond, further replies to it are dropped.
MAX_HELD_REPLY_BYTES = MAX_WIRE_BYTES
# How often held replies are offered to libzmq again.
HELD_REPLY_RETRY_MS = 5
MAX_BLOB_CHUNK = 8 << 20  # a 2 MB rank-16 adapter in one round trip; replies stay under MAX_WIRE_BYTES
# a replica's host tier of parsed adapter weights (computed serve --host-cache-mb), in MiB
DEFAULT_HOST_CACHE_MB = 512
# a replica's blob cache of verified adapter blobs on disk (computed serve --blob-cache-mb)
DEFAULT_BLOB_CACHE_MB = 4096
# the gateway's --prefix-slack: how many more queued requests than the least queued candidate
# a replica holding the prompt's prefix may have and still win (docs/gateway.md, Routing)
DEFAULT_PREFIX_SLACK = 8
# what one HTTP connection to the gateway may cost (gateway/connections.py, docs/security.md)
GATEWAY_MAX_HEAD_BYTES = 64 << 10  # --max-head-bytes; nginx's default is 4 x 8 KiB, Node's 16 KiB
GATEWAY_MAX_HEADERS = 100  # --max-headers; Apache's LimitRequestFields
GATEWAY_HEAD_TIMEOUT_S = 10.0  # --head-timeout
GATEWAY_BODY_TIMEOUT_S = 30.0  # --body-timeout
GATEWAY_MAX_CONNECTIONS = 1024  # --max-connections
MAX_EVENTS_PER_PAGE = 1000
HEARTBEAT_INTERVAL_S = 1.0          # statesvc's heartbeat on the diff stream, and each replica's
REPLICA_SILENCE_S = 3.0             # a replica that hears nothing this long catches up
REPLICA_STALE_AFTER_S = 10.0        # status shows a replica STALE after this long without heartbeat
MAX_REPLICAS = 1024                 # replica ids statesvc keeps (`statesvc serve --max-replicas`)
MAX_REPLICAS_CEILING = 16384        # largest --max-replicas: rows < 1 KiB, so `status` fits MAX_WIRE_BYTES
DEFAULT_SNAPSHOT_EVERY = 100
# The registry's cap (`pool init --max-adapters`): adapters the log holds, resident or not.
DEFAULT_MAX_ADAPTERS = 100_000
MAX_MAX_ADAPTERS = 10_000_000
MAX_LIST_PAGE = 1000  # adapters per `list` reply: a page stays far under MAX_WIRE_BYTES
# Largest adapter_model.safetensors accepted by `load` (bytes).
MAX_ADAPTER_BYTES = 4 << 30
MAX_CONFIG_BYTES = 1 << 20

ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADAPTER_NAME_WORDS = "a letter or digit, then up to 63 letters, digits, '.', '_' or '-'"
# event ids and log ids: a lowercase UUID (any version)
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")  # a sha256 as the wire and the log write it
MAX_SEQ = 2**62  # the largest seq (head, since, min_seq, offset) the wire and the log take
MAX_SEED = 2**63 - 1  # the largest sampling seed a replica takes

POOL_DTYPES = ("float32", "bfloat16")
# The largest finite value of each pool dtype: an adapter's scaling must not exceed it.
POOL_DTYPE_MAX: dict[str, float] = {"float32": 3.4028234663852886e38,
                                    "bfloat16": 3.3895313892515355e38}
# the prefix cache's block store by default: as many bytes as the running rows' KV cache, at
# most this many MiB (computed serve --kv-cache-mb; docs/prefix-cache.md)
DEFAULT_PREFIX_STORE_MB = 1024
