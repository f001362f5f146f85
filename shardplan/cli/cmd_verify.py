"""`verify` and `calibrate`: run a plan for real, and feed what it measured back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from enum import Enum

from shardplan.errors import ShardplanError, EXIT_VERIFY_FAILED, EXIT_VERIFY_MISMATCH

from shardplan.cli.app import app, JsonOpt

DEFAULT_HARDWARE = "h100-sxm-80gb"  # calibrate's base profile without --hardware (a serving run names its own)


class BackendChoice(str, Enum):
    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"


class ScaleChoice(str, Enum):
    PROXY = "proxy"
    FULL = "full"


class DtypeChoice(str, Enum):
    PLAN = "plan"
    FP32 = "fp32"


@app.command("verify")
def verify_cmd(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    backend: Annotated[BackendChoice, typer.Option(help="auto: NCCL with GPUs, gloo without.")] = BackendChoice.AUTO,
    scale: Annotated[Optional[ScaleChoice], typer.Option(help="full: the real model; proxy: the same layout on a small model (default without GPUs).", show_default=False)] = None,
    steps: Annotated[int, typer.Option(min=1, help="Training: optimizer steps to run.")] = 3,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds the whole run may take; a rank that hangs or dies ends it.")] = 300.0,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write the full report as JSON to this file.")] = None,
    dtype: Annotated[DtypeChoice, typer.Option("--dtype", help="plan: run in the plan's format (bf16 for a bf16, fp16 or fp8 plan, on GPUs and on CPUs with gloo); fp32: run fp32 (tighter numerics), compared with the cost model applied to fp32.")] = DtypeChoice.PLAN,
    device_memory_gib: Annotated[Optional[float], typer.Option("--device-memory-gib", min=0.001, help="Run as if each device had this much memory, GiB (as the profile's memory_capacity_gib; torch may use it less the profile's CUDA context, non-torch and NCCL figures). Default: the plan's GPU at --scale full, no limit for a proxy. A CPU run enforces it on its live tensors, a GPU run on the caching allocator.", show_default=False)] = None,
    engine_log: Annotated[Optional[Path], typer.Option("--engine-log", help="Check the plan against this vLLM/SGLang/TGI start-up log instead of running it (no torch, nothing launched).", show_default=False)] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="With --engine-log: the hardware profile the plan was made with, when it is a file (e.g. one `calibrate` wrote); default: the plan's profile by name.", show_default=False)] = None,
    from_plan: Annotated[Optional[Path], typer.Option("--from", help="Reshard: train this (old) plan's layout --steps steps, save a torch.distributed.checkpoint, load it into PLAN's layout in a fresh launch and train --steps more; check the loss against one unsharded run and each new rank's loaded bytes against replan's move list.", show_default=False)] = None,
    lost_nodes: Annotated[Optional[str], typer.Option(help="With --from: old nodes that are gone, e.g. 1 or 0,2 (as replan): never sources in the move list.", show_default=False)] = None,
    lost_ranks: Annotated[Optional[str], typer.Option(help="With --from: old ranks whose memory is lost, e.g. 3 or 2-3 (as replan).", show_default=False)] = None,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="An offloaded serving plan (engine transformers, --offload-layers): load this Hugging Face checkpoint folder (config.json, *.safetensors) with the plan's accelerate device_map on the CPU, generate, and compare the bytes per device, the GPU peak and the bytes moved per token with the plan.", show_default=False)] = None,
    offload_folder: Annotated[Optional[Path], typer.Option("--offload-folder", help="With --checkpoint and a plan that offloads to nvme: where accelerate writes the disk layers (a fresh folder inside it, removed after); default: the system's temporary folder.", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the plan for real with torch.distributed (DeviceMesh, DTensor tensor parallelism,
    FSDP2, torch.distributed.pipelining) and compare per-rank memory (weights, gradients,
    optimizer states, activations, KV cache) with the cost model applied to what ran; check the
    loss or logits against an unsharded single-process reference; time on GPUs.

    It runs in the plan's format (--dtype plan: bf16 for a bf16, fp16 or fp8 plan) and compares
    with the cost model applied to the format that ran; numerics tolerances follow it. Per rank
    it reports peak allocated and reserved memory (GPU: torch.cuda.memory_stats; CPU: the live
    tensors, reserved not measured) against the predicted total and reserve.

    A rank that runs out of device memory (a GPU's own, or on a CPU the plan's GPU at --scale
    full or --device-memory-gib, enforced on its live tensors) ends the run with a report: the
    op, tensor shape and bytes that did not fit, the component they belong to and its
    prediction, the components measured before, and the smallest change the cost model says
    fits (halve the micro-batch, recompute full, twice the tp, ZeRO-3).

    On one machine it starts the ranks itself through torchrun; started by a launcher (RANK and
    WORLD_SIZE set, e.g. the torchrun or slurm export on a cluster) it runs as one rank.
    Exit 4 when a component or the numerics are out of tolerance, 5 when the run did not
    complete: a rank ran out of memory (the report says where), raised, died or hung (the
    report names it); 2 for a plan it cannot run here.

    With --engine-log FILE it runs nothing: the memory figures the engine printed at start-up
    (weights, activation peak, KV cache bytes, tokens and blocks, max concurrency, a refusal)
    are compared with the plan's estimate. Exit 4 when one is out of tolerance, 2 for a log
    that cannot be read or holds no start-up memory lines.

    With --from OLD it reshards a training run: OLD's layout trains --steps steps (fp32) and
    saves a torch.distributed.checkpoint of the model and optimizer; a fresh launch with PLAN's
    world size (the --lost-nodes/--lost-ranks gone) loads it, DCP resharding it, and trains
    --steps more. The loss of every step must be one unsharded process's (rtol 1e-5 with SGD),
    and each new rank's loaded bytes the move list replan computes for the change, applied to
    what ran. Exit 4 when either is out of tolerance, 5 when a run fails, 2 for plans of
    different models or workloads, or a serving plan.

    With --checkpoint DIR, for a serving plan that keeps --offload-layers decoder layers in host
    RAM or on disk (engine transformers): the plan's accelerate device_map is loaded from DIR on
    the CPU (GPU 0 stood in by torch.device("cpu"), which accelerate keeps apart from its "cpu"
    offload target), a few tokens are generated greedily and compared with DIR loaded whole, and
    the GPU's resident weights and peak, the host or disk bytes, and the bytes moved per generated
    token are compared with the plan (5%). Exit 4 when one is out of tolerance or the tokens
    differ, 5 when the load or generation fails, 2 for a checkpoint that is missing or not the
    plan's model, a plan that is not an offloaded transformers serving plan, or an offload folder
    that cannot be written."""
    import gc

    gc.enable()  # a rank trains for many steps: the collector main() turns off for short commands runs again
    from shardplan.cli import render_common, render_verify

    if checkpoint is not None:
        _offloaded(plan, checkpoint, offload_folder, report=report, json_out=json_out, given={
            "--from": from_plan is not None, "--engine-log": engine_log is not None, "--hardware": hardware is not None,
            "--lost-nodes": lost_nodes is not None, "--lost-ranks": lost_ranks is not None,
            "--device-memory-gib": device_memory_gib is not None, "--scale": scale is not None,
            "--backend": backend is not BackendChoice.AUTO, "--dtype": dtype is not DtypeChoice.PLAN})
        return
    if offload_folder is not None:
        raise ShardplanError("applies to --checkpoint only", field="--offload-folder",
                             hint="give the offloaded plan's checkpoint with --checkpoint DIR")
    if from_plan is not None:
        _reshard(plan, from_plan, lost_nodes=lost_nodes, lost_ranks=lost_ranks, backend=backend, scale=scale,
                 steps=steps, timeout=timeout, report=report, device_memory_gib=device_memory_gib,
                 engine_log=engine_log, hardware=hardware, json_out=json_out)
        return
    if lost_nodes is not None or lost_ranks is not None:
        raise ShardplanError("applies to --from only", field="--lost-nodes" if lost_nodes is not None else "--lost-ranks",
                             hint="give the old plan with --from OLD.yaml")
    if engine_log is not None:
        if dtype is not DtypeChoice.PLAN or device_memory_gib is not None:
            raise ShardplanError("applies to a run, not to --engine-log", field="--dtype" if dtype is not DtypeChoice.PLAN
                                 else "--device-memory-gib", hint="drop it, or run the plan without --engine-log")
        _engine_log(plan, engine_log, hardware, json_out)
        return
    if hardware is not None:
        raise ShardplanError("applies to --engine-log only", field="--hardware",
                             hint="a run uses the plan's own profile")
    from shardplan.verify.launch import is_worker, verify_plan
    from shardplan.verify.runspec import RUN_DIR_ENV

    launched = is_worker() and os.environ.get(RUN_DIR_ENV)  # a rank the local launcher started
    on_event = _progress_line if render_common.err_console.is_terminal and not launched else None
    result = verify_plan(plan, backend=backend.value, scale=scale.value if scale else None, steps=steps,
                         timeout_seconds=timeout, report_path=report, on_event=on_event, dtype=dtype.value,
                         device_memory_gib=device_memory_gib)
    if result is None:
        return  # a rank other than 0: rank 0 reports
    if launched:
        if result.status == "oom":  # exit at once: torchrun then ends the peers waiting for this rank
            raise typer.Exit(EXIT_VERIFY_FAILED)
        return  # the local launcher reads the report and renders it
    render_common.emit(result.model_dump(mode="json") if json_out else result, json_out, render_verify.verify_report)
    if result.status == "mismatch":
        raise typer.Exit(EXIT_VERIFY_MISMATCH)
    if result.status == "oom":
        raise typer.Exit(EXIT_VERIFY_FAILED)


