"""Wall time of three `shardplan recommend` searches (issue 5's speed goal: each within 2 s on
one core). Run from the repository root:

    taskset -c 0 python benchmarks/search_speed.py

Each case runs in a fresh process (no warm caches), through the same `recommend()` the CLI
calls, and the wall time covers loading, the search, the explanation and the top plans'
estimates. Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CASES = [
    (
        "serving llama-3.1-70b, up to 16 H100, all dtypes and batch sizes",
        "recommend llama-3.1-70b -H h100-sxm-80gb --max-gpus 16 --max-model-len 8192 "
        "--allow-quantization fp8,int8,int4 --json",
    ),
    (
        "training llama-3.1-405b, 16,384 H100, seq 8192, full space",
        "recommend llama-3.1-405b -H h100-sxm-80gb --gpus 16384 --workload training --seq-len 8192 "
        "--global-batch-size 2048 --stack megatron --json",
    ),
    (
        "training deepseek-v3, 2,048 H800, expert parallelism",
        "recommend deepseek-v3 -H h800-sxm-80gb --gpus 2048 --workload training --seq-len 4096 "
        "--global-batch-size 15360 --stack megatron --json",
    ),
]

_RUN = """
import json, sys, time
start = time.perf_counter()
from shardplan.cli import app
from typer.testing import CliRunner
r = CliRunner().invoke(app, sys.argv[1].split())
wall = time.perf_counter() - start
d = json.loads(r.stdout)
d["_wall"] = wall
print(json.dumps({k: d[k] for k in ("_wall", "elapsed_seconds", "num_evaluated", "num_costed", "num_feasible", "why")}))
"""


def main() -> None:
    print("| case | layouts evaluated | costed in full | search s | wall s (process) | layouts/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, cmd in CASES:
        out = subprocess.run([sys.executable, "-c", _RUN, cmd], capture_output=True, text=True, check=True)
        d = json.loads(out.stdout)
        rate = d["num_evaluated"] / d["elapsed_seconds"]
        print(f"| {name} | {d['num_evaluated']:,} | {d['num_costed']:,} | {d['elapsed_seconds']:.2f} | {d['_wall']:.2f} | {rate:,.0f} |")
        print(f"<!-- {d['why']} -->", file=sys.stderr)


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"\ntotal {time.perf_counter() - t:.1f} s", file=sys.stderr)
