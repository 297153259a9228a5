"""Decode throughput of 32 sequences on 0, 1, 4, 16 and 32 distinct adapters: ours against PEFT.

    .venv/bin/python -m benchmarks.bench_decode [--steps 8] [--repeats 5] [--no-write] [--quick]

What it runs, and why: docs/benchmarks.md, "bench_decode.py".
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zmq
from rich.console import Console
from rich.table import Table

from benchmarks.harness import (Figure, decode_rates, figure, machine_info, median, output_flags,
    print_targets, publish, spread, target_lines)
from computed.serving.admission import AdmittedAdapter
from computed.backend import NativeBackend, XlaBackend, native
from computed.serving.engine import Engine
from computed.model.loader import load_model, with_layout
from computed.model.params import pack
from computed.model.runner import Runner, decode
from computed.residency.pool import LoraPool, MemoryPool, PoolSpec
from computed.residency.blob_cache import slot_weights
from shared.client import ControlClient, new_event_id
from shared.config import POOL_DTYPES
from shared.events import AdapterLoaded, lora_scaling
from shared.projections import MODULES
from shared.protocol import encode_request, unpack
from shared.reducer import State
from shared.replica_protocol import generate_args
from statesvc.tools.example import AdapterSpec, ModelShape, write_adapter, write_model
from testkit.fleet import Computed, StateSvc, cpu_seconds, wait_for
from testkit.jaxcount import counting_compiles

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = ModelShape(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                   max_position_embeddings=4096)
QUICK_SHAPE = ModelShape(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=256)
BATCH = 32
PROMPT = 32
ADAPTERS = 32
RANK = 16
ALPHA = 32
MIXES: tuple[int, ...] = (0, 1, 4, 16, 32)  # distinct adapters in the batch; 0: the base model
TARGET_MIX = 16  # the mix the targets are about
TARGET_OVER_BASE = 0.75
TARGET_OVER_PEFT = 3.0
CONTENDED = 0.10  # a median share of the CPUs used by other processes above this is flagged
PATHS = ("decode", "engine", "peft")
GATHER = "gather"  # timed on the mixes with adapters only
LOOP = "loop"  # timed on every mix
ALTERNATIVES = (LOOP, GATHER)
LABELS = {"decode": "decode", "engine": "Engine.step", "peft": "PEFT", GATHER: "per-token gather",
          LOOP: "XLA only"}

console = Console() if sys.stdout.isatty() else Console(width=150)


def adapter_names() -> list[str]:
    return [f"bench-{i:02d}" for i in range(ADAPTERS)]


def row_adapters(distinct: int) -> list[int]:
    """Each row's adapter index, -1 for the base model."""
    return [-1] * BATCH if distinct == 0 else [i % distinct for i in range(BATCH)]


@dataclass
class Timing:
    """Per timed round: seconds, the share of the CPUs this process used, and the share others used."""

    seconds: list[float] = field(default_factory=list)
    cpu_share: list[float] = field(default_factory=list)
    others_share: list[float] = field(default_factory=list)
    used: list[int] | None = None  # the rounds the figure is taken from; None: all

    def rounds(self) -> list[int]:
        return list(range(len(self.seconds))) if self.used is None else self.used

    def rates(self, steps: int) -> list[float]:
        """tokens/s of each round the figure is taken from."""
        return [BATCH * steps / self.seconds[i] for i in self.rounds()]

    def tokens_per_s(self, steps: int) -> float:
        return BATCH * steps / median([self.seconds[i] for i in self.rounds()])

    def add(self, other: Timing) -> None:
        self.seconds += other.seconds
        self.cpu_share += other.cpu_share
        self.others_share += other.others_share

    def clean(self, i: int) -> bool:
        """Whether other processes left the CPUs alone during round i (NaN off Linux counts as clean)."""
        return not self.others_share[i] > CONTENDED

    def as_dict(self, steps: int) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s(steps), "tokens_per_s_spread": spread(self.rates(steps)),
                "seconds": self.seconds,
                "cpu_share": self.cpu_share, "others_share": self.others_share, "used_rounds": self.used}


def clean_rounds(timings: list[Timing], rounds: int) -> list[int]:
    return [i for i in range(rounds) if all(t.clean(i) for t in timings)]


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (every process); NaN off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


@contextmanager
def timed(timing: Timing | None) -> Iterator[None]:
    """Time the block; while it runs, the other side of the comparison waits on its pipe, idle."""
    wall, cpu, busy = time.perf_counter(), time.process_time(), busy_seconds()
    yield
    if timing is not None:
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
        capacity = wall * (os.cpu_count() or 1)
        timing.seconds.append(wall)
        timing.cpu_share.append(cpu / capacity)
        timing.others_share.append(max(0.0, busy_seconds() - busy - cpu) / capacity)


# --------------------------------------------------------------------------- assets


def write_assets(root: Path, shape: ModelShape, dtype: str = "float32") -> tuple[Path, dict[str, Path]]:
    model_dir = write_model(root / "model", shape, seed=0, dtype=dtype)
    dirs = {name: write_adapter(root / "adapters" / name,
                                AdapterSpec(name, r=RANK, lora_alpha=ALPHA, target_modules=MODULES),
                                shape, seed=0, base_model_name_or_path=str(model_dir))
            for name in adapter_names()}
    return model_dir, dirs


def loaded_event(name: str, slot: int, data: bytes, targets: tuple[str, ...] = MODULES) -> AdapterLoaded:
    return AdapterLoaded(name=name, version=slot + 2, sha256="", size=len(data), rank=RANK,
                         alpha=float(ALPHA), scaling=lora_scaling(ALPHA, RANK, False), use_rslora=False,
                         targets=targets, pinned=False)


@dataclass
class Serving:
    """The admission port (computed/serving/admission.py) of an ACTIVE replica whose adapters never
    change."""

    pool: MemoryPool
    state: State

    def admit(self, adapter: str | None, min_seq: int, ticket: int = 0) -> AdmittedAdapter:
        if adapter is None:
            return AdmittedAdapter(-1, None, 0, self.state.seq, None)
        a = self.state.adapters[adapter]
        slot = a.version - 2  # loaded_event: every adapter resident in its own slot
        return AdmittedAdapter(slot, a.name, a.version, self.state.seq, self.pool.acquire(slot))

    def want(self, adapter: str | None) -> None:
        pass  # every adapter is resident

    def withdraw(self, ticket: int) -> None:
        pass

    def reading(self) -> AbstractContextManager[LoraPool]:
        return self.pool.reading()

    def pool_shapes(self) -> LoraPool:
        return self.pool.shapes()


# --------------------------------------------------------------------------- ours


