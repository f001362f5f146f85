"""Plain-data reports (dicts) for the CLI's --json and for render.py's tables.

`--json` prints exactly these objects; the tables render the same objects, so the two
never disagree.
"""

from __future__ import annotations

from typing import Any

from shardplan import units
from shardplan.cost.kv import kv_cache_bytes_per_token, kv_elements_per_token_per_layer
from shardplan.cost.params import count_params
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.loading import LoadedModel


def model_report(m: LoadedModel) -> dict[str, Any]:
    spec = m.spec
    counts = count_params(spec)
    bf16 = units.bytes_per_element(units.DType.BF16)
    derived: dict[str, Any] = {
        "attention_kind": spec.attention_kind.value,
        "num_attention_heads": spec.num_attention_heads,
        "num_kv_heads": spec.kv_heads,
        "head_dim": spec.attention_head_dim if spec.mla is None else None,
        "kv_cache_elements_per_token_per_layer": kv_elements_per_token_per_layer(spec),
        "num_layers": spec.num_layers,
        "num_sliding_window_layers": spec.num_sliding_layers,
        "sliding_window_tokens": spec.sliding_window,
        "weights_bytes_bf16": counts.total * bf16,
    }
    if spec.mla is not None:
        derived["mla"] = spec.mla.model_dump()
    if spec.moe is not None:
        derived.update(
            num_experts=spec.moe.num_experts,
            num_experts_per_token=spec.moe.num_experts_per_token,
            num_shared_experts=spec.moe.num_shared_experts,
            num_moe_layers=spec.num_moe_layers,
        )
    return {
        "name": spec.name,
        "model_type": spec.model_type,
        "origin": m.origin,
        "hf_id": m.hf_id,
        "num_params": counts.total,
        "num_active_params": counts.active_per_token,
        "num_mtp_params": counts.mtp,
        "published_num_params": m.published_num_params,
        "params_by_component": counts.by_component,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(spec, bf16),
        "derived": derived,
        "architecture": spec.model_dump(mode="json", exclude={"name", "source"}),
        "sources": m.sources,
        "notes": m.notes,
    }


def hardware_report(hw: HardwareProfile) -> dict[str, Any]:
    def link(l: Any) -> dict[str, Any]:
        return {
            "kind": l.kind.value,
            "bandwidth_bytes_per_second": l.bandwidth_bytes_per_second,
            "latency_seconds": l.latency_seconds,
            "efficiency": l.efficiency,
        }

    return {
        "name": hw.name,
        "description": hw.description,
        "gpu_model": hw.gpu_model,
        "num_gpus": hw.num_gpus,
        "gpus_per_node": hw.gpus_per_node,
        "num_nodes": hw.num_nodes,
        "memory_capacity_bytes": hw.memory_capacity_bytes,
        "memory_bandwidth_bytes_per_second": hw.memory_bandwidth_bytes_per_second,
        "peak_flops": {d.value: f for d, f in hw.peak_flops.items()},
        "intra_node_link": link(hw.intra_node),
        "inter_node_link": link(hw.inter_node),
        "host_link": link(hw.host_link),
        "host_memory_bytes_per_node": hw.host_memory_bytes_per_node,
        "nvme_capacity_bytes_per_node": hw.nvme_capacity_bytes_per_node,
        "nvme_bandwidth_bytes_per_second_per_node": hw.nvme_bandwidth_bytes_per_second_per_node,
        "efficiency": {
            "matmul": hw.matmul_efficiency,
            "memory_bandwidth": hw.memory_bandwidth_efficiency,
            "nvme": hw.nvme_efficiency,
            "matmul_fp8": hw.matmul_fp8_efficiency,
            "matmul_half_dim": hw.matmul_half_dim,
            "attention": hw.attention_efficiency,
            "kernel_overhead_seconds": hw.kernel_overhead_seconds,
            "kernel_launch_seconds": hw.kernel_launch_seconds,
            "overlap_compute_share": hw.overlap_compute_share,
            "intra_node_link": hw.intra_node.efficiency,
            "inter_node_link": hw.inter_node.efficiency,
            "host_link": hw.host_link.efficiency,
        },
        "price_per_gpu_hour_usd": hw.price_per_gpu_hour_usd,
        "sources": hw.sources,
    }
