"""The command line: parse options, call the library, render. No logic lives here."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from enum import Enum

from shardplan import __version__, fileio
from shardplan.cli import plots, render
from shardplan.cost import inputs as options
from shardplan.specs import cluster
from shardplan.tasks.capacity import default_max_gpus, serving_capacity, training_capacity
from shardplan.cost.estimate import estimate as run_estimate
from shardplan.cost.layout import PipelineSchedule, Recompute
from shardplan.cost.workload import Framework, InferenceWorkload, Optimizer, Quantization, TrainingWorkload
from shardplan.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_INTERNAL, EXIT_VERIFY_MISMATCH, ShardplanError
from shardplan.exporters import TARGETS, ExportOptions
from shardplan.tasks.export import export_plan
from shardplan.plan.manifest import load_manifest, manifest_json_schema
from shardplan.tasks.recommend import recommend as run_recommend
from shardplan.tasks.recommend import with_allowed_dtypes
from shardplan.search import Goal, Objective, Space
from shardplan.tasks.catalog import hardware_report, model_report
from shardplan.specs import loading

EXIT_CODES_HELP = (
    "Exit codes: 0 ok (the plan fits; recommend found one); 1 internal error; 2 bad input (option, file, field, "
    "layout or name); 3 the plan does not fit (recommend: nothing fits); 4 verify disagrees with the prediction. "
    "SHARDPLAN_DEBUG=1 shows tracebacks."
)

app = typer.Typer(
    name="shardplan",
    help="How should I shard this model on this hardware? Per-GPU memory and time for serving "
    "and training layouts (TP, PP, DP/ZeRO, EP, CP).\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)
models_app = typer.Typer(help="List bundled model specs, or show one (name, config.json, directory or YAML).")
hardware_app = typer.Typer(help="List bundled hardware profiles, or show one (name or YAML path).")
app.add_typer(models_app, name="models")
app.add_typer(hardware_app, name="hardware")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"shardplan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    pass


@models_app.callback(invoke_without_command=True)
def models_list(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """List the bundled model specs with their parameter counts."""
    if ctx.invoked_subcommand is not None:
        return
    rows = [model_report(m) for m in loading.list_models()]
    render.emit(rows, json_out, render.models_table)


@models_app.command("show")
def models_show(
    model: Annotated[str, typer.Argument(help="Bundled name (e.g. llama-3.1-70b), config.json, a directory, or a YAML spec.")],
    json_out: JsonOpt = False,
) -> None:
    """Parameter breakdown, total and active counts, KV bytes per token and head/expert facts."""
    r = model_report(loading.load_model(model))
    render.emit(r, json_out, render.model_detail)


@hardware_app.callback(invoke_without_command=True)
def hardware_list(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """List the bundled hardware profiles."""
    if ctx.invoked_subcommand is not None:
        return
    rows = [hardware_report(h) for h in loading.list_hardware()]
    render.emit(rows, json_out, render.hardware_table)


@hardware_app.command("show")
def hardware_show(
    hardware: Annotated[str, typer.Argument(help="Bundled name (e.g. h100-sxm-80gb) or a YAML profile.")],
    gpus_per_node: Annotated[Optional[int], typer.Option(min=1, help="Override GPUs per node.")] = None,
    nodes: Annotated[Optional[int], typer.Option(min=1, help="Number of nodes.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """GPU, node and link figures of one profile, with their sources in --json."""
    hw = loading.load_hardware(hardware).with_topology(gpus_per_node=gpus_per_node, num_nodes=nodes)
    r = hardware_report(hw)
    render.emit(r, json_out, render.hardware_detail)


class WorkloadKind(str, Enum):
    INFERENCE = "inference"
    TRAINING = "training"


class OffloadChoice(str, Enum):
    NONE = "none"
    OPTIMIZER_CPU = "optimizer-cpu"
    OPTIMIZER_NVME = "optimizer-nvme"
    ALL_CPU = "all-cpu"
    ALL_NVME = "all-nvme"


LAYOUT = "Layout (a degree of 1 means not used)"
SERVE = "Inference workload (vLLM semantics and defaults)"
TRAIN = "Training workload"
CLUSTER = "Model and cluster"

# Options shared by estimate and recommend, declared once.
ModelOpt = Annotated[str, typer.Argument(help="Bundled name, config.json, directory or YAML spec.")]
HardwareOpt = Annotated[str, typer.Option("--hardware", "-H", help="Bundled profile name or YAML.", rich_help_panel=CLUSTER)]
GpusOpt = Annotated[Optional[int], typer.Option(min=1, help="GPUs in the plan (default: one node).", rich_help_panel=CLUSTER)]
NodesOpt = Annotated[Optional[int], typer.Option(min=1, help="Nodes (default: as many as --gpus needs).", rich_help_panel=CLUSTER)]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option(min=1, help="Override the profile's GPUs per node.", rich_help_panel=CLUSTER)]
WorkloadOpt = Annotated[WorkloadKind, typer.Option(help="What the GPUs do.", rich_help_panel=CLUSTER)]
MaxModelLenOpt = Annotated[Optional[int], typer.Option(min=1, help="Longest sequence (default: the model's context).", rich_help_panel=SERVE)]
MaxNumSeqsOpt = Annotated[int, typer.Option(min=1, help="Sequences in flight.", rich_help_panel=SERVE)]
MaxNumBatchedTokensOpt = Annotated[int, typer.Option(min=1, help="Tokens per forward pass.", rich_help_panel=SERVE)]
GpuMemoryUtilizationOpt = Annotated[float, typer.Option(help="Share of device memory the engine may use.", rich_help_panel=SERVE)]
BlockSizeOpt = Annotated[int, typer.Option(min=1, help="Tokens per KV block.", rich_help_panel=SERVE)]
KvCacheDtypeOpt = Annotated[Optional[str], typer.Option(help="auto, bf16, fp16, fp8.", rich_help_panel=SERVE)]
WeightDtypeOpt = Annotated[Optional[str], typer.Option(help="bf16, fp16, fp8, int8, int4.", rich_help_panel=SERVE)]
QuantizationOpt = Annotated[Optional[Quantization], typer.Option(help="Weight quantization of the linear layers.", rich_help_panel=SERVE)]
EnforceEagerOpt = Annotated[bool, typer.Option(help="No CUDA graphs.", rich_help_panel=SERVE)]
InputLenOpt = Annotated[int, typer.Option(min=1, help="Prompt tokens per request (time to first token, throughput).", rich_help_panel=SERVE)]
OutputLenOpt = Annotated[int, typer.Option(min=1, help="Generated tokens per request.", rich_help_panel=SERVE)]
BatchSizeOpt = Annotated[Optional[int], typer.Option(min=1, help="Concurrent sequences for the time figures (default: as many as the KV cache holds, up to --max-num-seqs).", rich_help_panel=SERVE)]
SeqLenOpt = Annotated[int, typer.Option(min=1, help="Training sequence length.", rich_help_panel=TRAIN)]
GlobalBatchSizeOpt = Annotated[int, typer.Option(min=1, help="Sequences per optimizer step.", rich_help_panel=TRAIN)]
OptimizerOpt = Annotated[Optimizer, typer.Option(help="Optimizer (states in fp32).", rich_help_panel=TRAIN)]
FrameworkOpt = Annotated[Framework, typer.Option(help="Model-state bookkeeping: ZeRO paper, DeepSpeed, or Megatron (fp32 grads).", rich_help_panel=TRAIN)]
FlashAttentionOpt = Annotated[bool, typer.Option(help="Flash attention (no s^2 scores kept).", rich_help_panel=TRAIN)]
DropoutOpt = Annotated[bool, typer.Option(help="Dropout masks kept for backward.", rich_help_panel=TRAIN)]
OverlapGradReduceOpt = Annotated[bool, typer.Option(help="Data-parallel gradient reduction overlaps the backward (DDP/FSDP/DeepSpeed overlap_comm).", rich_help_panel=TRAIN)]


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
    virtual_stages: Annotated[int, typer.Option(min=1, help="Model chunks per GPU (interleaved schedule).", rich_help_panel=LAYOUT)] = 1,
    micro_batch_size: Annotated[int, typer.Option(min=1, help="Sequences per micro-batch.", rich_help_panel=LAYOUT)] = 1,
    offload: Annotated[OffloadChoice, typer.Option(help="Offload optimizer states (and parameters) to CPU or NVMe.", rich_help_panel=LAYOUT)] = OffloadChoice.NONE,
    max_model_len: MaxModelLenOpt = None,
    max_num_seqs: MaxNumSeqsOpt = 256,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = 8192,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = 0.9,
    block_size: BlockSizeOpt = 16,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    weight_dtype: WeightDtypeOpt = None,
    quantization: QuantizationOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    input_len: InputLenOpt = 1024,
    output_len: OutputLenOpt = 128,
    batch_size: BatchSizeOpt = None,
    seq_len: SeqLenOpt = 4096,
    global_batch_size: GlobalBatchSizeOpt = 512,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    framework: FrameworkOpt = Framework.ZERO,
    flash_attention: FlashAttentionOpt = True,
    dropout: DropoutOpt = False,
    overlap_grad_reduce: OverlapGradReduceOpt = True,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw each pipeline stage's per-GPU memory as stacked bars against the device's capacity, to FILE.png or FILE.svg (needs the plot extra).", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-GPU memory and time of one layout: weights, KV cache, activations, gradients,
    optimizer states, overhead, for every pipeline stage; whether it fits and what binds;
    serving: time to first token, time per output token, throughput and the best batch;
    training: step time, tokens/s per GPU, MFU/HFU, and where the time goes.

    Exit 0 when it fits, 3 when it does not (the report is still printed), 2 for a layout
    that cannot exist."""
    _check_plot(plot)
    loaded = loading.load_model(model)
    hw = cluster.cluster(loading.load_hardware(hardware), gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node)
    layout = options.layout_from_options(
        num_gpus=hw.num_gpus, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, zero_stage=zero_stage,
        hybrid_shard=hybrid_shard, sequence_parallel=sequence_parallel, recompute=recompute.value,
        pp_schedule=pp_schedule.value, virtual_stages=virtual_stages, micro_batch_size=micro_batch_size,
        offload=offload.value,
    )
    wl = _workload(locals())
    report = run_estimate(loaded.spec, hw, layout, wl).as_dict()
    render.emit(report, json_out, render.estimate_report)
    if plot is not None:
        plots.write_plot(plot, plots.estimate_figure(report))
        render.file_written(plot, "plot")
    if not report["fits"]:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


