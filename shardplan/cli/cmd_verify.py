"""`verify` and `calibrate`: run a plan for real, and feed what it measured back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from enum import Enum

from shardplan import fileio
from shardplan.cli import render_common, render_verify
from shardplan.errors import EXIT_VERIFY_MISMATCH
from shardplan.specs import loading

from shardplan.cli.app import app, JsonOpt
from shardplan.cli.options import (
    HardwareOpt,
)


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
    render_common.emit(result, json_out, render_verify.verify_report)
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
    render_common.emit(result, json_out, render_verify.calibrate_report)
