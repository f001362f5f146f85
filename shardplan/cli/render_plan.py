"""Tables for `estimate`, `recommend` and `show`."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from shardplan import units
from shardplan.cli.render_common import breakdown_table, load_band_line, console, file_written, fitted_table, fmt_count, fmt_gib, fmt_seconds
from shardplan.cost.report import CostReport, FitAtBandEdge, LoadReport, PredictionBand, TrainingMemoryReport, TrainingTimeReport
from shardplan.plan.schema import DeploymentManifest, PercentilesSection, PredictedLoadSection, ServingTime
from shardplan.search.explain import describe
from shardplan.search.results import LongRun, ParetoPoint, RecommendEntry, RecommendResult
from shardplan.search.space import TIGHT

_COMPONENTS = ("weights", "kv_cache", "activations", "gradients", "optimizer_states", "temporary", "overhead")


def _chunks(pairs: Any) -> str:
    """Layer chunks as `0-9, 40-49`: an interleaved stage's layers are not one range."""
    return ", ".join(f"{a}-{b}" for a, b in pairs)


def _without_source(rule: str) -> str:
    """'vLLM 0.6.4: X (source ...)' -> 'vLLM 0.6.4: X': the table keeps the rule, --json the source."""
    return rule[: rule.index(" (")] if rule.endswith(")") and " (" in rule else rule


def _band(bands: list[PredictionBand] | None, quantity: str) -> str:
    """' ±8.9% (p90 of 11 vLLM V1 ... start-up logs)' after a figure; ' (... band unknown)'; '' without bands."""
    b = next((b for b in bands or [] if b.quantity == quantity), None)
    if b is None:
        return ""
    return f" {b.note}" if b.band_abs_error is not None else f" ({b.note})"


def _verdict(edge: FitAtBandEdge) -> str:
    """'fits at the band's edge: ...' / 'tight: fits at the prediction, not at the band's edge (...)'."""
    head, colour = {"fits": ("fits", "green"), "tight": ("tight", "yellow"), "does not fit": ("does not fit", "red")}[
        edge.verdict]
    rest = edge.note[len(head):] if edge.note.startswith(head) else f": {edge.note}"
    return f"[{colour}]{head}[/{colour}]{escape(rest)}"


def estimate_report(r: CostReport) -> None:
    p, hw, m = r.plan, r.hardware, r.model
    console.print(
        f"[bold]{m.name}[/bold] ({fmt_count(m.num_params)} params) on {hw.num_gpus} x {hw.name} "
        f"({hw.num_nodes} node(s)), {r.workload.kind}: tp={p.tp} pp={p.pp} dp={p.dp} "
        f"cp={p.cp} ep={p.ep} zero={p.zero_stage} recompute={p.recompute}"
        + (f" virtual-stages={p.virtual_stages}" if p.virtual_stages > 1 else "")
    )
    wl = r.workload
    if wl.kind == "training" and (wl.master_dtype, wl.moment_dtype) != ("fp32", "fp32"):
        console.print(f"  optimizer keeps its master weights in {wl.master_dtype} and its moments in {wl.moment_dtype}")
    if wl.kind == "training" and wl.grad_reduce_dtype != "fp32":
        console.print(f"  main gradients kept and reduced in {wl.grad_reduce_dtype} (Megatron --grad-reduce-in-bf16)")
    if r.assumptions:  # the engine rules behind the serving figures; --json carries their sources too
        for line in r.assumptions:
            console.print(f"  assumes {_without_source(line)}", markup=False, highlight=False)
    cap = hw.memory_capacity_bytes
    t = Table(title="Memory per GPU by pipeline stage (GiB)", title_justify="left")
    t.add_column("", no_wrap=True)
    ranks = r.memory.per_rank
    for rank in ranks:
        t.add_column(f"stage {rank.stage}\nlayers {_chunks(rank.layer_chunks)}", justify="right")
    for c in _COMPONENTS:
        if any(rank.per_gpu_bytes[c] for rank in ranks):
            t.add_row(c.replace("_", " "), *[f"{units.bytes_to_gib(rank.per_gpu_bytes[c]):.2f}" for rank in ranks])
    t.add_row("[bold]total[/bold]", *[f"[bold]{units.bytes_to_gib(rank.per_gpu_bytes['total']):.2f}[/bold]" for rank in ranks])
    t.add_row("headroom", *[f"{units.bytes_to_gib(cap - rank.per_gpu_bytes['total']):.2f}" for rank in ranks])
    console.print(t)
    mem = r.memory
    console.print(
        f"capacity {fmt_gib(cap)} per GPU; budget {fmt_gib(mem.budget_bytes)}; "
        f"binding: stage {mem.binding_stage}, largest part {mem.binding_component}"
    )
    if r.kv_cache is not None:
        kv = r.kv_cache
        console.print(
            f"KV cache: {kv.bytes_per_token_per_gpu:,.0f} B/token/GPU; capacity {kv.capacity_tokens:,} tokens"
            f"{escape(_band(r.bands, 'kv_capacity'))} ({kv.num_blocks:,} blocks of {kv.block_size}); max concurrency "
            f"at {kv.max_model_len:,} tokens: {kv.max_concurrency:.2f}x"
        )
    elif isinstance(mem, TrainingMemoryReport):
        if r.bands:
            peak = max(mem.per_rank, key=lambda rank: rank.reserved_bytes)
            console.print(f"peak reserved {fmt_gib(peak.reserved_bytes)} per GPU (stage {peak.stage})"
                          f"{escape(_band(r.bands, 'peak_memory'))}")
        if mem.host_offload_bytes_per_node:
            console.print(f"host RAM for offloaded states: {fmt_gib(mem.host_offload_bytes_per_node)} per node")
        if mem.nvme_offload_bytes_per_node:
            console.print(f"NVMe for offloaded states: {fmt_gib(mem.nvme_offload_bytes_per_node)} per node")
    _time_report(r)
    if r.load is not None:
        load_table(r.load, r.bands)
    if r.fits and r.fit_at_band_edge is not None:
        console.print(_verdict(r.fit_at_band_edge))
    elif r.fits:
        console.print("[green]fits[/green]")
    else:
        console.print(f"[red]does not fit[/red]: {r.reason}")


