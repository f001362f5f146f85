"""`shardplan watch`: one scrape as tables (per GPU, per serving replica), or one JSON line.
Every string a page supplied is already escaped by the task (`tasks.watch.safe_text`); cells
are escaped again for rich markup, so a label such as `[red]` prints as written."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.text import Text

from shardplan.cli.render_common import fitted_table, fmt_seconds
from shardplan.tasks.watch import Percentiles, PlanPercentiles, WatchScrape

_VERDICT = {"within": "ok", "outside": "OUTSIDE", "not judged": "-"}


def json_line(obj: Any) -> None:
    """One scrape as one line of JSON on stdout (JSON lines), flushed so a pipe sees it now."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _pct(x: float | None, signed: bool = False) -> str:
    return "-" if x is None else (f"{x:+.1%}" if signed else f"{x:.1%}")


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:,.2f} GB/s"


def _tokens(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _pcts(p: Percentiles | None, predicted: float | None, plan: PlanPercentiles | None = None,
          rate: float | None = None, started: bool = False) -> str:
    if p is None:
        return "-"
    def one(v: float | None) -> str:
        if v is None:
            return "-"
        open_ended = p.above_highest_bucket > 0 and v == p.highest_bucket_seconds  # in the +Inf bucket: a lower bound
        return ("≥" if open_ended else "") + fmt_seconds(v)

    q = "/".join(one(v) for v in (p.p50_seconds, p.p90_seconds, p.p99_seconds))
    if started and p.observations_per_second is not None:  # TTFT: its count is the requests started
        q += f" at {p.observations_per_second:,.2f} req/s"
    if plan is not None:
        at = "" if rate is None else f" at {rate:,.2f} req/s"
        return q + f" (plan {'/'.join(fmt_seconds(v) for v in (plan.p50_seconds, plan.p90_seconds, plan.p99_seconds))}{at})"
    return q + ("" if predicted is None else f" (plan {fmt_seconds(predicted)})")


def _cells(row: list[str]) -> list[str]:
    return [escape(c) for c in row]


def watch_view(r: WatchScrape) -> RenderableType:
    """The scrape as a group of tables; what `--json` prints is `r.model_dump(mode="json")`."""
    parts: list[RenderableType] = []
    when = "first scrape" if r.interval_seconds is None else f"{r.interval_seconds:.1f} s after the last"
    head = Text(f"shardplan watch {r.plan} — scrape {r.scrape_index + 1} ({when}): ", no_wrap=False)
    head.append({"ok": "everything judged is within its band", "outside": "a figure is outside its band or the SLA",
                 "unreadable": "an endpoint could not be read"}[r.status],
                style={"ok": "green", "outside": "red", "unreadable": "red"}[r.status])
    parts.append(head)
    if r.gpus:
        cols = [("rank", "right", 0), ("node", "right", 3), ("gpu", "right", 2), ("host", "left", 4),
                ("memory", "right", 0), ("predicted", "right", 0), ("error", "right", 1), ("", "left", 0),
                ("NVLink", "right", 5), ("PCIe tx", "right", 5)]
        rows = [_cells([("-" if g.rank is None else str(g.rank)), "-" if g.node is None else str(g.node), g.gpu,
                        g.host or "-", _gib(g.memory_used_bytes),
                        "-" if g.memory_predicted_bytes is None else
                        f"{_gib(g.memory_predicted_bytes)} ±{_pct(g.memory_band_abs_error)}",
                        _pct(g.memory_error, signed=True), _VERDICT[g.memory_verdict],
                        _rate(g.nvlink_tx_bytes_per_second if g.nvlink_tx_bytes_per_second is not None
                              else g.nvlink_total_bytes_per_second)
                        + ("" if g.nvlink_bandwidth_fraction is None else f" ({g.nvlink_bandwidth_fraction:.0%})"),
                        _rate(g.pcie_tx_bytes_per_second)
                        + ("" if g.pcie_bandwidth_fraction is None else f" ({g.pcie_bandwidth_fraction:.0%})")])
                for g in r.gpus]
        parts.append(fitted_table("per GPU (DCGM): memory used against the plan's per-GPU total", cols, rows,
                                  caption="error: predicted / measured - 1; links: rate (share of the profile's "
                                          "bandwidth), reported, not judged"))
    if r.replicas:
        cols = [("replica", "right", 0), ("engine", "left", 3), ("running", "right", 1), ("waiting", "right", 2),
                ("KV usage", "right", 0), ("", "left", 0), ("KV cache tokens", "right", 0), ("predicted", "right", 1),
                ("", "left", 0), ("TTFT p50/p90/p99", "right", 4), ("SLA TTFT/TPOT", "left", 0), ("TPOT p50/p90/p99", "right", 4)]
        rows = [_cells(["-" if p.replica is None else str(p.replica),
                        f"{p.exporter} {p.engine}".strip(), _tokens(p.running_requests)
                        + ("" if p.predicted_batch_size is None else f" (plan {p.predicted_batch_size})"),
                        _tokens(p.waiting_requests),
                        _pct(p.kv_usage_fraction) + ("" if p.kv_usage_ceiling_fraction is None else
                                                     f" (≤{_pct(p.kv_usage_ceiling_fraction)})"),
                        _VERDICT[p.kv_usage_verdict], _tokens(p.kv_capacity_tokens),
                        _tokens(p.kv_capacity_predicted_tokens)
                        + ("" if p.kv_band_abs_error is None else f" ±{_pct(p.kv_band_abs_error)}"),
                        _VERDICT[p.kv_capacity_verdict],
                        _pcts(p.ttft, p.ttft_predicted_seconds, p.ttft_predicted, p.predicted_request_rate_per_second,
                              started=True),
                        "/".join("-" if c is None else _VERDICT[c.verdict] for c in (p.ttft_sla, p.tpot_sla)),
                        _pcts(p.tpot, p.tpot_predicted_seconds, p.tpot_predicted, p.predicted_request_rate_per_second)])
                for p in r.replicas]
        parts.append(fitted_table("per serving replica: KV cache and usage against the plan, latency against its SLA; "
                                  "latency reported", cols, rows,
                                  caption="KV usage (≤ the plan's usage for the running requests); percentiles since "
                                          "start on the first scrape, over the interval after; SLA: the per-request "
                                          "TTFT and (vLLM's) TPOT histograms against the plan's limits where their "
                                          "buckets decide it"))
    for e in r.endpoints:
        if e.error:
            parts.append(Text(f"unreadable: {e.url}: {e.error}", style="red"))
    for line in r.outside:
        parts.append(Text(f"outside: {line}", style="red"))
    for line in r.notes + [f"rank {g.rank if g.rank is not None else '-'} gpu {g.gpu}: {n}" for g in r.gpus for n in g.notes] \
            + [f"replica {p.replica if p.replica is not None else '-'}: {n}" for p in r.replicas for n in p.notes]:
        parts.append(Text(f"note: {line}", style="dim"))
    return Group(*parts)


__all__ = ["json_line", "watch_view"]
