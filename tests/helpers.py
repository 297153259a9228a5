"""Test helpers: a statesvc and its replicas as real subprocesses (Fleet), an in-process
Replica against a real statesvc (live_replica), and transformers + PEFT as the reference for
served outputs (HFReference; torch and transformers imported only when it is built)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zmq

from shared.client import ControlClient, new_event_id
from shared.events import AdapterLoaded, lora_scaling
from shared.fingerprint import read_model
from shared.keys import ClientKeys, client_keys
from statesvc.tools.example import ExampleAssets
from testkit.fleet import BIN, Computed, Gateway, StateSvc, wait_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# a replica's warm-up compiles every bucket: about 13 s on a quiet 2-core machine, several
# times that beside the other xdist worker's compiles (60 s, wait_for's default, timed out at
# a load average of 4-5); the bound only guards against a hang
WARMUP_TIMEOUT_S = 240.0


class Fleet:
    def __init__(self, tmp: Path, example: ExampleAssets, **svc_kw: Any) -> None:
        self.tmp, self.example = tmp, example
        self.statesvc = StateSvc(tmp / "data", **svc_kw)
        self.replicas: list[Computed] = []
        self.gateways: list[Gateway] = []

    def replica(self, name: str, *, start: bool = True, args: tuple[str, ...] = ("--no-warmup",),
                env: dict[str, str] | None = None) -> Computed:
        r = Computed(self.example.model_dir, self.statesvc, self.tmp / "replicas" / name,
                     replica_id=name, extra_args=args, env=env or {})
        self.replicas.append(r)
        return r.start() if start else r

    def serving(self, adapters: dict[str, str] | None = None, *, args: tuple[str, ...] = ("--no-warmup",),
                env: dict[str, str] | None = None, warm: bool = False) -> Computed:
        """The usual fleet to serve from: statesvc started, the pool initialised, `adapters` ({name:
        example adapter}) loaded, and one replica `r1` started and at the log's head (warmed up
        too, with `warm`)."""
        self.statesvc.start()
        self.init()
        for name, adapter in (adapters or {}).items():
            self.load(name, adapter)
        replica = self.replica("r1", args=args, env=env)
        if warm:
            wait_for(lambda: replica.status()["inference"]["warm"], what="warm-up", timeout=WARMUP_TIMEOUT_S)
        wait_for(lambda: self.converged(replica), timeout=WARMUP_TIMEOUT_S, what="replica at head")
        return replica

    def gateway(self, *extra_args: str) -> Gateway:
        """A `computed gateway` in front of this fleet's replicas, started and healthy."""
        gateway = Gateway(self.example.model_dir, self.statesvc, log_file=self.tmp / "gateway.log",
                          extra_args=extra_args)
        self.gateways.append(gateway)
        gateway.start()
        wait_for(gateway.healthy, what="gateway healthy")
        return gateway

    def stop(self) -> None:
        for g in self.gateways:
            g.stop()
        for r in self.replicas:
            r.stop()
        self.statesvc.stop()

    def client(self) -> ControlClient:
        return ControlClient(self.statesvc.control)

    def cmd(self, cmd: str, **args: Any) -> Any:
        with self.client() as c:
            return c.call(cmd, {"event_id": new_event_id(), **args})

    def init(self, **kw: Any) -> None:
        self.cmd("pool.init", model=str(self.example.model_dir),
                 **{"max_loras": 6, "max_rank": 32, "targets": "all", **kw})

    def load(self, name: str, adapter: str, **kw: Any) -> Any:
        return self.cmd("load", name=name, path=str(self.example.adapter_dirs[adapter]), **kw)

    def head(self) -> int:
        with self.client() as c:
            return int(c.call("status")["head_seq"])

    def converged(self, *replicas: Computed) -> bool:
        head = self.head()
        return all(r.status()["applied_seq"] == head and r.status()["state"] == "ACTIVE"
                   for r in replicas)

Command = Callable[..., Any]


def xla_flags(*flags: str) -> str:
    """This session's XLA_FLAGS (tests/conftest.py's fast compiles) with `flags` added: what a
    process the test starts gets in place of replacing the session's."""
    have = os.environ.get("XLA_FLAGS", "").split()
    return " ".join([*have, *(f for f in flags if f not in have)])


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """One of the project's commands (`statesvc`, `loractl`, `computed`), output captured."""
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=60)


