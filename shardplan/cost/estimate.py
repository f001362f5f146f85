"""estimate(): one layout of one model on one cluster -> a typed CostReport (cost/report.py)."""

from __future__ import annotations

import math
from typing import Any

from shardplan.cost.breakdown import RankMemory
from shardplan.cost.kv import kv_cache_bytes_per_token
from shardplan.cost.speculative import draft_kv_bytes_per_token_per_rank, lookahead_tokens
from shardplan.cost.compute import expert_token_sets
from shardplan.cost.layout import Layout, PipelineSchedule, layout_stage_ranges, validate_layout
from shardplan.errors import LayoutError
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.memory_training import training_memory
from shardplan.cost.params import count_params
from shardplan.cost.report import (
    CostReport,
    HardwareReport,
    InferenceWorkloadReport,
    KvCacheReport,
    LatencyPercentiles,
    LoadReport,
    MemoryReport,
    ModelReport,
    OffloadReport,
    PlanReport,
    RankMemoryReport,
    ServingBreakdown,
    ServingTimeReport,
    TrainingMemoryReport,
    TrainingTimeReport,
    TrainingWorkloadReport,
)
from shardplan.cost.time_serving import SERVING_OVERLAP, best_batch, serving_time
from shardplan.cost.traffic import load_figures, requests_for
from shardplan.cost.serving_load import SCHEDULES
from shardplan.cost.offload import pageable_note
from shardplan.cost.time_training import OVERLAP, training_assumptions, training_time
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.units import bytes_per_element


def _rank_report(r: RankMemory, capacity: float, chunks: tuple[range, ...]) -> RankMemoryReport:
    return RankMemoryReport(
        stage=r.stage,
        layers=r.layers,
        layer_chunks=[(c.start, c.stop - 1) for c in chunks],
        num_ranks=r.num_ranks,
        per_gpu_bytes=r.breakdown.as_dict(),
        headroom_bytes=capacity - r.breakdown.total,
        reserved_bytes=r.reserved_bytes,
        largest_allocation_bytes=r.largest_allocation_bytes,
        largest_allocation=r.largest_allocation,
        detail_bytes=r.detail,
        host_offload_bytes=r.host_bytes,
        nvme_offload_bytes=r.nvme_bytes,
    )


def _memory_fields(ranks: list[RankMemory], worst: RankMemory, budget: float, capacity: float, layout: Layout,
                   num_layers: int) -> dict[str, Any]:
    # A stage's `layers` is its first and last layer; interleaved stages hold several chunks.
    chunks = layout_stage_ranges(num_layers, layout)
    return dict(
        per_gpu_bytes=worst.breakdown.as_dict(),
        binding_stage=worst.stage,
        binding_component=_binding_component(worst),
        budget_bytes=budget,
        headroom_bytes=capacity - worst.breakdown.total,
        per_rank=[_rank_report(r, capacity, chunks[r.stage]) for r in ranks],
    )


def _binding_component(r: RankMemory) -> str:
    parts = {k: v for k, v in r.breakdown.as_dict().items() if k != "total"}
    return max(parts, key=lambda k: parts[k])


def plan_report(layout: Layout, num_layers: int) -> PlanReport:
    return PlanReport(
        stage_layers=[sum(len(r) for r in chunks) for chunks in layout_stage_ranges(num_layers, layout)],
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        ep=layout.ep,
        etp=layout.expert_tp,
        cp=layout.cp,
        zero_stage=layout.zero_stage,
        hybrid_shard=layout.hybrid_shard,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute.value,
        pp_schedule=layout.pp_schedule.value,
        virtual_stages=layout.virtual_stages,
        micro_batch_size=layout.micro_batch_size,
        offload=OffloadReport(optimizer=layout.offload_optimizer.value, params=layout.offload_params.value,
                              layers=layout.offload_layers),
    )


