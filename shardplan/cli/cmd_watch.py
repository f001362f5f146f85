"""`watch`: a running deployment's Prometheus pages held against its plan."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from shardplan.cli.app import app


@app.command("watch")
def watch_cmd(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    metrics: Annotated[Optional[list[str]], typer.Option(
        "--metrics", help="A Prometheus page to scrape: vLLM's or SGLang's /metrics, or NVIDIA's DCGM exporter "
                          "(http://HOST:9400/metrics). Repeat it for each engine and exporter.", show_default=False)] = None,
    map_file: Annotated[Optional[Path], typer.Option(
        "--map", help="YAML saying which rank or replica a series is when its labels do not: `nodes:` "
                      "(host label -> node), `gpus:` (GPU UUID -> rank), `replicas:` (a list of endpoint/engine/pod "
                      "-> replica).", show_default=False)] = None,
    interval: Annotated[float, typer.Option(min=0.5, max=3600.0, help="Seconds between scrapes.")] = 10.0,
    once: Annotated[bool, typer.Option("--once", help="Scrape once and exit with its code (scripts, CI). One scrape "
                                                      "gives no counter rate (NVLink totals): the row says so.")] = False,
    count: Annotated[Optional[int], typer.Option(min=1, help="Stop after this many scrapes (default: until Ctrl-C).",
                                                 show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print each scrape as one line of JSON on stdout (JSON lines).")] = False,
) -> None:
    """Watch a running deployment against its plan. Scrapes vLLM's and SGLang's /metrics and the DCGM
    exporter every --interval seconds, maps each series to the plan's ranks (GPU index, UUID, host)
    and serving replicas (vLLM's engine label, pod, or --metrics order; --map when labels are not
    enough), and shows per GPU the memory used against the plan's per-GPU total and per replica the
    KV cache (tokens) and its usage against the plan, each with the plan's error band; running and
    waiting requests; TTFT and TPOT p50/p90/p99 from the histograms, beside the plan's own (for a
    plan judged under traffic, its p50/p90/p99 at the rate to plan for, and that rate: the
    manifest's predicted.load) and, from the second scrape, the requests started per second
    between scrapes; NVLink and PCIe throughput against the profile's bandwidth. A KV usage near 100% is not a misprediction: usage is judged
    against how full the plan's cache is with the running requests (each of the plan's input_len +
    output_len tokens); memory and KV cache are judged both ways, |predicted / measured - 1| beyond
    the band; for a plan ranked within an SLA (the manifest's sla), each replica's TTFT histogram,
    and vLLM's per-request TPOT histogram where the page has it, against the limits at the SLA's
    percentile, where the buckets decide it (outside: too few requests can have been within the
    limit); the plan's TTFT and TPOT figures, the inter-token histograms and links are reported, not
    judged (the plan's latency holds at the rate it was sized for, which the pages do not state; an
    inter-token gap is not a request's TPOT; links have no measured band). Exit 0
    when everything judged is within its band, 4 when a shard is outside or a replica breaks the SLA
    (the line names it with the measured and predicted figures), 5 when an endpoint cannot be read (refused, timed out, an HTTP
    error, or not a metrics page: over 16 MiB or 100,000 series, binary, NaN or Inf where a figure
    is read); 2 for a plan, map file or URL that is wrong. Without --once it scrapes until Ctrl-C
    (or --count) and exits with the last scrape's code.

    Example: shardplan watch plan.yaml --metrics http://10.0.0.5:8000/metrics --metrics http://10.0.0.5:9400/metrics --once --json"""
    from rich.live import Live
    from shardplan.cli import render_watch
    from shardplan.cli.render_common import console
    from shardplan.tasks.watch import exit_error, open_watch

    watcher = open_watch(plan, list(metrics or []), map_file)
    limit = 1 if once else count
    live = Live(console=console, auto_refresh=False) if (console.is_terminal and not json_out and not once) else None
    last = None
    done = 0
    gc.enable()  # it runs until stopped: the collector main() turned off for a short command runs again
    try:
        if live is not None:
            live.start()
        while limit is None or done < limit:
            started = time.monotonic()
            last = watcher.scrape()
            done += 1
            if json_out:
                render_watch.json_line(last.model_dump(mode="json"))
            elif live is not None:
                live.update(render_watch.watch_view(last), refresh=True)
            else:
                console.print(render_watch.watch_view(last))
            if limit is not None and done >= limit:
                break
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass  # Ctrl-C ends a continuous watch: exit with the last scrape's code
    finally:
        if live is not None:
            live.stop()
    error = exit_error(last) if last is not None else None
    if error is not None:
        raise error