class RawDecode:
    """Runner.decode in a loop over one prefilled batch; each round restarts at the prompt's end.

    The runner is what the engine calls: computed.model.runner.decode over the
    smallest attention bucket that holds the longest sequence, on the backend its
    parameters were laid out for (the alternatives pass another: `alternative_runners`).
    """

    def __init__(self, runner: Runner, pool: MemoryPool | None, prompts: np.ndarray,
                 slots: np.ndarray) -> None:
        self.runner, self.slots = runner, slots.astype(np.int32)
        self.arrays = None if pool is None else pool.arrays  # the pool never changes here
        self.cache = runner.new_cache()  # K laid out as the runner's backend attends
        logits, self.cache = runner.prefill(self.arrays, self.cache, list(prompts), list(range(BATCH)),
                                            [int(s) for s in slots])
        self.first = logits.argmax(axis=-1).astype(np.int32)
        self.active = np.ones(BATCH, np.bool_)
        self.tokens: list[np.ndarray] = []  # the last round's tokens, [steps][BATCH]

    def round(self, steps: int, timing: Timing | None) -> None:
        tokens, out = self.first, []
        with timed(timing):
            for k in range(steps):
                positions = np.full(BATCH, PROMPT + k, np.int32)
                logits, self.cache = self._step(tokens, positions)
                tokens = logits.argmax(axis=-1).astype(np.int32)
                out.append(tokens)
        self.tokens = out

    def _step(self, tokens: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, Any]:
        return self.runner.decode(self.arrays, self.cache, tokens, positions, self.slots, self.active)


def alternative_runners(runner: Runner) -> dict[str, Runner]:
    """The runner's model on XLA alone (LOOP: XLA's dot over unpacked weights, a second copy of the
    model, the LoRA window loop, bucket attention over K positions-minor), and on its own backend
    with the per-token gather for the LoRA terms (GATHER)."""
    params = runner.params
    return {LOOP: Runner(runner.config, with_layout(params, XlaBackend()), max_batch=runner.max_batch,
                              max_len=runner.max_len),
            GATHER: Runner(runner.config, with_layout(params, dataclasses.replace(params.backend, lora="gather")),
                                max_batch=runner.max_batch, max_len=runner.max_len)}


class DeepDecode:
    """The base batch deep in a long cache, no prefill: every row at positions from `start` on,
    attention by `attention` ("kernel" or "xla", the native backend's option)."""

    def __init__(self, runner: Runner, start: int, attention: str) -> None:
        self.runner, self.start = runner, start
        self.params = with_layout(runner.params, NativeBackend(attention=attention))
        self.cache = runner.new_cache(blocked=attention == "kernel")  # each attention with its own layout of K
        self.slots, self.active = np.full(BATCH, -1, np.int32), np.ones(BATCH, np.bool_)

    def round(self, steps: int, timing: Timing | None) -> None:
        tokens = np.zeros(BATCH, np.int32)
        with timed(timing):
            for k in range(steps):
                at = self.start + k
                logits, self.cache = decode(self.params, None, self.cache, tokens, np.full(BATCH, at, np.int32),
                                            self.slots, self.active, self.runner.bucket(at + 1))
                tokens = np.asarray(logits).argmax(axis=-1).astype(np.int32)


class EngineDecode:
    """Engine.step over 32 running requests, admitted (prefilled) before the first round."""

    def __init__(self, runner: Runner, serving: Serving, prompts: np.ndarray, rows: list[int],
                 max_new_tokens: int, *, warm: bool = True) -> None:
        self.engine = Engine(runner, serving)
        if warm:  # what serving compiles; only the first engine compiles (shared jit caches)
            self.engine.warmup()
        names = adapter_names()
        for i in range(BATCH):
            done = self.engine.submit(f"r{i}", generate_args(
                [int(t) for t in prompts[i]], adapter=None if rows[i] < 0 else names[rows[i]],
                max_new_tokens=max_new_tokens), None)
            assert done is None, done
        self.engine.step()  # admits every request (32 prefills) and runs the first decode step
        if sum(r is not None for r in self.engine.rows) != BATCH:
            raise RuntimeError("the engine did not admit the whole batch")

    def round(self, steps: int, timing: Timing | None) -> None:
        with timed(timing):
            for _ in range(steps):
                done = self.engine.step()
                if done:
                    raise RuntimeError(f"{len(done)} requests finished early: raise max_new_tokens")

    def outputs(self) -> list[list[int]]:
        return [list(r.output) if r is not None else [] for r in self.engine.rows]


# --------------------------------------------------------------------------- PEFT


class PeftDecode:
    """PEFT mixed-batch greedy decoding with a KV cache; each round crops the cache back to the prompt."""

    def __init__(self, model: Any, prompts: np.ndarray, rows: list[int]) -> None:
        import torch
        self.torch, self.model = torch, model
        names = adapter_names()
        self.names = ["__base__" if a < 0 else names[a] for a in rows]
        self.prompts = torch.as_tensor(prompts, dtype=torch.long)
        with torch.no_grad():
            out = model(input_ids=self.prompts, use_cache=True, adapter_names=self.names, logits_to_keep=1)
        self.cache = out.cache
        # a sliding-window layer's cache cannot be cropped back once the window is full: each
        # round of such a model (bench_families) restarts from a copy of the prefilled cache
        self.prefilled = copy.deepcopy(self.cache) if any(getattr(self.cache, "is_sliding", ())) else None
        self.first = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens: list[np.ndarray] = []

    def requests(self, clients: int, new_tokens: int, timing: RequestTiming | None) -> list[list[int]]:
        """The served path's work, as PEFT does it: the first `clients` prompts prefilled as one
        batch into a fresh cache, then greedy decoding until each has `new_tokens` new tokens
        (the first from the prefill); returns each row's tokens."""
        torch, model = self.torch, self.model
        names = self.names[:clients]
        out = []
        with torch.no_grad(), timed(timing):
            first = model(input_ids=self.prompts[:clients], use_cache=True, adapter_names=names,
                          logits_to_keep=1)
            cache, tokens = first.cache, first.logits[:, -1].argmax(-1, keepdim=True)
            out.append(tokens)
            for _ in range(new_tokens - 1):
                logits = model(input_ids=tokens, cache=cache, use_cache=True, adapter_names=names).logits
                tokens = logits[:, -1].argmax(-1, keepdim=True)
                out.append(tokens)
        if timing is not None:
            timing.tokens.append(clients * new_tokens)
        return torch.cat(out, dim=1).tolist()  # type: ignore[no-any-return]

    def round(self, steps: int, timing: Timing | None) -> None:
        torch, model = self.torch, self.model
        surplus = self.cache.get_seq_length() - PROMPT
        if self.prefilled is not None:
            self.cache = copy.deepcopy(self.prefilled)
        elif surplus:
            self.cache.crop(-surplus)
        tokens, out = self.first, []
        with torch.no_grad(), timed(timing):
            for _ in range(steps):
                logits = model(input_ids=tokens, cache=self.cache, use_cache=True,
                               adapter_names=self.names).logits
                tokens = logits[:, -1].argmax(-1, keepdim=True)
                out.append(tokens[:, 0].numpy().astype(np.int32))
        self.tokens = out


def load_peft(model_dir: Path, dirs: dict[str, Path], threads: int) -> Any:
    import peft
    import torch
    import transformers
    torch.set_num_threads(threads)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    names = list(dirs)  # adapter_names(), or the first of them (bench_families)
    model = peft.PeftModel.from_pretrained(base, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(dirs[name]), adapter_name=name)
    return model.eval()


