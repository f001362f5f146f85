"""`models` and `hardware`: typed reports of catalog entries (ModelReport, HardwareReport).

`--json` prints `model_dump(mode="json")` of exactly these objects; the tables render the same
objects, so the two never disagree.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, RootModel

from shardplan import units
from shardplan.cost.kv import kv_cache_bytes_per_token, kv_elements_per_token_per_layer
from shardplan.cost.params import count_params
from shardplan.specs.hardware import HardwareProfile, Link
from shardplan.specs.loading import LoadedModel
from shardplan.tasks._results import Result, absent


class MlaReport(Result):
    """Multi-head latent attention ranks (DeepSeek); sizes in elements."""

    q_lora_rank: int | None = Field(description="query compression rank (elements); None: no query compression")
    kv_lora_rank: int = Field(description="compressed KV rank cached per token per layer (elements)")
    qk_rope_head_dim: int = Field(description="decoupled RoPE key dimension per head (elements)")
    qk_nope_head_dim: int = Field(description="non-RoPE query/key dimension per head (elements)")
    v_head_dim: int = Field(description="value dimension per head (elements)")


class DerivedFacts(Result):
    """Facts derived from the architecture. MoE keys are present only for MoE models, `mla`
    only for MLA models."""

    attention_kind: str = Field(description="mha, gqa, mqa or mla")
    num_attention_heads: int = Field(description="query heads")
    num_kv_heads: int = Field(description="key/value heads")
    head_dim: int | None = Field(description="elements per head; None for MLA (see mla)")
    kv_cache_elements_per_token_per_layer: int = Field(description="KV cache elements one token keeps in one full-attention layer")
    num_layers: int = Field(description="transformer layers")
    num_sliding_window_layers: int = Field(description="layers with sliding-window attention")
    sliding_window_tokens: int | None = Field(description="sliding window (tokens); None: no sliding window")
    weights_bytes_bf16: float = Field(description="all parameters at 2 bytes each (bytes)")
    mla: MlaReport | None = absent("MLA ranks (MLA models only)")
    num_experts: int | None = absent("routed experts per MoE layer (MoE only)")
    num_experts_per_token: int | None = absent("routed experts each token uses (MoE only)")
    num_shared_experts: int | None = absent("always-active experts (MoE only)")
    num_moe_layers: int | None = absent("layers whose MLP is MoE (MoE only)")


class ModelReport(Result):
    """`shardplan models show --json`, and one row of `shardplan models --json`."""

    name: str = Field(description="catalog name of the model")
    model_type: str = Field(description="Hugging Face model_type")
    origin: str = Field(description="the file the spec came from")
    hf_id: str | None = Field(description="Hugging Face repository id, when known")
    num_params: int = Field(description="parameters in total (count)")
    num_active_params: int = Field(description="parameters used per token (count; MoE: routed top-k only)")
    num_mtp_params: int = Field(description="multi-token-prediction module parameters, not in num_params (count)")
    published_num_params: int | None = Field(description="the publisher's parameter count, when given (count)")
    params_by_component: dict[str, int] = Field(description="parameter count per component; sums to num_params")
    kv_cache_bytes_per_token: float = Field(description="KV cache of one token over all layers at bf16 (bytes)")
    derived: DerivedFacts
    architecture: dict[str, Any] = Field(description="the model spec as shardplan holds it (less name and source)")
    sources: dict[str, str] | None = Field(description="where each figure comes from")
    notes: str | None = Field(description="free-text notes of the catalog entry")


class ModelList(RootModel[list[ModelReport]]):
    """`shardplan models --json`: a JSON list of ModelReport."""


class LinkReport(Result):
    """One interconnect, per GPU per direction."""

    kind: str = Field(description="nvlink, nvswitch, pcie, infiniband, ethernet, ...")
    bandwidth_bytes_per_second: float = Field(description="per GPU per direction (bytes/s, decimal)")
    latency_seconds: float = Field(description="per hop (seconds)")
    efficiency: float = Field(description="share of bandwidth_bytes_per_second collectives reach (0-1)")


class EfficiencyReport(Result):
    """The profile's efficiencies (fractions of peak, 0-1) and per-kernel overheads (seconds)."""

    matmul: float
    memory_bandwidth: float
    nvme: float
    matmul_fp8: float
    matmul_half_dim: float = Field(description="GEMM dimension at which half the matmul efficiency is reached (elements)")
    attention: float
    kernel_overhead_seconds: float
    kernel_launch_seconds: float
    overlap_compute_share: float
    intra_node_link: float
    inter_node_link: float
    host_link: float


