"""`computed serve`: a replica of the adapter pool, kept in step with statesvc."""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gateway.cli import gateway
from shared.config import (ADAPTER_NAME_RE, ADAPTER_NAME_WORDS, DEFAULT_BLOB_CACHE_MB,
                           DEFAULT_CONTROL, DEFAULT_HOST_CACHE_MB, DEFAULT_PREFIX_STORE_MB,
                           DEFAULT_PUBLISH, DEFAULT_REPLICA_LISTEN)
from shared.endpoints import (BindError, EndpointError, check_bind, click_addresses,
                              split_addresses)
from shared.faults import Faults

if TYPE_CHECKING:
    from computed.model.runner import Runner



@click.group()
def main() -> None:
    """loraplane compute daemon: a JAX LoRA memory pool that follows the log."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="computed %(levelname)s %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


@main.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False,
                                                        path_type=Path),
              help="Hugging Face checkpoint directory of the pool's base model.")
@click.option("--state", default=DEFAULT_CONTROL, show_default=True, callback=click_addresses,
              help="statesvc's control address; several instances of one log as a,b.")
@click.option("--diffs", default=DEFAULT_PUBLISH, show_default=True, callback=click_addresses,
              help="statesvc's diff (PUB) address; with several --state, one per instance, "
                   "in the same order.")
@click.option("--listen", default=DEFAULT_REPLICA_LISTEN, show_default=True,
              help="This replica's ROUTER address (status; inference); loopback only "
                   "without --auth.")
@click.option("--replica-id", default=None, help="[default: HOST-PORT of --listen]")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Blob cache, local state and run.json (what drills restart from) "
                   "[default: ./var/replicas/ID].")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="The base model's compute dtype.")
@click.option("--max-batch", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Requests decoded together (KV-cache rows).")
@click.option("--max-len", type=click.IntRange(16), default=None,
              help="Context per request, prompt + output [default: the model's "
                   "max_position_embeddings, at most 4096].")
@click.option("--queue-limit", type=click.IntRange(1), default=256, show_default=True,
              help="Requests waiting for a row before new ones get `overloaded`.")
@click.option("--min-seq-timeout", type=click.FloatRange(0), default=10.0, show_default=True,
              help="How long a request waits for its min_seq before `not_ready`.")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="Compile every prefill bucket and the decode step before serving.")
@click.option("--inference/--no-inference", default=True, show_default=True,
              help="Serve `generate` (off: a replica that only holds the pool).")
@click.option("--replay-from-zero", is_flag=True,
              help="Rebuild from seq 0, ignoring snapshots and the local state (drills).")
@click.option("--heartbeat/--no-heartbeat", default=True, show_default=True,
              help="Report to statesvc (off for short-lived drill replicas).")
@click.option("--key", envvar="LORAPLANE_KEY", default=None,
              help="CURVE: this replica's secret key file (env LORAPLANE_KEY).")
@click.option("--server-key", envvar="LORAPLANE_SERVER_KEY", default=None,
              help="CURVE: statesvc's public key file (env LORAPLANE_SERVER_KEY).")
@click.option("--auth", "auth_dir", type=click.Path(exists=True, file_okay=False,
                                                    path_type=Path), default=None,
              help="CURVE on the listen socket: a key dir made by `statesvc keys init`; "
                   "only keys in its clients/ and operators/ folders may connect.")
@click.option("--client-queue-limit", type=click.IntRange(1), default=64, show_default=True,
              help="Requests one client may have waiting or running at once.")
@click.option("--host-cache-mb", type=click.IntRange(0), default=DEFAULT_HOST_CACHE_MB,
              show_default=True,
              help="Host tier: parsed adapter weights ready for a slot write, LRU within this "
                   "many MiB (0: none; every miss reads, verifies and parses its blob).")
@click.option("--blob-cache-mb", type=click.IntRange(0), default=DEFAULT_BLOB_CACHE_MB,
              show_default=True,
              help="Blob cache: verified adapter blobs on disk, LRU within this many MiB; the "
                   "blobs of adapters in a slot or the host tier are kept beyond it (0: keep "
                   "only those).")
@click.option("--tensor-parallel", type=click.IntRange(1), default=1, show_default=True,
              help="Devices the replica's model, KV cache and LoRA pool are split over (a "
                   "one-axis mesh of the first N local devices; N > 1 runs the XLA backend). "
                   "N must divide the model's KV heads and intermediate size.")
@click.option("--prefetch", is_flag=True,
              help="Parse each newly loaded adapter into the host tier when its event is "
                   "applied, before any request asks for it.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Reuse the KV of prompt prefixes seen before under the same adapter content "
                   "(keyed by its sha256 and scaling, never its name), LRU within --kv-cache-mb.")
@click.option("--kv-cache-mb", type=click.IntRange(1), default=None,
              help="KV memory in MiB: the running rows' cache (max_batch x max_len) plus the "
                   "prefix cache's blocks in what is left [default: the rows' cache plus as many "
                   f"bytes again for the blocks, at most {DEFAULT_PREFIX_STORE_MB} MiB of them].")
@click.option("--prefill-chunk", type=click.IntRange(0), default=256, show_default=True,
              help="Prompt tokens a step prefills while other requests decode, so a long prompt "
                   "does not stall them (a multiple of 16; 0: whole prompts at once).")
@click.option("--compile-cache/--no-compile-cache", default=True, show_default=True,
              help="Keep the warm-up's compiled executables in --cache-dir/xla/, keyed by jax, the "
                   "kernels' build, the flags, the CPU and the model, so a restart reads them "
                   "back instead of compiling (JAX_COMPILATION_CACHE_DIR, when set, wins).")
@click.option("--peer-blobs/--no-peer-blobs", default=True, show_default=True,
              help="On a bootstrap or catch-up, fetch each missing blob from a replica that "
                   "applied its event (statesvc's status names them) before statesvc.")
def serve(model: Path, state: str, diffs: str, listen: str, replica_id: str | None,
          cache_dir: Path | None, dtype: str, max_batch: int, max_len: int | None,
          queue_limit: int, min_seq_timeout: float, warmup: bool, inference: bool,
          replay_from_zero: bool, heartbeat: bool, key: str | None, server_key: str | None,
          client_queue_limit: int, auth_dir: Path | None, host_cache_mb: int,
          blob_cache_mb: int, tensor_parallel: int, prefetch: bool, prefix_cache: bool, kv_cache_mb: int | None,
          prefill_chunk: int, compile_cache: bool, peer_blobs: bool) -> None:
    """Follow the log and hold every loaded adapter in the pool, until SIGTERM or Ctrl-C."""
    from computed.daemon import Daemon
    from computed.sync import PeerList
    from computed.replica import ModelMismatch, Replica
    from shared import memtune, runfile
    from shared.client import ControlClient
    from shared.fingerprint import ModelError, cached_weights_digest, read_model

    log = logging.getLogger("computed")
    memtune.tune()  # a blob's buffers reuse their pages (shared/memtune.py)
    try:
        check_bind(listen, authenticated=auth_dir is not None)
    except EndpointError as exc:
        raise click.UsageError(f"--listen: {exc}") from None
    if len(split_addresses(state)) != len(split_addresses(diffs)):
        raise click.UsageError(f"--state names {len(split_addresses(state))} instance(s) and "
                               f"--diffs {len(split_addresses(diffs))}: give each instance's "
                               "control and diff address, in the same order")
    replica_id = replica_id or f"{socket.gethostname()}-{listen.rsplit(':', 1)[-1]}"
    if not ADAPTER_NAME_RE.fullmatch(replica_id):
        raise click.BadParameter(f"{replica_id!r}: a replica id is {ADAPTER_NAME_WORDS}",
                                 param_hint="--replica-id")
    from shared.keys import KeyError_, auth_dir_keys, client_keys
    try:
        keys = client_keys(key, server_key)
    except KeyError_ as exc:
        raise click.UsageError(str(exc)) from None
    # the listen socket's key pair, checked before the pool or the model is built
    server_public = None if auth_dir is None else auth_dir_keys(auth_dir)[0]
    # peers serve with the server key of their --auth dir, which a fleet shares
    peer_keys = keys if keys is None or server_public is None else dataclasses.replace(
        keys, server=server_public)
    cache_dir = cache_dir or Path("var") / "replicas" / replica_id
    try:
        info = read_model(model)
        # the weights it serves are checked against the pool's (a pool-only replica serves none)
        weights = (cached_weights_digest(model, cache_dir / "model-weights.json")
                   if inference else None)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from None
    pool_layout = _tensor_parallel(model, tensor_parallel, log) if tensor_parallel > 1 else None
    # the client's socket is made on first use, in the sync thread that alone uses it
    client = ControlClient(state, timeout_s=3.0, retries=1, keys=keys)
    replica = Replica(info, client, cache_dir, from_zero=replay_from_zero,
                      faults=Faults.from_env(), host_cache_mb=host_cache_mb,
                      blob_cache_mb=blob_cache_mb,
                      prefetch=prefetch, pool_layout=pool_layout,
                      peers=PeerList(client, replica_id, peer_keys) if peer_blobs else None,
                      weights_sha256=weights)
    engine = None
    if inference:
        from computed.serving.engine import Engine
        from computed.model.config import ModelLoadError
        from computed.model.loader import load_model
        from computed.model.runner import Runner
        if compile_cache:
            from computed.model import compile_cache as cc
            cc.enable(cache_dir, fingerprint=info.fingerprint, dtype=dtype, tensor_parallel=tensor_parallel)
        try:
            config, params = load_model(model, dtype, tensor_parallel=tensor_parallel)
        except ModelLoadError as exc:
            raise click.ClickException(str(exc)) from None
        freed = memtune.release()  # the load's read, widened and packed copies, freed but resident
        log.info("model loaded; %.0f MB of the load's buffers returned to the system", freed / 2**20)
        length = max_len or min(config.max_position_embeddings, 4096)
        if prefill_chunk % 16:
            raise click.BadParameter(f"{prefill_chunk} is not a multiple of 16 (the KV block)",
                                     param_hint="--prefill-chunk")
        runner = Runner(config, params, max_batch=max_batch, max_len=length,
                             extend=prefix_cache or prefill_chunk > 0, piece=prefill_chunk)
        if not runner.extend and (prefix_cache or prefill_chunk):
            log.info("dynamic RoPE: no prefix cache and whole-prompt prefill (docs/prefix-cache.md)")
            prefix_cache, prefill_chunk = False, 0
        from computed.serving.grammar import Grammars
        engine = Engine(runner, replica, queue_limit=queue_limit, min_seq_wait_s=min_seq_timeout,
                        client_limit=client_queue_limit, prefill_chunk=prefill_chunk,
                        prefix_blocks=_prefix_blocks(runner, kv_cache_mb, prefix_cache),
                        grammars=Grammars.load(model, vocab_size=runner.vocab_size))
    try:
        daemon = Daemon(replica, replica_id=replica_id, listen=listen, state=state,
                        diffs=diffs, engine=engine, warmup=warmup, heartbeat=heartbeat,
                        keys=keys, auth_dir=auth_dir, about={"model": str(model.resolve())})
    except BindError as exc:  # in use, or not this host's: nothing was served
        replica.blobs.close()
        client.close()
        raise click.UsageError(f"--listen {exc}") from None
    # what `loractl drill --kill` trusts to kill and restart this replica (shared/runfile.py)
    runfile.write(cache_dir / runfile.RUN_FILE, runfile.RunFile(
        replica_id, os.getpid(), runfile.own_cmdline(), os.getcwd(), daemon.listen,
        str(model.resolve())))
    log.info("replica %s: model %s (%s), statesvc %s / %s, cache %s", replica_id, model,
             info.fingerprint[:12], state, diffs, cache_dir)
    print(f"READY listen={daemon.listen} id={replica_id}", flush=True)
    try:
        daemon.serve_forever()
    except ModelMismatch as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
    finally:
        replica.blobs.close()  # the blobs fetched last, still in memory, to their files
        client.close()
    log.info("stopped")


def _prefix_blocks(runner: Runner, kv_cache_mb: int | None, prefix_cache: bool) -> int:
    """The prefix cache's blocks within --kv-cache-mb, after the running rows' cache; by default
    as many bytes as the rows' cache, at most DEFAULT_PREFIX_STORE_MB (0 without the prefix
    cache). A UsageError where the budget does not hold the rows' cache (and one block, with the
    prefix cache)."""
    rows, block = runner.cache_bytes(), runner.block_bytes()
    if kv_cache_mb is None:
        return max(1, min(rows, DEFAULT_PREFIX_STORE_MB * 2**20) // block) if prefix_cache else 0
    blocks = (kv_cache_mb * 2**20 - rows) // block
    if blocks < int(prefix_cache):
        need = -(-(rows + block * int(prefix_cache)) // 2**20)
        raise click.UsageError(
            f"--kv-cache-mb {kv_cache_mb} does not hold the running rows' KV cache ({rows / 2**20:.1f} MiB "
            f"for --max-batch {runner.max_batch} x --max-len {runner.max_len})"
            + (" and a prefix block" if prefix_cache else "") + f": give at least {need}, or lower "
            "--max-batch or --max-len" + (", or pass --no-prefix-cache" if prefix_cache else ""))
    return int(blocks) if prefix_cache else 0


def _tensor_parallel(model: Path, n: int, log: logging.Logger) -> Any:
    """Check `--tensor-parallel n` against the model and the devices before anything loads (a
    UsageError naming the numbers), and return the pool's layout on the mesh."""
    import json

    import jax

    from computed.model import sharding
    from computed.model.config import DecoderConfig, ModelLoadError
    from computed.residency.pool import PoolSpec
    try:
        config = DecoderConfig.from_hf(json.loads((model / "config.json").read_text()))
        sharding.check(config, n, len(jax.local_devices()))
    except (ModelLoadError, sharding.TensorParallelError, OSError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    mesh = sharding.make_mesh(n)
    log.info("tensor-parallel %d over %s: the XLA backend on the mesh (the native CPU kernels "
             "are single-device)", n, ", ".join(str(d) for d in mesh.devices.flat))

    def layout(spec: PoolSpec) -> Any:
        return sharding.pool_shardings(spec, mesh)
    return layout


main.add_command(gateway)