def load_table(ld: LoadReport, bands: list[PredictionBand] | None = None) -> None:
    """The plan under traffic: latency percentiles and throughputs (cost/serving_load.py), and the
    measured error band of the medians and the output throughput where `bands` has them."""
    offered = (f"{ld.request_rate:g} req/s" if ld.request_rate is not None else "all at once") + (
        f", at most {ld.max_concurrency} in flight" if ld.max_concurrency is not None else "")
    console.print(f"Under traffic: {ld.num_requests:,} requests ({ld.lengths} lengths, mean {ld.mean_input_tokens:,.0f} in / "
                  f"{ld.mean_output_tokens:,.0f} out), {offered}, over {ld.num_replicas} replica(s); {ld.schedule}",
                  markup=False, highlight=False)
    t = Table(title_justify="left")
    for c in ("", "mean", "p50", "p90", "p99"):
        t.add_column(c, justify="right" if c else "left")
    for name, pct in (("TTFT", ld.ttft_seconds), ("TPOT", ld.tpot_seconds), ("ITL", ld.itl_seconds),
                      ("end-to-end", ld.e2e_seconds)):
        if pct is not None:
            t.add_row(name, *[fmt_seconds(getattr(pct, k)) for k in ("mean", "p50", "p90", "p99")])
    console.print(t)
    state = "[red]saturated[/red]" if ld.saturated else "not saturated"
    console.print(f"{ld.output_tokens_per_second:,.0f} output tokens/s ({ld.output_tokens_per_second_per_gpu:,.0f} per GPU), "
                  f"{ld.request_throughput_per_second:,.2f} req/s; sustains up to {ld.saturation_request_rate:,.2f} req/s: "
                  f"{state}; peak {ld.peak_running} running, {ld.mean_decode_batch:,.1f} decoding a step, "
                  f"{ld.num_preemptions} preempted per replica")
    line = load_band_line(bands)
    if line:
        console.print(line, markup=False, highlight=False)