def usage(*argv: str) -> subprocess.CompletedProcess[str]:
    """`run`'s result for a command line its command refuses as it parses its options (exit 2),
    run through the same click command in this process: no process start and no imports of its
    own, which is most of a refusal's time. An exception other than click's exit comes back in
    stderr as a traceback, as the process would print it. Where the command does not refuse, it
    runs here: only for command lines a test expects to be refused."""
    import traceback

    from click.testing import CliRunner

    from computed.cli import main as computed_main
    from statesvc.cli import main as statesvc_main
    from statesvc.loractl import main as loractl_main

    command = {"statesvc": statesvc_main, "computed": computed_main, "loractl": loractl_main}[argv[0]]
    res = CliRunner().invoke(command, list(argv[1:]), prog_name=argv[0])
    stderr = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        stderr += "".join(traceback.format_exception(res.exception))
    return subprocess.CompletedProcess(list(argv), res.exit_code, res.stdout, stderr)


def make_keys(tmp: Path, roles: dict[str, str | None]) -> tuple[Path, Path]:
    """A server key dir (`statesvc keys init`) and client key pairs (`loractl keys new`), each
    NAME's public key copied into its role folder there (None: a key the server does not
    know); returns (key dir, client keys dir)."""
    keydir, clients = tmp / "server-keys", tmp / "client-keys"
    made = [run("statesvc", "keys", "init", str(keydir)),
            *(run("loractl", "keys", "new", name, "--dir", str(clients)) for name in roles)]
    assert all(res.returncode == 0 for res in made), [res.stderr for res in made]
    for name, role in roles.items():
        if role:
            shutil.copy(clients / f"{name}.key", keydir / role / f"{name}.key")
    return keydir, clients


def fleet_keys(tmp: Path) -> tuple[Path, ClientKeys, tuple[str, ...]]:
    """CURVE for a fleet: statesvc's key dir (for --auth), an operator's client keys and the
    replicas' `--key`/`--server-key` arguments."""
    keydir, clients = make_keys(tmp, {"op": "operators", "r": "replicas"})
    server = str(keydir / "server.key")
    keys = client_keys(str(clients / "op.key_secret"), server)
    assert keys is not None
    return keydir, keys, ("--key", str(clients / "r.key_secret"), "--server-key", server)


def dealer(address: str, *, keys: ClientKeys | None = None,
           timeout_ms: int | None = None) -> zmq.Socket[Any]:
    """A raw DEALER connected to `address` (a statesvc's control socket, a replica's listen
    socket), LINGER 0 so closing it never blocks; a CURVE client with `keys`; with
    `timeout_ms`, a `recv` raises zmq.Again after that long instead of hanging the test."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if timeout_ms is not None:
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    if keys is not None:
        keys.apply(sock)
    sock.connect(address)
    return sock


def admit(replica: Any, adapter: str | None, min_seq: int = 0, ticket: int = 0,
          timeout_s: float = 60.0) -> Any:
    """`replica.admit`, waiting while the fill worker fetches the adapter's weights (Fetching:
    in serving the request waits in the engine's queue); other refusals are raised."""
    from computed.serving.admission import Fetching
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return replica.admit(adapter, min_seq, ticket)
        except Fetching:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def adapter_weights(adapter_dir: Path, version: int) -> Any:
    """A PEFT adapter directory's weights as a replica writes them into a slot: its event as
    statesvc would record it (scaling by `lora_scaling`), the safetensors parsed by the
    replica's own `slot_weights`."""
    from computed.residency.blob_cache import slot_weights  # jax: only the tests that use it import it
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg["use_rslora"])
    event = AdapterLoaded(name=adapter_dir.name, version=version, sha256="0" * 64, size=0, rank=r,
                          alpha=alpha, scaling=lora_scaling(alpha, r, rslora), use_rslora=rslora,
                          targets=tuple(cfg["target_modules"]), pinned=False)
    return slot_weights((adapter_dir / "adapter_model.safetensors").read_bytes(), event)