SEARCH = "Search and goal"
PIN = "Pinned degrees (given: fixed; left out: searched)"


class ObjectiveChoice(str, Enum):
    LATENCY = "latency"
    THROUGHPUT = "throughput"
    COST = "cost"
    STEP_TIME = "step-time"


@app.command()
def recommend(
    model: ModelOpt,
    hardware: HardwareOpt = "h100-sxm-80gb",
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    workload: WorkloadOpt = WorkloadKind.INFERENCE,
    max_gpus: Annotated[Optional[int], typer.Option(min=1, help="Search every GPU count up to this and report the smallest that meets the goal.", rich_help_panel=SEARCH)] = None,
    objective: Annotated[Optional[ObjectiveChoice], typer.Option(help="Serving: latency | throughput | cost; training: step-time | cost. Default: throughput / step-time.", rich_help_panel=SEARCH)] = None,
    max_ttft_ms: Annotated[Optional[float], typer.Option(min=0, help="Serving: longest time to first token allowed.", rich_help_panel=SEARCH)] = None,
    max_tpot_ms: Annotated[Optional[float], typer.Option(min=0, help="Serving: longest time per output token allowed.", rich_help_panel=SEARCH)] = None,
    min_throughput: Annotated[Optional[float], typer.Option(min=0, help="Serving: least output tokens/s over all GPUs.", rich_help_panel=SEARCH)] = None,
    gpu_hour_price: Annotated[Optional[float], typer.Option(min=0, help="USD per GPU-hour for --objective cost (default: the profile's).", rich_help_panel=SEARCH)] = None,
    allow_quantization: Annotated[Optional[str], typer.Option(help="Serving: formats the search may use, e.g. fp8,int8,int4 (fp8 also allows an fp8 KV cache).", rich_help_panel=SEARCH)] = None,
    allow_cross_node_tp: Annotated[bool, typer.Option(help="Let tensor parallelism span nodes.", rich_help_panel=SEARCH)] = False,
    allow_offload: Annotated[bool, typer.Option(help="Training: let the search offload optimizer states/parameters to CPU or NVMe.", rich_help_panel=SEARCH)] = True,
    top_k: Annotated[int, typer.Option("--top", min=1, help="Plans to show.", rich_help_panel=SEARCH)] = 5,
    compare: Annotated[Optional[str], typer.Option(help="A layout to compare with the winner, e.g. tp=8,pp=16,dp=128 (a published one).", rich_help_panel=SEARCH)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the winner's deployment manifest (YAML) here.", rich_help_panel=SEARCH)] = None,
    export_to: Annotated[Optional[str], typer.Option("--export", help=f"Also export the winner for this target ({', '.join(TARGETS)}), beside the -o manifest.", rich_help_panel=SEARCH)] = None,
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
    max_num_seqs: MaxNumSeqsOpt = 256,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = 8192,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = 0.9,
    block_size: BlockSizeOpt = 16,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    weight_dtype: WeightDtypeOpt = None,
    quantization: QuantizationOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    input_len: InputLenOpt = 1024,
    output_len: OutputLenOpt = 128,
    batch_size: BatchSizeOpt = None,
    seq_len: SeqLenOpt = 4096,
    global_batch_size: GlobalBatchSizeOpt = 512,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    framework: FrameworkOpt = Framework.ZERO,
    flash_attention: FlashAttentionOpt = True,
    dropout: DropoutOpt = False,
    overlap_grad_reduce: OverlapGradReduceOpt = True,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw the serving Pareto frontier (time per output token against tokens/s per GPU) or, training, step time against GPU count, the pick marked, to FILE.png or FILE.svg (needs the plot extra).", show_default=False, rich_help_panel=SEARCH)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Search every valid layout (tp, pp, dp/replicas, ep, cp, ZeRO, SP, recompute, micro-batch,
    virtual stages, offload, weight/KV formats, batch) and rank those that fit by the objective.

    Shows the top plans with memory, headroom, time and cost; the serving Pareto frontier
    (latency vs throughput per GPU); rejected layouts by reason; the binding constraint and the
    runner-up's gap. When nothing fits it lists the smallest changes that would (each found by
    searching again) and exits 3. `-o plan.yaml` writes the winner's deployment manifest."""
    if export_to is not None and output is None:
        raise ShardplanError("--export needs -o PLAN.yaml: the export is written beside the plan", field="--export",
                             hint="add -o plan.yaml")
    if export_to is not None and export_to not in TARGETS:
        raise ShardplanError(f"unknown export target '{export_to}'", field="--export", hint=f"use one of {', '.join(TARGETS)}")
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
    wl = _workload(locals())
    training = isinstance(wl, TrainingWorkload)
    obj = objective.value if objective else ("step-time" if training else "throughput")
    goal = Goal(
        objective=Objective(obj),
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
        offload=options.offload_pair(offload.value) if offload else None,
        allow_cross_node_tp=allow_cross_node_tp, allow_offload=allow_offload,
    )
    if not training:
        space = replace(space, quantizations=(wl.quantization,), kv_cache_dtypes=(wl.kv_cache_dtype,))
        if allow_quantization and not (weight_dtype or quantization or kv_cache_dtype):
            space = with_allowed_dtypes(space, allow_quantization.split(","))
    with render.progress("searching layouts") as progress:
        result = run_recommend(
            loaded, hw, wl, space, goal, num_gpus=num_gpus, max_gpus=max_gpus, compare_layout=compare,
            manifest_path=output, progress=progress,
        )
    if result["top"] and export_to is not None:
        assert output is not None
        exported = export_plan(output, export_to, ExportOptions(plan_file=str(output)), output.parent)
        result["export"] = {"target": export_to, "files": [f["path"] for f in exported["files"]]}
    if json_out:
        render.print_json(result)
    else:
        render.recommend_report(result)
        if "export" in result:
            render.export_report(exported, written=True)
    if plot is not None and result["top"]:
        plots.write_plot(plot, plots.recommend_figure(result))
        render.file_written(plot, "plot")
    if not result["top"]:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


