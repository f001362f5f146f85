"""`shardplan capacity`: how much hardware a model needs."""

from __future__ import annotations

import math
from typing import Annotated, Optional

import typer


# Module level: what the command's signature needs (the enums are light). The task, the specs
# and the renderers are imported when the command runs, so `shardplan --help` loads none of them.
from shardplan.cost.workload import Optimizer
from shardplan.errors import EXIT_DOES_NOT_FIT, ShardplanError

from shardplan.cli.app import app, JsonOpt
from shardplan.cli.targets import TargetOpt
from shardplan.cli.options import (
    resolve_stack,
    speculative_from_options,
    NumSpeculativeTokensOpt,
    SpeculativeMethodOpt,
    SpeculativeModelOpt,
    ChunkedPrefillOpt,
    OverlapSchedulingOpt,
    EngineOpt,
    EngineVersionOpt,
    SEARCH,
    BlockSizeOpt,
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
    GpusPerNodeOpt,
    HardwareOpt,
    KvCacheDtypeOpt,
    MaxNumBatchedTokensOpt,
    LOAD,
    InputLenOpt,
    OutputLenOpt,
    DatasetLengthsOpt,
    MaxNumSeqsOpt,
    ModelOpt,
    OptimizerOpt,
    SERVE,
    SeqLenOpt,
    WorkloadKind,
    WorkloadOpt,
)