def _time_report(r: CostReport) -> None:
    tm = r.time
    unfit = "" if tm.plan_fits else " [red](if it fit: it does not)[/red]"
    if isinstance(tm, TrainingTimeReport):
        console.print(breakdown_table("Time per training step" + ("" if tm.plan_fits else " (the plan does not fit)"),
                                      {"step": tm.breakdown}))
        console.print(
            f"step {fmt_seconds(tm.step_seconds)}; {tm.tokens_per_second_per_gpu:,.0f} tokens/s per GPU"
            f"{escape(_band(r.bands, 'tokens_per_second'))} ({tm.tokens_per_second:,.0f} in all); "
            f"MFU {100 * tm.mfu:.1f}%, HFU {100 * tm.hfu:.1f}%{unfit}"
        )
        return
    console.print(
        breakdown_table(
            f"Serving time at batch {tm.batch_size} ({tm.input_len} prompt + {tm.output_len} output tokens)"
            + ("" if tm.plan_fits else " (the plan does not fit)"),
            {"prefill (TTFT)": tm.breakdown.prefill, "decode step (TPOT)": tm.breakdown.decode_step},
        )
    )
    console.print(
        f"TTFT {fmt_seconds(tm.ttft_seconds)}, TPOT {fmt_seconds(tm.tpot_seconds)}, "
        f"{_throughput(tm.throughput_tokens_per_second, tm.throughput_tokens_per_second_per_gpu, tm.throughput_tokens_per_second_per_replica, r.plan.dp)}"
        f"{unfit}"
    )
    if tm.best_batch_size and tm.best_throughput_tokens_per_second is not None:
        console.print(
            f"best throughput within the KV cache: batch {tm.best_batch_size} per replica at "
            f"{tm.best_throughput_tokens_per_second:,.0f} output tokens/s over all GPUs"
        )
    if not tm.batch_fits_kv_cache:
        console.print(
            f"[yellow]batch {tm.batch_size} needs more KV cache than the {tm.max_batch_in_kv_cache} "
            f"sequences of {tm.input_len + tm.output_len} tokens it holds[/yellow]"
        )


def _throughput(total: float, per_gpu: float, per_replica: float | None, replicas: int) -> str:
    """The plan's output tokens/s (all replicas), per GPU and per replica: the same three everywhere."""
    text = f"{total:,.0f} output tokens/s over all GPUs ({per_gpu:,.0f} per GPU"
    if per_replica is not None and replicas > 1:
        text += f"; {replicas} replicas of {per_replica:,.0f}"
    return text + ")"


def _top_table(top: list[RecommendEntry]) -> Table:
    training = isinstance(top[0].time, TrainingTimeReport)
    loaded = top[0].load is not None
    # (header, justify, priority): 0 never dropped; larger numbers go first when it is narrow.
    cols = [("#", "right", 0), ("GPUs", "right", 0), ("layout", "left", 0), ("GiB", "right", 4), ("free", "right", 6)]
    if training:
        cols += [("step", "right", 1), ("tok/s/GPU", "right", 2), ("MFU", "right", 3)]
    elif loaded:
        cols += [("req/s", "right", 4), ("p90 TTFT", "right", 3), ("p90 TPOT", "right", 2), ("tok/s", "right", 1),
                 ("tok/s/GPU", "right", 5)]
    else:
        cols += [("TTFT", "right", 3), ("TPOT", "right", 2), ("tok/s", "right", 1), ("tok/s/GPU", "right", 5)]
    cols.append(("$/Mtok", "right", 7))
    edges = any(e.fit_at_band_edge is not None for e in top)
    if edges:
        cols.append(("at band edge", "left", 8))
    rows = []
    for e in top:
        mem, tm, usd = e.memory, e.time, e.cost.usd_per_million_tokens
        layout = describe(e.plan) + (f" (+{e.variants - 1} variants)" if e.variants > 1 else "")
        cells = [f"{e.rank}=" if e.tie else str(e.rank), str(e.num_gpus), layout,
                 f"{units.bytes_to_gib(mem.per_gpu_bytes['total']):.1f}", f"{units.bytes_to_gib(mem.headroom_bytes):.1f}"]
        if isinstance(tm, TrainingTimeReport):
            cells += [fmt_seconds(tm.step_seconds), f"{tm.tokens_per_second_per_gpu:,.0f}", f"{100 * tm.mfu:.1f}%"]
        elif loaded and e.load is not None:
            ld = e.load
            cells += [f"{ld.request_throughput_per_second:,.2f}", fmt_seconds(ld.ttft_seconds.p90),
                      fmt_seconds(ld.tpot_seconds.p90), f"{ld.output_tokens_per_second:,.0f}",
                      f"{ld.output_tokens_per_second_per_gpu:,.0f}"]
        else:
            cells += [fmt_seconds(tm.ttft_seconds), fmt_seconds(tm.tpot_seconds),
                      f"{tm.throughput_tokens_per_second:,.0f}", f"{tm.throughput_tokens_per_second_per_gpu:,.0f}"]
        cells.append("-" if usd is None else f"{usd:,.3f}")
        if edges:
            cells.append(e.fit_at_band_edge.verdict if e.fit_at_band_edge is not None else "-")
        rows.append(cells)
    return fitted_table("Best plans", cols, rows)