@app.command()
def capacity(
    model: ModelOpt,
    hardware: HardwareOpt = "h100-sxm-80gb",
    gpus_per_node: GpusPerNodeOpt = None,
    workload: WorkloadOpt = WorkloadKind.INFERENCE,
    max_gpus: Annotated[Optional[int], typer.Option(min=1, help="Largest GPU count to consider (default: 64 nodes' worth).", rich_help_panel=SEARCH)] = None,
    context: Annotated[int, typer.Option(min=1, help="Serving: tokens per sequence (vLLM's max_model_len) the GPUs must hold.", rich_help_panel=SERVE)] = 8192,
    concurrency: Annotated[int, typer.Option(min=1, help="Serving: sequences of --context tokens held at once.", rich_help_panel=SERVE)] = 1,
    max_num_seqs: MaxNumSeqsOpt = 256,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = 8192,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = 0.9,
    block_size: BlockSizeOpt = 16,
    kv_cache_dtype: KvCacheDtypeOpt = None,
    enforce_eager: EnforceEagerOpt = False,
    seq_len: SeqLenOpt = 4096,
    global_batch_size: GlobalBatchSizeOpt = 512,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    framework: FrameworkOpt = Framework.ZERO,
    flash_attention: FlashAttentionOpt = True,
    json_out: JsonOpt = False,
) -> None:
    """How much hardware does this model need? Serving: the fewest GPUs (and nodes) for each
    weight format (bf16, fp8, int8, int4) to hold --concurrency sequences of --context tokens,
    with the layout and its per-GPU memory; and for each tensor-parallel size, the longest
    context and the most sequences. Says when quantizing removes the need to shard.
    Training (--workload training): the fewest GPUs for each ZeRO stage and offload choice at
    --seq-len and --global-batch-size, with the fastest layout there.

    GPU counts are those recommend searches (powers of two in a node, then whole nodes) up to
    --max-gpus. Exit 0; 3 when nothing fits within --max-gpus."""
    loaded = loading.load_model(model)
    base = loading.load_hardware(hardware)
    hw = base.with_topology(gpus_per_node=gpus_per_node or base.gpus_per_node, num_nodes=1)
    limit = max_gpus or default_max_gpus(hw)
    if workload is WorkloadKind.TRAINING:
        wl_t = options.training_workload(seq_len=seq_len, global_batch_size=global_batch_size, optimizer=optimizer.value,
                                         framework=framework.value, flash_attention=flash_attention, dropout=False)
        result = training_capacity(loaded.spec, hw, wl_t, max_gpus=limit)
        found = any(r["min_num_gpus"] for r in result["rows"])
    else:
        if concurrency > max_num_seqs:
            raise ShardplanError(f"--concurrency {concurrency} exceeds --max-num-seqs {max_num_seqs}, the most the engine runs at once",
                                 field="--concurrency", hint=f"add --max-num-seqs {concurrency}")
        wl_s = options.inference_workload(
            max_model_len=context, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
            weight_dtype=None, quantization=None, enforce_eager=enforce_eager, input_len=1024, output_len=128, batch_size=None,
        )
        result = serving_capacity(loaded.spec, hw, wl_s, concurrency=concurrency, max_gpus=limit)
        found = any(r["min_num_gpus"] for r in result["formats"])
    render.emit(result, json_out, render.capacity_report)
    if not found:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


