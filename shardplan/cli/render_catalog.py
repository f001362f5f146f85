"""Tables for `models` and `hardware`."""

from __future__ import annotations


from rich.table import Table

from shardplan.cli.render_common import console, fmt_count, fmt_gib, fmt_rate_gb
from shardplan.tasks.catalog import HardwareReport, ModelReport


def models_table(rows: list[ModelReport]) -> None:
    t = Table(title="Bundled models", title_justify="left")
    for col in ("name", "type", "params", "active", "layers", "attention", "KV/token (bf16)"):
        # identifiers (the name to pass back, the HF type) never wrap; figures may
        t.add_column(col, justify="right" if col not in ("name", "type", "attention") else "left",
                     no_wrap=col in ("name", "type"))
    for r in rows:
        d = r.derived
        t.add_row(
            r.name,
            r.model_type,
            fmt_count(r.num_params),
            fmt_count(r.num_active_params),
            str(d.num_layers),
            d.attention_kind,
            f"{r.kv_cache_bytes_per_token / 1024:,.1f} KiB",
        )
    console.print(t)


def model_detail(r: ModelReport) -> None:
    console.print(f"[bold]{r.name}[/bold]  ({r.model_type}, from {r.origin})")
    t = Table(title="Parameters by component", title_justify="left")
    t.add_column("component")
    t.add_column("parameters", justify="right")
    t.add_column("share", justify="right")
    total = r.num_params
    for comp, n in r.params_by_component.items():
        t.add_row(comp, f"{n:,}", f"{100 * n / total:.1f}%")
    t.add_row("[bold]total[/bold]", f"[bold]{total:,}[/bold]", "100%")
    t.add_row("active per token", f"{r.num_active_params:,}", f"{100 * r.num_active_params / total:.1f}%")
    if r.num_mtp_params:
        t.add_row("MTP modules (not in total)", f"{r.num_mtp_params:,}", "")
    if r.published_num_params:
        diff = total - r.published_num_params
        t.add_row("published", f"{r.published_num_params:,}", "match" if diff == 0 else f"{diff:+,}")
    console.print(t)
    d = r.derived
    facts = Table(title="Derived", title_justify="left", show_header=False)
    facts.add_column("what")
    facts.add_column("value", justify="right")
    facts.add_row("attention", d.attention_kind)
    facts.add_row("heads / KV heads", f"{d.num_attention_heads} / {d.num_kv_heads}")
    if d.head_dim:
        facts.add_row("head_dim", str(d.head_dim))
    if d.mla:
        m = d.mla
        facts.add_row("MLA kv_lora_rank + rope dim", f"{m.kv_lora_rank} + {m.qk_rope_head_dim}")
    facts.add_row("KV cache per token (bf16, all layers)", f"{r.kv_cache_bytes_per_token:,.0f} B")
    facts.add_row("weights at bf16", fmt_gib(d.weights_bytes_bf16))
    if d.sliding_window_tokens:
        facts.add_row("sliding-window layers", f"{d.num_sliding_window_layers} of {d.num_layers} ({d.sliding_window_tokens} tokens)")
    if d.num_experts is not None:
        facts.add_row(
            "experts",
            f"{d.num_experts} routed, top-{d.num_experts_per_token}, {d.num_shared_experts} shared, "
            f"{d.num_moe_layers} MoE layers",
        )
    console.print(facts)


def hardware_table(rows: list[HardwareReport]) -> None:
    t = Table(title="Bundled hardware profiles", title_justify="left")
    for col in ("name", "GPU", "memory", "HBM", "bf16 dense", "GPUs/node", "intra-node", "inter-node"):
        t.add_column(col, justify="left" if col in ("name", "GPU") else "right", no_wrap=col == "name")
    for r in rows:
        peak = r.peak_flops.get("bf16") or r.peak_flops.get("fp16")
        t.add_row(
            r.name,
            r.gpu_model,
            fmt_gib(r.memory_capacity_bytes),
            fmt_rate_gb(r.memory_bandwidth_bytes_per_second),
            f"{peak / 1e12:,.0f} TFLOP/s",
            str(r.gpus_per_node),
            f"{r.intra_node_link.kind} {fmt_rate_gb(r.intra_node_link.bandwidth_bytes_per_second)}",
            f"{r.inter_node_link.kind} {fmt_rate_gb(r.inter_node_link.bandwidth_bytes_per_second)}",
        )
    console.print(t)


def hardware_detail(r: HardwareReport) -> None:
    console.print(f"[bold]{r.name}[/bold]: {r.description}")
    t = Table(show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("GPU", r.gpu_model)
    t.add_row("memory (as reported)", fmt_gib(r.memory_capacity_bytes))
    t.add_row("memory bandwidth", fmt_rate_gb(r.memory_bandwidth_bytes_per_second))
    for dtype, flops in r.peak_flops.items():
        t.add_row(f"dense peak {dtype}", f"{flops / 1e12:,.1f} TFLOP/s")
    t.add_row("GPUs per node x nodes", f"{r.gpus_per_node} x {r.num_nodes}")
    for key, label in (("intra_node_link", "intra-node"), ("inter_node_link", "inter-node"), ("host_link", "host link")):
        l = getattr(r, key)
        t.add_row(
            label,
            f"{l.kind} {fmt_rate_gb(l.bandwidth_bytes_per_second)}/GPU/dir, "
            f"{l.latency_seconds * 1e6:.1f} us, eff {l.efficiency:.2f}",
        )
    t.add_row("host memory per node", fmt_gib(r.host_memory_bytes_per_node))
    t.add_row("NVMe per node", f"{fmt_gib(r.nvme_capacity_bytes_per_node)} at {fmt_rate_gb(r.nvme_bandwidth_bytes_per_second_per_node)}")
    e = r.efficiency
    t.add_row("efficiency matmul / HBM", f"{e.matmul:.2f} / {e.memory_bandwidth:.2f}")
    if r.price_per_gpu_hour_usd:
        t.add_row("price per GPU-hour", f"${r.price_per_gpu_hour_usd:.2f}")
    console.print(t)
