"""lm-eval's `simple_evaluate`, the function its CLI's `lm_eval --model M --model_args A --tasks T`
calls, for several models in one process: one import of lm-eval, torch and transformers instead of
one per model, and a TaskManager over the test's own task YAML only (`include_defaults=False`;
the CLI always indexes lm-eval's 14k built-in YAML files first, most of a small run's time). The
models, their argument strings, seeds and batch size are the CLI's.

    python -m tests.integration.lm_eval_runner JOBS.json

JOBS.json: {"tasks": DIR, "names": [TASK, ...], "jobs": [{"model", "model_args", "out"}, ...]};
each job writes {"results": {TASK: metrics}, "samples": {TASK: [filtered_resps by doc_id]}} to its
"out" file."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    spec = json.loads(Path(spec_path).read_text())
    tasks = TaskManager(include_path=spec["tasks"], include_defaults=False)
    for job in spec["jobs"]:
        res = simple_evaluate(model=job["model"], model_args=job["model_args"], tasks=spec["names"],
                              batch_size=1, device="cpu", log_samples=True, task_manager=tasks,
                              random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                              fewshot_random_seed=0)
        assert res is not None, job
        samples = {task: [r["filtered_resps"] for r in sorted(rows, key=lambda r: r["doc_id"])]
                   for task, rows in res["samples"].items()}
        Path(job["out"]).write_text(json.dumps({"results": res["results"], "samples": samples},
                                               default=str))


if __name__ == "__main__":
    main(sys.argv[1])