@app.command()
def schema() -> None:
    """Print the JSON Schema of the deployment manifest that `recommend -o` writes."""
    render.print_json(manifest_json_schema())


@app.command()
def show(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    json_out: JsonOpt = False,
) -> None:
    """Re-render a deployment manifest: model, hardware, layout, placement, predicted memory and
    time. A manifest from a newer schema or with an impossible layout is rejected (exit 2)."""
    m = load_manifest(plan).model_dump(mode="json")
    render.emit(m, json_out, render.manifest_report)


ToOpt = Annotated[str, typer.Option("--to", help=f"Target: {', '.join(TARGETS)}.", show_default=False)]


@app.command("export")
def export_cmd(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    to: ToOpt,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Folder to write the files into (created if missing); default: print them.")] = None,
    model_path: Annotated[Optional[str], typer.Option(help="Checkpoint path or Hugging Face id the engine loads (default: the plan's hf_id).")] = None,
    script: Annotated[Optional[str], typer.Option(help="Training: the script and arguments each rank runs (default: `shardplan verify PLAN`; deepspeed/accelerate: train.py).")] = None,
    image: Annotated[Optional[str], typer.Option(help="kubernetes: container image (default: the engine's release image).")] = None,
    port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="Serving port (first replica) or rendezvous port.")] = None,
    nvme_path: Annotated[str, typer.Option(help="deepspeed: folder NVMe offload writes to.")] = "/local_nvme",
    engine: Annotated[str, typer.Option(help="kubernetes: serving engine the pods run (vllm, sglang, tgi, trtllm).")] = "vllm",
    json_out: JsonOpt = False,
) -> None:
    """Turn a plan into what a deployment tool takes: engine command lines (vllm, sglang, tgi,
    trtllm), training configs and launchers (deepspeed, torchrun, slurm, accelerate), Kubernetes
    objects, or a JAX mesh. Flags are pinned to a stated version of each tool. A plan the target
    cannot express (e.g. pipeline stages for TGI, ZeRO for a serving engine) exits 2 saying why;
    a plan that does not fit exits 3. Files are written atomically."""
    opts = ExportOptions(model_path=model_path, script=script, plan_file=str(plan), image=image, port=port,
                         nvme_path=nvme_path, engine=engine)
    result = export_plan(plan, to, opts, output)
    if json_out:
        render.print_json(result)
    else:
        render.export_report(result, written=output is not None)


