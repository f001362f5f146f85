"""Tables for `estimate`, `recommend` and `show`."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from shardplan import units


from shardplan.cli.render_common import console, breakdown_table, fmt_count, fmt_gib, fmt_seconds

_COMPONENTS = ("weights", "kv_cache", "activations", "gradients", "optimizer_states", "temporary", "overhead")


def estimate_report(r: dict[str, Any]) -> None:
    p = r["plan"]
    hw = r["hardware"]
    m = r["model"]
    console.print(
        f"[bold]{m['name']}[/bold] ({fmt_count(m['num_params'])} params) on {hw['num_gpus']} x {hw['name']} "
        f"({hw['num_nodes']} node(s)), {r['workload']['kind']}: tp={p['tp']} pp={p['pp']} dp={p['dp']} "
        f"cp={p['cp']} ep={p['ep']} zero={p['zero_stage']} recompute={p['recompute']}"
    )
    cap = hw["memory_capacity_bytes"]
    t = Table(title="Memory per GPU by pipeline stage (GiB)", title_justify="left")
    t.add_column("")
    ranks = r["memory"]["per_rank"]
    for rank in ranks:
        lo, hi = rank["layers"]
        t.add_column(f"stage {rank['stage']}\nlayers {lo}-{hi}", justify="right")
    for c in _COMPONENTS:
        if any(rank["per_gpu_bytes"][c] for rank in ranks):
            t.add_row(c.replace("_", " "), *[f"{units.bytes_to_gib(rank['per_gpu_bytes'][c]):.2f}" for rank in ranks])
    t.add_row("[bold]total[/bold]", *[f"[bold]{units.bytes_to_gib(rank['per_gpu_bytes']['total']):.2f}[/bold]" for rank in ranks])
    t.add_row("headroom", *[f"{units.bytes_to_gib(cap - rank['per_gpu_bytes']['total']):.2f}" for rank in ranks])
    console.print(t)
    mem = r["memory"]
    console.print(
        f"capacity {fmt_gib(cap)} per GPU; budget {fmt_gib(mem['budget_bytes'])}; "
        f"binding: stage {mem['binding_stage']}, largest part {mem['binding_component']}"
    )
    if "kv_cache" in r:
        kv = r["kv_cache"]
        console.print(
            f"KV cache: {kv['bytes_per_token_per_gpu']:,.0f} B/token/GPU; capacity {kv['capacity_tokens']:,} tokens "
            f"({kv['num_blocks']:,} blocks of {kv['block_size']}); max concurrency at {kv['max_model_len']:,} tokens: "
            f"{kv['max_concurrency']:.2f}x"
        )
    else:
        if mem.get("host_offload_bytes_per_node"):
            console.print(f"host RAM for offloaded states: {fmt_gib(mem['host_offload_bytes_per_node'])} per node")
        if mem.get("nvme_offload_bytes_per_node"):
            console.print(f"NVMe for offloaded states: {fmt_gib(mem['nvme_offload_bytes_per_node'])} per node")
    if "time" in r:
        _time_report(r)
    if r["fits"]:
        console.print("[green]fits[/green]")
    else:
        console.print(f"[red]does not fit[/red]: {r['reason']}")


def _time_report(r: dict[str, Any]) -> None:
    tm = r["time"]
    if "step_seconds" in tm:
        console.print(breakdown_table("Time per training step", {"step": tm["breakdown"]}))
        console.print(
            f"step {fmt_seconds(tm['step_seconds'])}; {tm['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU "
            f"({tm['tokens_per_second']:,.0f} in all); MFU {100 * tm['mfu']:.1f}%, HFU {100 * tm['hfu']:.1f}%"
        )
        return
    console.print(
        breakdown_table(
            f"Serving time at batch {tm['batch_size']} ({tm['input_len']} prompt + {tm['output_len']} output tokens)",
            {"prefill (TTFT)": tm["breakdown"]["prefill"], "decode step (TPOT)": tm["breakdown"]["decode_step"]},
        )
    )
    console.print(
        f"TTFT {fmt_seconds(tm['ttft_seconds'])}, TPOT {fmt_seconds(tm['tpot_seconds'])}, "
        f"{tm['throughput_tokens_per_second']:,.0f} output tokens/s ({tm['throughput_tokens_per_second_per_gpu']:,.0f} per GPU)"
    )
    if tm["best_batch_size"]:
        console.print(
            f"best throughput within the KV cache: batch {tm['best_batch_size']} at "
            f"{tm['best_throughput_tokens_per_second']:,.0f} output tokens/s"
        )
    if not tm["batch_fits_kv_cache"]:
        console.print(
            f"[yellow]batch {tm['batch_size']} needs more KV cache than the {tm['max_batch_in_kv_cache']} "
            f"sequences of {tm['input_len'] + tm['output_len']} tokens it holds[/yellow]"
        )


def _plan_cells(e: dict[str, Any]) -> list[str]:
    from shardplan.search.explain import describe

    return [str(e["rank"]), str(e["num_gpus"]), describe(e["plan"])]


def recommend_report(r: dict[str, Any]) -> None:
    console.print(
        f"[bold]{r['model']}[/bold] on {r['hardware']}, {r['workload']}, objective {r['objective']}: "
        f"{r['num_evaluated']:,} layouts evaluated ({r['num_costed']:,} costed in full) in {r['elapsed_seconds']:.2f} s; "
        f"{r['num_feasible']:,} fit"
    )
    top = r["top"]
    if top:
        t = Table(title="Best plans", title_justify="left")
        for c in ("#", "GPUs", "layout", "GiB", "free"):
            t.add_column(c, justify="left" if c == "layout" else "right", no_wrap=c != "layout")
        training = "step_seconds" in top[0]["time"]
        cols = ("step", "tok/s/GPU", "MFU") if training else ("TTFT", "TPOT", "tok/s", "tok/s/GPU")
        for c in cols + ("$/Mtok",):
            t.add_column(c, justify="right", no_wrap=True)
        for e in top:
            mem, tm, cost = e["memory"], e["time"], e["cost"]
            cells = _plan_cells(e) + [f"{units.bytes_to_gib(mem['per_gpu_bytes']['total']):.1f}", f"{units.bytes_to_gib(mem['headroom_bytes']):.1f}"]
            if training:
                cells += [fmt_seconds(tm["step_seconds"]), f"{tm['tokens_per_second_per_gpu']:,.0f}", f"{100 * tm['mfu']:.1f}%"]
            else:
                cells += [fmt_seconds(tm["ttft_seconds"]), fmt_seconds(tm["tpot_seconds"]),
                          f"{e['throughput_tokens_per_second_all_replicas']:,.0f}", f"{tm['throughput_tokens_per_second_per_gpu']:,.0f}"]
            usd = cost["usd_per_million_tokens"]
            cells.append("-" if usd is None else f"{usd:,.3f}")
            t.add_row(*cells)
        console.print(t)
    if r["pareto"]:
        t = Table(title="Pareto frontier: request latency vs throughput per GPU", title_justify="left")
        for c in ("GPUs", "tp", "pp", "replicas", "weights", "kv", "batch", "latency", "TTFT", "TPOT", "tokens/s/GPU"):
            t.add_column(c, justify="right")
        for p in r["pareto"]:
            t.add_row(str(p["num_gpus"]), str(p["tp"]), str(p["pp"]), str(p["replicas"]), p["quantization"], p["kv_cache_dtype"],
                      str(p["batch_size"]), fmt_seconds(p["e2e_latency_seconds"]), fmt_seconds(p["ttft_seconds"]),
                      fmt_seconds(p["tpot_seconds"]), f"{p['throughput_tokens_per_second_per_gpu']:,.0f}")
        console.print(t)
    if r["rejected"]:
        t = Table(title="Rejected layouts by reason", title_justify="left")
        t.add_column("reason")
        t.add_column("layouts", justify="right")
        for reason, n in r["rejected"].items():
            t.add_row(reason, f"{n:,}")
        console.print(t)
    b = r.get("search_budget")
    if b and b["spent"]:
        skipped = b["gpu_counts_not_searched"]
        console.print(f"[yellow]search budget of {b['max_steps']:,} steps spent[/yellow]: "
                      f"{b['num_layouts_not_searched']:,} layouts not searched"
                      + (f", GPU counts not searched: {', '.join(map(str, skipped))}" if skipped else "")
                      + " (the best shown is the best found; narrow --max-gpus or pin degrees to search the rest)")
    if r["smallest_num_gpus"] is not None and len(r["gpu_counts"]) > 1:
        console.print(f"smallest GPU count that meets the goal: {r['smallest_num_gpus']}")
    console.print(f"[bold]why[/bold]: {r['why']}")
    c = r.get("compare")
    if c:
        from shardplan.search.explain import describe

        pins = ", ".join(f"{k}={v}" for k, v in c["pins"].items())
        if not c["fits"]:
            reasons = "; ".join(f"{k}: {v:,}" for k, v in list(c["rejected"].items())[:3]) or "no such layout can exist"
            console.print(f"compared ({pins}): nothing with these settings fits ({reasons})")
        else:
            line = f"compared ({pins}): best is {describe(c['plan'])}"
            if "gap_fraction" in c:
                line += f", {100 * c['gap_fraction']:.1f}% behind the winner"
                parts = [f"{d['component'].replace('_', ' ')} {d['delta_seconds'] * 1e3:+.1f} ms" for d in c["differences"][:3]]
                if parts:
                    line += " (" + ", ".join(parts) + ")"
            console.print(line)
    for s in r["suggestions"]:
        console.print(f"[yellow]would fit with[/yellow] {s['change']}: {s['detail']}")
    if not top:
        console.print("[red]no layout fits[/red]" + ("" if r["suggestions"] else " (no single change found that makes one fit)"))
    if r["manifest"]:
        console.print(f"manifest written to {r['manifest']}")


def manifest_report(m: dict[str, Any]) -> None:
    mo, hw, lay, pl, pr = m["model"], m["hardware"], m["layout"], m["placement"], m["predicted"]
    console.print(
        f"[bold]{mo['name']}[/bold] ({fmt_count(mo['num_params'])} params, spec {mo['spec_sha256'][:12]}) on "
        f"{hw['num_gpus']} x {hw['gpu_model']} ({hw['num_nodes']} node(s) of {hw['gpus_per_node']}), "
        f"{m['workload']['kind']}; schema {m['schema_version']}, shardplan {m['shardplan_version']}"
    )
    console.print(
        "layout: " + " ".join(f"{a['axis']}={a['size']}" for a in pl["mesh_shape"])
        + f" ep={lay['ep']} zero={lay['zero_stage']} recompute={lay['recompute']} schedule={lay['pp_schedule']}"
        + f" v={lay['virtual_stages']} micro-batch={lay['micro_batch_size']}; rank order (outer to inner) {', '.join(pl['mesh_axis_order'])}"
    )
    t = Table(title="Pipeline stages", title_justify="left")
    for c in ("stage", "layers", "ranks", "nodes", "GiB/GPU"):
        t.add_column(c, justify="right")
    per_stage = {s["stage"]: s for s in pr["memory"]["stages"]}
    for s in pl["stages"]:
        layers = ", ".join(f"{a}-{b}" for a, b in s["layer_ranges"])
        mem = per_stage.get(s["stage"])
        t.add_row(str(s["stage"]), layers, f"{s['first_rank']}-{s['last_rank']}", f"{s['nodes'][0]}-{s['nodes'][1]}",
                  f"{units.bytes_to_gib(mem['per_gpu_bytes']['total']):.2f}" if mem else "-")
    console.print(t)
    if pl.get("experts"):
        ex = pl["experts"]
        console.print(f"experts: {ex['experts_per_rank']} per expert-parallel rank")
    console.print("predicted: " + ("[green]fits[/green]" if pr["fits"] else f"[red]does not fit[/red]: {pr['reason']}")
                  + f"; headroom {fmt_gib(pr['memory']['headroom_bytes'])}")
    console.print("time: " + ", ".join(f"{k} {v:.4g}" for k, v in pr["time"].items() if isinstance(v, (int, float))))
