"""`make demo`: the main job end to end on the embedded defaults.

A generated example model and adapters, statesvc on a temporary data dir and
free loopback ports, the pool configured, adapters loaded, retried, replaced
and unloaded through loractl, the log shown, and a restart that proves the
state survives it. Every process started here is stopped here.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.rule import Rule

from shared.processes import loopback, start_ready, stop_pid

BIN = Path(sys.executable).parent
console = Console(highlight=False, soft_wrap=True)


class Demo:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.control, self.publish = loopback(), loopback()
        self.data_dir = root / "data"
        self.proc: subprocess.Popen[Any] | None = None

    def start_statesvc(self) -> None:
        self.proc, ready = start_ready(
            [str(BIN / "statesvc"), "serve", "--data-dir", str(self.data_dir), "--control",
             self.control, "--publish", self.publish], log=self.root / "statesvc.log")
        console.print(f"[dim]statesvc pid {self.proc.pid}: {ready}[/]")

    def stop_statesvc(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)
            console.print(f"[dim]statesvc pid {self.proc.pid} stopped "
                          f"(exit {self.proc.returncode})[/]")
            self.proc = None

    def loractl(self, *args: str, show: bool = True, expect_fail: bool = False) -> str:
        argv = [str(BIN / "loractl"), "--state", self.control, *args]
        console.print(f"[bold cyan]$ loractl {shlex.join(args)}[/]")
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": str(max(console.width, 120))})
        if show:
            sys.stdout.write(res.stdout)
        if res.stderr:
            console.print(f"[yellow]{res.stderr.rstrip()}[/]")
        if (res.returncode != 0) != expect_fail:
            raise SystemExit(f"demo failed: loractl {' '.join(args)} exited {res.returncode}")
        return res.stdout


def run(root: Path) -> None:
    t0 = time.perf_counter()
    demo = Demo(root)
    console.print(Rule("1. example model and adapters (generated locally, nothing downloaded)"))
    assets = json.loads(demo.loractl("make-example", str(root / "example"), "--json",
                                     show=False))
    adapters: dict[str, str] = assets["adapters"]
    console.print(f"model {assets['model']}; adapters {', '.join(adapters)}")
    try:
        console.print(Rule("2. statesvc on a temporary data dir"))
        demo.start_statesvc()
        console.print(Rule("3. configure the pool (genesis event)"))
        demo.loractl("pool", "init", "--model", assets["model"], "--max-loras", "4",
                     "--max-rank", "16", "--targets", "all")
        console.print(Rule("4. load, retry, replace, refuse, unload"))
        demo.loractl("load", "support-bot", adapters["attn-qv-r8"])
        demo.loractl("load", "sql-writer", adapters["mlp-only-r16"], "--pin")
        demo.loractl("load", "summarizer", adapters["all-r2"])
        demo.loractl("load", "support-bot", adapters["attn-qv-r8"])  # same content: no event
        demo.loractl("load", "support-bot", adapters["attn-all-r4"], expect_fail=True)
        demo.loractl("load", "support-bot", adapters["attn-all-r4"], "--replace")
        demo.loractl("load", "big", adapters["all-r32-rslora"], expect_fail=True)
        demo.loractl("unload", "summarizer")
        demo.loractl("list")
        console.print(Rule("5. the log"))
        demo.loractl("events")
        before = json.loads(demo.loractl("status", "--json", show=False))
        console.print(Rule("6. restart: the log is the state"))
        demo.stop_statesvc()
        demo.start_statesvc()
        after = json.loads(demo.loractl("status", "--json", show=False))
        same = (before["head_seq"], before["digest"]) == (after["head_seq"], after["digest"])
        console.print(f"before restart: head {before['head_seq']} digest "
                      f"{before['digest'][:16]}; after: head {after['head_seq']} digest "
                      f"{after['digest'][:16]} -> "
                      + ("[green]identical[/]" if same else "[bold red]DIFFERENT[/]"))
        if not same:
            raise SystemExit("demo failed: the state changed across a restart")
    finally:
        demo.stop_statesvc()
    console.print(Rule("done"))
    console.print(f"demo finished in {time.perf_counter() - t0:.1f} s; no process left running")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="loraplane-demo-") as tmp:
        run(Path(tmp))


if __name__ == "__main__":
    main()