@app.command("checkpoint")
def checkpoint_cmd(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    checkpoint_dir: Annotated[Path, typer.Argument(help="A safetensors checkpoint: a folder with model.safetensors.index.json or one .safetensors file (or that file).")],
    dtype: Annotated[Optional[str], typer.Option(help="The tensors' dtype (default: the model spec's, e.g. bf16).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Which bytes of a safetensors checkpoint each rank reads for this plan. Reads the index and
    the file headers only (never tensor data), checks every tensor's name, shape and dtype
    against the model, and reports per rank the files, byte ranges and total bytes, and the
    total per node. A missing, extra or mis-shaped tensor, or an index entry outside the
    folder, exits 2 naming it."""
    from shardplan.tasks.checkpoint import plan_checkpoint

    result = plan_checkpoint(plan, checkpoint_dir, dtype=dtype)
    render.emit(result, json_out, render.checkpoint_report)


@app.command("replan")
def replan_cmd(
    plan: Annotated[Path, typer.Argument(help="The current plan (a manifest written by `shardplan recommend -o`).")],
    gpus: Annotated[Optional[int], typer.Option(min=1, help="GPUs of the changed cluster.")] = None,
    nodes: Annotated[Optional[int], typer.Option(min=1, help="Nodes of the changed cluster (the plan's GPUs per node).")] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="Hardware profile (default: the plan's).")] = None,
    margin: Annotated[float, typer.Option(min=0, max=0.99, help="Take the layout that moves least among those within this fraction of the best objective.")] = 0.05,
    objective: Annotated[Optional[ObjectiveChoice], typer.Option(help="Rank by this instead of the plan's objective.")] = None,
    top_k: Annotated[int, typer.Option("--top", min=1, help="Candidate layouts to cost the move of.")] = 5,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the chosen plan's manifest here (and its move list beside it).")] = None,
    moves: Annotated[Optional[Path], typer.Option(help="Write the move list here (.json, or .yaml); default: beside -o as NAME.moves.json.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """A new plan for a changed cluster (--gpus N or --nodes N), ranked like recommend, with the
    cost of getting there: for each candidate, the bytes of weights (training: and optimizer
    states) each new rank must receive from the old ranks. Chooses the layout that moves least
    among those within --margin of the best, writes its manifest and the move list (which
    tensor slice goes from which old rank to which new rank). Exit 3 when nothing fits."""
    from shardplan.plan.readback import plan_hardware
    from shardplan.tasks.replan import replan

    if (gpus is None) == (nodes is None):
        raise ShardplanError("give the changed cluster as --gpus N or --nodes N", field="--gpus", hint="give one of them")
    old = load_manifest(plan)
    base = plan_hardware(old, str(plan), hardware)
    gpn = old.hardware.gpus_per_node if old.hardware.num_nodes > 1 else base.gpus_per_node
    n = cluster.cluster(base, gpus=gpus, nodes=nodes, gpus_per_node=gpn).num_gpus
    hw = base.with_topology(gpus_per_node=gpn, num_nodes=1)
    result = replan(old, source=str(plan), hw=hw, num_gpus=n, margin=margin, top_k=top_k,
                    objective=objective.value if objective else None, manifest_path=output, moves_path=moves)
    render.emit(result, json_out, render.replan_report)
    if result["chosen"] is None:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


class BackendChoice(str, Enum):
    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"


class ScaleChoice(str, Enum):
    PROXY = "proxy"
    FULL = "full"


@app.command("verify")
def verify_cmd(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    backend: Annotated[BackendChoice, typer.Option(help="auto: NCCL with GPUs, gloo without.")] = BackendChoice.AUTO,
    scale: Annotated[Optional[ScaleChoice], typer.Option(help="full: the real model; proxy: the same layout on a small model (default without GPUs).", show_default=False)] = None,
    steps: Annotated[int, typer.Option(min=1, help="Training: optimizer steps to run.")] = 3,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds the whole run may take; a rank that hangs or dies ends it.")] = 300.0,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write the full report as JSON to this file.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the plan for real with torch.distributed (DeviceMesh, DTensor tensor parallelism,
    FSDP2, torch.distributed.pipelining) and compare per-rank memory (weights, gradients,
    optimizer states, activations, KV cache) with the cost model applied to what ran; check the
    loss or logits against an unsharded single-process reference; time on GPUs.

    On one machine it starts the ranks itself through torchrun; started by a launcher (RANK and
    WORLD_SIZE set, e.g. the torchrun or slurm export on a cluster) it runs as one rank.
    Exit 4 when a component or the numerics are out of tolerance, 5 when a rank raised, died or
    hung (the report names it), 2 for a plan it cannot run here."""
    from shardplan.verify.launch import is_worker, verify_plan
    from shardplan.verify.runspec import RUN_DIR_ENV

    result = verify_plan(plan, backend=backend.value, scale=scale.value if scale else None, steps=steps,
                         timeout_seconds=timeout, report_path=report)
    if result is None:
        return  # a rank other than 0: rank 0 reports
    launched = is_worker() and os.environ.get(RUN_DIR_ENV)
    if launched:
        return  # the local launcher reads the report and renders it
    render.emit(result, json_out, render.verify_report)
    if result["status"] == "mismatch":
        raise typer.Exit(EXIT_VERIFY_MISMATCH)


@app.command("calibrate")
def calibrate_cmd(
    report: Annotated[Path, typer.Argument(help="A report written by `shardplan verify --report` on GPUs.")],
    hardware: HardwareOpt = "h100-sxm-80gb",
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the calibrated profile (YAML).")] = Path("my-hw.yaml"),
    name: Annotated[Optional[str], typer.Option(help="The new profile's name (default: the file's stem).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Turn a GPU verify report's measured matmul FLOP/s, memory bandwidth and all-reduce bus
    bandwidth into a copy of a hardware profile whose efficiencies are the measured ones (each
    with its source line); pass the file to --hardware and later estimates use it.

    Exit 2 for a report from a CPU run, a failed run, or one without probes."""
    from shardplan.tasks.calibrate import calibrate, parse_report

    parsed = parse_report(loading.read_structured(report), str(report))
    base_path = loading.hardware_path(hardware)
    data, rows, notes = calibrate(parsed, loading.read_structured(base_path), name=name or output.stem,
                                  report_source=str(report))
    text = f"# calibrated by `shardplan calibrate {report}` from {base_path.name}\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    loading.hardware_from_data(yaml.safe_load(text), str(output))  # loads as written
    fileio.write_text_atomic(output, text)
    result = {"profile": str(output), "name": data["name"], "base": base_path.name, "changes": rows, "notes": notes}
    render.emit(result, json_out, render.calibrate_report)


def _check_plot(path: Optional[Path]) -> None:
    """Before any work: the format is known and matplotlib is installed."""
    if path is not None:
        plots.plot_format(path)
        plots.require_matplotlib()


def _workload(o: dict) -> InferenceWorkload | TrainingWorkload:
    """The workload from the shared workload options of a command (its locals)."""
    if o["workload"] is WorkloadKind.TRAINING:
        return options.training_workload(
            seq_len=o["seq_len"], global_batch_size=o["global_batch_size"], optimizer=o["optimizer"].value,
            framework=o["framework"].value, flash_attention=o["flash_attention"], dropout=o["dropout"],
            overlap_grad_reduce=o["overlap_grad_reduce"],
        )
    q = o["quantization"]
    return options.inference_workload(
        max_model_len=o["max_model_len"], max_num_seqs=o["max_num_seqs"], max_num_batched_tokens=o["max_num_batched_tokens"],
        gpu_memory_utilization=o["gpu_memory_utilization"], block_size=o["block_size"], kv_cache_dtype=o["kv_cache_dtype"],
        weight_dtype=o["weight_dtype"], quantization=q.value if q else None, enforce_eager=o["enforce_eager"],
        input_len=o["input_len"], output_len=o["output_len"], batch_size=o["batch_size"],
    )


def main() -> None:
    """Console entry point: maps ShardplanError to one line and its exit code."""
    debug = os.environ.get("SHARDPLAN_DEBUG") == "1"
    try:
        app(standalone_mode=True)
    except ShardplanError as e:
        if debug:
            traceback.print_exc()
        render.error_line(e.one_line())
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        render.error_line("interrupted")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the last line of defence: no raw traceback for users
        if debug:
            traceback.print_exc()
        render.error_line(
            f"internal error: {type(e).__name__}: {e} (a bug; rerun with SHARDPLAN_DEBUG=1 and report the traceback)"
        )
        sys.exit(EXIT_INTERNAL)


__all__ = ["app", "main", "EXIT_BAD_INPUT"]