@app.command()
def capacity(
    ctx: typer.Context,
    model: ModelOpt,
    hardware: HardwareOpt = "h100-sxm-80gb",
    gpus_per_node: GpusPerNodeOpt = None,
    workload: WorkloadOpt = WorkloadKind.INFERENCE,
    max_gpus: Annotated[Optional[int], typer.Option(min=1, help="Largest GPU count to consider (default: 64 nodes' worth).", rich_help_panel=SEARCH)] = None,
    target: TargetOpt = None,
    context: Annotated[int, typer.Option(min=1, help="Serving: tokens per sequence (vLLM's max_model_len) the GPUs must hold; at most the model's context (the default is capped to it).", rich_help_panel=SERVE)] = 8192,
    concurrency: Annotated[int, typer.Option(min=1, help="Serving: sequences of --context tokens held at once.", rich_help_panel=SERVE)] = 1,
    max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = None,
    block_size: BlockSizeOpt = None,
    engine: EngineOpt = "vllm",
    engine_version: EngineVersionOpt = None,
    enable_chunked_prefill: ChunkedPrefillOpt = None,
    overlap_scheduling: OverlapSchedulingOpt = None,
    speculative_model: SpeculativeModelOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    request_rate: Annotated[Optional[str], typer.Option("--request-rate", help="Serving: size the plan for this many requests per second within the SLA (--max-ttft-ms, --max-tpot-ms at --slo-percentile): the fewest GPUs and the replica layout, from the engine's continuous batching simulated under Poisson arrivals.", show_default=False, rich_help_panel=LOAD)] = None,
    max_ttft_ms: Annotated[Optional[float], typer.Option(min=0, help="With --request-rate: longest time to first token allowed at the percentile (default 1000 when neither limit is given).", show_default=False, rich_help_panel=LOAD)] = None,
    max_tpot_ms: Annotated[Optional[float], typer.Option(min=0, help="With --request-rate: longest time per output token allowed at the percentile (default 50 when neither limit is given).", show_default=False, rich_help_panel=LOAD)] = None,
    slo_percentile: Annotated[int, typer.Option(help="With --request-rate: the percentile the limits hold at (50, 90 or 99).", rich_help_panel=LOAD)] = 90,
    input_len: InputLenOpt = None,
    output_len: OutputLenOpt = None,
    dataset_lengths: DatasetLengthsOpt = None,
    allow_quantization: Annotated[Optional[str], typer.Option(help="With --request-rate: weight formats to size besides the model's, e.g. fp8,int4.", show_default=False, rich_help_panel=LOAD)] = None,
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
    json_out: JsonOpt = False,
) -> None:
    """How much hardware does this model need? Serving: the fewest GPUs (and nodes) for each
    weight format (bf16, fp8, int8, int4) to hold --concurrency sequences of --context tokens,
    with the layout and its per-GPU memory; and for each tensor-parallel size, the longest
    context and the most sequences. Says when quantizing removes the need to shard.
    Training (--workload training): the fewest GPUs for each ZeRO stage and offload choice at
    --seq-len and --global-batch-size, with the fastest layout there.

    With --request-rate R: the fewest GPUs, and the replica layout, that serve R requests/s
    within --max-ttft-ms/--max-tpot-ms at --slo-percentile, e.g.
    shardplan capacity llama-3.1-70b --request-rate 20 --max-ttft-ms 1000 --max-tpot-ms 50
    The answer holds R over a long run too (6,000 requests a replica at each one's share): a
    shape whose long run breaks the SLA is sized again by what a replica holds over one.

    GPU counts are those recommend searches (powers of two in a node, then whole nodes) up to
    --max-gpus. Exit 0; 3 when nothing fits within --max-gpus."""
    from shardplan.cli import render_capacity, render_common
    from shardplan.cli.targets import engine_and_stack, given
    from shardplan.cost import inputs as options
    from shardplan.knowledge.load import engine_rules, stack_rules
    from shardplan.specs import loading
    from shardplan.tasks.capacity import CapacityResult, default_max_gpus, serving_capacity, training_capacity

    from shardplan.specs import cluster

    cluster.at_most(max_gpus, cluster.MAX_GPUS, "--max-gpus")
    loaded = loading.load_model(model)
    base = loading.load_hardware(hardware)
    hw = cluster.cluster(base, gpus=None, nodes=None, gpus_per_node=gpus_per_node)
    limit = max_gpus or default_max_gpus(hw)
    model_context = loaded.spec.max_position_embeddings
    if context > model_context:  # the engines refuse a max_model_len past the model's context
        if given(ctx, "context"):
            raise ShardplanError(f"{context:,} tokens exceed {loaded.spec.name}'s context ({model_context:,})",
                                 field="--context", hint=f"give at most {model_context}")
        context = model_context
    engine, stack = engine_and_stack(target, training=workload is WorkloadKind.TRAINING, engine=engine, stack=stack,
                                     engine_given=given(ctx, "engine"))
    if workload is WorkloadKind.TRAINING:
        stack_name, framework_name = resolve_stack(stack, framework)
        wl_t = options.training_workload(seq_len=seq_len, global_batch_size=global_batch_size, optimizer=optimizer.value,
                                         framework=framework_name, flash_attention=flash_attention,
                                         dropout=loaded.spec.trains_with_dropout,
                                         stack=stack_rules(stack_name), compile=compile,
                                         attention_kernel=attention_kernel, matmul_dtype=matmul_dtype,
                                         tp_comm_overlap=tp_comm_overlap, finetune=finetune, lora_rank=lora_rank,
                                         lora_alpha=lora_alpha, lora_targets=lora_targets, lora_dropout=lora_dropout,
                                         qlora_double_quant=qlora_double_quant, paged_optimizer=paged_optimizer,
                                         spec=loaded.spec, master_dtype=master_dtype, moment_dtype=moment_dtype,
                                         optimizer_impl=optimizer_impl, reduce_bucket_size=reduce_bucket_size,
                                         recompute_modules=recompute_modules,
                                         grad_reduce_dtype=grad_reduce_dtype)
        with render_common.progress("finding the fewest GPUs per ZeRO stage and offload") as progress:
            result = CapacityResult(training_capacity(loaded.spec, hw, wl_t, max_gpus=limit, progress=progress,
                                                      target=target))
    elif request_rate is not None:
        _size_for_rate(loaded.spec, hw, engine, engine_version, limit, locals())
        return
    else:
        rules = engine_rules(engine, engine_version)
        wl_s = options.inference_workload(
            engine=rules, hw=hw, model_max_len=loaded.spec.max_position_embeddings,
            speculative=speculative_from_options(loaded.spec, speculative_model, speculative_method, num_speculative_tokens),
            enable_chunked_prefill=enable_chunked_prefill, overlap_scheduling=overlap_scheduling, max_model_len=context, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
            weight_dtype=None, quantization=None, enforce_eager=enforce_eager, input_len=1024, output_len=128, batch_size=None,
            vision=loaded.spec.vision, encoder_decoder=loaded.spec.num_cross_attention_layers > 0,
            checkpoint_format=loaded.spec.shipped_format, mla=loaded.spec.mla is not None,
            sliding_window=loaded.spec.num_sliding_layers > 0,
        )
        if concurrency > wl_s.max_num_seqs:
            given = "--max-num-seqs" if max_num_seqs is not None else f"{rules.label}'s default max_num_seqs on this GPU"
            from shardplan.cost.inputs import MAX_SEQUENCES

            # The fix names a --max-num-seqs that is itself accepted, or the most any is.
            fix = (f"add --max-num-seqs {concurrency}" if concurrency <= MAX_SEQUENCES
                   else f"give --concurrency at most {MAX_SEQUENCES}, with --max-num-seqs as many")
            raise ShardplanError(f"--concurrency {concurrency} exceeds {given} ({wl_s.max_num_seqs}), the most the engine "
                                 "runs at once", field="--concurrency", hint=fix)
        result = CapacityResult(serving_capacity(loaded.spec, hw, wl_s, concurrency=concurrency, max_gpus=limit,
                                                 target=target))
    render_common.emit(result.model_dump(mode="json") if json_out else result.root, json_out, render_capacity.capacity_report)
    if not result.found:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _size_for_rate(spec, hw, engine: str, engine_version: Optional[str], limit: int, o: dict) -> None:
    """capacity --request-rate: the fewest GPUs that serve the rate within the SLA (tasks/sizing.py)."""
    from dataclasses import replace

    from shardplan.cli import render_capacity, render_common
    from shardplan.cost import inputs as options
    from shardplan.cost.traffic import Sla
    from shardplan.cost.workload import Quantization
    from shardplan.knowledge.load import engine_rules
    from shardplan.search.space import DEFAULT_MAX_TPOT_SECONDS, DEFAULT_MAX_TTFT_SECONDS, check_latency_limits
    from shardplan.specs.lengths import load_lengths
    from shardplan.tasks.sizing import size_for_rate

    if o["slo_percentile"] not in (50, 90, 99):
        raise ShardplanError(f"must be 50, 90 or 99 (got {o['slo_percentile']})", field="--slo-percentile", hint="e.g. 90")
    rules = engine_rules(engine, engine_version)
    input_len, output_len, shortened = options.request_lengths(o["input_len"], o["output_len"],
                                                               o["context"] or spec.max_position_embeddings)
    wl = options.inference_workload(
        engine=rules, hw=hw, model_max_len=spec.max_position_embeddings, enable_chunked_prefill=o["enable_chunked_prefill"],
        overlap_scheduling=o["overlap_scheduling"], max_model_len=o["context"], max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
        gpu_memory_utilization=o["gpu_memory_utilization"], block_size=o["block_size"], kv_cache_dtype=o["kv_cache_dtype"],
        weight_dtype=None, quantization=None, enforce_eager=o["enforce_eager"], input_len=input_len,
        output_len=output_len, batch_size=None, vision=spec.vision,
        encoder_decoder=spec.num_cross_attention_layers > 0, checkpoint_format=spec.shipped_format,
        mla=spec.mla is not None, sliding_window=spec.num_sliding_layers > 0)
    lengths, name = None, "fixed"
    if o["dataset_lengths"]:
        lengths = load_lengths(o["dataset_lengths"])
        name = lengths.source
    load = options.serving_load(request_rate=o["request_rate"], concurrency=None, num_prompts=1000, lengths=lengths,
                                lengths_name=name, prefix_cache_hit=0.0, arrivals="poisson", seed=0,
                                input_len=input_len, output_len=output_len,
                                max_model_len=wl.max_model_len or spec.max_position_embeddings, context_option="--context")
    assert load is not None  # a rate was given
    if shortened:
        wl = replace(wl, assumptions=(*wl.assumptions, shortened))
    if math.isinf(load.request_rate_per_second):
        raise ShardplanError("needs a finite rate", field="--request-rate", hint="requests per second, e.g. 20")
    ttft, tpot = o["max_ttft_ms"], o["max_tpot_ms"]
    if ttft is None and tpot is None:
        ttft, tpot = DEFAULT_MAX_TTFT_SECONDS * 1e3, DEFAULT_MAX_TPOT_SECONDS * 1e3
    formats = [wl.quantization]
    for f in filter(None, (x.strip() for x in (o["allow_quantization"] or "").split(","))):
        try:
            q = Quantization(f)
        except ValueError:
            raise ShardplanError(f"unknown weight format '{f}'", field="--allow-quantization",
                                 hint="e.g. fp8,int8,int4") from None
        if q not in formats:
            formats.append(q)
    sla = Sla(ttft / 1e3 if ttft is not None else None, tpot / 1e3 if tpot is not None else None, o["slo_percentile"])
    check_latency_limits(sla.max_ttft_seconds, sla.max_tpot_seconds)
    with render_common.progress("sizing replicas for the rate"):
        result = size_for_rate(spec, hw, replace(wl, load=load), rate=load.request_rate_per_second, sla=sla,
                               formats=tuple(formats), max_gpus=limit)
    if result.at_rate is not None:
        from shardplan.tasks._bands import load_bands

        result = result.model_copy(update={"bands": load_bands(wl, hw, result.at_rate.saturated)})
    render_common.emit(result.model_dump(mode="json"), o["json_out"], lambda _: render_capacity.sizing_report(result))
    if not result.found:
        raise typer.Exit(EXIT_DOES_NOT_FIT)
