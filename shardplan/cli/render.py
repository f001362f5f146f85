"""Rich tables for humans: the only module that prints for people. Everything it shows
comes from the report dicts that `--json` prints."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from shardplan import units

console = Console()
err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def emit(obj: Any, as_json: bool, table: Callable[[Any], None]) -> None:
    """A command's result: the JSON object with --json, else its rich rendering."""
    if as_json:
        print_json(obj)
    else:
        table(obj)


def fmt_count(n: float | None) -> str:
    if n is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.0f}"


def fmt_gib(n_bytes: float | None) -> str:
    if n_bytes is None:
        return "-"
    return f"{units.bytes_to_gib(n_bytes):.2f} GiB"


def fmt_rate_gb(n_bytes_per_second: float) -> str:
    return f"{n_bytes_per_second / units.BYTES_PER_GB:,.0f} GB/s"


def models_table(rows: list[dict[str, Any]]) -> None:
    t = Table(title="Bundled models", title_justify="left")
    for col in ("name", "type", "params", "active", "layers", "attention", "KV/token (bf16)"):
        t.add_column(col, justify="right" if col not in ("name", "type", "attention") else "left")
    for r in rows:
        d = r["derived"]
        t.add_row(
            r["name"],
            r["model_type"],
            fmt_count(r["num_params"]),
            fmt_count(r["num_active_params"]),
            str(d["num_layers"]),
            d["attention_kind"],
            f"{r['kv_cache_bytes_per_token'] / 1024:,.1f} KiB",
        )
    console.print(t)


def model_detail(r: dict[str, Any]) -> None:
    console.print(f"[bold]{r['name']}[/bold]  ({r['model_type']}, from {r['origin']})")
    t = Table(title="Parameters by component", title_justify="left")
    t.add_column("component")
    t.add_column("parameters", justify="right")
    t.add_column("share", justify="right")
    total = r["num_params"]
    for comp, n in r["params_by_component"].items():
        t.add_row(comp, f"{n:,}", f"{100 * n / total:.1f}%")
    t.add_row("[bold]total[/bold]", f"[bold]{total:,}[/bold]", "100%")
    t.add_row("active per token", f"{r['num_active_params']:,}", f"{100 * r['num_active_params'] / total:.1f}%")
    if r["num_mtp_params"]:
        t.add_row("MTP modules (not in total)", f"{r['num_mtp_params']:,}", "")
    if r["published_num_params"]:
        diff = total - r["published_num_params"]
        t.add_row("published", f"{r['published_num_params']:,}", "match" if diff == 0 else f"{diff:+,}")
    console.print(t)
    d = r["derived"]
    facts = Table(title="Derived", title_justify="left", show_header=False)
    facts.add_column("what")
    facts.add_column("value", justify="right")
    facts.add_row("attention", d["attention_kind"])
    facts.add_row("heads / KV heads", f"{d['num_attention_heads']} / {d['num_kv_heads']}")
    if d.get("head_dim"):
        facts.add_row("head_dim", str(d["head_dim"]))
    if d.get("mla"):
        m = d["mla"]
        facts.add_row("MLA kv_lora_rank + rope dim", f"{m['kv_lora_rank']} + {m['qk_rope_head_dim']}")
    facts.add_row("KV cache per token (bf16, all layers)", f"{r['kv_cache_bytes_per_token']:,.0f} B")
    facts.add_row("weights at bf16", fmt_gib(d["weights_bytes_bf16"]))
    if d.get("sliding_window_tokens"):
        facts.add_row("sliding-window layers", f"{d['num_sliding_window_layers']} of {d['num_layers']} ({d['sliding_window_tokens']} tokens)")
    if "num_experts" in d:
        facts.add_row(
            "experts",
            f"{d['num_experts']} routed, top-{d['num_experts_per_token']}, {d['num_shared_experts']} shared, "
            f"{d['num_moe_layers']} MoE layers",
        )
    console.print(facts)