class HardwareReport(Result):
    """`shardplan hardware show --json`, and one row of `shardplan hardware --json`."""

    name: str = Field(description="catalog name of the profile")
    description: str
    gpu_model: str = Field(description="the GPU's product name (nvidia-smi)")
    num_gpus: int = Field(description="GPUs in all (count)")
    gpus_per_node: int = Field(description="GPUs per node (count)")
    num_nodes: int = Field(description="nodes (count)")
    memory_capacity_bytes: int = Field(description="device memory per GPU (bytes)")
    memory_bandwidth_bytes_per_second: float = Field(description="device memory bandwidth per GPU (bytes/s, decimal)")
    peak_flops: dict[str, float] = Field(description="dense peak per dtype (FLOP/s)")
    intra_node_link: LinkReport
    inter_node_link: LinkReport
    host_link: LinkReport
    host_memory_bytes_per_node: int = Field(description="host RAM per node (bytes)")
    nvme_capacity_bytes_per_node: int = Field(description="NVMe capacity per node (bytes)")
    nvme_bandwidth_bytes_per_second_per_node: float = Field(description="NVMe read bandwidth per node (bytes/s, decimal)")
    efficiency: EfficiencyReport
    price_per_gpu_hour_usd: float | None = Field(description="rental price per GPU-hour (USD), when known")
    sources: dict[str, str] = Field(description="where each figure comes from")


class HardwareList(RootModel[list[HardwareReport]]):
    """`shardplan hardware --json`: a JSON list of HardwareReport."""


def model_report(m: LoadedModel) -> ModelReport:
    spec = m.spec
    counts = count_params(spec)
    bf16 = units.bytes_per_element(units.DType.BF16)
    moe: dict[str, Any] = {}
    if spec.moe is not None:
        moe = dict(num_experts=spec.moe.num_experts, num_experts_per_token=spec.moe.num_experts_per_token,
                   num_shared_experts=spec.moe.num_shared_experts, num_moe_layers=spec.num_moe_layers)
    derived = DerivedFacts(
        attention_kind=spec.attention_kind.value,
        num_attention_heads=spec.num_attention_heads,
        num_kv_heads=spec.kv_heads,
        head_dim=spec.attention_head_dim if spec.mla is None else None,
        kv_cache_elements_per_token_per_layer=kv_elements_per_token_per_layer(spec),
        num_layers=spec.num_layers,
        num_sliding_window_layers=spec.num_sliding_layers,
        sliding_window_tokens=spec.sliding_window,
        weights_bytes_bf16=counts.total * bf16,
        mla=MlaReport(**spec.mla.model_dump()) if spec.mla is not None else None,
        **moe,
    )
    return ModelReport(
        name=spec.name,
        model_type=spec.model_type,
        origin=m.origin,
        hf_id=m.hf_id,
        num_params=counts.total,
        num_active_params=counts.active_per_token,
        num_mtp_params=counts.mtp,
        published_num_params=m.published_num_params,
        params_by_component=counts.by_component,
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(spec, bf16),
        derived=derived,
        architecture=spec.model_dump(mode="json", exclude={"name", "source"}),
        sources=m.sources,
        notes=m.notes,
    )


def _link(link: Link) -> LinkReport:
    return LinkReport(kind=link.kind.value, bandwidth_bytes_per_second=link.bandwidth_bytes_per_second,
                      latency_seconds=link.latency_seconds, efficiency=link.efficiency)


def hardware_report(hw: HardwareProfile) -> HardwareReport:
    return HardwareReport(
        name=hw.name,
        description=hw.description,
        gpu_model=hw.gpu_model,
        num_gpus=hw.num_gpus,
        gpus_per_node=hw.gpus_per_node,
        num_nodes=hw.num_nodes,
        memory_capacity_bytes=hw.memory_capacity_bytes,
        memory_bandwidth_bytes_per_second=hw.memory_bandwidth_bytes_per_second,
        peak_flops={d.value: f for d, f in hw.peak_flops.items()},
        intra_node_link=_link(hw.intra_node),
        inter_node_link=_link(hw.inter_node),
        host_link=_link(hw.host_link),
        host_memory_bytes_per_node=hw.host_memory_bytes_per_node,
        nvme_capacity_bytes_per_node=hw.nvme_capacity_bytes_per_node,
        nvme_bandwidth_bytes_per_second_per_node=hw.nvme_bandwidth_bytes_per_second_per_node,
        efficiency=EfficiencyReport(
            matmul=hw.matmul_efficiency,
            memory_bandwidth=hw.memory_bandwidth_efficiency,
            nvme=hw.nvme_efficiency,
            matmul_fp8=hw.matmul_fp8_efficiency,
            matmul_half_dim=hw.matmul_half_dim,
            attention=hw.attention_efficiency,
            kernel_overhead_seconds=hw.kernel_overhead_seconds,
            kernel_launch_seconds=hw.kernel_launch_seconds,
            overlap_compute_share=hw.overlap_compute_share,
            intra_node_link=hw.intra_node.efficiency,
            inter_node_link=hw.inter_node.efficiency,
            host_link=hw.host_link.efficiency,
        ),
        price_per_gpu_hour_usd=hw.price_per_gpu_hour_usd,
        sources=hw.sources,
    )


def model_list(models: list[LoadedModel]) -> ModelList:
    return ModelList([model_report(m) for m in models])


def hardware_list(profiles: list[HardwareProfile]) -> HardwareList:
    return HardwareList([hardware_report(h) for h in profiles])
