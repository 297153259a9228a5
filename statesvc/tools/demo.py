"""`make demo`: the main job end to end, from nothing, on the embedded defaults.

A generated example model (`make demo FAMILY=qwen2`: of that family, with its tokenizer and
chat template; default llama) and adapters; CURVE keys for everyone; statesvc and
two replicas on free loopback ports, all with --auth; five adapters registered on a pool of
three slots per replica; one batch that mixes the base model and all five adapters (the
replica evicts to serve it: docs/residency.md), then the same batch through the
OpenAI-compatible gateway with the `openai` client (one request streamed) and a chat in the
family's template; an unload and
a request for it refused; a drill that kills
a replica and rebuilds it by replay with matching digests; a clean shutdown
with no process left behind. Every process started here is stopped here.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq
from jinja2.exceptions import TemplateError
from rich.console import Console
from rich.rule import Rule
from rich.table import Table

from shared import runfile
from shared.keys import ClientKeys, client_keys, init_server_keys, new_client_keys
from shared.protocol import encode_request
from shared.replica_protocol import GENERATE, STATUS, generate_args
from shared.text import TextCodec
from statesvc.tools.commands import EXAMPLE_CHOICES
from statesvc.tools.example import example_adapters
from statesvc.tools.processes import BIN, Computed, Gateway, StateSvc, alive, loopback, wait_for

console = Console(highlight=False, soft_wrap=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# the names the example's adapters are served under, in `example_adapters` order (a dense
# family's attn-qv-r8, attn-all-r4, mlp-only-r16, all-r32-rslora, all-r2; a MoE's on attention)
ROLES = ("support-bot", "translator", "sql-writer", "coder", "summarizer")
SLOTS = 3  # fewer than the adapters: the mixed batch needs evictions
# short enough for every family's template within the replicas' --max-len 64 (Qwen2.5's and
# Granite's default system turns are not: the system message replaces them)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is LoRA?"}]


class Demo:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.control, self.publish = loopback(), loopback()
        # statesvc's key dir (operators/, replicas/) and the replicas' (operators/, clients/)
        self.keys, self.replica_keys, self.mine = (root / "keys", root / "replica-keys",
                                                   root / "client-keys")
        for server in (self.keys, self.replica_keys):
            init_server_keys(server)
        public, self.operator = new_client_keys(self.mine, "admin")
        for server in (self.keys, self.replica_keys):
            (server / "operators" / public.name).write_bytes(public.read_bytes())
        self.procs: dict[str, StateSvc | Computed | Gateway] = {}
        self.extra_pids: list[int] = []  # processes the drill restarted
        self.env = {**os.environ, "COLUMNS": str(max(console.width, 120))}

    def start(self, name: str, service: StateSvc | Computed | Gateway) -> str:
        self.procs[name] = service.start()
        console.print(f"[dim]{name}: pid {service.pid}, {service.ready}[/]")
        return service.ready

    def start_statesvc(self) -> StateSvc:
        svc = StateSvc(self.root / "data", self.control, self.publish,
                       extra_args=("--auth", str(self.keys)), log_file=self.root / "statesvc.log")
        self.start("statesvc", svc)
        return svc

    def start_replica(self, name: str, model: str, svc: StateSvc) -> str:
        public, secret = new_client_keys(self.mine, name)
        (self.keys / "replicas" / public.name).write_bytes(public.read_bytes())
        ready = self.start(name, Computed(
            Path(model), svc, self.root / name, replica_id=name, log_file=self.root / f"{name}.log",
            extra_args=("--max-batch", "8", "--max-len", "64", "--key", str(secret),
                        "--server-key", str(self.keys / "server.key"),
                        "--auth", str(self.replica_keys))))
        return ready.split("listen=")[1].split()[0]

    def replica_client_keys(self) -> ClientKeys:
        """The operator's key toward the replicas' listen sockets."""
        keys = client_keys(str(self.operator), str(self.replica_keys / "server.key"))
        assert keys is not None
        return keys

    def start_gateway(self, model: str, svc: StateSvc) -> str:
        """The OpenAI-compatible gateway, with its own key: reads on statesvc (its
        replicas/), generate on the replicas (their clients/)."""
        public, secret = new_client_keys(self.mine, "gateway")
        for server, role in ((self.keys, "replicas"), (self.replica_keys, "clients")):
            (server / role / public.name).write_bytes(public.read_bytes())
        gw = Gateway(Path(model), svc, log_file=self.root / "gateway.log", extra_args=(
            "--key", str(secret), "--server-key", str(self.keys / "server.key"),
            "--replica-server-key", str(self.replica_keys / "server.key")))
        self.start("gateway", gw)
        return gw.url

    def loractl(self, *args: str, show: bool = True, expect_fail: bool = False) -> str:
        shown = [a if not a.startswith(str(self.root)) else "…" + a[len(str(self.root)):]
                 for a in args]
        console.print(f"[bold cyan]$ loractl {shlex.join(shown)}[/]")
        res = subprocess.run([str(BIN / "loractl"), "--state", self.control, "--key",
                              str(self.operator), "--server-key", str(self.keys / "server.key"),
                              *args],
                             capture_output=True, text=True, timeout=300, env=self.env)
        if show:
            sys.stdout.write(res.stdout)
        if res.stderr and (show or res.returncode):
            console.print(f"[yellow]{res.stderr.rstrip()}[/]")
        if (res.returncode != 0) != expect_fail:
            raise SystemExit(f"demo failed: loractl {' '.join(args)} exited {res.returncode}")
        return res.stdout

    def stop_all(self) -> list[int]:
        for service in reversed(list(self.procs.values())):
            service.stop()
        for pid in self.extra_pids:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        pids = [s.pid for s in self.procs.values()] + self.extra_pids
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        return [p for p in pids if alive(p)]


def replica_batch(address: str, adapters: list[str | None],
                keys: ClientKeys) -> dict[str | None, Any]:
    """Send one request per adapter at once (one decode batch), and gather the replies."""
    return ask(address, [(a, GENERATE, generate_args(PROMPT, adapter=a, max_new_tokens=8))
                         for a in adapters], keys)


def replica_status(address: str, keys: ClientKeys) -> Any:
    return ask(address, [(None, STATUS, {})], keys)[None]["result"]


def ask(address: str, requests: list[tuple[str | None, str, Any]],
        keys: ClientKeys) -> dict[str | None, Any]:
    """Send every (label, command, args) at once on one socket; the replies by label."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys.apply(sock)
    sock.connect(address)
    try:
        ids = {}
        for label, cmd, args in requests:
            rid = uuid.uuid4().hex
            ids[rid] = label
            sock.send(encode_request(rid, cmd, args))
        out: dict[str | None, Any] = {}
        while len(out) < len(ids):
            if not sock.poll(120_000):
                raise SystemExit("demo failed: the replica did not answer")
            reply = msgpack.unpackb(sock.recv())
            out[ids[reply["id"]]] = reply
        return out
    finally:
        sock.close(0)