def _show_load(console: Any, ld: PredictedLoadSection) -> None:
    """A manifest's figures under traffic: as judged, over a long run, and the rate to plan for."""
    def q(p: PercentilesSection | None) -> str:
        return "-" if p is None else "/".join(fmt_seconds(v) for v in (p.p50, p.p90, p.p99))

    at = "all at once" if ld.request_rate_per_second is None else f"{ld.request_rate_per_second:,.2f} req/s"
    if ld.max_concurrency is not None:
        at = f"{ld.max_concurrency:,} requests in flight"
    console.print(f"under traffic: at {at} over {ld.num_requests:,} requests, TTFT p50/p90/p99 {q(ld.ttft_seconds)}, "
                  f"TPOT {q(ld.tpot_seconds)}, {ld.output_tokens_per_second:,.0f} output tokens/s"
                  + ("; saturated" if ld.saturated else ""), soft_wrap=True)
    lr = ld.long_run
    if lr is not None:
        verdict = "meets the SLA" if lr.within_sla else f"breaks the SLA ({lr.why})"
        console.print(f"over a long run ({lr.num_requests:,} requests) at that rate: TTFT {q(lr.ttft_seconds)}, TPOT "
                      f"{q(lr.tpot_seconds)}, {verdict}", soft_wrap=True)
        if lr.held_request_rate_per_second is not None:
            console.print(f"plan for {lr.held_request_rate_per_second:,.2f} req/s, the rate a run as long holds: TTFT "
                          f"{q(lr.held_ttft_seconds)}, TPOT {q(lr.held_tpot_seconds)}", soft_wrap=True)


def _pick_band(e: RecommendEntry, long_run: LongRun | None = None) -> None:
    """The pick's fit-deciding figure with its measured error band, and the verdict at its edge."""
    edge = e.fit_at_band_edge
    if edge is None:
        return
    if edge.quantity == "kv_capacity":
        figure = f"KV capacity {edge.predicted:,.0f} tokens"
    else:
        figure = f"peak reserved {fmt_gib(edge.predicted)} per GPU"
    if edge.verdict == "tight":
        verdict = "[yellow]tight[/yellow]: fits at the prediction, not at the band's edge"
    elif edge.band_abs_error is None:
        verdict = "[green]fits[/green] at the prediction"
    else:
        verdict = "[green]fits[/green] at the band's edge"
    console.print(f"#1: {figure}{escape(_band(e.bands, edge.quantity))}; {verdict}", soft_wrap=True)
    line = load_band_line(e.bands)
    if line:
        console.print(f"#1: {line}", soft_wrap=True, markup=False, highlight=False)
    ld = e.load
    if long_run is not None and ld is not None and ld.request_rate is not None:
        if not long_run.within_sla:  # near what the plan keeps up with, a longer run settles at higher latencies
            p = long_run.percentile
            console.print(f"#1: judged at {ld.request_rate:,.2f} req/s over {ld.num_requests:,} requests; over "
                          f"{long_run.num_requests:,} at that rate p{p} TTFT {long_run.ttft_seconds * 1e3:,.0f} ms, p{p} "
                          f"TPOT {long_run.tpot_seconds * 1e3:,.1f} ms, over the SLA ({long_run.why}): "
                          + (f"over as long a run it holds {long_run.held_request_rate:,.2f} req/s, the rate to plan for"
                             if long_run.held_request_rate is not None else
                             "a longer run settles at higher latencies, so plan for a lower rate or looser limits"),
                          soft_wrap=True, markup=False, highlight=False)
    elif ld is not None and ld.saturated and ld.request_rate is not None and ld.max_concurrency is None:
        # The rate was judged over a finite run: a queue that grows slowly may not reach the SLA's percentile in it.
        console.print(f"#1: judged at {ld.request_rate:,.2f} req/s over {ld.num_requests:,} requests; with every request "
                      f"waiting it sustains {ld.saturation_request_rate:,.2f} req/s, so over a longer run at this rate "
                      f"its queue may grow: plan for the lower rate (its output, {ld.output_tokens_per_second:,.0f} "
                      "tokens/s over the run, is what it is ranked by)", soft_wrap=True, markup=False, highlight=False)


