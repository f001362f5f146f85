"""The command line: parse options, call the library, render. No logic lives here."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated, Optional

import typer

from enum import Enum

from shardplan import __version__, options, render
from shardplan.cost.estimate import estimate as run_estimate
from shardplan.cost.layout import PipelineSchedule, Recompute
from shardplan.cost.workload import Framework, Optimizer, Quantization
from shardplan.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_INTERNAL, ShardplanError
from shardplan.report import hardware_report, model_report
from shardplan.specs import loading

EXIT_CODES_HELP = (
    "Exit codes: 0 ok (the plan fits); 1 internal error; 2 bad input (option, file, field, "
    "layout or name); 3 the plan does not fit; 4 verify disagrees with the prediction. "
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
    if json_out:
        render.print_json(rows)
    else:
        render.models_table(rows)


@models_app.command("show")
def models_show(
    model: Annotated[str, typer.Argument(help="Bundled name (e.g. llama-3.1-70b), config.json, a directory, or a YAML spec.")],
    json_out: JsonOpt = False,
) -> None:
    """Parameter breakdown, total and active counts, KV bytes per token and head/expert facts."""
    r = model_report(loading.load_model(model))
    if json_out:
        render.print_json(r)
    else:
        render.model_detail(r)


@hardware_app.callback(invoke_without_command=True)
def hardware_list(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """List the bundled hardware profiles."""
    if ctx.invoked_subcommand is not None:
        return
    rows = [hardware_report(h) for h in loading.list_hardware()]
    if json_out:
        render.print_json(rows)
    else:
        render.hardware_table(rows)


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
    if json_out:
        render.print_json(r)
    else:
        render.hardware_detail(r)


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


@app.command()
def estimate(
    model: Annotated[str, typer.Argument(help="Bundled name, config.json, directory or YAML spec.")],
    hardware: Annotated[str, typer.Option("--hardware", "-H", help="Bundled profile name or YAML.", rich_help_panel=CLUSTER)] = "h100-sxm-80gb",
    gpus: Annotated[Optional[int], typer.Option(min=1, help="GPUs in the plan (default: one node).", rich_help_panel=CLUSTER)] = None,
    nodes: Annotated[Optional[int], typer.Option(min=1, help="Nodes (default: as many as --gpus needs).", rich_help_panel=CLUSTER)] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option(min=1, help="Override the profile's GPUs per node.", rich_help_panel=CLUSTER)] = None,
    workload: Annotated[WorkloadKind, typer.Option(help="What the GPUs do.", rich_help_panel=CLUSTER)] = WorkloadKind.INFERENCE,
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
    max_model_len: Annotated[Optional[int], typer.Option(min=1, help="Longest sequence (default: the model's context).", rich_help_panel=SERVE)] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Sequences in flight.", rich_help_panel=SERVE)] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="Tokens per forward pass.", rich_help_panel=SERVE)] = 8192,
    gpu_memory_utilization: Annotated[float, typer.Option(help="Share of device memory the engine may use.", rich_help_panel=SERVE)] = 0.9,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block.", rich_help_panel=SERVE)] = 16,
    kv_cache_dtype: Annotated[Optional[str], typer.Option(help="auto, bf16, fp16, fp8.", rich_help_panel=SERVE)] = None,
    weight_dtype: Annotated[Optional[str], typer.Option(help="bf16, fp16, fp8, int8, int4.", rich_help_panel=SERVE)] = None,
    quantization: Annotated[Optional[Quantization], typer.Option(help="Weight quantization of the linear layers.", rich_help_panel=SERVE)] = None,
    enforce_eager: Annotated[bool, typer.Option(help="No CUDA graphs.", rich_help_panel=SERVE)] = False,
    input_len: Annotated[int, typer.Option(min=1, help="Prompt tokens per request (time to first token, throughput).", rich_help_panel=SERVE)] = 1024,
    output_len: Annotated[int, typer.Option(min=1, help="Generated tokens per request.", rich_help_panel=SERVE)] = 128,
    batch_size: Annotated[Optional[int], typer.Option(min=1, help="Concurrent sequences for the time figures (default: as many as the KV cache holds, up to --max-num-seqs).", rich_help_panel=SERVE)] = None,
    seq_len: Annotated[int, typer.Option(min=1, help="Training sequence length.", rich_help_panel=TRAIN)] = 4096,
    global_batch_size: Annotated[int, typer.Option(min=1, help="Sequences per optimizer step.", rich_help_panel=TRAIN)] = 512,
    optimizer: Annotated[Optimizer, typer.Option(help="Optimizer (states in fp32).", rich_help_panel=TRAIN)] = Optimizer.ADAMW,
    framework: Annotated[Framework, typer.Option(help="Model-state bookkeeping: ZeRO paper, DeepSpeed, or Megatron (fp32 grads).", rich_help_panel=TRAIN)] = Framework.ZERO,
    flash_attention: Annotated[bool, typer.Option(help="Flash attention (no s^2 scores kept).", rich_help_panel=TRAIN)] = True,
    dropout: Annotated[bool, typer.Option(help="Dropout masks kept for backward.", rich_help_panel=TRAIN)] = False,
    overlap_grad_reduce: Annotated[bool, typer.Option(help="Data-parallel gradient reduction overlaps the backward (DDP/FSDP/DeepSpeed overlap_comm).", rich_help_panel=TRAIN)] = True,
    json_out: JsonOpt = False,
) -> None:
    """Per-GPU memory and time of one layout: weights, KV cache, activations, gradients,
    optimizer states, overhead, for every pipeline stage; whether it fits and what binds;
    serving: time to first token, time per output token, throughput and the best batch;
    training: step time, tokens/s per GPU, MFU/HFU, and where the time goes.

    Exit 0 when it fits, 3 when it does not (the report is still printed), 2 for a layout
    that cannot exist."""
    loaded = loading.load_model(model)
    hw = options.cluster(loading.load_hardware(hardware), gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node)
    layout = options.layout_from_options(
        num_gpus=hw.num_gpus, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, zero_stage=zero_stage,
        hybrid_shard=hybrid_shard, sequence_parallel=sequence_parallel, recompute=recompute.value,
        pp_schedule=pp_schedule.value, virtual_stages=virtual_stages, micro_batch_size=micro_batch_size,
        offload=offload.value,
    )
    if workload is WorkloadKind.TRAINING:
        wl = options.training_workload(
            seq_len=seq_len, global_batch_size=global_batch_size, optimizer=optimizer.value,
            framework=framework.value, flash_attention=flash_attention, dropout=dropout,
            overlap_grad_reduce=overlap_grad_reduce,
        )
    else:
        wl = options.inference_workload(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
            weight_dtype=weight_dtype, quantization=quantization.value if quantization else None,
            enforce_eager=enforce_eager, input_len=input_len, output_len=output_len, batch_size=batch_size,
        )
    report = run_estimate(loaded.spec, hw, layout, wl).as_dict()
    if json_out:
        render.print_json(report)
    else:
        render.estimate_report(report)
    if not report["fits"]:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


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