def peft_worker(conn: Connection, model_dir: Path, dirs: dict[str, Path], threads: int,
                prompts: np.ndarray, mixes: tuple[int, ...] | None = None) -> None:
    """The PEFT side, in its own process: runs a round when told to and answers its timing and tokens
    (on `mixes`, by default MIXES).

    A process of its own because torch and XLA in one process slow each other
    down: PEFT's steps there took up to 15 times as long as alone.
    """
    import peft
    import torch
    import transformers
    model = load_peft(model_dir, dirs, threads)
    runs = {k: PeftDecode(model, prompts, row_adapters(k)) for k in (mixes or MIXES)}
    conn.send({"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
               "attn_implementation": model.base_model.model.config._attn_implementation})
    while True:
        msg = conn.recv()
        if msg[0] == "round":
            _, k, steps, count = msg
            timing = Timing()
            runs[k].round(steps, timing if count else None)
            conn.send((timing, runs[k].tokens))
        elif msg[0] == "requests":
            _, k, clients, new_tokens, count = msg
            requests = RequestTiming()
            outputs = runs[k].requests(clients, new_tokens, requests if count else None)
            conn.send((requests, outputs))
        elif msg[0] == "gemm":
            conn.send(gemm_rate_torch(threads))
        else:
            conn.close()
            return


class PeftProcess:
    """The parent's handle on peft_worker."""

    def __init__(self, model_dir: Path, dirs: dict[str, Path], threads: int, prompts: np.ndarray,
                 mixes: tuple[int, ...] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peft_worker, args=(child, model_dir, dirs, threads, prompts, mixes),
                                daemon=True)
        self.proc.start()
        child.close()
        self.info: dict[str, str] = self.conn.recv()
        self.tokens: dict[int, list[np.ndarray]] = {}

    def round(self, k: int, steps: int, timing: Timing | None) -> None:
        self.conn.send(("round", k, steps, timing is not None))
        got, self.tokens[k] = self.conn.recv()
        if timing is not None:
            timing.add(got)

    def requests(self, k: int, clients: int, new_tokens: int, timing: RequestTiming | None) -> list[list[int]]:
        """PeftDecode.requests in PEFT's process; returns the tokens."""
        self.conn.send(("requests", k, clients, new_tokens, timing is not None))
        got, outputs = self.conn.recv()
        if timing is not None:
            timing.add(got)
        return outputs  # type: ignore[no-any-return]

    def gemm_rate(self) -> float:
        self.conn.send(("gemm",))
        return float(self.conn.recv())

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(timeout=30)


# --------------------------------------------------------------------------- the served path

SERVED_TOKENS = 64  # new tokens per request on the served path (--served-tokens)
TARGET_SERVED_OVER_ENGINE = 0.9  # issue 15: served >= 0.9x Engine.step
SERVED = "served"
WHOLE = (SERVED, "engine", "peft")  # the served path's work: served, in process (Engine.step), PEFT
PEFT_WHOLE_MIXES = (TARGET_MIX,)  # PEFT's whole requests take ~4x ours: timed where the target is


@dataclass
class RequestTiming(Timing):
    """Timing of whole requests (prefill and every new token), per round: the tokens generated
    beside the seconds, the shares of the CPUs as Timing has them (a served round counts the
    replica's CPU time as its own, not as other load)."""

    tokens: list[int] = field(default_factory=list)

    def rate(self, i: int) -> float:
        return self.tokens[i] / self.seconds[i]

    def add(self, other: Timing) -> None:
        super().add(other)
        if isinstance(other, RequestTiming):
            self.tokens += other.tokens

    def as_dict(self, steps: int = 0) -> dict[str, Any]:
        rates = [self.rate(i) for i in self.rounds()]
        return {"tokens_per_s": median(rates), "tokens_per_s_spread": spread(rates),
                "seconds": self.seconds, "tokens": self.tokens, "cpu_share": self.cpu_share,
                "others_share": self.others_share, "used_rounds": self.used}


class EngineRequests:
    """The served path's work in process: Engine.step from the submission of the requests to the
    last one's end, the same prompts, adapters and new tokens as the served clients send, each
    request prefilled as the engine admits it, as the replica does."""

    def __init__(self, runner: Runner, serving: Serving, prompts: np.ndarray, *, clients: int,
                 new_tokens: int, warm: bool = True) -> None:
        self.engine = Engine(runner, serving)
        if warm:
            self.engine.warmup()  # compiled already: the jit caches are shared
        self.prompts, self.clients, self.new_tokens = prompts, clients, new_tokens
        self.outputs: list[list[int]] = []

    def round(self, distinct: int, timing: RequestTiming | None) -> None:
        outputs: dict[str, list[int]] = {}
        with timed(timing):
            for i, frame in enumerate(request_args(self.prompts, distinct, self.clients, self.new_tokens)):
                done = self.engine.submit(f"r{i}", frame, None)
                assert done is None, done
            while len(outputs) < self.clients:
                for d in self.engine.step():
                    assert d.result is not None, d.error
                    outputs[d.req_id] = list(d.result["output_ids"])
        if timing is not None:
            timing.tokens.append(sum(len(o) for o in outputs.values()))
        self.outputs = [outputs[f"r{i}"] for i in range(self.clients)]


def request_args(prompts: np.ndarray, distinct: int, clients: int, new_tokens: int,
                 min_seq: int = 0) -> list[dict[str, Any]]:
    """The args of the served round's `generate` requests: client i sends prompt i with adapter
    i % distinct (the rows of the in-process batches), greedy."""
    names = adapter_names()
    return [generate_args([int(t) for t in prompts[i]], adapter=names[i % distinct] if distinct else None,
                          max_new_tokens=new_tokens, min_seq=min_seq) for i in range(clients)]


def served_max_batch(quick: bool, clients: int) -> int:
    """A served replica's --max-batch: the batch, or in a smoke run its clients (fewer shapes
    to compile); bench_dtype's served replicas too."""
    return clients if quick else BATCH