def estimate(
    spec: ModelSpec,
    hw: HardwareProfile,
    layout: Layout,
    workload: InferenceWorkload | TrainingWorkload,
) -> CostReport:
    training = isinstance(workload, TrainingWorkload)
    validate_layout(spec, layout, hw.num_gpus, training=training)
    counts = count_params(spec)
    capacity = float(hw.memory_capacity_bytes)
    common: dict[str, Any] = dict(
        model=ModelReport(name=spec.name, num_params=counts.total, num_active_params=counts.active_per_token),
        hardware=HardwareReport(name=hw.name, num_gpus=hw.num_gpus, gpus_per_node=hw.gpus_per_node,
                                num_nodes=hw.num_nodes, memory_capacity_bytes=hw.memory_capacity_bytes),
        workload=(TrainingWorkloadReport(kind="training", **_workload_dict(workload)) if training
                  else InferenceWorkloadReport(kind="inference", **_workload_dict(workload, layout.tp))),
        plan=plan_report(layout, spec.num_layers),
    )
    if training:
        _check_batch(layout, workload)  # type: ignore[arg-type]
        tm = training_memory(spec, hw, layout, workload)  # type: ignore[arg-type]
        worst = max(tm.ranks, key=lambda r: r.breakdown.total)
        memory = TrainingMemoryReport(
            **_memory_fields(tm.ranks, worst, capacity, capacity, layout, spec.num_layers),
            host_offload_bytes_per_node=tm.host_bytes_per_node,
            nvme_offload_bytes_per_node=tm.nvme_bytes_per_node,
            num_microbatches=tm.num_microbatches,
        )
        time = _training_time(spec, hw, layout, workload, tm.num_microbatches)  # type: ignore[arg-type]
        time = time.model_copy(update={"plan_fits": tm.fits})
        return CostReport(**common, fits=tm.fits, reason=tm.reason, memory=memory, time=time,
                          assumptions=training_assumptions(hw, workload, spec))  # type: ignore[arg-type]
    sm = serving_memory(spec, hw, layout, workload)  # type: ignore[arg-type]
    # The binding rank is the one with the least KV room.
    worst = min(sm.ranks, key=lambda r: r.breakdown.kv_cache)
    kv_elt = bytes_per_element(workload.kv_cache_dtype or workload.activation_dtype)  # type: ignore[union-attr]
    kv = KvCacheReport(
        bytes_per_token=kv_cache_bytes_per_token(spec, kv_elt) + (  # the drafter's layers, unsplit
            draft_kv_bytes_per_token_per_rank(spec, workload.speculative, 1, kv_elt) if workload.speculative else 0.0),  # type: ignore[union-attr]
        bytes_per_token_per_gpu=max(sm.kv_bytes_per_token_per_rank),
        capacity_tokens=sm.kv_capacity_tokens,
        num_blocks=sm.kv_num_blocks,
        block_size=workload.block_size,  # type: ignore[union-attr]
        max_model_len=sm.max_model_len,
        bytes_per_sequence=sm.kv_bytes_per_sequence,
        max_concurrency=sm.max_concurrency,
    )
    return CostReport(
        **common, fits=sm.fits, reason=sm.reason,
        memory=MemoryReport(**_memory_fields(sm.ranks, worst, sm.budget_bytes, capacity, layout, spec.num_layers)),
        kv_cache=kv, time=_serving_time(spec, hw, layout, workload, sm).model_copy(update={"plan_fits": sm.fits}),  # type: ignore[arg-type]
        assumptions=list(workload.assumptions) + [n for n in (pageable_note(hw, layout, workload),  # type: ignore[arg-type]
                                                              expert_group_note(layout)) if n],
        load=_load(spec, hw, layout, workload, sm) if sm.fits and workload.load is not None else None,  # type: ignore[union-attr,arg-type]
    )


def expert_group_note(layout: Layout) -> str | None:
    """The assumption to print when a serving plan's expert group spans replicas (ep x etp wider
    than tp): the engines align every step of those replicas, and so does the model under traffic."""
    k = expert_token_sets(layout)  # replicas whose tokens an expert group serves
    if layout.dp <= 1 or k <= 1 or k != int(k):
        return None
    return (f"the expert group (ep x etp = {layout.ep * layout.expert_tp}) spans {int(k)} replicas of tp={layout.tp}, "
            "which the engines run as one "
            "(vLLM data parallelism with --enable-expert-parallel, SGLang DP attention) and whose steps they align: "
            "every forward of the group waits for its slowest rank (a prompt chunk on one stalls the others' decodes; "
            "idle ranks run one-token passes, docs.vllm.ai serving/data_parallel_deployment). Under traffic shardplan "
            f"steps the {int(k)} replicas together, each with its own scheduler, cache and share of the requests: a "
            "step lasts as long as the slowest replica's own work plus the experts' work over the group's tokens "
            "(cost/serving_load.py simulate_group); a static batch is the same on every replica "
            "(docs/research/dp-attention-groups.md)")


def _load(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, sm: Any) -> LoadReport:
    f = load_figures(spec, hw, layout, wl, sm.kv_account, itl=True)
    r, load = f.replica, wl.load
    assert load is not None  # checked by the caller
    reqs = requests_for(wl, load, max(1, r.num_requests))
    return LoadReport(
        request_rate=None if math.isinf(load.request_rate_per_second) else load.request_rate_per_second,
        max_concurrency=load.max_concurrency, num_requests=r.num_requests * f.num_replicas, lengths=load.lengths_name,
        mean_input_tokens=sum(p for p, _ in reqs) / len(reqs), mean_output_tokens=sum(o for _, o in reqs) / len(reqs),
        prefix_cache_hit=load.prefix_cache_hit_fraction, num_replicas=f.num_replicas,
        ttft_seconds=LatencyPercentiles(**vars(r.ttft_seconds)), tpot_seconds=LatencyPercentiles(**vars(r.tpot_seconds)),
        e2e_seconds=LatencyPercentiles(**vars(r.e2e_seconds)),
        itl_seconds=LatencyPercentiles(**vars(r.itl_seconds)) if r.itl_seconds is not None else None,
        request_throughput_per_second=f.request_throughput_per_second, output_tokens_per_second=f.output_tokens_per_second,
        output_tokens_per_second_per_gpu=f.output_tokens_per_second_per_gpu, total_tokens_per_second=f.total_tokens_per_second,
        saturation_request_rate=f.saturation_request_rate_per_second, saturated=f.saturated, num_steps=r.num_steps,
        num_preemptions=r.num_preemptions, num_refused=r.num_refused, peak_running=r.peak_running,
        mean_decode_batch=r.mean_decode_batch, schedule=SCHEDULES[wl.schedule if wl.chunked_prefill else "unchunked"],
        tokens_per_decode_step=f.tokens_per_decode_step,
    )


