"""`computed gateway`: the OpenAI-compatible HTTP front door (docs/gateway.md)."""
from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Callable

import click

from shared.config import (DEFAULT_CONTROL, DEFAULT_PREFIX_SLACK, GATEWAY_BODY_TIMEOUT_S,
                           GATEWAY_HEAD_TIMEOUT_S, GATEWAY_MAX_CONNECTIONS,
                           GATEWAY_MAX_HEAD_BYTES, GATEWAY_MAX_HEADERS)
from shared.endpoints import bind_problem, click_addresses

log = logging.getLogger("computed.gateway")
# descriptors kept for what is not an HTTP connection: per request in flight, its replica
# link (a DEALER's TCP connection and mailbox, its monitor's mailbox); then statesvc's and
# the poller's sockets, the listening socket, the model's files, libzmq's own
FDS_PER_PENDING, FDS_SPARE = 3, 256
MIN_CONNECTIONS = 16


@click.command("gateway")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False,
                                                        path_type=Path),
              help="The pool's base model dir: its tokenizer.json, tokenizer_config.json "
                   "(chat template) and config.json.")
@click.option("--state", default=DEFAULT_CONTROL, show_default=True, callback=click_addresses,
              help="statesvc's control address (registry, replicas and their status); "
                   "several instances of one log as a,b.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="0: any free port (the READY line names it).")
@click.option("--served-model-name", default=None,
              help="The base model's name in `model` fields [default: --model's dir name].")
@click.option("--max-pending", type=click.IntRange(1), default=256, show_default=True,
              help="Requests in flight at once; more are refused with 429.")
@click.option("--request-timeout", type=click.FloatRange(1), default=120.0, show_default=True,
              help="Seconds to wait for a replica's answer before trying another.")
@click.option("--poll-interval", type=click.FloatRange(0.05), default=0.5, show_default=True,
              help="Seconds between reads of statesvc's and the replicas' status.")
@click.option("--prefix-slack", type=click.IntRange(0), default=DEFAULT_PREFIX_SLACK,
              show_default=True,
              help="A replica holding a longer prefix of the prompt wins while it has at most "
                   "this many more queued requests than the least queued candidate of its "
                   "tier; 0: the prefix only breaks ties of the queue (docs/gateway.md, "
                   "Routing).")
@click.option("--auth", "auth", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Operators' bearer tokens (a JSON file, docs/gateway.md): only they may "
                   "load and unload, each as its own statesvc identity. Allows a --host that "
                   "is not loopback.")
@click.option("--key", envvar="LORAPLANE_KEY", default=None,
              help="CURVE: the gateway's own *.key_secret, for statesvc (a key in its "
                   "replicas/: reads only) and replicas (a key in their clients/).")
@click.option("--server-key", envvar="LORAPLANE_SERVER_KEY", default=None,
              help="CURVE: statesvc's server.key, when it runs with --auth.")
@click.option("--replica-server-key", envvar="LORAPLANE_REPLICA_SERVER_KEY", default=None,
              help="CURVE: the replicas' server.key, when they run with --auth.")
@click.option("--allowed-hosts", default=None,
              help="The names a request's Host header may carry, comma-separated (`ip`: any "
                   "IP address; `*`: any, behind a proxy that checks it) [default: the --host "
                   "address and its names: localhost and the loopback addresses for loopback; "
                   "this machine's names and any IP address for 0.0.0.0 or ::].")
@click.option("--max-head-bytes", type=click.IntRange(1024), default=GATEWAY_MAX_HEAD_BYTES,
              show_default=True,
              help="A request's line and headers together; a longer head is answered 431.")
@click.option("--max-headers", type=click.IntRange(1), default=GATEWAY_MAX_HEADERS,
              show_default=True, help="Header lines a request may have; more is answered 431.")
@click.option("--head-timeout", type=click.FloatRange(0.1), default=GATEWAY_HEAD_TIMEOUT_S,
              show_default=True,
              help="Seconds a request head may take to arrive whole, from the connection's "
                   "start or the previous answer's end; then 408 and the connection closes.")
@click.option("--body-timeout", type=click.FloatRange(0.1), default=GATEWAY_BODY_TIMEOUT_S,
              show_default=True,
              help="Seconds a request body may take to arrive whole; then 408.")
@click.option("--max-connections", type=click.IntRange(MIN_CONNECTIONS),
              default=GATEWAY_MAX_CONNECTIONS, show_default=True,
              help="HTTP connections open at once; one more is answered 503 and closed. "
                   "Lowered to what the open-files limit (ulimit -n) leaves room for.")
@click.pass_context
def gateway(ctx: click.Context, model: Path, state: str, host: str, port: int,
            served_model_name: str | None, max_pending: int, request_timeout: float,
            poll_interval: float, prefix_slack: int, auth: Path | None, key: str | None,
            server_key: str | None, replica_server_key: str | None,
            allowed_hosts: str | None, max_head_bytes: int, max_headers: int,
            head_timeout: float, body_timeout: float, max_connections: int) -> None:
    """Serve OpenAI's /v1/completions, /v1/chat/completions and /v1/models over the
    replicas that statesvc knows, on http://HOST:PORT."""
    import ipaddress

    import uvicorn

    from gateway.app import build_app
    from gateway.auth import OPERATOR_KEY_WITHOUT_AUTH, load_operators, may_change_log
    from gateway.connections import HttpLimits, limited_protocol
    from gateway.crosssite import default_hosts, parse_allowed_hosts
    from gateway.routing import Router
    from gateway.service import Gateway
    from shared.keys import KeyError_, client_keys
    from shared.lograte import limit_repeats

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and auth is None:
        raise click.BadParameter(f"{host!r}: without --auth anyone who reaches the gateway "
                                 f"may load and unload adapters, so it binds a loopback "
                                 f"address only (127.0.0.1, ::1, localhost)",
                                 param_hint="--host")
    try:
        keys = client_keys(key, server_key)
        replica_keys = client_keys(key, replica_server_key) if replica_server_key else None
        operators = None if auth is None else load_operators(auth, server_key)
    except (KeyError_, ValueError) as exc:
        raise click.UsageError(str(exc))
    try:
        hosts = default_hosts(host) if allowed_hosts is None else \
            parse_allowed_hosts(allowed_hosts)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--allowed-hosts") from None
    connections = _connection_cap(ctx, max_connections, max_pending)
    # the gateway's own key loads and unloads for every caller without --auth: not an
    # operator's (asked of statesvc now; if it does not answer, at the first load)
    own_key_changes_log = may_change_log(state, keys) \
        if auth is None and keys is not None else False
    if own_key_changes_log:
        raise click.UsageError(OPERATOR_KEY_WITHOUT_AUTH)
    if own_key_changes_log is None:
        log.warning("statesvc at %s did not answer: whether --key is an operator's key is "
                    "asked at the first load or unload", state)
    # what a client can make the gateway log once per request is logged a few times a window
    limit_repeats("computed.gateway", "uvicorn.error")
    # bind first, before anything starts: connections made after it wait in the backlog until
    # uvicorn accepts, and a port in use is refused before any thread runs
    sock = _listening(host, port)
    router = Router(state, interval_s=poll_interval, keys=keys, replica_keys=replica_keys,
                    prefix_slack=prefix_slack).start()
    try:
        gw = Gateway(router, model, served_name=served_model_name or model.resolve().name,
                     request_timeout_s=request_timeout)
    except ValueError as exc:  # NoTokenizer, or a config's eos_token_id that is no token id
        raise click.UsageError(str(exc))
    router.wait_polled(10.0)
    bound = sock.getsockname()
    log.info("gateway for %s (%s) on http://%s:%d, statesvc %s", gw.served_name, model,
             bound[0], bound[1], state)
    print(f"READY http://{bound[0]}:{bound[1]} model={gw.served_name}", flush=True)
    if operators is not None:
        log.info("--auth: operators %s may load and unload", ", ".join(o.name for o in operators))
    limits = HttpLimits(max_head_bytes=max_head_bytes, max_headers=max_headers,
                        head_timeout_s=head_timeout, max_connections=connections)
    app = build_app(gw, max_pending=max_pending, operators=operators, hosts=hosts,
                    body_timeout_s=body_timeout, own_key_changes_log=own_key_changes_log)
    config = uvicorn.Config(app, http=limited_protocol(limits), log_level="warning",
                            access_log=False, lifespan="off",
                            proxy_headers=False)  # nothing reads a forwarded client address
    try:
        profiled(lambda: uvicorn.Server(config).run(sockets=[sock]))
    finally:
        router.stop()


def _connection_cap(ctx: click.Context, max_connections: int, max_pending: int) -> int:
    """--max-connections within what the open-files limit leaves after the descriptors the
    requests in flight need: lowered, with a warning, from the default; a usage error naming
    the flags when given on the command line."""
    from gateway.connections import descriptors_for_connections
    reserve = FDS_PER_PENDING * max_pending + FDS_SPARE
    fits = descriptors_for_connections(max_connections, reserve)
    if fits >= max_connections:
        return max_connections
    why = (f"the open-files limit (ulimit -n) leaves room for {fits} connections beside the "
           f"{reserve} descriptors that --max-pending {max_pending} needs")
    given = ctx.get_parameter_source("max_connections") is click.core.ParameterSource.COMMANDLINE
    if given or fits < MIN_CONNECTIONS:
        raise click.BadParameter(f"{max_connections}: {why}; raise the limit (ulimit -n), or "
                                 f"lower --max-connections or --max-pending",
                                 param_hint="--max-connections")
    log.warning("--max-connections %d lowered to %d: %s", max_connections, fits, why)
    return fits


def _listening(host: str, port: int) -> socket.socket:
    """A TCP socket listening on HOST:PORT, or a usage error saying why it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        problem = (f"{host} does not resolve ({exc.strerror}); give an IP address or a known "
                   "name" if isinstance(exc, socket.gaierror)
                   else bind_problem(exc.errno, exc.strerror))
        raise click.UsageError(f"--host {host} --port {port}: {problem}"
                               + (" (--port 0 picks a free one)" if exc.errno == errno.EADDRINUSE
                                  else "")) from None
    return sock


def profiled(serve: Callable[[], None]) -> None:
    """serve(), under cProfile when LORAPLANE_GATEWAY_PROFILE names the file for its stats
    (benchmarks/bench_gateway.py --profile): SIGTERM then ends it by SystemExit, so the
    stats are written (uvicorn re-raises the signal after its shutdown)."""
    path = os.environ.get("LORAPLANE_GATEWAY_PROFILE")
    if not path:
        return serve()
    import cProfile
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    prof = cProfile.Profile()
    try:
        prof.runcall(serve)
    finally:
        prof.dump_stats(path)
