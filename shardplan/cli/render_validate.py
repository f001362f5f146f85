"""`shardplan validate`: the error table per group and quantity, then (optionally) every case."""

from __future__ import annotations

from shardplan import units
from shardplan.cli.render_common import console, fitted_table
from shardplan.tasks.validate import ValidateResult

QUANTITY_NAMES = {"kv_capacity": "KV capacity", "peak_memory": "peak memory", "tokens_per_second": "tokens/s",
                  "start_verdict": "start/refuse", "ttft_p50": "median TTFT", "tpot_p50": "median TPOT", "itl_p50": "median ITL",
                  "output_tokens_per_second": "output tokens/s", "layout_speed_ratio": "tokens/s, one layout / another"}


def _versions(v: list[str]) -> str:
    if not v:
        return ""
    return v[0] if len(v) == 1 else f"{v[0]}-{v[-1]}"


def validate_report(r: ValidateResult, *, cases_table: bool) -> None:
    cols = [("group", "left", 0), ("versions", "left", 3), ("quantity", "left", 0), ("cases", "right", 0),
            ("mean", "right", 1), ("median", "right", 2), (f"p{r.band_percentile} (band)", "right", 0),
            ("max", "right", 1), ("leans", "right", 2), ("worst case", "left", 4)]
    rows = []
    for g in r.groups:
        verdict = g.quantity == "start_verdict"
        if verdict:
            wrong = round(g.mean_abs_error * g.num_cases)
            stats = ["", "", f"{wrong} wrong", "", ""]
        else:
            stats = [f"{g.mean_abs_error:.1%}", f"{g.median_abs_error:.1%}", f"±{g.band_abs_error:.1%}",
                     f"{g.max_abs_error:.1%}", f"{g.mean_signed_error:+.1%}"]
        worst = f"{g.worst_case_id} ({g.worst_error:+.0%})" if not verdict and g.max_abs_error > 0 else ""
        rows.append([g.group, _versions(g.versions), QUANTITY_NAMES[g.quantity], str(g.num_cases), *stats, worst])
    console.print(fitted_table(
        f"shardplan against {r.num_cases} measured cases ({r.corpus}): |predicted / measured - 1|", cols, rows,
        caption="leans: the mean signed error (above 0: the prediction above the measurement, optimistic for "
                "capacities and throughputs, pessimistic for latencies); --json has each worst case's source"))
    if cases_table:
        ccols = [("case", "left", 0), ("group", "left", 2), ("quantity", "left", 1), ("measured", "right", 0),
                 ("predicted", "right", 0), ("error", "right", 0)]
        crows = [[c.case_id, c.group, QUANTITY_NAMES[c.quantity], _fmt(c.measured, c.quantity),
                  _fmt(c.predicted, c.quantity), f"{c.error:+.1%}" if c.quantity != "start_verdict"
                  else ("right" if c.error == 0 else "wrong")] for c in r.cases]
        console.print(fitted_table("every case", ccols, crows))
    if r.skipped:
        console.print(f"{len(r.skipped)} shipped rows have no complete case and are not counted "
                      "(--json lists each with the reason)")


def _fmt(value: float, quantity: str) -> str:
    if quantity == "peak_memory":
        return f"{value / units.BYTES_PER_GIB:.2f} GiB"
    if quantity == "start_verdict":
        return "started" if value else "refused"
    if quantity in ("ttft_p50", "tpot_p50", "itl_p50"):
        return f"{value * 1e3:,.1f} ms"
    return f"{value:,.0f}"