def hardware_table(rows: list[dict[str, Any]]) -> None:
    t = Table(title="Bundled hardware profiles", title_justify="left")
    for col in ("name", "GPU", "memory", "HBM", "bf16 dense", "GPUs/node", "intra-node", "inter-node"):
        t.add_column(col, justify="left" if col in ("name", "GPU") else "right")
    for r in rows:
        peak = r["peak_flops"].get("bf16") or r["peak_flops"].get("fp16")
        t.add_row(
            r["name"],
            r["gpu_model"],
            fmt_gib(r["memory_capacity_bytes"]),
            fmt_rate_gb(r["memory_bandwidth_bytes_per_second"]),
            f"{peak / 1e12:,.0f} TFLOP/s",
            str(r["gpus_per_node"]),
            f"{r['intra_node_link']['kind']} {fmt_rate_gb(r['intra_node_link']['bandwidth_bytes_per_second'])}",
            f"{r['inter_node_link']['kind']} {fmt_rate_gb(r['inter_node_link']['bandwidth_bytes_per_second'])}",
        )
    console.print(t)


def hardware_detail(r: dict[str, Any]) -> None:
    console.print(f"[bold]{r['name']}[/bold]: {r['description']}")
    t = Table(show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("GPU", r["gpu_model"])
    t.add_row("memory (as reported)", fmt_gib(r["memory_capacity_bytes"]))
    t.add_row("memory bandwidth", fmt_rate_gb(r["memory_bandwidth_bytes_per_second"]))
    for dtype, flops in r["peak_flops"].items():
        t.add_row(f"dense peak {dtype}", f"{flops / 1e12:,.1f} TFLOP/s")
    t.add_row("GPUs per node x nodes", f"{r['gpus_per_node']} x {r['num_nodes']}")
    for key, label in (("intra_node_link", "intra-node"), ("inter_node_link", "inter-node"), ("host_link", "host link")):
        l = r[key]
        t.add_row(
            label,
            f"{l['kind']} {fmt_rate_gb(l['bandwidth_bytes_per_second'])}/GPU/dir, "
            f"{l['latency_seconds'] * 1e6:.1f} us, eff {l['efficiency']:.2f}",
        )
    t.add_row("host memory per node", fmt_gib(r["host_memory_bytes_per_node"]))
    t.add_row("NVMe per node", f"{fmt_gib(r['nvme_capacity_bytes_per_node'])} at {fmt_rate_gb(r['nvme_bandwidth_bytes_per_second_per_node'])}")
    e = r["efficiency"]
    t.add_row("efficiency matmul / HBM", f"{e['matmul']:.2f} / {e['memory_bandwidth']:.2f}")
    if r["price_per_gpu_hour_usd"]:
        t.add_row("price per GPU-hour", f"${r['price_per_gpu_hour_usd']:.2f}")
    console.print(t)


def error_line(text: str) -> None:
    # The message is plain text: brackets in it (a pip extra, a list) are not rich markup.
    err_console.print(Text.assemble(("error:", "red"), " ", text), highlight=False, soft_wrap=True)


def file_written(path: Any, what: str) -> None:
    """A side file (a plot) was written: a log line on stderr, so stdout stays data."""
    err_console.print(f"{what} written to {path}", markup=False, highlight=False, soft_wrap=True)


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


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    return f"{s * 1e6:,.1f} us"


def _breakdown_table(title: str, columns: dict[str, dict[str, float]]) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("")
    for name in columns:
        t.add_column(name, justify="right")
        t.add_column("share", justify="right")
    keys = [k for k in next(iter(columns.values())) if k != "total"]
    for k in keys:
        if not any(col[k] for col in columns.values()):
            continue
        cells: list[str] = []
        for col in columns.values():
            cells += [fmt_seconds(col[k]), f"{100 * col[k] / col['total']:.1f}%" if col["total"] else "-"]
        t.add_row(k.replace("_", " "), *cells)
    total_cells: list[str] = []
    for col in columns.values():
        total_cells += [f"[bold]{fmt_seconds(col['total'])}[/bold]", "100%"]
    t.add_row("[bold]total[/bold]", *total_cells)
    return t


def _time_report(r: dict[str, Any]) -> None:
    tm = r["time"]
    if "step_seconds" in tm:
        console.print(_breakdown_table("Time per training step", {"step": tm["breakdown"]}))
        console.print(
            f"step {fmt_seconds(tm['step_seconds'])}; {tm['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU "
            f"({tm['tokens_per_second']:,.0f} in all); MFU {100 * tm['mfu']:.1f}%, HFU {100 * tm['hfu']:.1f}%"
        )
        return
    console.print(
        _breakdown_table(
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


# ----- recommend ------------------------------------------------------------------------------

PROGRESS_AFTER_SECONDS = 0.5  # searches shorter than this show no bar


@contextmanager
def progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback for long searches: a transient bar on stderr that appears only once
    the search has run for PROGRESS_AFTER_SECONDS (quick searches print nothing)."""
    start = time.monotonic()
    bar: Progress | None = None
    task = None

    def update(done: int, total: int) -> None:
        nonlocal bar, task
        if bar is None:
            if time.monotonic() - start < PROGRESS_AFTER_SECONDS or not err_console.is_terminal:
                return
            bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err_console, transient=True)
            bar.start()
            task = bar.add_task(label, total=total)
        bar.update(task, completed=done, total=total)  # type: ignore[arg-type]

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()


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


# ----- capacity -------------------------------------------------------------------------------


def _fmt_gpus(row: dict[str, Any]) -> list[str]:
    if row["min_num_gpus"] is None:
        return ["-", "-"]
    return [str(row["min_num_gpus"]), str(row["num_nodes"])]


def capacity_report(r: dict[str, Any]) -> None:
    from shardplan.search.explain import describe

    counts = r["gpu_counts_considered"]
    searched = f"GPU counts considered: {', '.join(map(str, counts[:6]))}{', ...' if len(counts) > 6 else ''} up to {r['max_gpus']} ({r['gpus_per_node']} per node)"
    if r["workload"] == "training":
        t = Table(title=f"{r['model']} on {r['hardware']}, training {r['seq_len']:,} tokens x {r['global_batch_size']} sequences: "
                        "fewest GPUs per ZeRO stage and offload", title_justify="left")
        for c in ("ZeRO", "offload", "GPUs", "nodes", "fastest layout there", "GiB/GPU", "free", "step"):
            t.add_column(c, justify="left" if c in ("offload", "fastest layout there") else "right")
        for row in r["rows"]:
            cells = [str(row["zero_stage"]), row["offload"], *_fmt_gpus(row)]
            if row["min_num_gpus"] is None:
                cells += ["not found", "-", "-", "-"]
            else:
                cells += [describe(row["plan"]), f"{units.bytes_to_gib(row['per_gpu_bytes']['total']):.1f}",
                          f"{units.bytes_to_gib(row['headroom_bytes']):.1f}", fmt_seconds(row["step_seconds"])]
            t.add_row(*cells)
        console.print(t)
        for row in r["rows"]:
            if row["not_found"]:
                console.print(f"ZeRO {row['zero_stage']}, offload {row['offload']}: {row['not_found']}")
        console.print(searched)
        return
    tps = [p["tp"] for p in r["formats"][0]["per_tp"]]
    t = Table(title=f"{r['model']} on {r['hardware']}, serving {r['concurrency']} sequence(s) of {r['max_model_len']:,} tokens: "
                    "fewest GPUs per weight format", title_justify="left",
              caption=f"tp=N: one replica of N GPUs (pp=1): longest context at {r['concurrency']} sequence(s) / "
                      f"most sequences of {r['max_model_len']:,} tokens", caption_justify="left")
    for c in ("weights", "GPUs", "nodes", "layout", "weights/GPU", "KV cache/GPU", "seqs held"):
        t.add_column(c, justify="left" if c in ("weights", "layout") else "right")
    for tp in tps:
        t.add_column(f"tp={tp}", justify="right")
    for row in r["formats"]:
        cells = [row["weight_dtype"], *_fmt_gpus(row)]
        if row["min_num_gpus"] is None:
            cells += ["not found", "-", "-", "-"]
        else:
            p, b = row["plan"], row["per_gpu_bytes"]
            cells += [f"tp={p['tp']} pp={p['pp']}" + (f" ep={p['ep']}" if p["ep"] > 1 else ""),
                      fmt_gib(b["weights"]), fmt_gib(b["kv_cache"]), f"{row['kv_cache']['max_concurrency']:.1f}"]
        by_tp = {p["tp"]: p for p in row["per_tp"]}
        for tp in tps:
            p = by_tp.get(tp)
            cells.append("-" if p is None or not p["longest_context_tokens"] else f"{p['longest_context_tokens']:,} / {p['most_sequences']:,}")
        t.add_row(*cells)
    console.print(t)
    q = r["quantization_removes_sharding"]
    if q:
        dense = f"{q['dense_min_num_gpus']} GPUs" if q["dense_min_num_gpus"] else f"more than {r['max_gpus']} GPUs"
        console.print(f"[green]{q['weight_dtype']} weights fit on one GPU: quantization removes the need to shard[/green] "
                      f"({q['dense_weight_dtype']} needs {dense})")
    for row in r["formats"]:
        if row["not_found"]:
            console.print(f"{row['weight_dtype']}: {row['not_found']}")
    console.print(f"{searched}; memory budget {r['gpu_memory_utilization']:g} x device memory (vLLM); "
                  f"KV cache {r['kv_cache_dtype']}", highlight=False)


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


def export_report(result: dict[str, Any], *, written: bool) -> None:
    """Written: one line per file. Not written: the files' text on stdout, raw (no markup), each
    under a `==> name <==` line when there are several (as `head` prints several files)."""
    files = result["files"]
    if written:
        for f in files:
            console.print(f"{result['target']}: wrote {f['path']} ({f['bytes']:,} bytes)", markup=False, highlight=False)
        return
    for i, f in enumerate(files):
        if len(files) > 1:
            sys.stdout.write(("\n" if i else "") + f"==> {f['name']} <==\n")
        sys.stdout.write(f["text"])
    sys.stdout.flush()


def fmt_bytes(n_bytes: float) -> str:
    """GiB from 1 GiB up, else MiB (a proxy model's tensors are megabytes)."""
    if n_bytes >= units.BYTES_PER_GIB:
        return fmt_gib(n_bytes)
    return f"{n_bytes / units.BYTES_PER_MIB:.2f} MiB"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def verify_report(r: dict[str, Any]) -> None:
    """Predicted against measured per rank and memory component, the numerics check, time."""
    run = r["run"]
    mdl = run["model"]
    status = "[green]ok[/green]" if r["status"] == "ok" else "[red]mismatch[/red]"
    console.print(f"verify {r['plan']}: {status} ({r['backend']} on {r['device']}, {r['world_size']} ranks, "
                  f"{run['scale']} model: hidden {mdl['hidden_size']}, {mdl['num_layers']} layers, "
                  f"{mdl['num_attention_heads']}/{mdl['num_kv_heads']} heads, vocab {mdl['vocab_size']}; {run['dtype']})")
    console.print("work: " + ", ".join(f"{k} {v}" for k, v in run["work"].items()), highlight=False)
    t = Table(title="memory per rank: measured vs the cost model applied to what ran", title_justify="left")
    axes = ("pp", "dp", "cp", "tp") if r["world_size"] > 1 and any(rank.get("cp") for rank in r["ranks"]) else ("pp", "dp", "tp")
    for col in ("rank", "/".join(axes), "component", "measured", "predicted", "error", "tolerance", ""):
        t.add_column(col, justify="right" if col in ("measured", "predicted", "error", "tolerance") else "left")
    for rank in r["ranks"]:
        coords = "/".join(str(rank.get(a, 0)) for a in axes)
        for i, c in enumerate(rank["components"]):
            mark = "[green]ok[/green]" if c["ok"] else "[red]OUT[/red]"
            tol = "-" if c["tolerance"] is None else f"{c['tolerance']:.0%}"
            t.add_row(str(rank["rank"]) if i == 0 else "", coords if i == 0 else "",
                      c["component"], fmt_bytes(c["measured_bytes"]), fmt_bytes(c["predicted_bytes"]),
                      _pct(c["relative_error"]), tol, mark)
        t.add_section()
    console.print(t)
    n = r["numerics"]
    if not n.get("checked", True):
        console.print(f"numerics: {n['check']}")
    else:
        err = n.get("max_relative_error", n.get("max_abs_error"))
        mark = "[green]match[/green]" if n["ok"] else "[red]DIFFER[/red]"
        console.print(f"numerics ({n['check']}) vs the unsharded reference: {mark}, max error {err:.2e} "
                      f"(tolerance {n['tolerance']:.0e})")
    tm = r["time"]
    measured = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in tm["measured"].items())
    predicted = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in tm["predicted"].items())
    console.print(f"time: measured {measured}; predicted {predicted}" +
                  ("" if tm["compared"] else f" (not compared: {tm['reason']})"), highlight=False)
    probes = [p for p in r.get("probes", []) if "error" not in p]
    if probes:
        first = probes[0]
        parts = [f"{first['matmul_dtype']} matmul {max(p['matmul_flops_per_second'] for p in probes) / 1e12:.1f} TFLOP/s",
                 f"memory {max(p['memory_bytes_per_second'] for p in probes) / 1e9:.0f} GB/s"]
        if first.get("all_reduce_bus_bytes_per_second"):
            parts.append(f"all-reduce bus {first['all_reduce_bus_bytes_per_second'] / 1e9:.1f} GB/s")
        console.print(f"hardware probes ({first['device_name']}, best rank): {', '.join(parts)}; "
                      "`shardplan calibrate REPORT` makes a profile of them", highlight=False)
    for note in run["notes"]:
        console.print(f"note: {note}", highlight=False)
    for mm in r["mismatches"]:
        console.print(f"[red]out of tolerance:[/red] {mm}", highlight=False)


def calibrate_report(r: dict[str, Any]) -> None:
    t = Table(title=f"{r['name']}: efficiencies measured (base {r['base']})", title_justify="left")
    for c in ("field", "base", "measured", "what", "figure"):
        t.add_column(c, justify="right" if c in ("base", "measured") else "left")
    for c in r["changes"]:
        scale = 1e12 if c["unit"] == "TFLOP/s" else 1e9
        t.add_row(c["field"], f"{c['old']:.3f}", f"{c['new']:.3f}", c["what"],
                  f"{c['measured'] / scale:.4g} of {c['peak'] / scale:.4g} {c['unit']}")
    console.print(t)
    for note in r["notes"]:
        console.print(f"note: {note}", highlight=False)
    console.print(f"profile written to {r['profile']}; use it with --hardware {r['profile']}", highlight=False)


# ----- checkpoint and replan -------------------------------------------------------------------


def checkpoint_report(r: dict[str, Any]) -> None:
    console.print(
        f"[bold]{r['model']}[/bold] checkpoint {r['checkpoint']}: {r['num_tensors']} tensors ({r['dtype']}) in "
        f"{len(r['files'])} file(s), {fmt_bytes(r['checkpoint_tensor_bytes'])} of tensors; names, shapes and dtypes "
        "match the model", highlight=False)
    t = Table(title=f"What each rank of {r['plan']} reads", title_justify="left")
    for c in ("rank", "node", "tensors", "files", "reads", "runs", "bytes"):
        t.add_column(c, justify="right", no_wrap=True)
    for rk in r["ranks"]:
        t.add_row(str(rk["rank"]), str(rk["node"]), str(rk["num_tensors"]), str(len(rk["files"])),
                  f"{sum(f['num_reads'] for f in rk['files']):,}", f"{sum(f['num_runs'] for f in rk['files']):,}",
                  fmt_bytes(rk["bytes"]))
    console.print(t)
    nodes = ", ".join(f"node {n['node']} {fmt_bytes(n['bytes'])}" for n in r["nodes"])
    console.print(f"per node: {nodes}; all ranks {fmt_bytes(r['total_read_bytes'])} = {r['replication']:.4f} x the "
                  "checkpoint (the plan's replication); byte ranges per file in --json", highlight=False)


def _degrees(plan: dict[str, Any]) -> str:
    """A layout's degrees in a few characters: tp, pp, dp, and what else is on."""
    parts = [f"tp{plan['tp']}", f"pp{plan['pp']}", f"dp{plan.get('dp', plan.get('replicas', 1))}"]
    parts += [f"{k}{plan[k]}" for k in ("cp", "ep") if plan.get(k, 1) > 1]
    if plan.get("zero_stage"):
        parts.append(f"zero{plan['zero_stage']}")
    return " ".join(parts)


def replan_report(r: dict[str, Any]) -> None:
    f = r["from"]
    console.print(
        f"[bold]{r['model']}[/bold] on {r['hardware']}, {r['workload']}: {f['num_gpus']} -> {r['to_num_gpus']} GPUs, "
        f"objective {r['objective']}; {r['num_evaluated']:,} layouts evaluated, {r['num_feasible']:,} fit", highlight=False)
    if r["candidates"]:
        t = Table(title=f"Candidates (* chosen: the least moved within {r['margin']:.0%} of the best; dim: outside)",
                  title_justify="left")
        for c in ("#", "layout", "gap", "moved", "intra-node", "inter-node", "max/rank"):
            t.add_column(c, justify="left" if c == "layout" else "right", no_wrap=c != "layout")
        for c in r["candidates"]:
            route = c["moved_bytes_by_route"]
            t.add_row(f"{c['rank']}{'*' if c['chosen'] else ''}", _degrees(c["plan"]), f"{100 * c['gap_fraction']:.1f}%",
                      fmt_bytes(c["moved_bytes"]), fmt_bytes(route["intra_node"]), fmt_bytes(route["inter_node"]),
                      fmt_bytes(c["max_received_bytes_per_rank"]), style=None if c["within_margin"] else "dim")
        console.print(t)
    mv = r["moves"]
    if mv is None:
        console.print(f"[red]no layout fits on {r['to_num_gpus']} GPUs[/red]")
        return
    states = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mv["moved_bytes_by_state"].items()) or "nothing"
    console.print(f"chosen #{r['chosen']}: {mv['num_moves']:,} slices move ({states}); {fmt_bytes(mv['kept_bytes'])} "
                  "stays on its GPU", highlight=False)
    t = Table(title="Per new rank", title_justify="left")
    for c in ("rank", "node", "kept", "received", "from other nodes", "from old ranks"):
        t.add_column(c, justify="left" if c == "from old ranks" else "right", no_wrap=c != "from old ranks")
    for rk in mv["ranks"]:
        src = rk["sources"]
        t.add_row(str(rk["rank"]), str(rk["node"]), fmt_bytes(rk["kept_bytes"]), fmt_bytes(rk["received_bytes"]),
                  fmt_bytes(rk["received_inter_node_bytes"]),
                  ", ".join(map(str, src[:8])) + (f" (+{len(src) - 8})" if len(src) > 8 else ""))
    console.print(t)
    if r["manifest"]:
        console.print(f"manifest written to {r['manifest']}")
    if r["moves_file"]:
        console.print(f"move list written to {r['moves_file']}")
