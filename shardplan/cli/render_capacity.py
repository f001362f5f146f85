"""Tables for `capacity`."""

from __future__ import annotations

import math
from typing import Any

from shardplan import units


from rich.table import Table

from shardplan.cli.render_common import console, fitted_table, fmt_gib, fmt_seconds, load_band_line
from shardplan.tasks.capacity import FormatRow, ServingCapacity, TrainingCapacity, TrainingRow


def _fmt_gpus(row: FormatRow | TrainingRow) -> list[str]:
    if row.min_num_gpus is None:
        return ["-", "-"]
    return [str(row.min_num_gpus), str(row.num_nodes)]


def _edge(row: FormatRow | TrainingRow) -> str:
    """fits / tight at the measured error band's edge (`--json` has the band and the figures)."""
    return row.fit_at_band_edge.verdict if row.fit_at_band_edge is not None else "-"


def capacity_report(r: ServingCapacity | TrainingCapacity) -> None:
    from shardplan.search.explain import describe

    counts = r.gpu_counts_considered
    searched = f"GPU counts considered: {', '.join(map(str, counts[:6]))}{', ...' if len(counts) > 6 else ''} up to {r.max_gpus} ({r.gpus_per_node} per node)"
    if isinstance(r, TrainingCapacity):
        cols = [("ZeRO", "right", 0), ("offload", "left", 0), ("GPUs", "right", 0), ("nodes", "right", 3),
                ("fastest layout there", "left", 0), ("GiB/GPU", "right", 2), ("free", "right", 4), ("step", "right", 1),
                ("at band edge", "left", 5)]
        rows = []
        for row in r.rows:
            cells = [str(row.zero_stage), row.offload, *_fmt_gpus(row)]
            if row.min_num_gpus is None:
                cells += ["not found", "-", "-", "-", "-"]
            else:
                cells += [describe(row.plan), f"{units.bytes_to_gib(row.per_gpu_bytes['total']):.1f}",
                          f"{units.bytes_to_gib(row.headroom_bytes):.1f}", fmt_seconds(row.step_seconds), _edge(row)]
            rows.append(cells)
        offered = (f" the {r.stack} stack runs (--stack deepspeed for every ZeRO stage and offload)"
                   if r.stack and r.stack != "deepspeed" and r.target is None else "")
        t = fitted_table(f"{r.model} on {r.hardware}, training {r.seq_len:,} tokens x {r.global_batch_size} sequences: "
                         f"fewest GPUs per ZeRO stage and offload{offered}", cols, rows)
        console.print(t)
        for row in r.rows:
            if row.not_found:
                console.print(f"ZeRO {row.zero_stage}, offload {row.offload}: {row.not_found}")
        console.print(searched)
        return
    tps = [p.tp for p in r.formats[0].per_tp]
    # (header, justify, priority): 0 never dropped; on a narrow terminal the per-tp columns go first.
    cols = [("weights", "left", 0), ("GPUs", "right", 0), ("nodes", "right", 4), ("layout", "left", 0),
            ("weights/GPU", "right", 3), ("KV cache/GPU", "right", 2), ("seqs held", "right", 1),
            ("at band edge", "left", 4)]
    cols += [(f"tp={tp}", "right", 5 + i) for i, tp in enumerate(reversed(tps))][::-1]
    rows = []
    for row in r.formats:
        cells = [row.weight_dtype, *_fmt_gpus(row)]
        if row.min_num_gpus is None:
            cells += ["not found", "-", "-", "-", "-"]
        else:
            p, b = row.plan, row.per_gpu_bytes
            cells += [f"tp={p['tp']} pp={p['pp']}" + (f" ep={p['ep']}" if p["ep"] > 1 else ""),
                      fmt_gib(b["weights"]), fmt_gib(b["kv_cache"]), f"{row.kv_cache['max_concurrency']:.1f}", _edge(row)]
        by_tp = {p.tp: p for p in row.per_tp}
        for tp in tps:
            p = by_tp.get(tp)
            cell = "-" if p is None or not p.longest_context_tokens else f"{p.longest_context_tokens:,} / {p.most_sequences:,}"
            if p is not None and p.longest_context_tokens_offloaded:
                cell += f" (offloaded: {p.longest_context_tokens_offloaded:,} / {p.most_sequences_offloaded:,})"
            cells.append(cell)
        rows.append(cells)
    t = fitted_table(f"{r.model} on {r.hardware}, serving {r.concurrency} sequence(s) of {r.max_model_len:,} tokens: "
                     "fewest GPUs per weight format", cols, rows,
                     caption=f"tp=N: one replica of N GPUs (pp=1): longest context at {r.concurrency} sequence(s) / "
                             f"most sequences of {r.max_model_len:,} tokens; (offloaded: the same with every layer's "
                             "weights in host memory, where the engine can)")
    console.print(t)
    q = r.quantization_removes_sharding
    if q:
        dense = f"{q.dense_min_num_gpus} GPUs" if q.dense_min_num_gpus else f"more than {r.max_gpus} GPUs"
        console.print(f"[green]{q.weight_dtype} weights fit on one GPU: quantization removes the need to shard[/green] "
                      f"({q.dense_weight_dtype} needs {dense})")
    for row in r.formats:
        if row.not_found:
            console.print(f"{row.weight_dtype}: {row.not_found}")
    console.print(f"{searched}; memory budget {r.gpu_memory_utilization:g} x device memory ({r.engine}); "
                  f"KV cache {r.kv_cache_dtype}", highlight=False)