def _pareto_table(points: list[ParetoPoint]) -> Table:
    cols = [("GPUs", "right", 0), ("tp", "right", 0), ("pp", "right", 0), ("replicas", "right", 0),
            ("weights", "right", 0), ("kv", "right", 0), ("batch", "right", 0), ("latency", "right", 0),
            ("TTFT", "right", 2), ("TPOT", "right", 1), ("tokens/s/GPU", "right", 0)]
    rows = [[str(p.num_gpus), str(p.tp), str(p.pp), str(p.replicas), p.quantization, p.kv_cache_dtype,
             str(p.batch_size), fmt_seconds(p.e2e_latency_seconds), fmt_seconds(p.ttft_seconds),
             fmt_seconds(p.tpot_seconds), f"{p.throughput_tokens_per_second_per_gpu:,.0f}"] for p in points]
    return fitted_table("Pareto frontier: request latency vs throughput per GPU", cols, rows)


def recommend_report(r: RecommendResult) -> None:
    console.print(r.assumptions, markup=False, highlight=False, soft_wrap=True)  # one line: the terminal wraps it
    console.print(
        f"[bold]{r.model}[/bold] on {r.hardware}, {r.workload}, objective {r.objective}: "
        f"{r.num_evaluated:,} layouts evaluated ({r.num_costed:,} costed in full) in {r.elapsed_seconds:.2f} s; "
        f"{r.num_feasible:,} fit"
    )
    if r.top:
        console.print(_top_table(r.top))
        _pick_band(r.top[0], r.long_run)
    if r.pareto:
        console.print(_pareto_table(r.pareto))
    if r.rejected:
        t = Table(title="Rejected layouts by reason", title_justify="left")
        t.add_column("reason")
        t.add_column("layouts", justify="right", no_wrap=True)
        for reason, n in r.rejected.items():
            t.add_row(reason, f"{n:,}")
        console.print(t)
    b = r.search_budget
    if b.spent:
        skipped = b.gpu_counts_not_searched
        console.print(f"[yellow]search budget of {b.max_steps:,} steps spent[/yellow]: "
                      f"{b.num_layouts_not_searched:,} layouts not searched"
                      + (f", GPU counts not searched: {', '.join(map(str, skipped))}" if skipped else "")
                      + " (the best shown is the best found; narrow --max-gpus or pin degrees to search the rest)")
    if r.smallest_num_gpus is not None and len(r.gpu_counts) > 1:
        console.print(f"smallest GPU count that meets the goal: {r.smallest_num_gpus}")
    console.print(f"[bold]why[/bold]: {r.why}")
    d = r.disaggregated
    if d is not None:
        console.print(f"[bold]disaggregated[/bold]: {d.prefill_replicas} prefill replica(s) of tp={d.prefill_tp} + "
                      f"{d.decode_replicas} decode replica(s) of tp={d.decode_tp}: {d.request_rate_per_second:,.2f} req/s "
                      f"({d.output_tokens_per_second_per_gpu:,.0f} output tokens/s per GPU) against "
                      f"{d.aggregated_request_rate_per_second:,.2f} aggregated "
                      f"({d.aggregated_output_tokens_per_second_per_gpu:,.0f}), each the most offered within the SLA; "
                      f"{escape(d.why)}")
    c = r.compare
    if c:
        pins = ", ".join(f"{k}={v}" for k, v in c.pins.items())
        if not c.fits:
            reasons = "; ".join(f"{k}: {v:,}" for k, v in list((c.rejected or {}).items())[:3]) or "no such layout can exist"
            console.print(f"compared ({pins}): nothing with these settings fits ({reasons})")
        elif c.plan is not None:
            line = f"compared ({pins}): best is {describe(c.plan)}"
            if c.gap_fraction is not None:
                line += f", {100 * c.gap_fraction:.1f}% behind the winner"
                parts = [f"{d.component.replace('_', ' ')} {d.delta_seconds * 1e3:+.1f} ms" for d in (c.differences or [])[:3]]
                if parts:
                    line += " (" + ", ".join(parts) + ")"
            console.print(line)
    offloaded_pick = bool(r.top) and bool(getattr(r.top[0].plan, "offload", None) and r.top[0].plan.offload.layers)
    for s in r.suggestions:
        # With a pick that fits on the GPUs alone these are the trade the other way, not a rescue.
        label = "would fit with" if not r.top or offloaded_pick else "alternative:"
        console.print(f"[yellow]{label}[/yellow] {s.change}: {s.detail}")
    if not r.top and r.strict_fit and r.rejected.get(TIGHT):
        band = r.bands[0].note if r.bands else "the band"
        console.print(f"[red]no layout fits at the error band's edge[/red]: {r.rejected[TIGHT]:,} fit only at the "
                      f"prediction ({escape(band)}); without --strict-fit they are ranked last", soft_wrap=True)
    elif not r.top and not r.num_evaluated and r.invalid_degree_combinations:
        # nothing was costed: every layout was refused by the stack's or the target's rules
        reasons = sorted(r.invalid_degree_combinations.items(), key=lambda kv: -kv[1])[:8]
        console.print("[red]no layout to cost[/red]: every one was refused (" +
                      "; ".join(f"{escape(k)}: {v:,}" for k, v in reasons) + ")", soft_wrap=True)
    elif not r.top:
        console.print("[red]no layout fits[/red]" + ("" if r.suggestions else " (no single change found that makes one fit)"))
    if r.manifest:
        file_written(r.manifest, "manifest")


