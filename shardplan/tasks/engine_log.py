"""`shardplan verify PLAN --engine-log FILE`: hold an engine's own start-up log against the
plan's estimate. Reads the plan (plan.readback) and the log (specs.engine_log, bounded), runs
the cost model on the plan's inputs and compares (verify.engine_log_check). Launches nothing
and needs no torch."""

from __future__ import annotations

from pathlib import Path

from shardplan.cost.estimate import estimate
from shardplan.plan import readback
from shardplan.specs.cluster import cluster
from shardplan.specs.engine_log import read_engine_log
from shardplan.verify.engine_log_check import EngineLogCheck, compare_engine_log, predicted_from_report


def check_engine_log(plan: Path, log: Path, hardware: str | None = None) -> EngineLogCheck:
    """The log's figures against the plan's estimate. `hardware`: the profile the plan was made
    with when it is a file (a calibrated profile); default: the plan's profile by name. Raises
    ShardplanError (exit 2) for a plan or log that cannot be read, a training plan, or a log that
    states nothing comparable."""
    parsed = read_engine_log(log)  # first: a bad log is reported before the plan's model is loaded
    inputs = readback.read_plan(plan, hardware_override=hardware)
    m = inputs.manifest
    hw = cluster(inputs.hardware, gpus=m.hardware.num_gpus, nodes=m.hardware.num_nodes,
                 gpus_per_node=m.hardware.gpus_per_node)
    report = estimate(inputs.model.spec, hw, inputs.layout, inputs.workload)
    return compare_engine_log(parsed, predicted_from_report(report), plan=inputs.source)