class ServedReplica:
    """A real `statesvc serve` and `computed serve` (subprocesses), the pool and adapters loaded
    through the state service, and `clients` DEALER sockets that each send one `generate`."""

    def __init__(self, root: Path, model_dir: Path, dirs: dict[str, Path], prompts: np.ndarray, *,
                 clients: int, new_tokens: int, max_len: int, slots: int, pool_dtype: str,
                 dtype: str = "float32", name: str = "served", max_batch: int = BATCH,
                 warm: bool = True) -> None:
        self.prompts, self.clients, self.new_tokens = prompts, clients, new_tokens
        self.svc = StateSvc(root / f"{name}-data")
        # without its warm-up (a smoke run), the replica compiles what the warm-up round sends it
        self.replica = Computed(model_dir, self.svc, root / f"{name}-replica", replica_id="bench",
                                extra_args=("--max-batch", str(max_batch), "--max-len", str(max_len),
                                            "--dtype", dtype, *(() if warm else ("--no-warmup",))))
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket[Any]] = []
        self.outputs: list[list[int]] = []
        self.timings: dict[zmq.Socket[Any], dict[str, float]] = {}  # the last round's, per client
        try:
            self.svc.start()
            with ControlClient(self.svc.control, timeout_s=60) as c:
                def cmd(command: str, **args: Any) -> Any:
                    return c.call(command, {"event_id": new_event_id(), **args})
                seq = cmd("pool.init", model=str(model_dir), max_loras=slots, max_rank=RANK,
                          targets="all", dtype=pool_dtype)["seq"]
                for name in adapter_names():
                    seq = cmd("load", name=name, path=str(dirs[name]))["seq"]
            self.seq = int(seq)
            self.replica.start()
            wait_for(lambda: int(self.replica.status()["applied_seq"]) >= self.seq, timeout=300,
                     what="the replica to apply the adapters")
            for _ in range(clients):
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self.replica.listen)
                self.socks.append(sock)
        except BaseException:
            self.stop()
            raise

    def round(self, distinct: int, timing: RequestTiming | None) -> None:
        frames = [encode_request(f"r{i}", "generate", args) for i, args in enumerate(
            request_args(self.prompts, distinct, self.clients, self.new_tokens, self.seq))]
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        outputs: dict[zmq.Socket[Any], list[int]] = {}
        pids = [p.proc.pid for p in (self.replica, self.svc) if p.proc is not None]
        served_cpu = sum(cpu_seconds(pid) for pid in pids)
        with timed(timing):
            for sock, frame in zip(self.socks, frames):
                sock.send(frame)
            while len(outputs) < len(self.socks):
                ready = dict(poller.poll(120_000))
                if not ready:
                    raise RuntimeError(f"the served replica did not answer; see {self.replica.log}")
                for sock in ready:
                    reply = unpack(sock.recv())
                    if not reply.get("ok"):
                        raise RuntimeError(f"generate failed: {reply.get('error')}")
                    outputs[sock] = list(reply["result"]["output_ids"])
                    self.timings[sock] = reply["result"]["timings"]
        if timing is not None:
            # the replica's and statesvc's CPU time is the served path's own, not other load
            served_cpu = sum(cpu_seconds(pid) for pid in pids) - served_cpu
            capacity = timing.seconds[-1] * (os.cpu_count() or 1)
            timing.cpu_share[-1] += served_cpu / capacity
            timing.others_share[-1] = max(0.0, timing.others_share[-1] - served_cpu / capacity)
            timing.tokens.append(sum(len(o) for o in outputs.values()))
        self.outputs = [outputs[sock] for sock in self.socks]

    def stop(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()
        for proc in (self.replica, self.svc):
            if proc.proc is not None:
                proc.stop()


# --------------------------------------------------------------------------- GEMM rates

GEMM = (BATCH, SHAPE.hidden_size, SHAPE.intermediate_size)  # the MLP's up/gate product in a decode step


def _rate(call: Callable[[], Any], sync: Callable[[Any], Any], iters: int = 50) -> float:
    """GFLOP/s of the GEMM product, best of 3 runs of `iters` calls."""
    n, k, m = GEMM
    sync(call())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            y = call()
        sync(y)
        best = min(best, (time.perf_counter() - t0) / iters)
    return round(2 * n * k * m / best / 1e9, 1)


def _gemm_operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n, k, m = GEMM
    return rng.standard_normal((n, k), np.float32), rng.standard_normal((k, m), np.float32)


def gemm_rate_xla() -> float:
    x, w = _gemm_operands()
    f = jax.jit(lambda a, b: a @ b)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    return _rate(lambda: f(xj, wj), jax.block_until_ready)


def gemm_rate_kernel() -> float | None:
    """The dense kernel's rate on the same product over the packed weight; None where it cannot run."""
    panel = native.dense_panel()
    if not panel:
        return None
    x, w = _gemm_operands()
    f = jax.jit(lambda a, b: native.dense_matmuls(a, [b])[0])
    xj, wp = jnp.asarray(x), pack(w, panel)
    return _rate(lambda: f(xj, wp), jax.block_until_ready)


def gemm_rate_torch(threads: int) -> float:
    import torch
    torch.set_num_threads(threads)
    x, w = _gemm_operands()
    xt, wt = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w.T))
    return _rate(lambda: torch.nn.functional.linear(xt, wt), lambda y: y)


# --------------------------------------------------------------------------- the run