def _reshard(plan: Path, from_plan: Path, *, lost_nodes: str | None, lost_ranks: str | None,
             backend: BackendChoice, scale: ScaleChoice | None, steps: int, timeout: float, report: Path | None,
             device_memory_gib: float | None, engine_log: Path | None, hardware: str | None,
             json_out: bool) -> None:
    """verify PLAN --from OLD: the two launches, the loss and the bytes (`verify.reshard_launch`).
    Both legs run fp32 whatever --dtype says: the continuation is checked at fp32 tolerance."""
    from shardplan.cli import render_common, render_verify
    from shardplan.cli.cmd_deploy import _index_list  # replan's parser of --lost-nodes / --lost-ranks
    from shardplan.verify.reshard_launch import verify_reshard

    refused = {"--engine-log": engine_log is not None, "--hardware": hardware is not None,
               "--device-memory-gib": device_memory_gib is not None}
    for flag, given in refused.items():
        if given:
            raise ShardplanError("does not apply to --from", field=flag, hint="drop it: --from runs both plans")
    on_event = _progress_line if render_common.err_console.is_terminal else None
    result = verify_reshard(plan, from_plan, lost_nodes=_index_list(lost_nodes, "--lost-nodes"),
                            lost_ranks=_index_list(lost_ranks, "--lost-ranks"), backend=backend.value,
                            scale=scale.value if scale else None, steps=steps, timeout_seconds=timeout,
                            report_path=report, on_event=on_event)
    render_common.emit(result.model_dump(mode="json") if json_out else result, json_out, render_verify.reshard_report)
    if result.status == "mismatch":
        raise typer.Exit(EXIT_VERIFY_MISMATCH)


