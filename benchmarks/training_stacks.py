"""Training per stack against published measurements (issue: training per stack): for every row
of shardplan/validation/corpus/training_stacks/<stack>.yaml with a complete `case:`, the
predicted peak memory (the caching allocator's reserved peak where the source printed reserved
or nvidia-smi memory, the allocated total where it printed torch.cuda.max_memory_allocated) and
tokens/s against what was measured. Prints a Markdown table per stack and the mean and max
|error|. Run from the repository root:

    python benchmarks/training_stacks.py

The rows are read and predicted by `shardplan.validation` (the code behind `shardplan validate`):
`shipped.training_row_case` turns a row into a case (a bundled model, or a `shape:` block for a
model shardplan does not bundle; measured throughput read as printed: tokens/s per GPU or for all
GPUs, samples/s, the time of one optimizer step, or the row's `inferred` value where the source
printed only TFLOP/s) and `predict.compare` predicts it. Rows without a complete case are listed.
"""

from __future__ import annotations

import statistics
import sys

from shardplan.errors import ShardplanError
from shardplan.specs.loading import read_structured
from shardplan.units import BYTES_PER_GIB
from shardplan.validation.predict import compare
from shardplan.validation.shipped import CORPUS_DIR, Skipped, training_row_case

DATA = CORPUS_DIR / "training_stacks"


def evaluate(stack: str, rows: list[dict]) -> tuple[list[tuple], list[str]]:
    """(id, measured GiB, predicted GiB, counter, measured tokens/s/GPU, predicted) per row with a
    case (None where the row has no such figure), and the rows left out with why."""
    out, skipped = [], []
    for r in rows:
        case = training_row_case(stack, r)
        if isinstance(case, Skipped):
            skipped.append(r["id"])
            continue
        try:
            got = {c.quantity: c for c in compare(case, CORPUS_DIR)}
        except (ShardplanError, ValueError) as e:
            skipped.append(f"{r['id']} ({e})")
            continue
        mem, tps = got.get("peak_memory"), got.get("tokens_per_second")
        out.append((r["id"], mem.measured / BYTES_PER_GIB if mem else None,
                    mem.predicted / BYTES_PER_GIB if mem else None, case.measured.memory_counter,
                    tps.measured if tps else None, tps.predicted if tps else None))
    return out, skipped


def main() -> int:
    for path in sorted(DATA.glob("*.yaml")):
        stack = path.stem
        rows, skipped = evaluate(stack, read_structured(path)["rows"])
        print(f"\n### {stack}\n\n| row | memory measured | predicted | error | tokens/s/GPU measured | predicted | error |")
        print("|---|---|---|---|---|---|---|")
        mem_err, tps_err = [], []
        for rid, mem, pmem, counter, tps, ptps in rows:
            me = f"{pmem / mem - 1:+.0%}" if mem else ""
            te = f"{ptps / tps - 1:+.0%}" if tps else ""
            if mem:
                mem_err.append(abs(pmem / mem - 1))
            if tps:
                tps_err.append(abs(ptps / tps - 1))
            print(f"| {rid} | {f'{mem:.1f} GiB ({counter})' if mem else ''} | {f'{pmem:.1f} GiB' if pmem else ''} | "
                  f"{me} | {f'{tps:,.0f}' if tps else ''} | {f'{ptps:,.0f}' if ptps else ''} | {te} |")
        for what, errs in (("memory", mem_err), ("tokens/s", tps_err)):
            if errs:
                print(f"\n{what}: {len(errs)} rows, mean |error| {statistics.mean(errs):.0%}, max {max(errs):.0%}, "
                      f"within 10%: {sum(e <= 0.10 for e in errs)}")
        if skipped:
            print(f"\nskipped ({len(skipped)}): " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