def sizing_report(r: Any) -> None:
    """capacity --request-rate: the fewest GPUs that serve the rate within the SLA (tasks/sizing.py)."""
    limits = [f"p{r.slo_percentile} TTFT <= {r.max_ttft_seconds * 1e3:g} ms" if r.max_ttft_seconds is not None else "",
              f"p{r.slo_percentile} TPOT <= {r.max_tpot_seconds * 1e3:g} ms" if r.max_tpot_seconds is not None else ""]
    console.print(f"SLA: {', '.join(x for x in limits if x)}; {r.model} on {r.hardware} at {r.request_rate:g} requests/s "
                  f"({r.lengths} lengths, mean {r.mean_input_tokens:,.0f} in / {r.mean_output_tokens:,.0f} out)",
                  markup=False, highlight=False)
    t = Table(title="Replica shapes (fewest GPUs first)", title_justify="left")
    long_runs = any(row.long_run_request_rate_per_replica is not None for row in r.rows)
    for c in ("tp", "pp", "ep", "weights", "GPUs/replica", "req/s per replica", *(("over a long run",) if long_runs else ()),
              "replicas", "GPUs", "why not"):
        t.add_column(c, justify="left" if c in ("weights", "why not") else "right")
    for row in r.rows:
        held = row.long_run_request_rate_per_replica
        t.add_row(str(row.tp), str(row.pp), str(row.ep), row.quantization, str(row.gpus_per_replica),
                  "-" if row.max_request_rate_per_replica is None else f"{row.max_request_rate_per_replica:,.2f}",
                  *((("-" if held is None else f"{held:,.2f}"),) if long_runs else ()),
                  "-" if row.replicas is None else str(row.replicas), "-" if row.num_gpus is None else str(row.num_gpus),
                  row.reason or "")
    console.print(t)
    if r.best is None:
        over = [row.num_gpus for row in r.rows if row.num_gpus is not None]
        if over:  # shapes meet the SLA, but the rate needs more of them than --max-gpus allows
            console.print(f"[red]the rate needs more GPUs than --max-gpus[/red]: with replicas of at most --max-gpus "
                          f"GPUs each, the fewest that serve it within the SLA are {min(over):,}; raise --max-gpus or "
                          "lower the rate")
        else:
            console.print("[red]no replica shape meets the SLA[/red]: relax --max-ttft-ms / --max-tpot-ms or use faster GPUs")
        return
    b, a = r.best, r.at_rate
    line = (f"[bold]{b.num_gpus} GPUs[/bold]: {b.replicas} replica(s) of tp={b.tp} pp={b.pp}"
            + (f" ep={b.ep}" if b.ep > 1 else "") + f" with {b.quantization} weights")
    if a is not None:
        line += (f"; at {r.request_rate:g} req/s p{a.p} TTFT {a.ttft_seconds * 1e3:,.0f} ms, p{a.p} TPOT "
                 f"{a.tpot_seconds * 1e3:,.1f} ms, {a.output_tokens_per_second_per_gpu:,.0f} output tokens/s per GPU")
    console.print(line)
    if a is not None and a.saturated and a.saturation_request_rate > 0:
        # The rate was judged over a finite run; at or above what the plan sustains with every request waiting,
        # a longer one queues without bound: the replicas that keep each one's share below it.
        per_replica_request_rate = a.saturation_request_rate / b.replicas
        more = math.floor(r.request_rate / per_replica_request_rate) + 1
        console.print(f"at {r.request_rate:g} req/s the plan is at or above what it sustains with every request waiting "
                      f"({a.saturation_request_rate:,.2f} req/s), so over a longer run its queue may grow: {more} "
                      f"replicas ({more * b.gpus_per_replica} GPUs) keep the rate below it", markup=False, highlight=False)
    lr = r.long_run
    resized = [row for row in r.rows if row.long_run_request_rate_per_replica is not None]
    if resized and lr is not None:  # shapes sized again by what a replica holds over a long run
        first = resized[0]
        console.print(f"sized by long runs: tp={first.tp} pp={first.pp}, judged at {first.max_request_rate_per_replica:,.2f} "
                      f"req/s a replica over the rate search's run, broke the SLA at its share of the rate over "
                      f"{lr.num_requests // max(1, b.replicas):,} requests a replica and holds "
                      f"{first.long_run_request_rate_per_replica:,.2f} over as long a run"
                      + (f" ({len(resized)} shapes sized again)" if len(resized) > 1 else "")
                      + f"; the answer holds over {lr.num_requests:,} requests: p{lr.percentile} TTFT "
                      f"{lr.ttft_seconds * 1e3:,.0f} ms, p{lr.percentile} TPOT {lr.tpot_seconds * 1e3:,.1f} ms",
                      markup=False, highlight=False)
    band = load_band_line(r.bands)
    if band:
        console.print(band, markup=False, highlight=False)
