"""One rank's whole `verify` session under a launcher: run the rank; on rank 0, run the
unsharded reference and compare with the cost model; on a rank that runs out of memory, its
out-of-memory report. Imports torch (through the worker)."""

from __future__ import annotations

import os
from typing import Any

from shardplan.cost.params import count_params
from shardplan.errors import VerifyRunFailed
from shardplan.plan.schema import DeploymentManifest
from shardplan.units import DType
from shardplan.verify import cpu_matmul, worker
from shardplan.verify.compare import compare
from shardplan.verify.outofmemory import FALLBACK_PROFILE, allocator_limit_bytes, hardware_for, oom_report
from shardplan.verify.runspec import RunSpec

__all__ = ["FALLBACK_PROFILE", "RunOutOfMemory", "hardware_for", "reference_fits", "run_worker"]

MIN_COLLECTIVE_TIMEOUT_SECONDS = 5.0  # a gloo collective on a loaded 2-core CPU takes ~1 s
REFERENCE_BYTES_PER_PARAM = 16.0  # fp32 weights, gradients and two Adam moments
REFERENCE_MAX_SHARE_OF_RAM = 0.5


class RunOutOfMemory(VerifyRunFailed):
    """This rank ran out of device memory; `report` is the out-of-memory report (status "oom")."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__("; ".join(report["mismatches"]) or "out of memory")
        self.report = report


def reference_fits(run: RunSpec) -> bool:
    """An unsharded fp32 copy with its gradients and Adam moments must fit in half this host's RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return count_params(run.spec).total * REFERENCE_BYTES_PER_PARAM < REFERENCE_MAX_SHARE_OF_RAM * ram


def run_worker(m: DeploymentManifest, run: RunSpec, *, plan: str, backend: str,
               timeout_seconds: float) -> dict[str, Any] | None:
    """Rank 0's report (None on other ranks). Raises RunOutOfMemory, its report written to the
    rank's status file first, when this rank runs out of memory."""
    # A rendezvous that never completes spends up to two of these (the store connect, then its
    # barrier), so a quarter of --timeout keeps a rank started under a launcher within the bound.
    collective_timeout = max(MIN_COLLECTIVE_TIMEOUT_SECONDS, timeout_seconds / 4)
    hw, hw_note = hardware_for(m, run)
    device = "cuda" if backend == "nccl" else "cpu"
    reports: list[dict[str, Any]] = []
    # A 16-bit run on a CPU without 16-bit GEMM instructions: its matmuls as fp32 GEMMs of the same values.
    emulated = device == "cpu" and run.dtype is not DType.FP32 and cpu_matmul.install()

    def on_out_of_memory(details: dict[str, Any]) -> None:
        report = oom_report(run, hw, [details], plan=plan, backend=backend, device=device,
                            notes=[hw_note] if hw_note else None)
        worker.write_status(details["rank"], state="oom", error=details["error"], report=report)
        reports.append(report)

    try:
        rank, results = worker.run_rank(run, m.placement.tp_splits, m.placement.gpus_per_node, backend,
                                        collective_timeout, limit_bytes=allocator_limit_bytes(run, hw),
                                        on_out_of_memory=on_out_of_memory)
    except worker.RankOutOfMemory:
        if not reports:
            raise
        raise RunOutOfMemory(reports[0]) from None
    if rank != 0 or results is None:
        return None
    try:
        return _report(m, run, results, plan=plan, backend=backend, notes=[cpu_matmul.NOTE] if emulated else [])
    except BaseException as e:
        worker.write_status(rank, state="error", error=f"{type(e).__name__}: {e}"[:2000])
        raise


def _report(m: DeploymentManifest, run: RunSpec, results: list[dict[str, Any]], *, plan: str,
            backend: str, notes: list[str]) -> dict[str, Any]:
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
    report["run"]["notes"].extend([hw_note, *notes] if hw_note else notes)
    return report