@contextmanager
def live_replica(tmp_path: Path, example: ExampleAssets,
                 max_loras: int) -> Iterator[tuple[Command, Replica]]:
    """Yield (cmd, replica): `cmd(command, **args)` writes to statesvc with a new event_id;
    the replica is bootstrapped and its slot write, clear and read have compiled."""
    svc = StateSvc(tmp_path / "data").start()
    from computed.replica import Replica  # jax: only the tests that use it import it
    try:
        with ControlClient(svc.control) as c:
            def cmd(command: str, **args: object) -> Any:
                return c.call(command, {"event_id": new_event_id(), **args})

            cmd("pool.init", model=str(example.model_dir), max_loras=max_loras, max_rank=32,
                targets="all")
            replica = Replica(read_model(example.model_dir), c, tmp_path / "replica")
            replica.bootstrap()
            # one diff at a time: applied together, a load and its unload cancel out and
            # would touch (and compile) nothing
            first = sorted(example.adapter_dirs)[0]
            cmd("load", name="warm", path=str(example.adapter_dirs[first]))
            replica.catch_up()
            replica.pool_digest()
            cmd("unload", name="warm")
            replica.catch_up()
            yield cmd, replica
    finally:
        svc.stop()


class HFReference:
    """Greedy continuations from transformers + PEFT, cached by (adapter dir, prompt, n)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        import transformers
        torch.set_num_threads(1)  # a tiny model: threads only fight XLA for the 2 cores
        self.torch = torch
        self.base = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32).eval()
        self.peft_model = None
        self.names: dict[Path, str] = {}
        self.cache: dict[tuple[Path | None, tuple[int, ...], int], list[int]] = {}

    def _select(self, adapter_dir: Path | None) -> object:
        if adapter_dir is None:
            return self.base if self.peft_model is None else None
        import peft
        if adapter_dir not in self.names:
            name = f"a{len(self.names)}"
            if self.peft_model is None:
                self.peft_model = peft.PeftModel.from_pretrained(self.base, str(adapter_dir),
                                                                 adapter_name=name)
            else:
                self.peft_model.load_adapter(str(adapter_dir), adapter_name=name)
            self.names[adapter_dir] = name
        assert self.peft_model is not None
        self.peft_model.set_adapter(self.names[adapter_dir])
        return self.peft_model

    def greedy(self, adapter_dir: Path | None, prompt: list[int], n: int) -> list[int]:
        key = (adapter_dir, tuple(prompt), n)
        if key not in self.cache:
            self.cache[key] = self._greedy(adapter_dir, prompt, n)
        return self.cache[key]

    def _greedy(self, adapter_dir: Path | None, prompt: list[int], n: int) -> list[int]:
        torch = self.torch
        model = self._select(adapter_dir)
        ids = list(prompt)
        with torch.no_grad():
            if model is None:  # the base model under a PeftModel
                assert self.peft_model is not None
                with self.peft_model.disable_adapter():
                    return self._loop(self.peft_model, ids, n)
            return self._loop(model, ids, n)

    def log_softmax(self, adapter_dir: Path | None, ids: list[int]) -> Any:
        """log_softmax of the logits after each of `ids` (numpy [len(ids), vocab] float32): what
        the token after position i scores as row i."""
        torch = self.torch
        model = self._select(adapter_dir)
        with torch.no_grad():
            if model is None:
                assert self.peft_model is not None
                with self.peft_model.disable_adapter():
                    logits = self.peft_model(torch.tensor([ids])).logits[0]  # type: ignore[operator]
            else:
                logits = model(torch.tensor([ids])).logits[0]  # type: ignore[operator]
        return torch.log_softmax(logits.float(), dim=-1).numpy()

    def _loop(self, model: object, ids: list[int], n: int) -> list[int]:
        torch = self.torch
        out = []
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]  # type: ignore[operator]
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
        return out


def held(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A replica status's slots as {slot: {name, version}} (without digests and pins)."""
    return {s: {"name": h["name"], "version": h["version"]} for s, h in status["slots"].items()}


def slot_holding(status: dict[str, Any], name: str) -> int:
    """The slot a replica's status shows holding adapter `name`."""
    return next(int(s) for s, h in status["slots"].items() if h["name"] == name)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread in the module that imports this: the reference models are tiny, and extra
    torch threads only contend with XLA's (10x slower here)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