def agreement(a: list[np.ndarray] | list[list[int]], b: list[np.ndarray] | list[list[int]]) -> float:
    """The fraction of (step, row) greedy tokens two paths agree on."""
    return float(np.mean(np.stack(a) == np.stack(b)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    steps, repeats, max_len = args.steps, args.repeats, args.max_len
    max_rounds = max(repeats, args.max_rounds or 2 * repeats)
    # the prefill's token, the admitting step, every round, and one more: nothing finishes while timed
    max_new = 3 + (max_rounds + 1) * steps
    if PROMPT + max_new > max_len:
        raise SystemExit(f"--max-len {max_len} is too short for {max_rounds + 1} rounds of {steps} steps "
                         f"after a {PROMPT}-token prompt; raise --max-len or lower --steps/--max-rounds")
    shape = QUICK_SHAPE if args.quick else SHAPE
    started = time.perf_counter()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, shape.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        console.print("writing the checkpoint and adapters ...")
        model_dir, dirs = write_assets(Path(tmp), shape)
        console.print(f"loading transformers + PEFT in a process of its own ({args.torch_threads} torch "
                      "threads) ...")
        peft_proc = PeftProcess(model_dir, dirs, args.torch_threads, prompts)
        served_proc: ServedReplica | None = None
        try:
            if PROMPT + args.served_tokens > max_len:
                raise SystemExit(f"--max-len {max_len} is too short for {args.served_tokens} served tokens")
            console.print(f"starting statesvc and `computed serve` ({args.served_clients} clients, "
                          f"{args.served_tokens} new tokens each) ...")
            served_proc = ServedReplica(Path(tmp), model_dir, dirs, prompts, clients=args.served_clients,
                                   new_tokens=args.served_tokens, max_len=max_len, slots=args.slots,
                                   pool_dtype=args.pool_dtype, max_batch=args.served_max_batch,
                                   warm=not args.quick)
            replica = served_proc
            config, params = load_model(model_dir)
            # which backend the "decode" column ran on, as serving selects it here
            backend_info = {"name": type(params.backend).__name__,
                            **dataclasses.asdict(params.backend)}
            pool = MemoryPool(PoolSpec(num_layers=config.num_layers, module_dims=config.module_dims,
                                       slots=args.slots, max_rank=RANK, dtype=args.pool_dtype))
            adapters = {}
            for slot, name in enumerate(adapter_names()):
                data = (dirs[name] / "adapter_model.safetensors").read_bytes()
                adapters[name] = loaded_event(name, slot, data)
                pool.write_slot(slot, slot_weights(data, adapters[name]))
            serving = Serving(pool, State(seq=ADAPTERS + 1, adapters=adapters))
            runner = Runner(config, params, max_batch=BATCH, max_len=max_len)
            others = alternative_runners(runner)
            n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(others[LOOP].params))

            console.print("prefilling (this compiles prefill and decode) ...")
            raw = {k: RawDecode(runner, pool, prompts, np.asarray(row_adapters(k))) for k in MIXES}
            alternatives = {a: {k: RawDecode(others[a], pool, prompts, np.asarray(row_adapters(k)))
                                for k in MIXES if k or a == LOOP} for a in ALTERNATIVES}
            # a smoke run skips the engines' warm-up (every prefill and decode shape of a 32-row
            # batch): its warm-up round compiles the few it runs, before anything is timed
            warm = not args.quick
            engines = {k: EngineDecode(runner, serving, prompts, row_adapters(k), max_new, warm=warm)
                       for k in MIXES}
            no_pool = RawDecode(runner, None, prompts, np.full(BATCH, -1))
            timings = {p: {k: Timing() for k in MIXES} for p in PATHS}
            for a, by_mix in alternatives.items():
                timings[a] = {k: Timing() for k in by_mix}
            no_pool_timing = Timing()
            # the served path's work three ways, timed whole: served, in process, PEFT
            requests = EngineRequests(runner, serving, prompts, clients=args.served_clients,
                                      new_tokens=args.served_tokens, warm=warm)
            whole = {w: {k: RequestTiming() for k in (PEFT_WHOLE_MIXES if w == "peft" else MIXES)}
                     for w in WHOLE}
            whole_tokens: dict[str, dict[int, list[list[int]]]] = {w: {} for w in WHOLE}

            def one_round(k: int, count: bool) -> None:
                if k == 0:
                    no_pool.round(steps, no_pool_timing if count else None)
                raw[k].round(steps, timings["decode"][k] if count else None)
                for a, by_mix in alternatives.items():
                    if k in by_mix:
                        by_mix[k].round(steps, timings[a][k] if count else None)
                engines[k].round(steps, timings["engine"][k] if count else None)
                peft_proc.round(k, steps, timings["peft"][k] if count else None)
                replica.round(k, whole[SERVED][k] if count else None)
                whole_tokens[SERVED][k] = replica.outputs
                requests.round(k, whole["engine"][k] if count else None)
                whole_tokens["engine"][k] = requests.outputs
                if k in whole["peft"]:
                    whole_tokens["peft"][k] = peft_proc.requests(k, args.served_clients, args.served_tokens,
                                                                 whole["peft"][k] if count else None)

            console.print("round 0 (warm-up)")
            for k in MIXES:
                one_round(k, False)
            every = [no_pool_timing, *(t for by_mix in timings.values() for t in by_mix.values()),
                     *(t for by_mix in whole.values() for t in by_mix.values())]
            rounds, clean = 0, []
            with counting_compiles() as compiles:
                while len(clean) < repeats and rounds < max_rounds:  # rounds other processes disturbed don't count
                    for k in MIXES:
                        one_round(k, True)
                    rounds += 1
                    clean = clean_rounds(every, rounds)
                    console.print(f"round {rounds}: {len(clean)} of {repeats} without other load")
            for t in every:
                t.used = clean or None
            tokens_agree = {}
            for k in MIXES:
                ours = raw[k].tokens
                served = engines[k].outputs()
                engine = [np.array([out[1 + i] for out in served]) for i in range(steps)]
                tokens_agree[str(k)] = {"decode_vs_peft": agreement(ours, peft_proc.tokens[k]),
                                        "decode_vs_engine": agreement(ours, engine),
                                        "served_vs_engine": agreement(whole_tokens[SERVED][k],
                                                                      whole_tokens["engine"][k]),
                                        **({"served_vs_peft": agreement(whole_tokens[SERVED][k],
                                                                        whole_tokens["peft"][k])}
                                           if k in whole_tokens["peft"] else {})}
                for a, by_mix in alternatives.items():
                    if k in by_mix:
                        tokens_agree[str(k)][f"decode_vs_{a}"] = agreement(ours, by_mix[k].tokens)
            del raw, alternatives, engines, no_pool, others, requests
            gemm = {"xla": gemm_rate_xla(), "kernel": gemm_rate_kernel(), "torch": peft_proc.gemm_rate()}
        finally:
            peft_proc.stop()
            if served_proc is not None:
                served_proc.stop()

        long_base = long_context = None
        if args.long_max_len:
            console.print(f"base batch with a {args.long_max_len}-position cache ...")
            long_runner = Runner(config, params, max_batch=BATCH, max_len=args.long_max_len)
            long = RawDecode(long_runner, pool, prompts, np.full(BATCH, -1))
            long.round(steps, None)
            t = Timing()
            while (len(clean_rounds([t], len(t.seconds))) < args.long_repeats
                   and len(t.seconds) < 3 * args.long_repeats):
                long.round(steps, t)
            t.used = clean_rounds([t], len(t.seconds)) or None
            long_base = {"max_len": args.long_max_len, **t.as_dict(steps)}
            del long
            deep = {a: DeepDecode(long_runner, 3 * args.long_max_len // 4, a) for a in ("kernel", "xla")}
            console.print(f"base batch from position {3 * args.long_max_len // 4} of that cache, "
                          "attention by the kernel and by XLA ...")
            deep_t = {a: Timing() for a in deep}
            for d in deep.values():
                d.round(steps, None)  # compiles
            while (len(clean_rounds(list(deep_t.values()), len(deep_t["kernel"].seconds))) < args.long_repeats
                   and len(deep_t["kernel"].seconds) < 3 * args.long_repeats):
                for a, d in deep.items():
                    d.round(steps, deep_t[a])
            used = clean_rounds(list(deep_t.values()), len(deep_t["kernel"].seconds)) or None
            for t in deep_t.values():
                t.used = used
            per_round = [deep_t["xla"].seconds[i] / deep_t["kernel"].seconds[i] for i in deep_t["kernel"].rounds()]
            long_context = {"max_len": args.long_max_len, "start": 3 * args.long_max_len // 4,
                            **{a: t.as_dict(steps) for a, t in deep_t.items()},
                            "kernel_over_xla": median(per_round), "kernel_over_xla_spread": spread(per_round)}
            del deep

    def ratio(a: Timing, b: Timing) -> tuple[float, list[float]]:
        """a over b: the median and the spread of the per-round ratios (rounds both count; each
        round times every path side by side), as benchmarks/suite.py reports it."""
        both = [i for i in a.rounds() if i in b.rounds()]
        per_round = [b.seconds[i] / a.seconds[i] for i in both]
        return median(per_round), spread(per_round)

    table = {}
    for k in MIXES:
        row: dict[str, Any] = {p: timings[p][k].as_dict(steps) for p in (*PATHS, *ALTERNATIVES)
                               if k in timings[p]}
        versus = {"base": lambda p: timings[p][0], "peft": lambda p: timings["peft"][k]}
        for a in ALTERNATIVES:
            if k in timings[a]:
                versus[a] = lambda p, a=a: timings[a][k]  # type: ignore[misc]
        for p in ("decode", "engine"):
            for name, other in versus.items():
                row[p][f"over_{name}"], row[p][f"over_{name}_spread"] = ratio(timings[p][k], other(p))
        for a in ALTERNATIVES:
            if k in timings[a]:
                for name, other in (("base", timings["decode"][0]), ("peft", timings["peft"][k])):
                    row[a][f"over_{name}"], row[a][f"over_{name}_spread"] = ratio(timings[a][k], other)
        table[str(k)] = row
    served_table: dict[str, Any] = {}
    for k in MIXES:
        cell = whole[SERVED][k].as_dict()
        cell.update({w: whole[w][k].as_dict() for w in WHOLE if w != SERVED and k in whole[w]})
        for name, against in (("base", whole[SERVED][0]), ("peft", whole["peft"].get(k)),
                              ("engine", whole["engine"][k])):
            if against is None:
                continue
            per_round = [whole[SERVED][k].rate(i) / against.rate(i) for i in whole[SERVED][k].rounds()]
            cell[f"over_{name}"], cell[f"over_{name}_spread"] = median(per_round), spread(per_round)
        served_table[str(k)] = cell
    targets = []
    for p in ("decode", "engine"):
        top = table[str(TARGET_MIX)][p]
        targets += [
            {"name": f"{LABELS[p]}: {TARGET_MIX} adapters / base model", "measured": round(top["over_base"], 3),
             "target": f">= {TARGET_OVER_BASE}x", "met": top["over_base"] >= TARGET_OVER_BASE},
            {"name": f"{LABELS[p]}: {TARGET_MIX} adapters / PEFT, same batch", "measured": round(top["over_peft"], 3),
             "target": f">= {TARGET_OVER_PEFT}x", "met": top["over_peft"] >= TARGET_OVER_PEFT}]
    top = served_table[str(TARGET_MIX)]
    targets += [
        {"name": f"served: {TARGET_MIX} adapters / base model", "measured": round(top["over_base"], 3),
         "target": f">= {TARGET_OVER_BASE}x", "met": top["over_base"] >= TARGET_OVER_BASE},
        {"name": f"served: {TARGET_MIX} adapters / PEFT, same batch", "measured": round(top["over_peft"], 3),
         "target": f">= {TARGET_OVER_PEFT}x", "met": top["over_peft"] >= TARGET_OVER_PEFT},
        {"name": f"served / in-process Engine.step (the same requests), {TARGET_MIX} adapters", "measured": round(top["over_engine"], 3),
         "target": f">= {TARGET_SERVED_OVER_ENGINE}x", "met": top["over_engine"] >= TARGET_SERVED_OVER_ENGINE}]
    info = peft_proc.info
    return {
        "machine": machine_info(), "backend": backend_info, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "versions": {"jax": jax.__version__, "torch": info["torch"], "transformers": info["transformers"],
                     "peft": info["peft"]},
        "model": {**{k: v for k, v in vars(shape).items() if k != "rope_scaling"}, "parameters": n_params,
                  "dtype": "float32", "attn_implementation": info["attn_implementation"]},
        "adapters": {"count": ADAPTERS, "rank": RANK, "alpha": ALPHA, "targets": list(MODULES),
                     "fraction_of_projections": adapter_fraction(shape, TARGET_MIX)},
        "settings": {"batch": BATCH, "prompt": PROMPT, "steps": steps, "repeats": repeats,
                     "rounds_run": rounds, "clean_rounds": clean, "contended_above": CONTENDED,
                     "slots": args.slots, "pool_dtype": args.pool_dtype, "max_len": max_len,
                     "torch_threads": args.torch_threads, "quick": args.quick,
                     "served_clients": args.served_clients, "served_tokens": args.served_tokens,
                     "served_max_batch": args.served_max_batch,
                     "xla_threads": os.cpu_count()},
        "results": table, "served": served_table, "targets": targets, "compiles_while_timing": len(compiles),
        "no_pool_base": no_pool_timing.as_dict(steps),
        "tokens_agree": tokens_agree, "long_cache_base": long_base,
        "long_context": long_context, "gemm_gflops": gemm,
        "seconds": round(time.perf_counter() - started, 1),
    }


# --------------------------------------------------------------------------- report


def _mix_label(k: int) -> str:
    return "base model" if k == 0 else f"{k} adapter" + ("s" if k > 1 else "")


def render(result: dict[str, Any]) -> tuple[Table, str]:
    s, m = result["settings"], result["model"]
    table = Table(title=f"decode, batch {s['batch']}, tokens/s (median of {s['repeats']} rounds "
                        f"of {s['steps']} steps)")
    for col in ("distinct adapters", "decode", "Engine.step", "loop", "gather", "PEFT", "decode / base",
                "Engine / base", "loop / base", "decode / loop", "decode / gather", "decode / PEFT",
                "Engine / PEFT", "loop / PEFT"):
        table.add_column(col, justify="right")
    lines = ["| distinct adapters | ours tok/s (decode) | ours tok/s (Engine.step) | XLA only tok/s "
             "| per-token gather tok/s | PEFT tok/s | ours / base (decode, Engine, loop) | decode / loop "
             "| decode / gather | ours / PEFT (decode, Engine, loop) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def rate(cell: dict[str, Any]) -> str:  # the median and the spread of the rounds
        lo, hi = cell["tokens_per_s_spread"]
        return f"{cell['tokens_per_s']:,.0f} ({lo:,.0f}-{hi:,.0f})"

    for k in MIXES:
        r = result["results"][str(k)]
        d, e, p = r["decode"], r["engine"], r["peft"]
        g, lp = (rate(r[a]) if a in r else "-" for a in (GATHER, LOOP))
        over_g, over_l = (f"{d[f'over_{a}']:.2f}" if f"over_{a}" in d else "-" for a in (GATHER, LOOP))
        l_base, l_peft = (f"{r[LOOP][f'over_{n}']:.2f}" if LOOP in r else "-" for n in ("base", "peft"))
        short = {n: f"{c['tokens_per_s']:,.0f}" for n, c in r.items()}  # the console: medians only
        table.add_row(_mix_label(k), short["decode"], short["engine"], short.get(LOOP, "-"), short.get(GATHER, "-"),
                      short["peft"], f"{d['over_base']:.2f}", f"{e['over_base']:.2f}", l_base, over_l, over_g,
                      f"{d['over_peft']:.2f}", f"{e['over_peft']:.2f}", l_peft)
        lines.append(f"| {_mix_label(k)} | {rate(d)} | {rate(e)} | {lp} | {g} | {rate(p)} "
                     f"| {d['over_base']:.2f}, {e['over_base']:.2f}, {l_base} | {over_l} | {over_g} "
                     f"| {d['over_peft']:.2f}, {e['over_peft']:.2f}, {l_peft} |")
    served = result.get("served")
    if served:
        lines += ["", "| distinct adapters | served tok/s | in process (Engine.step) tok/s | PEFT tok/s "
                  "| served / served base | served / in process | served / PEFT |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for k in MIXES:
            c = served[str(k)]
            peft, over_peft = (rate(c["peft"]), f"{c['over_peft']:.2f}") if "peft" in c else ("-", "-")
            lines.append(f"| {_mix_label(k)} | {rate(c)} | {rate(c['engine'])} | {peft} "
                         f"| {c['over_base']:.2f} | {c['over_engine']:.2f} | {over_peft} |")
        lines += ["", f"Whole requests, the same work three ways: {s['served_clients']} requests (row i: "
                  f"prompt i, adapter i % k), {s['served_tokens']} new tokens each (greedy), timed from the "
                  "first request to the last token, prefill included. Served: a real `statesvc serve` and "
                  f"`computed serve --max-batch {s.get('served_max_batch', s['batch'])}` (subprocesses, the "
                  "same model and adapters, "
                  "loaded through the state service), one ZeroMQ DEALER per request, all sent at once; in "
                  "process: `Engine.submit` of the same requests and `Engine.step` until the last one "
                  "finishes (prefills as the engine admits them, as in the replica); PEFT: the same prompts "
                  "prefilled as one batch, then greedy decoding with the KV cache (timed on {TARGET_MIX} "
                  "adapters only, the target's batch: it takes about four times as long as ours). In the same "
                  "rounds as the decode figures; ratios per round."]
    v = result["versions"]
    lines += ["",
              f"Model (random, written by statesvc/tools/example.py): vocab {m['vocab_size']}, hidden "
              f"{m['hidden_size']}, intermediate {m['intermediate_size']}, {m['num_hidden_layers']} layers, "
              f"{m['num_attention_heads']} heads, {m['num_key_value_heads']} KV heads, head_dim {m['head_dim']}, "
              f"{m['parameters'] / 1e6:.0f} M parameters, float32. {result['adapters']['count']} adapters, "
              f"r={result['adapters']['rank']}, alpha {result['adapters']['alpha']}, all seven target modules; "
              f"pool of {s['slots']} slots, {s['pool_dtype']}; KV cache of {s['max_len']} positions. Row i uses "
              f"adapter i % k; prompts of {s['prompt']} tokens, then greedy decoding. tokens/s: the median "
              f"of the rounds (their range in brackets). decode: "
              f"`Runner.decode` (`computed.model.runner.decode` as the engine calls it: projections from the "
              f"native dense kernel `computed/backend/kernels/dense.cc` over packed weights, LoRA from `sgmv.cc`, "
              f"attention from `attention.cc`) in a loop; XLA only: the same "
              f"loop without the native kernels, as a replica runs where they cannot be built (XLA's dot, LoRA from "
              f"XLA's window loop `lora.segmented_group`, attention over the length bucket); per-token "
              f"gather: the same loop with the LoRA terms from A and B gathered for every row "
              f"(BGMV-style, the backend's `lora=\"gather\"`, never used in serving); Engine.step: "
              f"the serving loop with host sampling; PEFT {v['peft']} mixed-batch inference (`adapter_names`) "
              f"on transformers {v['transformers']} ({m['attn_implementation']} attention), torch {v['torch']} "
              f"with {s['torch_threads']} threads.",
              ""]
    lines += target_lines(result)
    lines += ["", notes(result), "", machine_line(result)]
    return table, "\n".join(lines)


def shares(result: dict[str, Any], paths: tuple[str, ...], key: str) -> list[float]:
    """`key` over the rounds the figures are taken from, for every mix and each of `paths`."""
    out = []
    for row in result["results"].values():
        for p in paths:
            used = row[p]["used_rounds"]
            out += [x for i, x in enumerate(row[p][key]) if used is None or i in used]
    return out


def machine_line(result: dict[str, Any]) -> str:
    s = result["settings"]
    clean = len(s["clean_rounds"])
    ours, theirs = shares(result, ("decode", "engine"), "cpu_share"), shares(result, ("peft",), "cpu_share")
    others = shares(result, PATHS, "others_share")
    m, backend = result["machine"], result.get("backend") or {}
    line = (f"{m['nproc']} CPUs ({m.get('cpu', 'model not recorded')}; kernels built for "
            f"{', '.join(m.get('kernel_isas') or ['no vector ISA recorded'])}; the decode column "
            f"on {backend.get('name', 'an unrecorded backend')}), Python {m['python']}, jax "
            f"{result['versions']['jax']}, load average {result['load_average_before'][0]:.2f} before the run, "
            f"{result['machine']['date']}. {s['rounds_run']} rounds run; the medians are of "
            + (f"the {clean} that ran without other load (other processes under {100 * CONTENDED:.0f}% of "
               "the CPUs in every measurement)" if clean else "all of them: none ran without other load")
            + f". In those, our process used {100 * median(ours):.0f}% of the CPUs (median), PEFT's "
            f"{100 * median(theirs):.0f}%, other processes {100 * median(others):.0f}% (at most "
            f"{100 * max(others):.0f}%).")
    if clean < s["repeats"]:
        line += (f" **Fewer than {s['repeats']} undisturbed rounds: the figures are unreliable, PEFT's above "
                 "all (torch's threads wait for each other when one is descheduled).**")
    return (line + f" `python -m benchmarks.bench_decode` reproduces it ({result['seconds']:.0f} s); "
            "`benchmarks/results/decode.json` has every round.")


def adapter_fraction(shape: ModelShape, adapters: int) -> float:
    """Parameters of `adapters` adapters over those of the projections they adapt (all layers)."""
    dims = [shape.module_dims(m) for m in MODULES]
    return adapters * RANK * sum(i + o for i, o in dims) / sum(i * o for i, o in dims)


def notes(result: dict[str, Any]) -> str:
    base = result["results"]["0"]["decode"]["tokens_per_s"]
    g, nb = result["gemm_gflops"], result["no_pool_base"]["tokens_per_s"]
    notes = [f"At this shape {TARGET_MIX} adapters hold "
             f"{100 * result['adapters']['fraction_of_projections']:.0f}% as many parameters as "
             "the projections they adapt (about 10% at hidden 4096, intermediate 11008), so the LoRA "
             "share of a step is large.",
             f"The base batch through `decode` with no LoRA pool makes {nb:,.0f} tokens/s "
             f"({nb / base:.2f}x the pooled figure): what the LoRA path costs when no row uses it.",
             f"One [32, 1024] x [1024, 2816] float32 product (the MLP's) runs at {g['xla']} GFLOP/s in XLA"
             + (f", {g['kernel']} in the dense kernel" if g.get("kernel") else "")
             + f" and {g['torch']} in torch here (one weight, hot in the cache; a step reads each "
             "weight once, from memory)."]
    lb = result["long_cache_base"]
    if lb and lb["used_rounds"] is None:
        notes.append(f"With a {lb['max_len']}-position cache: not measured without other load.")
    elif lb:
        notes.append(f"With a {lb['max_len']}-position cache, the base batch at the same positions makes "
                     f"{lb['tokens_per_s']:,.0f} tokens/s, {lb['tokens_per_s'] / base:.2f}x the figure above "
                     "(a step reads the positions its rows hold, not the cache).")
    lc = result.get("long_context")
    if lc:
        notes.append(f"Deep in that cache (every row from position {lc['start']} on), the base batch makes "
                     f"{lc['kernel']['tokens_per_s']:,.0f} tokens/s with the attention kernel and "
                     f"{lc['xla']['tokens_per_s']:,.0f} with XLA's attention over the bucket: "
                     f"{lc['kernel_over_xla']:.2f}x.")
    agree = result["tokens_agree"]
    notes.append("Greedy tokens agree with PEFT's on "
                 + ", ".join(f"{100 * agree[str(k)]['decode_vs_peft']:.0f}%" for k in MIXES)
                 + f" of (step, row) pairs ({', '.join(str(k) for k in MIXES)} adapters), the per-token "
                 "gather's with ours on "
                 + ", ".join(f"{100 * agree[str(k)]['decode_vs_gather']:.0f}%" for k in MIXES if k)
                 + ", the window loop's on "
                 + ", ".join(f"{100 * agree[str(k)]['decode_vs_loop']:.0f}%" for k in MIXES if k)
                 + f"; {result['compiles_while_timing']} compiles while timing.")
    return " ".join(notes)


def main(argv: list[str] | None = None) -> int:
    global MIXES
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed rounds without other load wanted (after one warm-up round)")
    ap.add_argument("--max-rounds", type=int, default=0,
                    help="give up waiting for undisturbed rounds after this many (default: 2 x --repeats)")
    ap.add_argument("--max-len", type=int, default=256, help="KV-cache positions per row (ours)")
    ap.add_argument("--slots", type=int, default=64, help=f"pool slots (max_loras); {ADAPTERS} are filled")
    ap.add_argument("--pool-dtype", choices=POOL_DTYPES, default="float32",
                    help="the pool's dtype (`loractl pool init --dtype`); the model is float32")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                    help="torch.set_num_threads for PEFT (XLA uses every core)")
    ap.add_argument("--long-max-len", type=int, default=1024,
                    help="time the base batch again with a cache this long (0: skip)")
    ap.add_argument("--long-repeats", type=int, default=3,
                    help="undisturbed rounds wanted for each long-cache figure")
    ap.add_argument("--served-clients", type=int, default=BATCH,
                    help="concurrent clients (one DEALER each) of the served replica (`--max-batch` is 32)")
    ap.add_argument("--served-tokens", type=int, default=SERVED_TOKENS,
                    help="new tokens each served request generates")
    ap.add_argument("--mixes", default=",".join(map(str, MIXES)),
                    help=f"distinct adapters per batch to time, comma-separated (the targets need 0 and "
                         f"{TARGET_MIX}); fewer for a shorter run, with --no-write")
    output_flags(ap, "decode", "a smoke run: a tiny model, one round of 4 steps, mixes 0 and 16, no long "
                 "cache; writes nothing unless `python -m benchmarks --quick` points it elsewhere")
    args = ap.parse_args(argv)
    mixes = tuple(sorted({int(k) for k in args.mixes.split(",")}))
    if not {0, TARGET_MIX} <= set(mixes) <= set(MIXES):
        ap.error(f"--mixes must include 0 and {TARGET_MIX} (the targets') and be among {MIXES}; got {args.mixes!r}")
    if mixes != MIXES and not args.no_write:
        ap.error("--mixes other than all of them needs --no-write (results/ keeps every mix)")
    if args.quick:  # the base model and the targets' mix: every path and figure kind, 2 of 5 mixes' compiles
        args.steps, args.repeats, args.max_rounds, args.max_len, args.long_max_len = 4, 1, 1, 64, 0
        args.served_clients, args.served_tokens = 4, 4
        mixes = (0, TARGET_MIX)
    args.served_max_batch = served_max_batch(args.quick, args.served_clients)
    MIXES = mixes  # read by run, render and notes alike
    if not 1 <= args.served_clients <= BATCH:
        ap.error(f"--served-clients must be in [1, {BATCH}] (the batch, the replica's --max-batch)")
    if args.slots < ADAPTERS:
        ap.error(f"--slots must be at least {ADAPTERS}, the adapters the batch mixes")
    result = run(args)
    table, markdown = render(result)
    console.print(table)
    print_targets(result, console.print)
    console.print("whole requests, tokens/s served / in process / PEFT: " + ", ".join(
        f"{_mix_label(k)} {c['tokens_per_s']:,.0f} / {c['engine']['tokens_per_s']:,.0f} / "
        + (f"{c['peft']['tokens_per_s']:,.0f} " if "peft" in c else "- ")
        + f"({c['over_engine']:.2f}x in process" + (f", {c['over_peft']:.2f}x PEFT)" if "peft" in c else ")")
        for k in MIXES for c in (result["served"][str(k)],)))
    console.print(notes(result))
    console.print(machine_line(result))
    publish("decode", result, markdown, quick=args.quick, no_write=args.no_write, say=console.print)
    return 0


def figures(r: dict[str, Any]) -> list[Figure]:
    """The benchmark's own ratios (medians of per-round ratios, with their spread), so the
    table and the benchmark's section agree."""
    results = r["results"]
    steps, batch = r["settings"]["steps"], r["settings"]["batch"]
    base = decode_rates(results["0"]["decode"], batch * steps)
    out = [figure("decode", "decode, base model, batch 32", median(base), "tokens/s",
                  spread=spread(base), runs=len(base))]
    if "over_loop" in results["0"]["decode"]:  # the dense kernel and attention alone: no LoRA terms
        out.append(figure("decode", "decode, base model: ours / XLA only (no native kernels)",
                          results["0"]["decode"]["over_loop"], "x",
                          spread=results["0"]["decode"].get("over_loop_spread"), runs=len(base)))
    for k in sorted(results, key=int):
        if k == "0":
            continue
        ours = results[k]["decode"]
        runs = len(decode_rates(ours, batch * steps))
        label = f"{k} distinct adapter{'s' if k != '1' else ''}"
        for key, name, goal in (("base", "/ base model", 0.75),
                                ("peft", ": ours / PEFT mixed batch", 3.0),
                                ("loop", ": ours / XLA only (no native kernels)", None),
                                ("gather", ": ours / per-token gather (BGMV-style)", None)):
            if f"over_{key}" not in ours:
                continue
            value = ours[f"over_{key}"]
            target = f">= {goal:g}x" if goal is not None and k == "16" else None
            out.append(figure("decode", f"decode, {label} {name}".replace(" :", ":"), value, "x",
                              target=target, meets=value >= goal if target and goal else None,
                              spread=ours.get(f"over_{key}_spread"), runs=runs))
    served = r.get("served") or {}
    for k in sorted(served, key=int):
        cell = served[k]
        runs = len(cell["seconds"]) if cell.get("used_rounds") is None else len(cell["used_rounds"])
        label = "base model" if k == "0" else f"{k} distinct adapter{'s' if k != '1' else ''}"
        if k == "0":
            out.append(figure("decode", "served, base model, batch 32", cell["tokens_per_s"], "tokens/s",
                              spread=cell["tokens_per_s_spread"], runs=runs))
        for key, name, goal in (("base", "/ served base", 0.75), ("peft", "/ PEFT mixed batch", 3.0),
                                ("engine", "/ in-process Engine.step, the same requests", 0.9)):
            if k == "0" and key == "base" or f"over_{key}" not in cell:
                continue
            value = cell[f"over_{key}"]
            target = f">= {goal:g}x" if k == "16" else None
            out.append(figure("decode", f"served, {label} {name}", value, "x", target=target,
                              meets=value >= goal if target else None,
                              spread=cell.get(f"over_{key}_spread"), runs=runs))
    lc = r.get("long_context")
    if lc:
        out.append(figure("decode", f"decode, base model from position {lc['start']} of {lc['max_len']}: "
                          "attention kernel / XLA attention", lc["kernel_over_xla"], "x",
                          spread=lc["kernel_over_xla_spread"], runs=len(lc["kernel"]["seconds"])))
    return out


if __name__ == "__main__":
    sys.exit(main())
