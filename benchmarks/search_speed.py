"""Wall time of `shardplan recommend` searches and of `shardplan --help` (issue 25's goal: every
single-count search within 1 s, `--max-gpus 512` within 3 s, `--max-gpus 65536` within 10 s with
no GPU count left unsearched, `--help` within 0.3 s, on this 2-core machine). Run from the
repository root:

    python benchmarks/search_speed.py            # median of 5 fresh processes per command
    python benchmarks/search_speed.py --runs 1   # a quick look
    python benchmarks/search_speed.py --compare-workers   # one process against the forked workers
    python benchmarks/search_speed.py --against ../old --only train   # this tree against another checkout

Each command runs as a whole process (`python -m shardplan ...`, no warm caches): the wall time
covers Python start-up, imports, loading, the search, the explanation and the top plans'
estimates. The package's bytecode is compiled first (`compileall`), as pip compiles an installed
package's: a shell with PYTHONDONTWRITEBYTECODE set would otherwise recompile every module on
every run (about 0.1 s here) and time that instead of shardplan. Prints a Markdown table for BENCHMARKS.md, and for each search a digest of its
results (the top plans with their objective values, the Pareto front, the counts), so that two
runs of the script on two versions of the code show whether the results changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time

# (name, arguments after `shardplan`, target wall seconds)
CASES: list[tuple[str, str, float]] = [
    ("serve llama-3.1-70b, --max-gpus 16 H100, fp8/int8/int4",
     "recommend llama-3.1-70b -H h100-sxm-80gb --max-gpus 16 --allow-quantization fp8,int8,int4 --json", 1.0),
    ("train llama-3.1-405b, 16,384 H100",
     "recommend llama-3.1-405b -H h100-sxm-80gb --workload training --gpus 16384 --seq-len 8192 "
     "--global-batch-size 2048 --json", 1.0),
    ("train deepseek-v3, 2,048 H800",
     "recommend deepseek-v3 -H h800-sxm-80gb --gpus 2048 --workload training --seq-len 4096 "
     "--global-batch-size 15360 --json", 1.0),
    ("serve llama-3.1-70b, 512 H100", "recommend llama-3.1-70b -H h100-sxm-80gb --gpus 512 --json", 1.0),
    ("serve llama-3.1-405b, 512 H100", "recommend llama-3.1-405b -H h100-sxm-80gb --gpus 512 --json", 1.0),
    ("serve deepseek-v3, 512 H100", "recommend deepseek-v3 -H h100-sxm-80gb --gpus 512 --json", 1.0),
    ("serve llama-3.1-70b, --max-gpus 512 H100",
     "recommend llama-3.1-70b -H h100-sxm-80gb --max-gpus 512 --json", 3.0),
    ("serve llama-3.1-70b, --max-gpus 65536 H100",
     "recommend llama-3.1-70b -H h100-sxm-80gb --max-gpus 65536 --json", 10.0),
    ("serve llama-3.1-70b at 10 req/s within p90 TTFT 1 s / TPOT 50 ms, --max-gpus 16 H100 (issue 23)",
     "recommend llama-3.1-70b -H h100-sxm-80gb --max-gpus 16 --request-rate 10 --max-ttft-ms 1000 --max-tpot-ms 50 "
     "--json", 2.0),
    ("shardplan --help", "--help", 0.3),
]


def _digest(d: dict) -> tuple[str, str]:
    """Short hashes of what the search returned: the ranked plans with their objective values and
    the Pareto front; and the counts (candidates, evaluated, feasible, rejected by reason)."""
    results = json.dumps([[e["plan"], e["objective_value"]] for e in d["top"]] + [d["pareto"]], sort_keys=True)
    counts = json.dumps([d["num_candidates"], d["num_evaluated"], d["num_feasible"], d["rejected"]], sort_keys=True)
    return hashlib.sha256(results.encode()).hexdigest()[:10], hashlib.sha256(counts.encode()).hexdigest()[:10]


def _run(args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[float, dict | None]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "shardplan", *args.split()], capture_output=True, text=True, env=env,
                         cwd=cwd)
    wall = time.perf_counter() - start
    if out.returncode not in (0, 3):  # 3: nothing fits (a result, not an error)
        raise SystemExit(f"shardplan {args} exited {out.returncode}: {out.stderr.strip()}")
    return wall, (json.loads(out.stdout) if "--json" in args else None)


def _compile_bytecode() -> None:
    """Write the package's __pycache__ as an install would (a no-op when it is already current)."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("shardplan")
    assert spec is not None and spec.submodule_search_locations, "shardplan is not importable"
    compileall.compile_dir(spec.submodule_search_locations[0], quiet=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command (the median is shown)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--compare-workers", action="store_true",
                        help="each search with SHARDPLAN_SEARCH_WORKERS=0 (one process) and as it is, runs "
                             "alternating, with both results digests (they must be equal)")
    parser.add_argument("--against", metavar="CHECKOUT", default=None,
                        help="another checkout of shardplan (e.g. a `git worktree` of an older commit): each command "
                             "runs from it and from this tree in turn, so that a host whose speed drifts slows both alike")
    opts = parser.parse_args()
    _compile_bytecode()
    if opts.compare_workers:
        return _compare_workers(opts)
    if opts.against:
        return _against(opts)
    print("| command | median wall s | min-max s | target s | met | search s | evaluated | costed "
          "| GPU counts unsearched | results digest | counts digest |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|---|---|")
    for name, args, target in CASES:
        if opts.only not in name:
            continue
        walls, d = [], None
        for _ in range(opts.runs):
            wall, d = _run(args)
            walls.append(wall)
        med = statistics.median(walls)
        met = "yes" if med <= target else "no"
        if d is None:
            print(f"| `shardplan {args}` | {med:.2f} | {min(walls):.2f}-{max(walls):.2f} | {target:g} | {met} "
                  "| | | | | | |")
            continue
        res, cnt = _digest(d)
        unsearched = d["search_budget"]["gpu_counts_not_searched"]
        left = f"{len(unsearched)} ({unsearched[0]:,}-{unsearched[-1]:,})" if unsearched else "none"
        print(f"| {name} | {med:.2f} | {min(walls):.2f}-{max(walls):.2f} | {target:g} | {met} "
              f"| {d['elapsed_seconds']:.2f} | {d['num_evaluated']:,} | {d['num_costed']:,} | {left} | {res} | {cnt} |",
              flush=True)
    return 0


