"""`estimate`, `recommend`, `show` and `schema`: one layout, the search, and the plan file."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Optional

import typer


# Module level: what the commands' signatures need (the enums are light modules). The cost
# model, the search, the tasks, the exporters, the renderers and the plots are imported where
# they are used, so `shardplan --help` loads none of them and `recommend --json` no renderer.
from shardplan.cli import render_common, schemas
from shardplan.cost.layout import PipelineSchedule, Recompute
from shardplan.cost.workload import InferenceWorkload, Optimizer, Quantization, TrainingWorkload
from shardplan.errors import EXIT_DOES_NOT_FIT, ShardplanError

from shardplan.cli.app import app, JsonOpt
from shardplan.cli.targets import TargetOpt

if TYPE_CHECKING:
    from shardplan.cost.report import CostReport
from shardplan.cli.options import (
    check_outputs,
    CpuOffloadGbOpt,
    NCpuMoeOpt,
    NGpuLayersOpt,
    OffloadLayersOpt,
    resolve_stack,
    speculative_from_options,
    NumSpeculativeTokensOpt,
    SpeculativeMethodOpt,
    SpeculativeModelOpt,
    ChunkedPrefillOpt,
    OverlapSchedulingOpt,
    LimitMmPerPromptOpt,
    EngineOpt,
    EngineVersionOpt,
    ExportToOpt,
    PIN,
    SEARCH,
    ObjectiveChoice,
    BatchSizeOpt,
    BlockSizeOpt,
    DropoutOpt,
    EnforceEagerOpt,
    AttentionKernelOpt,
    CompileOpt,
    FineTuneOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    PagedOptimizerOpt,
    MasterDtypeOpt,
    MomentDtypeOpt,
    OptimizerImplOpt,
    GradReduceDtypeOpt,
    RecomputeModulesOpt,
    ReduceBucketSizeOpt,
    QloraDoubleQuantOpt,
    FlashAttentionOpt,
    MatmulDtypeOpt,
    TpCommOverlapOpt,
    FrameworkOpt,
    StackOpt,
    GlobalBatchSizeOpt,
    GpuMemoryUtilizationOpt,
    GpusOpt,
    GpusPerNodeOpt,
    HardwareOpt,
    InputLenOpt,
    KvCacheDtypeOpt,
    LAYOUT,
    MaxModelLenOpt,
    MaxNumBatchedTokensOpt,
    MaxNumSeqsOpt,
    ModelOpt,
    NodesOpt,
    OffloadChoice,
    OptimizerOpt,
    OutputLenOpt,
    OverlapGradReduceOpt,
    QuantizationOpt,
    SeqLenOpt,
    WeightDtypeOpt,
    WorkloadKind,
    WorkloadOpt,
    ArrivalsOpt,
    ConcurrencyOpt,
    DatasetLengthsOpt,
    NumPromptsOpt,
    PrefixCacheHitOpt,
    RequestRateOpt,
    SeedOpt,
    SpecAcceptanceRateOpt,
)


@app.command()
def estimate(
    model: ModelOpt,
    hardware: HardwareOpt = "h100-sxm-80gb",
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    workload: WorkloadOpt = WorkloadKind.INFERENCE,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel degree.", rich_help_panel=LAYOUT)] = 1,
    pp: Annotated[int, typer.Option(min=1, help="Pipeline-parallel stages.", rich_help_panel=LAYOUT)] = 1,
    dp: Annotated[Optional[int], typer.Option(min=1, help="Data-parallel degree (default: GPUs / (tp x pp x cp)).", rich_help_panel=LAYOUT)] = None,
    ep: Annotated[int, typer.Option(min=1, help="Expert-parallel degree (folds over dp x cp x tp).", rich_help_panel=LAYOUT)] = 1,
    etp: Annotated[Optional[int], typer.Option(min=1, help="Expert tensor-parallel degree (default: tp without EP, 1 with).", rich_help_panel=LAYOUT)] = None,
    cp: Annotated[int, typer.Option(min=1, help="Context-parallel degree (training).", rich_help_panel=LAYOUT)] = 1,
    zero_stage: Annotated[int, typer.Option(min=0, max=3, help="ZeRO stage: 1 optimizer, 2 +gradients, 3 +parameters (FSDP full shard).", rich_help_panel=LAYOUT)] = 0,
    hybrid_shard: Annotated[bool, typer.Option(help="Shard ZeRO/FSDP states only within a node (HSDP).", rich_help_panel=LAYOUT)] = False,
    sequence_parallel: Annotated[bool, typer.Option(help="Megatron sequence parallelism (needs tp > 1).", rich_help_panel=LAYOUT)] = False,
    recompute: Annotated[Recompute, typer.Option(help="Activation recomputation.", rich_help_panel=LAYOUT)] = Recompute.NONE,
    pp_schedule: Annotated[PipelineSchedule, typer.Option(help="Pipeline schedule.", rich_help_panel=LAYOUT)] = PipelineSchedule.ONE_F_ONE_B,
    virtual_stages: Annotated[Optional[int], typer.Option(min=1, help="Model chunks per GPU (interleaved schedule); default 1, or with --pp-schedule interleaved the fastest v that splits the layers evenly (printed).", show_default=False, rich_help_panel=LAYOUT)] = None,
    pp_embedding_as_layer: Annotated[bool, typer.Option(help="Count the embedding as one layer when splitting layers over pipeline stages (Megatron-LM --account-for-embedding-in-pipeline-split).", rich_help_panel=LAYOUT)] = False,
    pp_loss_as_layer: Annotated[bool, typer.Option(help="Count the output layer and loss as one layer in the pipeline split (--account-for-loss-in-pipeline-split).", rich_help_panel=LAYOUT)] = False,
    pp_first_stage_layers: Annotated[Optional[int], typer.Option(min=1, help="Decoder layers on the first pipeline stage; the other stages share the rest (--decoder-first-pipeline-num-layers).", show_default=False, rich_help_panel=LAYOUT)] = None,
    pp_last_stage_layers: Annotated[Optional[int], typer.Option(min=1, help="Decoder layers on the last pipeline stage (--decoder-last-pipeline-num-layers).", show_default=False, rich_help_panel=LAYOUT)] = None,
    micro_batch_size: Annotated[int, typer.Option(min=1, help="Sequences per micro-batch.", rich_help_panel=LAYOUT)] = 1,
    offload: Annotated[OffloadChoice, typer.Option(help="Offload optimizer states (and parameters) to CPU or NVMe; serving: where --offload-layers go (all-cpu, all-nvme).", rich_help_panel=LAYOUT)] = OffloadChoice.NONE,
    offload_layers: OffloadLayersOpt = None,
    cpu_offload_gb: CpuOffloadGbOpt = None,
    n_gpu_layers: NGpuLayersOpt = None,
    n_cpu_moe: NCpuMoeOpt = None,
    max_model_len: MaxModelLenOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = None,
    block_size: BlockSizeOpt = None,
    engine: EngineOpt = "vllm",
    engine_version: EngineVersionOpt = None,
    enable_chunked_prefill: ChunkedPrefillOpt = None,
    overlap_scheduling: OverlapSchedulingOpt = None,
    limit_mm_per_prompt: LimitMmPerPromptOpt = None,
    speculative_model: SpeculativeModelOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    weight_dtype: WeightDtypeOpt = None,
    quantization: QuantizationOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    input_len: InputLenOpt = None,
    output_len: OutputLenOpt = None,
    batch_size: BatchSizeOpt = None,
    request_rate: RequestRateOpt = None,
    concurrency: ConcurrencyOpt = None,
    num_prompts: NumPromptsOpt = 1000,
    dataset_lengths: DatasetLengthsOpt = None,
    prefix_cache_hit: PrefixCacheHitOpt = 0.0,
    arrivals: ArrivalsOpt = "poisson",
    seed: SeedOpt = 0,
    spec_acceptance_rate: SpecAcceptanceRateOpt = None,
    seq_len: SeqLenOpt = 4096,
    global_batch_size: GlobalBatchSizeOpt = 512,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    stack: StackOpt = None,
    framework: FrameworkOpt = None,
    flash_attention: FlashAttentionOpt = None,
    attention_kernel: AttentionKernelOpt = None,
    compile: CompileOpt = False,
    matmul_dtype: MatmulDtypeOpt = None,
    tp_comm_overlap: TpCommOverlapOpt = False,
    finetune: FineTuneOpt = "full",
    lora_rank: LoraRankOpt = 16,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = "all-linear",
    lora_dropout: LoraDropoutOpt = 0.0,
    qlora_double_quant: QloraDoubleQuantOpt = True,
    paged_optimizer: PagedOptimizerOpt = False,
    master_dtype: MasterDtypeOpt = None,
    moment_dtype: MomentDtypeOpt = None,
    optimizer_impl: OptimizerImplOpt = None,
    reduce_bucket_size: ReduceBucketSizeOpt = None,
    recompute_modules: RecomputeModulesOpt = None,
    grad_reduce_dtype: GradReduceDtypeOpt = None,
    dropout: DropoutOpt = None,
    overlap_grad_reduce: OverlapGradReduceOpt = True,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw each pipeline stage's per-GPU memory as stacked bars against the device's capacity, to FILE.png or FILE.svg (needs the plot extra).", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-GPU memory and time of one layout: weights, KV cache, activations, gradients,
    optimizer states, overhead, for every pipeline stage; whether it fits and what binds;
    serving: time to first token, time per output token, throughput and the best batch;
    training: step time, tokens/s per GPU, MFU/HFU, and where the time goes. With
    --request-rate or --concurrency, serving under that traffic too: the engine's continuous
    batching simulated, TTFT/TPOT/e2e percentiles and the rate the plan sustains, with how far
    the model's medians fell from published vLLM/SGLang benchmarks in the same regime
    (`shardplan validate`), e.g.
    shardplan estimate llama-3.1-8b --gpus 1 --request-rate 4 --dataset-lengths sharegpt

    Exit 0 when it fits, 3 when it does not (the report is still printed), 2 for a layout
    that cannot exist."""
    from shardplan.cost import inputs as options
    from shardplan.cost.estimate import estimate as run_estimate
    from shardplan.cost.offload import with_serving_offload
    from shardplan.knowledge.load import engine_rules
    from shardplan.specs import cluster, loading
    from shardplan.tasks._bands import banded

    _check_plot(plot)
    loaded = loading.load_model(model)
    hw = cluster.cluster(loading.load_hardware(hardware), gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node)
    def layout_with(v: int):
        return options.layout_from_options(
            num_gpus=hw.num_gpus, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, zero_stage=zero_stage,
            hybrid_shard=hybrid_shard, sequence_parallel=sequence_parallel, recompute=recompute.value,
            pp_schedule=pp_schedule.value, virtual_stages=v, micro_batch_size=micro_batch_size, offload=offload.value,
            pp_embedding_as_layer=pp_embedding_as_layer, pp_loss_as_layer=pp_loss_as_layer,
            pp_first_stage_layers=pp_first_stage_layers, pp_last_stage_layers=pp_last_stage_layers,
        )

    wl = _workload(locals())
    if virtual_stages is None and pp_schedule is PipelineSchedule.INTERLEAVED:
        report = _fastest_interleaving(loaded.spec, hw, wl, pp, layout_with)
    else:
        layout = layout_with(virtual_stages or 1)
        if isinstance(wl, InferenceWorkload):
            rules = engine_rules(engine, engine_version)
            layout = with_serving_offload(loaded.spec, layout, wl, offload_layers=offload_layers,
                                          cpu_offload_gib=cpu_offload_gb, n_gpu_layers=n_gpu_layers,
                                          targets=tuple(rules.offload.targets) if rules.offload else None,
                                          n_cpu_moe=n_cpu_moe)
            from shardplan.tasks._targets import check_engine_layout

            check_engine_layout(loaded.spec, hw, layout, wl)
        elif any(v is not None for v in (offload_layers, cpu_offload_gb, n_gpu_layers, n_cpu_moe)):
            raise ShardplanError("offloading a number of layers applies to serving", field="--offload-layers",
                                 hint="training offloads all parameters: --offload all-cpu --zero-stage 3")
        report = run_estimate(loaded.spec, hw, layout, wl)
    report = banded(report, hw)  # each figure's measured error band, and the verdict at its edge
    render_common.emit(report.model_dump(mode="json"), json_out, lambda _: _render_plan().estimate_report(report))
    if plot is not None:
        from shardplan.cli import plots

        plots.write_plot(plot, plots.estimate_figure(report))
        render_common.file_written(plot, "plot")
    if not report.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)






