"""`make up`: statesvc and one replica on the example model, in the foreground.

Uses the defaults (./var, tcp://127.0.0.1:7100/7101, replica on :7200) so
`loractl` and `loractl generate --replica tcp://127.0.0.1:7200` work without
flags. Ctrl-C (or SIGTERM) stops both, replica first.
"""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from shared.config import DEFAULT_REPLICA_LISTEN
from shared.fleet import BIN, start_ready, stop_pid

VAR = Path("var")


def main() -> None:
    example = VAR / "example"
    if not (example / "model" / "config.json").exists():
        subprocess.run([str(BIN / "loractl"), "make-example", str(example)], check=True)
    VAR.mkdir(exist_ok=True)
    procs: list[subprocess.Popen[Any]] = []
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        proc, ready = start_ready([str(BIN / "statesvc"), "serve"], log=VAR / "statesvc.log")
        procs.append(proc)
        print(f"statesvc  pid {proc.pid}: {ready} (log var/statesvc.log)")
        proc, ready = start_ready([str(BIN / "computed"), "serve", "--model",
                                   str(example / "model"), "--replica-id", "replica-1"],
                                  log=VAR / "replica-1.log")
        procs.append(proc)
        print(f"computed  pid {proc.pid}: {ready} (log var/replica-1.log)")
        print(f"""
Try, in another terminal:
  .venv/bin/loractl pool init --model {example}/model --max-loras 8 --max-rank 32 --targets all
  .venv/bin/loractl load chat {example}/adapters/attn-qv-r8
  .venv/bin/loractl generate --replica {DEFAULT_REPLICA_LISTEN} --adapter chat --input-ids 1,2,3
  .venv/bin/loractl status
Ctrl-C stops both.""", flush=True)
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        for p in procs:
            if p.poll() is not None:
                print(f"pid {p.pid} exited with {p.returncode}; stopping the rest")
    finally:
        for p in reversed(procs):
            stop_pid(p)
        print("stopped")


if __name__ == "__main__":
    main()
