"""bench_decode's paths, shared with the benches built on it (dtype, families, peer): the bench's
model and adapters, our in-process decode loops, the engine's, and the served replica.

What each path runs: docs/benchmarks.md, "bench_decode.py".
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from benchmarks.harness import Fleet, Timing, median, spread, timed
from computed.backend import NativeBackend, XlaBackend
from computed.model.loader import with_layout
from computed.model.runner import Runner, decode
from computed.residency.pool import LoraPool, MemoryPool
from computed.serving.admission import AdmittedAdapter
from computed.serving.engine import Engine
from shared.events import AdapterLoaded, lora_scaling
from shared.projections import MODULES
from shared.protocol import encode_request, unpack
from shared.reducer import State
from shared.replica_protocol import generate_args
from statesvc.tools.example import AdapterSpec, ModelShape, write_adapter, write_model
from testkit.fleet import cpu_seconds

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
PATHS = ("decode", "engine", "peft")
GATHER = "gather"  # timed on the mixes with adapters only
LOOP = "loop"  # timed on every mix
ALTERNATIVES = (LOOP, GATHER)
LABELS = {"decode": "decode", "engine": "Engine.step", "peft": "PEFT", GATHER: "per-token gather",
          LOOP: "XLA only"}


def adapter_names() -> list[str]:
    return [f"bench-{i:02d}" for i in range(ADAPTERS)]


def row_adapters(distinct: int) -> list[int]:
    """Each row's adapter index, -1 for the base model."""
    return [-1] * BATCH if distinct == 0 else [i % distinct for i in range(BATCH)]




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
    """A real `statesvc serve` and `computed serve` (a harness Fleet), the pool and adapters loaded
    through the state service, and `clients` DEALER sockets that each send one `generate`."""

    def __init__(self, root: Path, model_dir: Path, dirs: dict[str, Path], prompts: np.ndarray, *,
                 clients: int, new_tokens: int, max_len: int, slots: int, pool_dtype: str,
                 dtype: str = "float32", name: str = "served", max_batch: int = BATCH,
                 warm: bool = True) -> None:
        self.prompts, self.clients, self.new_tokens = prompts, clients, new_tokens
        # without its warm-up (a smoke run), the replica compiles what the warm-up round sends it
        self.fleet = Fleet(root, model_dir, adapters={n: dirs[n] for n in adapter_names()}, max_loras=slots,
                           max_rank=RANK, pool={"dtype": pool_dtype}, name=name,
                           replica_args=("--max-batch", str(max_batch), "--max-len", str(max_len),
                                         "--dtype", dtype, *(() if warm else ("--no-warmup",))))
        self.replica = self.fleet.replica
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket[Any]] = []
        self.outputs: list[list[int]] = []
        self.timings: dict[zmq.Socket[Any], dict[str, float]] = {}  # the last round's, per client
        try:
            self.fleet.start()
            self.seq = self.fleet.seq
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
        pids = list(self.fleet.pids().values())
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
        self.fleet.stop()




def agreement(a: list[np.ndarray] | list[list[int]], b: list[np.ndarray] | list[list[int]]) -> float:
    """The fraction of (step, row) greedy tokens two paths agree on."""
    return float(np.mean(np.stack(a) == np.stack(b)))
