"""Wall time and peak memory of `shardplan replan` on large clusters and of `shardplan checkpoint`
on large or hostile indexes and headers: the commands QA found unbounded (replan of a 2-GPU plan
to 4,096, 65,536 and 2^24 GPUs, of a 4-GPU training plan to 2,048; a checkpoint index of 0.6 M
and 1.5 M weight_map entries; a header nested 100,000 levels deep). Each command runs as a fresh
process with a 60 s limit. Run from the repository root:

    python benchmarks/replan_scale.py
    python benchmarks/replan_scale.py --only replan

Prints a Markdown table for BENCHMARKS.md: wall seconds, peak RSS (MiB) and exit code per command
(124: killed at the limit).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT_SECONDS = 60


def _run(args: list[str], cwd: Path) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit code) of `python -m shardplan ARGS` (124 when killed at the limit)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shardplan", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = start + LIMIT_SECONDS
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            return time.perf_counter() - start, usage.ru_maxrss / 1024, 124
        time.sleep(0.05)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def _checkpoint(folder: Path, extra_entries: int = 0, edit_header=None) -> Path:
    """debug's tensors (fp32, zeros) in two safetensors files written by hand, and an index with
    `extra_entries` more weight_map entries over the same two files."""
    from shardplan.plan.placement import model_tensors
    from shardplan.specs.loading import load_model

    folder.mkdir(parents=True, exist_ok=True)
    tensors = model_tensors(load_model("debug").spec)
    weight_map = {}
    for i in range(2):
        rel = f"model-{i + 1:05d}-of-00002.safetensors"
        header, offset = {}, 0
        for t in tensors[i::2]:
            header[t.name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.numel * 4]}
            offset += t.numel * 4
            weight_map[t.name] = rel
        text = json.dumps(header)
        if edit_header is not None and i == 0:
            text = edit_header(text)
        (folder / rel).write_bytes(struct.pack("<Q", len(text)) + text.encode() + bytes(offset))
    files = sorted(set(weight_map.values()))
    weight_map.update({f"model.extra.{k}.weight": files[k % 2] for k in range(extra_entries)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


INDEX_ENTRIES = (600_000, 1_500_000)


def _prepare(work: Path) -> None:
    """The plans and checkpoints the commands read (in a process of its own: the one that measures
    the commands stays small, so a command's peak RSS is its own)."""
    for args in (["recommend", "debug", "--gpus", "2", "-o", "good.yaml"],
                 ["recommend", "debug", "--gpus", "4", "--workload", "training", "-o", "train.yaml"]):
        subprocess.run([sys.executable, "-m", "shardplan", *args], cwd=work, check=True, capture_output=True)
    for entries in INDEX_ENTRIES:
        _checkpoint(work / f"index-{entries}", entries)
    _checkpoint(work / "deep", edit_header=lambda h: h[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("replan", "checkpoint"), help="run one group of commands")
    parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.prepare is not None:
        _prepare(opts.prepare)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, __file__, "--prepare", str(work)], check=True)
        cases: list[tuple[str, list[str]]] = []
        if opts.only in (None, "replan"):
            cases += [(f"replan good.yaml --gpus {n}", ["replan", "good.yaml", "--gpus", str(n), "--json"])
                      for n in (4096, 65536, 16777216)]
            cases += [("replan train.yaml --gpus 2048", ["replan", "train.yaml", "--gpus", "2048", "--json"])]
        if opts.only in (None, "checkpoint"):
            for entries in INDEX_ENTRIES:
                folder = work / f"index-{entries}"
                size = (folder / "model.safetensors.index.json").stat().st_size / 2**20
                name = f"checkpoint, index of {entries:,} extra entries ({size:.0f} MiB; exit 2: not in any header)"
                cases.append((name, ["checkpoint", "good.yaml", str(folder), "--json"]))
            cases.append(("checkpoint, a header nested 100,000 levels (exit 2)",
                          ["checkpoint", "good.yaml", str(work / "deep")]))
        for name, args in cases:
            wall, rss, code = _run(args, work)
            rows.append(f"| {name} | {wall:.2f} | {rss:.0f} | {code} |")
    print("| command | wall (s) | peak RSS (MiB) | exit |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