def _compare_workers(opts: argparse.Namespace) -> int:
    """One process against the default workers (search/ahead.py), alternating runs so that the
    machine's drift falls on both alike; the digests show the answers are the same."""
    import os

    one = {**os.environ, "SHARDPLAN_SEARCH_WORKERS": "0"}
    default = {k: v for k, v in os.environ.items() if k != "SHARDPLAN_SEARCH_WORKERS"}
    print("| command | one process: median wall s | with workers: median wall s | speed-up | digests equal |")
    print("|---|---:|---:|---:|---|")
    for name, args, _ in CASES:
        if opts.only not in name or "--json" not in args:
            continue
        walls: dict[str, list[float]] = {"one": [], "default": []}
        digests: set[tuple[str, str]] = set()
        for _ in range(opts.runs):
            for key, env in (("one", one), ("default", default)):
                wall, d = _run(args, env)
                walls[key].append(wall)
                assert d is not None
                digests.add(_digest(d))
        a, b = statistics.median(walls["one"]), statistics.median(walls["default"])
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {'yes' if len(digests) == 1 else 'NO'} |", flush=True)
    return 0


def _against(opts: argparse.Namespace) -> int:
    """Each search from the other checkout (`--against`, put first on PYTHONPATH) and from this
    tree, alternating run by run; medians of wall and search seconds, and whether the results
    digests agree."""
    import compileall
    import os
    from pathlib import Path

    other = Path(opts.against).resolve()
    if not (other / "shardplan" / "__init__.py").is_file():
        raise SystemExit(f"--against {opts.against}: no shardplan package there")
    compileall.compile_dir(str(other / "shardplan"), quiet=1)
    here = Path(__file__).resolve().parent.parent
    trees = {"other": (other, {**os.environ, "PYTHONPATH": str(other), "PYTHONDONTWRITEBYTECODE": ""}),
             "this": (here, {**os.environ, "PYTHONDONTWRITEBYTECODE": ""})}
    print(f"| command | {other.name} wall s | this wall s | {other.name} search s | this search s | results digests equal |")
    print("|---|---:|---:|---:|---:|---|")
    for name, args, _ in CASES:
        if opts.only not in name or "--json" not in args:
            continue
        walls: dict[str, list[float]] = {k: [] for k in trees}
        searches: dict[str, list[float]] = {k: [] for k in trees}
        digests: dict[str, set[str]] = {k: set() for k in trees}
        for _ in range(opts.runs):
            for key, (cwd, env) in trees.items():
                wall, d = _run(args, env, str(cwd))
                assert d is not None
                walls[key].append(wall)
                searches[key].append(d["elapsed_seconds"])
                digests[key].add(_digest(d)[0])
        med = {k: (statistics.median(walls[k]), statistics.median(searches[k])) for k in trees}
        same = "yes" if digests["other"] == digests["this"] and len(digests["this"]) == 1 else "NO"
        print(f"| {name} | {med['other'][0]:.2f} | {med['this'][0]:.2f} | {med['other'][1]:.2f} | {med['this'][1]:.2f} "
              f"| {same} |", flush=True)
    return 0


if __name__ == "__main__":
    t = time.perf_counter()
    code = main()
    print(f"\ntotal {time.perf_counter() - t:.1f} s", file=sys.stderr)
    raise SystemExit(code)