@app.command()
def recommend(
    ctx: typer.Context,
    model: ModelOpt,
    hardware: HardwareOpt = "h100-sxm-80gb",
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    workload: WorkloadOpt = WorkloadKind.INFERENCE,
    max_gpus: Annotated[Optional[int], typer.Option(min=1, help="Search every GPU count up to this and report the smallest that meets the goal.", rich_help_panel=SEARCH)] = None,
    objective: Annotated[Optional[ObjectiveChoice], typer.Option(help="Serving: goodput (most output tokens/s per GPU from requests within the SLA, under continuous batching; the default) | latency | throughput | cost (static batches); training: step-time | cost. Default: goodput / step-time.", rich_help_panel=SEARCH)] = None,
    max_ttft_ms: Annotated[Optional[float], typer.Option(min=0, help="Serving: longest time to first token allowed (goodput: at --slo-percentile; default 1000 when neither limit is given).", rich_help_panel=SEARCH)] = None,
    max_tpot_ms: Annotated[Optional[float], typer.Option(min=0, help="Serving: longest time per output token allowed (goodput: at --slo-percentile; default 50 when neither limit is given).", rich_help_panel=SEARCH)] = None,
    slo_percentile: Annotated[int, typer.Option(help="Serving goodput: the percentile of TTFT and TPOT the limits hold at (50, 90 or 99).", rich_help_panel=SEARCH)] = 90,
    request_rate: RequestRateOpt = None,
    concurrency: ConcurrencyOpt = None,
    num_prompts: NumPromptsOpt = 1000,
    dataset_lengths: DatasetLengthsOpt = None,
    prefix_cache_hit: PrefixCacheHitOpt = 0.0,
    arrivals: ArrivalsOpt = "poisson",
    seed: SeedOpt = 0,
    spec_acceptance_rate: SpecAcceptanceRateOpt = None,
    min_throughput: Annotated[Optional[float], typer.Option(min=0, help="Serving: least output tokens/s over all GPUs.", rich_help_panel=SEARCH)] = None,
    gpu_hour_price: Annotated[Optional[float], typer.Option(min=0, help="USD per GPU-hour for --objective cost (default: the profile's).", rich_help_panel=SEARCH)] = None,
    allow_quantization: Annotated[Optional[str], typer.Option(help="Serving: formats the search may use, e.g. fp8,int8,int4 (fp8 also allows an fp8 KV cache).", rich_help_panel=SEARCH)] = None,
    allow_cross_node_tp: Annotated[bool, typer.Option(help="Let tensor parallelism span nodes.", rich_help_panel=SEARCH)] = False,
    allow_offload: Annotated[bool, typer.Option(help="Training: let the search offload optimizer states/parameters to CPU or NVMe. Serving with a fixed --gpus: when nothing fits on the GPUs alone, try the engine's smaller weight formats and layers held in host memory (--engine llamacpp runs them on the CPU).", rich_help_panel=SEARCH)] = True,
    top_k: Annotated[int, typer.Option("--top", min=1, help="Plans to show: the best variant of each parallel shape (tp, pp, dp, cp, ep); plans within the model's measured error in comparing two layouts (training; serving: equal values) of the first are ties (=): the pick is the tie with fewer GPUs, tp inside a node, smaller cp, fewer stages, smaller tp, simpler schedule; the other plans follow by the ranked figure.", rich_help_panel=SEARCH)] = 5,
    disaggregated: Annotated[bool, typer.Option("--disaggregated", help="Serving on a fixed --gpus count (goodput, with or without --request-rate; not with --concurrency): also write the best split into prefill and decode pools into the manifest (-o), which `shardplan export --to vllm --disaggregated` launches with vLLM's prefill/decode KV-transfer connector. The answer compares the split with aggregated serving either way, e.g. recommend llama-3.1-8b --gpus 8 --input-len 8000 --output-len 300 --max-tpot-ms 20 --request-rate 5.", rich_help_panel=SEARCH)] = False,
    expand: Annotated[bool, typer.Option("--expand", help="Show every variant (formats, batch, ZeRO stage, recompute, virtual stages) as its own row instead of each shape's best.", rich_help_panel=SEARCH)] = False,
    strict_fit: Annotated[bool, typer.Option("--strict-fit", help="Leave out plans that fit only at the prediction, not at the pessimistic edge of the measured error band (`shardplan validate`); without it they rank after those that fit at the edge.", rich_help_panel=SEARCH)] = False,
    compare: Annotated[Optional[str], typer.Option(help="A layout to compare with the winner, e.g. tp=8,pp=16,dp=128 (a published one).", rich_help_panel=SEARCH)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the winner's deployment manifest (YAML) here: its layout, placement and predictions; for serving under traffic also its latency percentiles, its long run and the rate to plan for (predicted.load, which `shardplan show` and `shardplan watch` read).", rich_help_panel=SEARCH)] = None,
    export_to: ExportToOpt = None,
    target: TargetOpt = None,
    tp: Annotated[Optional[int], typer.Option(min=1, help="Tensor-parallel degree.", rich_help_panel=PIN)] = None,
    pp: Annotated[Optional[int], typer.Option(min=1, help="Pipeline stages.", rich_help_panel=PIN)] = None,
    dp: Annotated[Optional[int], typer.Option(min=1, help="Data-parallel degree (serving: replicas).", rich_help_panel=PIN)] = None,
    ep: Annotated[Optional[int], typer.Option(min=1, help="Expert-parallel degree.", rich_help_panel=PIN)] = None,
    cp: Annotated[Optional[int], typer.Option(min=1, help="Context-parallel degree (training).", rich_help_panel=PIN)] = None,
    zero_stage: Annotated[Optional[int], typer.Option(min=0, max=3, help="ZeRO stage (training).", rich_help_panel=PIN)] = None,
    hybrid_shard: Annotated[Optional[bool], typer.Option("--hybrid-shard/--no-hybrid-shard", help="HSDP (training).", show_default=False, rich_help_panel=PIN)] = None,
    sequence_parallel: Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel", help="Sequence parallelism.", show_default=False, rich_help_panel=PIN)] = None,
    recompute: Annotated[Optional[Recompute], typer.Option(help="Activation recomputation.", rich_help_panel=PIN)] = None,
    pp_schedule: Annotated[Optional[PipelineSchedule], typer.Option(help="Pipeline schedule.", rich_help_panel=PIN)] = None,
    virtual_stages: Annotated[Optional[int], typer.Option(min=1, help="Model chunks per GPU.", rich_help_panel=PIN)] = None,
    micro_batch_size: Annotated[Optional[int], typer.Option(min=1, help="Sequences per micro-batch.", rich_help_panel=PIN)] = None,
    offload: Annotated[Optional[OffloadChoice], typer.Option(help="Offload (training).", rich_help_panel=PIN)] = None,
    max_model_len: MaxModelLenOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = None,
    block_size: BlockSizeOpt = None,
    engine: EngineOpt = "vllm",
    engine_version: EngineVersionOpt = None,
    enable_chunked_prefill: ChunkedPrefillOpt = None,
    overlap_scheduling: OverlapSchedulingOpt = None,
    limit_mm_per_prompt: LimitMmPerPromptOpt = None,
    speculative_model: SpeculativeModelOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    weight_dtype: WeightDtypeOpt = None,
    quantization: QuantizationOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    input_len: InputLenOpt = None,
    output_len: OutputLenOpt = None,
    batch_size: BatchSizeOpt = None,
    seq_len: SeqLenOpt = 4096,
    global_batch_size: GlobalBatchSizeOpt = 512,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    stack: StackOpt = None,
    framework: FrameworkOpt = None,
    flash_attention: FlashAttentionOpt = None,
    attention_kernel: AttentionKernelOpt = None,
    compile: CompileOpt = False,
    matmul_dtype: MatmulDtypeOpt = None,
    tp_comm_overlap: TpCommOverlapOpt = False,
    finetune: FineTuneOpt = "full",
    lora_rank: LoraRankOpt = 16,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = "all-linear",
    lora_dropout: LoraDropoutOpt = 0.0,
    qlora_double_quant: QloraDoubleQuantOpt = True,
    paged_optimizer: PagedOptimizerOpt = False,
    master_dtype: MasterDtypeOpt = None,
    moment_dtype: MomentDtypeOpt = None,
    optimizer_impl: OptimizerImplOpt = None,
    reduce_bucket_size: ReduceBucketSizeOpt = None,
    recompute_modules: RecomputeModulesOpt = None,
    grad_reduce_dtype: GradReduceDtypeOpt = None,
    dropout: DropoutOpt = None,
    overlap_grad_reduce: OverlapGradReduceOpt = True,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw the serving Pareto frontier (time per output token against tokens/s per GPU) or, training, step time against GPU count, the pick marked, to FILE.png or FILE.svg (needs the plot extra).", show_default=False, rich_help_panel=SEARCH)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Search every valid layout (tp, pp, dp/replicas, ep, cp, ZeRO, SP, recompute, micro-batch,
    virtual stages, offload, weight/KV formats, batch) and rank those that fit by the objective.

    Shows the top plans with memory, headroom, time and cost; the serving Pareto frontier
    (latency vs throughput per GPU); rejected layouts by reason; the binding constraint and the
    runner-up's gap. When nothing fits it lists the smallest changes that would (each found by
    searching again) and exits 3. `-o plan.yaml` writes the winner's deployment manifest.

    Serving ranks by goodput by default: output tokens/s per GPU from requests within the SLA
    (p90 TTFT 1 s, TPOT 50 ms unless --max-ttft-ms/--max-tpot-ms), the engine's continuous
    batching simulated at the highest rate each plan sustains (or at --request-rate), and says
    whether separate prefill and decode pools would do better. The pick is run again over 6,000
    requests a replica at its rate; where that breaks the SLA, the answer gives the rate that holds
    over as long a run (a few hundred requests' p90 scatters near the SLA's edge). The simulations run on forked
    worker processes too where the machine has more cores (SHARDPLAN_SEARCH_WORKERS=N, 0 for one
    core; the answer is the same). Example:
    shardplan recommend llama-3.1-70b --gpus 8 --request-rate 6 --max-ttft-ms 800 --max-tpot-ms 60"""
    from shardplan.cost.inputs import offload_pair
    from shardplan.search import Goal, Objective, Space
    from shardplan.search.ahead import search_workers
    from shardplan.specs import cluster, loading
    from shardplan.cli.targets import engine_and_stack, given, with_export
    from shardplan.tasks.recommend import recommend as run_recommend
    from shardplan.tasks.recommend import with_allowed_dtypes

    if disaggregated and output is None:
        raise ShardplanError("--disaggregated writes the split into the manifest", field="--disaggregated",
                             hint="add -o plan.yaml")
    if export_to is not None and output is None:
        raise ShardplanError("--export needs -o PLAN.yaml: the export is written beside the plan", field="--export",
                             hint="add -o plan.yaml")
    check_outputs(("-o", output), ("--plot", plot), folders_made=("-o",) if export_to is not None else ())
    _check_plot(plot)
    loaded = loading.load_model(model)
    base = loading.load_hardware(hardware)
    if max_gpus is None:
        hw = cluster.cluster(base, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node)
        num_gpus: Optional[int] = hw.num_gpus
        hw = hw.with_topology(gpus_per_node=gpus_per_node or base.gpus_per_node, num_nodes=1)
    else:
        if gpus is not None or nodes is not None:
            raise ShardplanError("give either --gpus/--nodes or --max-gpus", field="--max-gpus", hint="drop one of them")
        cluster.at_most(max_gpus, cluster.MAX_GPUS, "--max-gpus")
        cluster.at_most(gpus_per_node, cluster.MAX_GPUS, "--gpus-per-node")
        hw, num_gpus = base.with_topology(gpus_per_node=gpus_per_node or base.gpus_per_node, num_nodes=1), None
    # --target (or the one --export implies) fixes the engine or stack the plans are sized with
    target = with_export(target, export_to, training=workload is WorkloadKind.TRAINING)
    engine, stack = engine_and_stack(target, training=workload is WorkloadKind.TRAINING, engine=engine, stack=stack,
                                     engine_given=given(ctx, "engine"))
    wl = _workload(locals())
    training = isinstance(wl, TrainingWorkload)
    obj = objective.value if objective else ("step-time" if training else "goodput")
    defaulted = obj == "goodput" and max_ttft_ms is None and max_tpot_ms is None
    if defaulted:
        from shardplan.search.space import DEFAULT_MAX_TPOT_SECONDS, DEFAULT_MAX_TTFT_SECONDS

        max_ttft_ms, max_tpot_ms = DEFAULT_MAX_TTFT_SECONDS * 1e3, DEFAULT_MAX_TPOT_SECONDS * 1e3
    if obj == "goodput" and not training and isinstance(wl, InferenceWorkload) and wl.load is None:
        from shardplan.cost.workload import ServingLoad

        wl = replace(wl, load=ServingLoad(num_requests=num_prompts, seed=seed, poisson=arrivals == "poisson",
                                          spec_acceptance_rate=spec_acceptance_rate))
    goal = Goal(
        objective=Objective(obj),
        slo_percentile=slo_percentile,
        sla_defaulted=defaulted,
        group_by_shape=not expand,
        max_ttft_seconds=max_ttft_ms / 1e3 if max_ttft_ms is not None else None,
        max_tpot_seconds=max_tpot_ms / 1e3 if max_tpot_ms is not None else None,
        min_throughput_tokens_per_second=min_throughput,
        gpu_hour_price_usd=gpu_hour_price,
        top_k=top_k,
    )
    space = Space(
        tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero_stage=zero_stage, hybrid_shard=hybrid_shard,
        sequence_parallel=sequence_parallel, recompute=recompute, pp_schedule=pp_schedule,
        virtual_stages=virtual_stages, micro_batch_size=micro_batch_size,
        offload=offload_pair(offload.value) if offload else None,
        allow_cross_node_tp=allow_cross_node_tp, allow_offload=allow_offload, workers=search_workers(),
    )
    if not training:
        space = replace(space, quantizations=(wl.quantization,), kv_cache_dtypes=(wl.kv_cache_dtype,))
        if allow_quantization and not (weight_dtype or quantization or kv_cache_dtype):
            space = with_allowed_dtypes(space, allow_quantization.split(","))
            # Formats the engine does not run on this GPU at all (knowledge checkpoint_formats refused_architectures:
            # its formats that the workload's, resolved for this GPU, leave out) are left out of the search, and said.
            from shardplan.knowledge.load import engine_rules

            refused = set(engine_rules(wl.engine, wl.engine_version).weight_formats) - set(wl.weight_formats)
            dropped = [q.value for q in space.quantizations if q.value in refused]
            if dropped:
                print(f"warning: --allow-quantization: {', '.join(dropped)} left out: {wl.engine} does not run it on "
                      f"{hw.gpu_architecture} GPUs (knowledge/engines/{wl.engine}.yaml)", file=sys.stderr)
                space = replace(space, quantizations=tuple(q for q in space.quantizations if q.value not in refused))
        elif not (weight_dtype or quantization or allow_quantization):
            # Nothing fits at the model's own format: the engine's smaller formats are tried next (with
            # offload), one of each size (awq and gptq store what int4 does).
            # Not the bytes a quantized checkpoint (CHECKPOINT_KINDS) planned as it ships already holds (int4 for a 4-bit one).
            as_shipped = loaded.spec.checkpoint_quantization is not None and loaded.spec.ships(wl.quantization.value)
            formats = [Quantization(f) for f in wl.weight_formats
                       if f not in ("awq", "gptq") and not (as_shipped and loaded.spec.ships(f))]
            space = replace(space, fallback_quantizations=tuple(formats))
    with contextlib.ExitStack() as staging:
        manifest_path = output
        if (export_to is not None or plot is not None) and output is not None:
            # The manifest is staged apart and written with the export's files and the plot, all or none.
            import tempfile

            folder = staging.enter_context(tempfile.TemporaryDirectory(prefix="shardplan-"))
            manifest_path = Path(folder) / "plan.yaml"
        with render_common.progress("searching layouts") as progress:
            try:
                result = run_recommend(
                    loaded, hw, wl, space, goal, num_gpus=num_gpus, max_gpus=max_gpus, compare_layout=compare,
                    manifest_path=manifest_path, progress=progress, strict_fit=strict_fit,
                    write_disaggregation=disaggregated, target=target,
                    engine_given=any(given(ctx, o) for o in ("engine", "engine_version", "cpu_offload_gb", "gpu_memory_utilization")),
                )
            except ShardplanError as e:
                if e.field == "--target" and export_to is not None and not given(ctx, "target"):
                    # the target is the one --export implies: name the option the user gave
                    e.field, e.message = "--export", f"{export_to} launches {target}'s plans, and {e.message}"
                raise
        from shardplan.fileio import PendingFile, write_files_atomic

        drawn: list[PendingFile] = []
        if plot is not None and result.top:  # drawn before anything is written, and written with it
            from shardplan.cli import plots

            drawn.append(PendingFile(path=plot, data=plots.render(plots.recommend_figure(result), plots.plot_format(plot)),
                                     what="--plot"))
        if result.top and export_to is not None and output is not None and manifest_path is not None:
            from shardplan.exporters import ExportOptions
            from shardplan.search.results import ExportSummary
            from shardplan.tasks.export import export_plan

            engine_opt = {"engine": target} if export_to == "kubernetes" and target and not training else {}
            exported = export_plan(manifest_path, export_to, ExportOptions(plan_file=str(output), **engine_opt),
                                   output.parent, plan_copy=output, also=drawn)
            summary = ExportSummary(target=export_to, files=[f.path for f in exported.files if f.path is not None])
            result = result.model_copy(update={"export": summary, "manifest": str(output)})
        elif result.top and output is not None and manifest_path is not None and manifest_path != output:
            write_files_atomic([PendingFile(path=output, data=manifest_path.read_bytes(), what="-o"), *drawn])
            result = result.model_copy(update={"manifest": str(output)})
        elif drawn:
            write_files_atomic(drawn)
    if json_out:
        render_common.print_json(result.model_dump(mode="json"))
    else:
        _render_plan().recommend_report(result)
        if result.export is not None:
            from shardplan.cli import render_deploy

            render_deploy.export_report(exported, written=True)
    if plot is not None and result.top:
        render_common.file_written(plot, "plot")
    if not result.top:
        raise typer.Exit(EXIT_DOES_NOT_FIT)



@app.command()
def schema(
    output: Annotated[str, typer.Option("--output", help=f"Whose --json output: {', '.join(schemas.OUTPUTS)}.")] = "manifest",
) -> None:
    """Print the JSON Schema of a command's `--json` output (default: the deployment manifest
    that `recommend -o` writes)."""
    from shardplan.plan.manifest import manifest_json_schema

    model = schemas.output_model(output)
    if model is None:
        raise ShardplanError(f"no output named {output!r}", field="--output", hint="use one of " + ", ".join(schemas.OUTPUTS))
    render_common.print_json(manifest_json_schema() if output == "manifest" else model.model_json_schema())


@app.command()
def show(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    json_out: JsonOpt = False,
) -> None:
    """Re-render a deployment manifest: model, hardware, layout, placement, predicted memory and
    time. A manifest from a newer schema or with an impossible layout is rejected (exit 2)."""
    from shardplan.plan.manifest import load_manifest

    m = load_manifest(plan)
    render_common.emit(m.model_dump(mode="json"), json_out, lambda _: _render_plan().manifest_report(m))


def _render_plan() -> ModuleType:
    """The table renderers (and rich), imported only when a table is printed."""
    from shardplan.cli import render_plan

    return render_plan



def _fastest_interleaving(spec, hw, wl, pp: int, layout_with) -> CostReport:
    """--pp-schedule interleaved without --virtual-stages: every v >= 2 that splits the layers
    (with the embedding and the loss where they count as layers) evenly over pp x v chunks (as
    Megatron-LM requires) is costed, and the fastest step is kept
    and said, rather than v = 1 (a 1F1B bubble under another name)."""
    from shardplan.cost.estimate import estimate as run_estimate

    if pp <= 1:
        raise ShardplanError("the interleaved schedule runs virtual stages over pipeline stages, and pp = 1",
                             field="--pp-schedule", hint="give --pp 2 or more, or --pp-schedule 1f1b")
    probe = layout_with(2)  # the embedding and the loss count as pipeline units where asked
    units = spec.num_layers + int(probe.pp_embedding_as_layer) + int(probe.pp_loss_as_layer)
    allowed = [v for v in range(2, units // max(pp, 1) + 1) if units % (pp * v) == 0]
    reports = []
    refusals: list[ShardplanError] = []
    for v in allowed:
        try:
            reports.append((v, run_estimate(spec, hw, layout_with(v), wl)))
        except ShardplanError as e:
            refusals.append(e)  # a v the micro-batch count (or the split asked for) cannot schedule
    if not reports and refusals:
        raise refusals[0]  # every even split is refused for the same reason: say it
    if not reports:
        raise ShardplanError(f"no virtual-stage count splits the {units} pipeline units ({spec.num_layers} layers"
                             f"{', the embedding and loss' if units > spec.num_layers else ''}) evenly over pp = {pp}",
                             field="--virtual-stages", hint="give --virtual-stages, or --pp-schedule 1f1b")
    seconds = {v: (r.time.step_seconds if r.training and r.time else 0.0) for v, r in reports}
    v, report = min(reports, key=lambda vr: (not vr[1].fits, seconds[vr[0]]))
    note = (f"interleaved schedule: v = {v}, the fastest of v = {', '.join(str(x) for x, _ in reports)} "
            f"(no --virtual-stages given)")
    return report.model_copy(update={"assumptions": [*(report.assumptions or []), note]})


def _check_plot(path: Optional[Path]) -> None:
    """Before any work: the format is known and matplotlib is installed."""
    if path is not None:
        from shardplan.cli import plots

        plots.plot_format(path)
        plots.require_matplotlib()


def _workload(o: dict) -> InferenceWorkload | TrainingWorkload:
    """The workload from the shared workload options of a command (its locals)."""
    from shardplan.cost import inputs as options
    from shardplan.knowledge.load import engine_rules, stack_rules

    if o["workload"] is WorkloadKind.TRAINING:
        stack, framework = resolve_stack(o["stack"], o["framework"])
        return options.training_workload(
            seq_len=o["seq_len"], global_batch_size=o["global_batch_size"], optimizer=o["optimizer"].value,
            framework=framework, flash_attention=o["flash_attention"],
            dropout=o["loaded"].spec.trains_with_dropout if o["dropout"] is None else o["dropout"],
            overlap_grad_reduce=o["overlap_grad_reduce"], stack=stack_rules(stack), compile=o["compile"],
            attention_kernel=o["attention_kernel"], matmul_dtype=o["matmul_dtype"],
            tp_comm_overlap=o["tp_comm_overlap"], finetune=o["finetune"], lora_rank=o["lora_rank"],
            lora_alpha=o["lora_alpha"], lora_targets=o["lora_targets"], lora_dropout=o["lora_dropout"],
            qlora_double_quant=o["qlora_double_quant"], paged_optimizer=o["paged_optimizer"], spec=o["loaded"].spec,
            master_dtype=o["master_dtype"], moment_dtype=o["moment_dtype"], optimizer_impl=o["optimizer_impl"],
            reduce_bucket_size=o["reduce_bucket_size"], recompute_modules=o["recompute_modules"],
            grad_reduce_dtype=o["grad_reduce_dtype"],
        )
    q = o["quantization"]
    input_len, output_len, shortened = options.request_lengths(
        o["input_len"], o["output_len"], o["max_model_len"] or o["loaded"].spec.max_position_embeddings)
    wl = options.inference_workload(
        engine=engine_rules(o["engine"], o["engine_version"]), hw=o["hw"], model_max_len=o["loaded"].spec.max_position_embeddings,
        enable_chunked_prefill=o["enable_chunked_prefill"], overlap_scheduling=o["overlap_scheduling"],
        speculative=speculative_from_options(o["loaded"].spec, o["speculative_model"], o["speculative_method"],
                                             o["num_speculative_tokens"]),
        max_model_len=o["max_model_len"], max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
        gpu_memory_utilization=o["gpu_memory_utilization"], block_size=o["block_size"], kv_cache_dtype=o["kv_cache_dtype"],
        weight_dtype=o["weight_dtype"], quantization=q.value if q else None, enforce_eager=o["enforce_eager"],
        input_len=input_len, output_len=output_len, batch_size=o["batch_size"],
        vision=o["loaded"].spec.vision, images_per_prompt=o.get("limit_mm_per_prompt"),
        encoder_decoder=o["loaded"].spec.num_cross_attention_layers > 0,
        checkpoint_format=o["loaded"].spec.shipped_format, mla=o["loaded"].spec.mla is not None,
        sliding_window=o["loaded"].spec.num_sliding_layers > 0,
    )
    if shortened:
        from dataclasses import replace

        wl = replace(wl, assumptions=(*wl.assumptions, shortened))
    return _with_load(o, wl)


def _goodput_search(o: dict) -> bool:
    """`recommend` ranking serving plans by goodput (its default): each plan is simulated under
    traffic at the highest rate it sustains, so traffic options apply without a rate."""
    objective = o.get("objective")
    return ("top_k" in o and o.get("workload") is not WorkloadKind.TRAINING
            and (objective is None or objective.value == "goodput")
            and o.get("request_rate") is None and o.get("concurrency") is None)


def _with_load(o: dict, wl: InferenceWorkload) -> InferenceWorkload:
    """The workload with the traffic of --request-rate / --concurrency, if given; `recommend`'s goodput
    search gets its traffic (request lengths, prefix hits, arrivals) here too, at a rate it searches."""
    from dataclasses import replace

    from shardplan.cost import inputs as options

    lengths, name = None, "fixed"
    if o.get("dataset_lengths"):
        from shardplan.specs.lengths import load_lengths

        lengths = load_lengths(o["dataset_lengths"])
        name = lengths.source
    context = wl.max_model_len or o["loaded"].spec.max_position_embeddings
    goodput = _goodput_search(o)
    load = options.serving_load(
        request_rate="inf" if goodput else o.get("request_rate"), concurrency=o.get("concurrency"),
        num_prompts=o.get("num_prompts", 1000), lengths=lengths, lengths_name=name,
        prefix_cache_hit=o.get("prefix_cache_hit", 0.0), arrivals=o.get("arrivals", "poisson"), seed=o.get("seed", 0),
        input_len=wl.input_len, output_len=wl.output_len, max_model_len=context,
        spec_acceptance_rate=o.get("spec_acceptance_rate"), speculative=wl.speculative is not None)
    if load is None:  # a static batch: its requests must fit the context as well
        options.check_request_fits(wl.input_len, wl.output_len, context)
        return wl
    return replace(wl, load=load)  # for the goodput search, a load with no rate (inf): the search resolves it
