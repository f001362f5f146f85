"""Per-case errors of the continuous-batching model against the published serving runs in
shardplan/validation/corpus/serving_load (issue 23): median TTFT, median TPOT and output throughput, predicted over
measured, for every run the model can be asked about. Run from the repository root:

    python benchmarks/serving_load_errors.py            # the Markdown table for BENCHMARKS.md

Rows the model is not asked about (flags it does not model, an unstated version, a deployment that
does not start as shardplan sizes it) are listed at the end with the reason. The same mapping from a
published row to shardplan's inputs is the golden test's (tests/golden/serving_load_cases.py).
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "golden"))

import serving_load_cases as S  # noqa: E402


def main() -> None:
    rows = []
    skipped = [(s.id, s.reason) for s in S.skipped()]
    for c in S.cases():
        try:
            r = S.predict(c)
        except S.NotModelled as e:
            skipped.append((c.id, str(e)))
            continue
        m = c.measured
        e = S.errors(c, r)
        load = "rate inf" if c.max_concurrency is None else f"c={c.max_concurrency}"
        rows.append((c, m, r, e, load))
    print("| run | engine | GPUs | load | median TTFT ms (pred / meas) | median TPOT ms | median ITL ms | output tok/s "
          "| err TTFT | err TPOT | err ITL | err tok/s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, m, r, e, load in rows:
        print(f"| {c.id} | {c.engine} {c.engine_version} | {c.tp}x {c.hardware} | {load} | "
              f"{r.ttft_seconds.p50 * 1e3:,.1f} / {m.median_ttft_ms:,.1f} | {r.tpot_seconds.p50 * 1e3:,.1f} / "
              f"{m.median_tpot_ms or math.nan:,.1f} | "
              f"{(r.itl_seconds.p50 * 1e3) if r.itl_seconds is not None else math.nan:,.1f} / {m.median_itl_ms or math.nan:,.1f} | "
              f"{r.output_tokens_per_second:,.0f} / {m.output_tokens_per_second:,.0f} | "
              f"{e['median_ttft']:+.0%} | {e['median_tpot']:+.0%} | {e['median_itl']:+.0%} | {e['output_throughput']:+.0%} |")
    print()
    for label, keep in (("at most 16 in flight", lambda c: c.max_concurrency is not None and c.max_concurrency <= 16),
                        ("saturation (more in flight, or rate inf)", lambda c: not (c.max_concurrency is not None
                                                                                   and c.max_concurrency <= 16))):
        sel = [x for x in rows if keep(x[0])]
        parts = []
        for k, name, tol in (("median_ttft", "TTFT", 0.20), ("median_tpot", "TPOT", 0.20), ("median_itl", "ITL", 0.20),
                             ("output_throughput", "output tok/s", 0.15)):
            v = [abs(x[3][k]) for x in sel if x[3][k] == x[3][k]]
            if v:
                within = sum(1 for a in v if a <= tol)
                parts.append(f"{name}: median |error| {statistics.median(v):.0%}, {within}/{len(v)} within {tol:.0%}")
        print(f"- {label}, {len(sel)} runs: " + "; ".join(parts))
    print()
    print(f"Not asked ({len(skipped)}): " + "; ".join(f"{i} ({why})" for i, why in skipped))


if __name__ == "__main__":
    main()
