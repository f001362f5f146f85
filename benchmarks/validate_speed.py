"""Wall time of `shardplan validate` over the shipped corpus (issue 29's goal: the table in under
5 s on this 2-core machine), whole process, median of 5 fresh processes. Run from the repository
root:

    python benchmarks/validate_speed.py

Prints a Markdown row for BENCHMARKS.md with the number of cases predicted.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

RUNS = 5


def main() -> int:
    times, cases = [], 0
    for _ in range(RUNS):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "shardplan", "validate", "--json"], check=True,
                             capture_output=True, text=True).stdout
        times.append(time.perf_counter() - start)
        cases = json.loads(out)["num_cases"]
    print("| command | cases | median wall (s) | min | max |\n|---|---|---|---|---|")
    print(f"| shardplan validate --json | {cases} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