def manifest_report(m: DeploymentManifest) -> None:
    mo, hw, lay, pl, pr = m.model, m.hardware, m.layout, m.placement, m.predicted
    console.print(
        f"[bold]{mo.name}[/bold] ({fmt_count(mo.num_params)} params, spec {mo.spec_sha256[:12]}) on "
        f"{hw.num_gpus} x {hw.gpu_model} ({hw.num_nodes} node(s) of {hw.gpus_per_node}), "
        f"{m.workload.kind}; schema {m.schema_version}, shardplan {m.shardplan_version}"
    )
    console.print(
        "layout: " + " ".join(f"{a.axis}={a.size}" for a in pl.mesh_shape)
        + f" ep={lay.ep} zero={lay.zero_stage} recompute={lay.recompute} schedule={lay.pp_schedule}"
        + f" v={lay.virtual_stages} micro-batch={lay.micro_batch_size}; rank order (outer to inner) {', '.join(pl.mesh_axis_order)}"
    )
    t = Table(title="Pipeline stages", title_justify="left")
    for c in ("stage", "layers", "ranks", "nodes", "GiB/GPU"):
        t.add_column(c, justify="right", no_wrap=c != "layers")
    per_stage = {s.stage: s for s in pr.memory.stages}
    for s in pl.stages:
        mem = per_stage.get(s.stage)
        t.add_row(str(s.stage), _chunks(s.layer_ranges), f"{s.first_rank}-{s.last_rank}", f"{s.nodes[0]}-{s.nodes[1]}",
                  f"{units.bytes_to_gib(mem.per_gpu_bytes['total']):.2f}" if mem else "-")
    console.print(t)
    if pl.experts is not None:
        console.print(f"experts: {pl.experts.experts_per_rank} per expert-parallel rank")
    console.print("predicted: " + ("[green]fits[/green]" if pr.fits else f"[red]does not fit[/red]: {pr.reason}")
                  + f"; headroom {fmt_gib(pr.memory.headroom_bytes)}")
    if pr.fit_at_band_edge is not None:
        console.print(f"at the error band's edge: {escape(pr.fit_at_band_edge.note)}", soft_wrap=True)
    tm = pr.time
    if m.sla is not None:
        limits = [f"{q} <= {fmt_seconds(v)}" for q, v in (("TTFT", m.sla.max_ttft_seconds), ("TPOT", m.sla.max_tpot_seconds))
                  if v is not None]
        console.print(f"SLA it was ranked within: p{m.sla.percentile} {', '.join(limits)}"
                      + (" (shardplan's default)" if m.sla.defaulted else ""), soft_wrap=True)
    if pr.load is not None:
        _show_load(console, pr.load)
    if isinstance(tm, ServingTime):
        console.print(f"time{' of one static batch' if pr.load is not None else ''}: batch {tm.batch_size} per replica, "
                      f"TTFT {fmt_seconds(tm.ttft_seconds)}, TPOT "
                      f"{fmt_seconds(tm.tpot_seconds)}, "
                      + _throughput(tm.throughput_tokens_per_second, tm.throughput_tokens_per_second_per_gpu,
                                    tm.throughput_tokens_per_second_per_replica, lay.dp))
    else:
        console.print(f"time: step {fmt_seconds(tm.step_seconds)}, {tm.tokens_per_second:,.0f} tokens/s over all GPUs "
                      f"({tm.tokens_per_second_per_gpu:,.0f} per GPU), MFU {100 * tm.mfu:.1f}%, HFU {100 * tm.hfu:.1f}%")