def _training_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, num_micro: int) -> TrainingTimeReport:
    t = training_time(spec, hw, layout, wl, num_micro)
    return TrainingTimeReport(
        step_seconds=t.step_seconds,
        tokens_per_second_per_gpu=t.tokens_per_second_per_gpu,
        tokens_per_second=t.tokens_per_second_per_gpu * layout.world_size,
        mfu=t.mfu,
        hfu=t.hfu,
        flop_convention=(
            "MFU: model FLOPs = 3 x the forward's FLOPs (every GEMM: 2 x active weights per token; attention "
            "scores and weighted sum as the kernel computes them, causal half with flash attention) per step, "
            "over the dense bf16/fp16 peak; HFU adds recomputation"
        ),
        model_flops_per_step=t.model_flops_per_step,
        hardware_flops_per_step=t.hardware_flops_per_step,
        breakdown=t.breakdown.as_dict(),
        overlap_assumptions=OVERLAP,
    )


def _serving_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, sm: Any) -> ServingTimeReport:
    # The batch: as asked, else the most sequences of input_len + output_len the KV cache holds.
    ctx = wl.input_len + wl.output_len + lookahead_tokens(wl.speculative)  # K lookahead slots per sequence
    fit_batch = sm.kv_account.sequences_held(ctx)
    limit = max(0, min(fit_batch, wl.max_num_seqs))
    batch = wl.batch_size if wl.batch_size is not None else max(1, limit)
    t = serving_time(spec, hw, layout, wl, batch)
    best = best_batch(spec, hw, layout, wl, limit)
    # serving_time costs one replica; the dp replicas serve independently, so the plan's
    # throughput is dp times one replica's, and per GPU it is that over all the plan's GPUs.
    total = t.throughput_tokens_per_second * layout.dp
    return ServingTimeReport(
        batch_size=batch,
        input_len=wl.input_len,
        output_len=wl.output_len,
        batch_fits_kv_cache=batch <= fit_batch,
        max_batch_in_kv_cache=fit_batch,
        ttft_seconds=t.ttft_seconds,
        tpot_seconds=t.tpot_seconds,
        e2e_latency_seconds=t.e2e_latency_seconds,
        throughput_tokens_per_second=total,
        throughput_tokens_per_second_per_gpu=total / layout.world_size,
        throughput_tokens_per_second_per_replica=t.throughput_tokens_per_second,
        best_batch_size=best.batch_size if best else None,
        best_throughput_tokens_per_second=best.throughput_tokens_per_second * layout.dp if best else None,
        breakdown=ServingBreakdown(prefill=t.prefill.as_dict(), decode_step=t.decode.as_dict()),
        overlap_assumptions=SERVING_OVERLAP,
    )


def _check_batch(layout: Layout, wl: TrainingWorkload) -> None:
    per_step = layout.dp * layout.micro_batch_size
    if wl.global_batch_size % per_step:
        raise LayoutError(
            f"global batch {wl.global_batch_size} is not a multiple of dp x micro-batch = {per_step}",
            field="global_batch_size",
            hint=f"use a multiple of {per_step}",
        )
    num_micro = wl.global_batch_size // per_step
    if layout.pp_schedule is PipelineSchedule.INTERLEAVED and num_micro % layout.pp:
        raise LayoutError(
            f"the interleaved schedule needs the {num_micro} micro-batches to be a multiple of pp={layout.pp}",
            field="global_batch_size",
            hint="Megatron-LM requires it; change the batch or use --pp-schedule 1f1b",
        )


def _workload_dict(w: InferenceWorkload | TrainingWorkload, tp: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in w.__dict__.items():
        if k in ("assumptions", "load"):  # reported once, at the top of the report; the load in its own section
            continue
        if k == "cuda_graph_max_batch_by_tp":  # reported as the plan's own: cuda_graph_max_batch at its tp
            continue
        if k == "cuda_graph_max_batch" and isinstance(w, InferenceWorkload):
            out[k] = w.graph_max_at(tp)
            continue
        if k == "speculative":
            out[k] = None if v is None else dict(method=v.method.value, num_speculative_tokens=v.num_speculative_tokens,
                                                 draft_model=v.draft_name, draft_source=v.draft_source,
                                                 draft_hf_id=v.draft_hf_id)
            continue
        out[k] = dict(v) if k == "python_ops_per_layer_parts" else v.value if hasattr(v, "value") else v
    return out
