"""`make up`: statesvc, one replica and the OpenAI-compatible gateway on the example model,
in the foreground.

Uses the defaults (./var, tcp://127.0.0.1:7100/7101, replica on :7200, gateway on
http://127.0.0.1:8000) so `loractl`, `loractl generate --replica tcp://127.0.0.1:7200` and
an OpenAI client on http://127.0.0.1:8000/v1 work without flags. Ctrl-C (or SIGTERM) stops
them all, gateway first.
"""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from shared.config import DEFAULT_CONTROL, DEFAULT_PUBLISH, DEFAULT_REPLICA_LISTEN
from statesvc.tools.processes import BIN, Computed, Gateway, StateSvc

VAR = Path("var")


def main() -> None:
    example = VAR / "example"
    # none yet, or one written before the example had a tokenizer
    if not (example / "model" / "tokenizer.json").exists():
        subprocess.run([str(BIN / "loractl"), "make-example", str(example)], check=True)
    VAR.mkdir(exist_ok=True)
    procs: list[StateSvc | Computed | Gateway] = []
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        svc = StateSvc(VAR, DEFAULT_CONTROL, DEFAULT_PUBLISH, log_file=VAR / "statesvc.log")
        procs.append(svc.start())
        print(f"statesvc  pid {svc.pid}: {svc.ready} (log var/statesvc.log)")
        replica = Computed(example / "model", svc, VAR / "replicas" / "replica-1",
                           DEFAULT_REPLICA_LISTEN, "replica-1", log_file=VAR / "replica-1.log")
        procs.append(replica.start())
        print(f"computed  pid {replica.pid}: {replica.ready} (log var/replica-1.log)")
        gateway = Gateway(example / "model", svc, log_file=VAR / "gateway.log", port=8000)
        procs.append(gateway.start())
        print(f"gateway   pid {gateway.pid}: {gateway.ready} (log var/gateway.log)")
        print(f"""
Try, in another terminal:
  .venv/bin/loractl pool init --model {example}/model --max-loras 8 --max-rank 32 --targets all
  .venv/bin/loractl load chat {example}/adapters/attn-qv-r8
  .venv/bin/loractl generate --replica {DEFAULT_REPLICA_LISTEN} --adapter chat --input-ids 1,2,3
  .venv/bin/loractl status
  curl -s {gateway.url}/v1/completions -H 'content-type: application/json' \\
    -d '{{"model": "chat", "prompt": "Hello", "max_tokens": 8, "temperature": 0}}'
Ctrl-C stops them all.""", flush=True)
        while not stopping and all(p.running for p in procs):
            time.sleep(0.2)
        for p in procs:
            if not p.running:
                print(f"pid {p.pid} exited; stopping the rest")
    finally:
        for p in reversed(procs):
            p.stop()
        print("stopped")


if __name__ == "__main__":
    main()
