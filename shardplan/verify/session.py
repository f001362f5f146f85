"""One rank's whole `verify` session under a launcher: run the rank; on rank 0, run the
unsharded reference and compare with the cost model. Imports torch (through the worker)."""

from __future__ import annotations

import os
from typing import Any

from shardplan.cost.params import count_params
from shardplan.errors import ShardplanError
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.cluster import cluster
from shardplan.specs import loading
from shardplan.specs.hardware import HardwareProfile
from shardplan.verify import worker
from shardplan.verify.compare import compare
from shardplan.verify.runspec import RunSpec

FALLBACK_PROFILE = "h100-sxm-80gb"
MIN_COLLECTIVE_TIMEOUT_SECONDS = 5.0  # a gloo collective on a loaded 2-core CPU takes ~1 s
REFERENCE_BYTES_PER_PARAM = 16.0  # fp32 weights, gradients and two Adam moments
REFERENCE_MAX_SHARE_OF_RAM = 0.5


def hardware_for(m: DeploymentManifest, run: RunSpec) -> tuple[HardwareProfile, str | None]:
    """The plan's profile at the run's size; a bundled stand-in (named in the report) when the
    plan's custom profile is not on this machine: memory figures do not depend on it."""
    note = None
    try:
        hw = loading.load_hardware(m.hardware.profile_name)
    except ShardplanError:
        hw, note = loading.load_hardware(FALLBACK_PROFILE), f"profile {m.hardware.profile_name!r} not found here; " \
            f"time predictions use {FALLBACK_PROFILE}"
    return cluster(hw, gpus=run.world_size, nodes=m.hardware.num_nodes if run.world_size == m.hardware.num_gpus else None,
                   gpus_per_node=m.hardware.gpus_per_node), note


def reference_fits(run: RunSpec) -> bool:
    """An unsharded fp32 copy with its gradients and Adam moments must fit in half this host's RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return count_params(run.spec).total * REFERENCE_BYTES_PER_PARAM < REFERENCE_MAX_SHARE_OF_RAM * ram


def run_worker(m: DeploymentManifest, run: RunSpec, *, plan: str, backend: str,
               timeout_seconds: float) -> dict[str, Any] | None:
    # A rendezvous that never completes spends up to two of these (the store connect, then its
    # barrier), so a quarter of --timeout keeps a rank started under a launcher within the bound.
    collective_timeout = max(MIN_COLLECTIVE_TIMEOUT_SECONDS, timeout_seconds / 4)
    rank, results = worker.run_rank(run, m.placement.tp_splits, m.placement.gpus_per_node, backend, collective_timeout)
    if rank != 0 or results is None:
        return None
    try:
        return _report(m, run, results, plan=plan, backend=backend)
    except BaseException as e:
        worker.write_status(rank, state="error", error=f"{type(e).__name__}: {e}"[:2000])
        raise


def _report(m: DeploymentManifest, run: RunSpec, results: list[dict[str, Any]], *, plan: str,
            backend: str) -> dict[str, Any]:
    hw, hw_note = hardware_for(m, run)
    # Phases for the launcher's progress lines; the state stays "done" (the rank's run is over).
    if not reference_fits(run):
        reference = None
    else:
        worker.write_status(0, state="done", phase="reference")
        if run.training:
            reference = worker.reference_training(run)
        else:
            reference = {d: worker.reference_serving(run, d) for d in range(run.layout.dp)}
    worker.write_status(0, state="done", phase="compare")
    report = compare(run, hw, results, reference, plan=plan, backend=backend,
                     device="cuda" if backend == "nccl" else "cpu")
    if hw_note:
        report["run"]["notes"].append(hw_note)
    return report