def gateway_batch(url: str, models: list[str]) -> dict[str, tuple[str, float, int]]:
    """One request per model at once through the gateway with the official `openai` client
    (so they share one decode batch), the first streamed: model -> (text, ms, chunks)."""
    import openai  # the demo's client, as an application's would be
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def one(i: int, model: str) -> tuple[str, float, int]:
        t = time.perf_counter()
        args: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
        if i == 0:
            chunks = list(client.completions.create(stream=True, **args))
            text = "".join(c.choices[0].text for c in chunks)
            return text, (time.perf_counter() - t) * 1e3, len(chunks)
        text = client.completions.create(**args).choices[0].text
        return text, (time.perf_counter() - t) * 1e3, 0

    with ThreadPoolExecutor(len(models)) as pool:
        return dict(zip(models, pool.map(one, range(len(models)), models)))


def gateway_chat(url: str, model: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    """One chat completion through the gateway: (the answer, usage.prompt_tokens)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    res = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=8, temperature=0)
    assert res.usage is not None
    return res.choices[0].message.content or "", res.usage.prompt_tokens


def prefix_turns(address: str, keys: ClientKeys) -> tuple[str, bool]:
    """Two turns on one adapter sharing a 48-token system prompt, one after the other: the
    second's system prompt comes from the replica's prefix cache (docs/prefix-cache.md)."""
    system = [3 + (7 * i) % 200 for i in range(48)]
    before = replica_status(address, keys)["prefix_cache"]
    for turn in ([11, 12, 13], [21, 22, 23]):
        ask(address, [("support-bot", GENERATE, generate_args(system + turn, adapter="support-bot",
                                                              max_new_tokens=4))], keys)
    after = replica_status(address, keys)["prefix_cache"]
    hit = after["hit_tokens"] - before["hit_tokens"]
    console.print(f"replica-1 prefix cache: two turns on support-bot sharing a {len(system)}-token system "
                  f"prompt; the second took {hit} of its {len(system) + 3} prompt tokens from the cache "
                  f"({after['used_blocks']} of {after['capacity_blocks']} blocks held)")
    return f"prefix cache: the second turn reused {hit} tokens of the shared system prompt", hit >= len(system)


def run(root: Path, family: str = "llama") -> None:
    t0 = time.perf_counter()
    demo = Demo(root)
    console.print(Rule(f"1. example {family} model and adapters (generated here, nothing "
                       "downloaded)"))
    assets = json.loads(demo.loractl("make-example", str(root / "example"), "--family", family,
                                     "--json", show=False))
    dirs: dict[str, str] = assets["adapters"]
    adapters = dict(zip(ROLES, (a.name for a in example_adapters(family)), strict=True))
    cfg = json.loads((Path(assets["model"]) / "config.json").read_text())
    tied = "tied" if cfg["tie_word_embeddings"] else "untied"
    console.print(f"{cfg['architectures'][0]} checkpoint (GQA, {tied}, with {family}'s tokenizer "
                  f"and chat template) and PEFT adapters {', '.join(dirs)}")
    report: list[tuple[str, bool]] = []
    try:
        console.print(Rule("2. statesvc and two replicas on loopback, every socket with --auth"))
        svc = demo.start_statesvc()
        r1 = demo.start_replica("replica-1", assets["model"], svc)
        demo.start_replica("replica-2", assets["model"], svc)
        console.print(Rule(f"3. configure {SLOTS} slots per replica, register "
                           f"{len(adapters)} adapters"))
        demo.loractl("pool", "init", "--model", assets["model"], "--max-loras", str(SLOTS),
                     "--max-rank", "32", "--targets", "all")
        for name, adapter in adapters.items():
            demo.loractl("load", name, dirs[adapter])
        head = json.loads(demo.loractl("status", "--json", show=False))["head_seq"]
        console.print(Rule(f"4. one batch mixing the base model and all {len(adapters)} "
                           f"adapters on {SLOTS} slots"))
        # min_seq: the replica answers once it has applied our last load
        replica_key = ("--replica-server-key", str(demo.replica_keys / "server.key"))
        # the replica answers once it has compiled too (seconds per prefill bucket and window:
        # longer on a busy machine, and for a family with sliding windows)
        demo.loractl("--timeout", "240", "generate", "--replica", r1, *replica_key,
                     "--adapter", "support-bot", "--input-ids", ",".join(map(str, PROMPT)),
                     "--min-seq", str(head))
        replies = replica_batch(r1, [None, *adapters], demo.replica_client_keys())
        table = Table(title=f"prompt {PROMPT}, greedy, 8 new tokens, all in one batch")
        for col in ("adapter", "version", "output_ids", "total ms"):
            table.add_column(col)
        for label, reply in replies.items():
            res = reply["result"]
            table.add_row(label or "(base model)",
                          str(res["adapter"]["version"]) if res["adapter"] else "",
                          " ".join(map(str, res["output_ids"])),
                          f"{res['timings']['total_ms']:.0f}")
        console.print(table)
        distinct = len({tuple(r["result"]["output_ids"]) for r in replies.values()})
        report.append((f"mixed batch: {distinct} different outputs from {len(replies)} requests",
                       distinct == len(replies)))
        res = replica_status(r1, demo.replica_client_keys())["residency"]
        console.print(f"replica-1 residency: {res['resident']} of {res['slots']} slots held, "
                      f"{res['hits']} hits, {res['misses']} misses, {res['evictions']} evictions; "
                      f"host tier {res['host_entries']} entries, {res['host_bytes']} bytes")
        report.append((f"{len(adapters)} adapters served on {SLOTS} slots: "
                       f"{res['evictions']} evictions", res["evictions"] >= len(adapters) - SLOTS
                       and res["resident"] <= SLOTS))
        report.append(prefix_turns(r1, demo.replica_client_keys()))
        console.print(Rule("5. the same batch through the OpenAI-compatible gateway"))
        url = demo.start_gateway(assets["model"], svc)
        base = Path(assets["model"]).name
        wait_for(lambda: len(httpx.get(url + "/v1/models").json()["data"]) == 1 + len(adapters),
                 what="the gateway to list the adapters")
        console.print(f"through the gateway at {url} with the official openai client "
                      f"(model = {base} or an adapter's name), the first request streamed")
        texts = gateway_batch(url, [base, *adapters])
        table = Table(title=f"prompt {PROMPT}, greedy, 8 new tokens, all in one batch (random "
                      "weights: the text is noise, different per adapter)")
        for col in ("model", "text", "ms", "SSE chunks"):
            table.add_column(col)
        for model, (text, ms, chunks) in texts.items():
            table.add_row(model, repr(text), f"{ms:.0f}", str(chunks or ""))
        console.print(table)
        distinct = len({text for text, _, _ in texts.values()})
        report.append((f"mixed batch through the gateway: {distinct} different outputs from "
                       f"{len(texts)} requests", distinct == len(texts)))
        report.append(("the streamed request came as one chunk per token", texts[base][2] == 9))
        codec, chat = TextCodec.load(Path(assets["model"])), CHAT
        try:
            codec.render_chat(chat)
        except TemplateError as exc:  # Gemma 2's takes no system message
            console.print(f"{family}'s chat template refuses a system message ({exc}): the "
                          "chat goes without it", markup=False)
            chat = CHAT[1:]
        console.print(f"a chat through the gateway, rendered with {family}'s chat template:")
        console.print(repr(codec.render_chat(chat)), markup=False)
        answer, prompt_tokens = gateway_chat(url, "support-bot", chat)
        console.print(f"support-bot answers {answer!r} (random weights: noise)", markup=False)
        want = len(codec.encode_chat(chat))
        report.append((f"chat through the gateway in {family}'s template: {prompt_tokens} prompt "
                       f"tokens, the template's {want}", prompt_tokens == want))
        console.print(Rule("6. unload one; a request for it is refused"))
        demo.loractl("unload", "summarizer")
        head = json.loads(demo.loractl("status", "--json", show=False))["head_seq"]
        demo.loractl("generate", "--replica", r1, *replica_key, "--adapter", "summarizer",
                     "--input-ids", "1,2,3", "--min-seq", str(head), expect_fail=True)
        report.append(("request for an unloaded adapter refused with unknown_adapter", True))
        time.sleep(1.5)  # one heartbeat period, so the replicas have reported the head
        demo.loractl("status")
        demo.loractl("events")  # the audit trail: every event names the key that recorded it
        console.print(Rule("7. drill: kill replica-2, rebuild by replay, compare everything"))
        run_file = root / "replica-2" / runfile.RUN_FILE  # the operator's own record of it
        old_pid = runfile.read(run_file).pid
        drill = demo.loractl("drill", "--kill", "replica-2", "--run-file", str(run_file),
                             *replica_key, "--diffs", demo.publish)
        report.append(("drill: every replica agrees (digests and probes)",
                       "all agree" in drill))
        # the drill restarted replica-2 itself, and it wrote its new pid: stop it too
        new_pid = runfile.read(run_file).pid
        if new_pid != old_pid:
            demo.extra_pids.append(new_pid)
    finally:
        console.print(Rule("8. shutdown"))
        left = demo.stop_all()
    report.append(("clean shutdown: no process left", not left))
    console.print(Rule("report"))
    for what, ok in report:
        console.print(("[green]PASS[/] " if ok else "[bold red]FAIL[/] ") + what)
    console.print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    if not all(ok for _, ok in report):
        raise SystemExit("demo failed")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m statesvc.tools.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=EXAMPLE_CHOICES, default="llama",
                        help="the example model's family (default: llama)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loraplane-demo-") as tmp:
        run(Path(tmp), args.family)


if __name__ == "__main__":
    main()