def _offloaded(plan: Path, checkpoint: Path, offload_folder: Path | None, *, report: Path | None, json_out: bool,
               given: dict[str, bool]) -> None:
    """verify PLAN --checkpoint DIR: an offloaded serving plan loaded with accelerate on the CPU
    (`verify.offload_serving`, which imports torch when it runs)."""
    from shardplan.cli import render_common, render_verify
    import json

    from shardplan.fileio import write_text_atomic
    from shardplan.verify.offload_serving import verify_offloaded_plan

    for flag, was_given in given.items():
        if was_given:
            raise ShardplanError("does not apply to --checkpoint", field=flag,
                                 hint="drop it: --checkpoint loads the plan's device_map in one process, in the plan's "
                                      "format")
    result = verify_offloaded_plan(plan, checkpoint, offload_folder=offload_folder)
    if report is not None:
        write_text_atomic(report, json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    render_common.emit(result.model_dump(mode="json") if json_out else result, json_out, render_verify.offload_report)
    if result.status == "mismatch":
        raise typer.Exit(EXIT_VERIFY_MISMATCH)


def _engine_log(plan: Path, log: Path, hardware: str | None, json_out: bool) -> None:
    from shardplan.cli import render_common, render_verify
    from shardplan.tasks.engine_log import check_engine_log

    result = check_engine_log(plan, log, hardware)
    render_common.emit(result.model_dump(mode="json") if json_out else result, json_out, render_verify.engine_log_check)
    if result.status == "mismatch":
        raise typer.Exit(EXIT_VERIFY_MISMATCH)


def _progress_line(text: str) -> None:
    """A verify progress line on stderr (only when stderr is a terminal): never in stdout."""
    from shardplan.cli import render_common

    render_common.err_console.print(f"verify: {text}", markup=False, highlight=False, soft_wrap=True)


@app.command("calibrate")
def calibrate_cmd(
    report: Annotated[Optional[Path], typer.Argument(help="A report written by `shardplan verify --report` on GPUs (or give --engine-log).", show_default=False)] = None,
    engine_log: Annotated[Optional[Path], typer.Option("--engine-log", help="Calibrate the device memory and runtime overheads from this vLLM start-up log instead of a report.", show_default=False)] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="With --engine-log: the logged run's tensor-parallel size (default: the --plan's, else 1; its non-torch memory holds NCCL buffers when > 1).", show_default=False)] = None,
    plan: Annotated[Optional[Path], typer.Option("--plan", help="The plan the measured run deployed (with --engine-log: the plan the engine was started from; with REPORT: default, the plan the report names). The run is recorded in the profile as a measured case, and predictions made with the profile take their error band from its cases.", show_default=False)] = None,
    serving_run: Annotated[Optional[Path], typer.Option("--serving-run", help="Calibrate the GPU's compute rate from this serving benchmark run instead: a `validate --cases` file with a serving_load case (the run's engine, layout, traffic and measured figures).", show_default=False)] = None,
    case_id: Annotated[Optional[str], typer.Option("--case", help="With --serving-run: the id of the run to fit, when the file holds several.", show_default=False)] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="The base profile, a bundled name or YAML (default: h100-sxm-80gb; with --serving-run, the profile the run names).", show_default=False)] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the calibrated profile (YAML).")] = Path("my-hw.yaml"),
    name: Annotated[Optional[str], typer.Option(help="The new profile's name (default: the file's stem).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Turn a GPU verify report's measured matmul FLOP/s, memory bandwidth and all-reduce bus
    bandwidth into a copy of a hardware profile whose efficiencies are the measured ones (each
    with its source line); pass the file to --hardware and later estimates use it.

    With --engine-log FILE instead of REPORT: a vLLM start-up log's total_gpu_memory,
    non_torch_memory and CUDA-graph figures become the profile's device memory and runtime
    overheads (each with the log line it comes from).

    The run is also recorded in the profile (`measured_cases:`, the `validate --cases` schema):
    an engine log with --plan as an engine_log case (its KV capacity, or its refusal), a
    full-scale training run's report as a training case (its allocated peak). Estimates,
    recommend and capacity with the profile then show the band of its own cases where they
    match ("±0.2% (p90 of 1 ... measured on this profile)"); other figures keep the shipped band.

    A report of a run that ran out of memory is read for the probes the failed rank ran after
    freeing its memory (matmul and memory bandwidth; the all-reduce could not run, so the link
    efficiencies stay the base profile's, and a note says so).

    With --serving-run FILE: a GPU held below its chip's rated power or clocks runs its
    compute-bound steps (prompts) slower than the datasheet peaks while its decode keeps the
    memory bandwidth; a serving benchmark run with long prompts measures how much. The fraction of
    the peaks at which shardplan's simulation of the run gives its measured output throughput
    becomes the profile's gpu.power_limited_compute_fraction, e.g. `shardplan calibrate
    --serving-run my-run.yaml -o my-h100.yaml` (the run's figures before and after are printed;
    a run whose throughput hardly depends on compute, such as short prompts at low load, is
    refused).

    Exit 2 for a report from a CPU run, a failed run, or one without probes; for a log without
    those figures; for a serving run that cannot measure the compute rate; or for none or more
    than one of REPORT, --engine-log and --serving-run. Nothing is written then."""
    from shardplan.cli import render_common, render_verify
    from shardplan.errors import ShardplanError
    from shardplan.tasks.calibrate import (calibrate_profile, calibrate_profile_from_engine_log,
                                           calibrate_profile_from_serving_run)

    if case_id is not None and serving_run is None:
        raise ShardplanError("--case names a run of a --serving-run file", field="--case",
                             hint="drop --case, or pass --serving-run FILE")
    given = [n for n, v in (("REPORT", report), ("--engine-log", engine_log), ("--serving-run", serving_run)) if v is not None]
    if len(given) != 1:
        if not given:
            raise ShardplanError("give a verify REPORT, --engine-log FILE or --serving-run FILE", field="--engine-log",
                                 hint="e.g. `shardplan calibrate --engine-log vllm.log --hardware HW -o my-hw.yaml`")
        raise ShardplanError(f"give one of {' and '.join(given)}, not both", field=given[-1],
                             hint="calibrate from one source at a time")
    if serving_run is not None:
        if tp is not None or plan is not None:
            raise ShardplanError("a serving run states its own layout and deployment", field="--tp" if tp is not None else "--plan",
                                 hint="drop --tp and --plan with --serving-run")
        result = calibrate_profile_from_serving_run(serving_run, output, case_id=case_id, hardware=hardware, name=name)
    elif engine_log is not None:
        result = calibrate_profile_from_engine_log(engine_log, hardware or DEFAULT_HARDWARE, output, name=name, tp=tp,
                                                   plan=plan)
    else:
        if tp is not None:
            raise ShardplanError("--tp describes an engine log's run; a verify report states its own ranks",
                                 field="--tp", hint="drop --tp, or calibrate from --engine-log")
        result = calibrate_profile(report, hardware or DEFAULT_HARDWARE, output, name=name, plan=plan)
    render_common.emit(result.model_dump(mode="json") if json_out else result, json_out, render_verify.calibrate_report)
