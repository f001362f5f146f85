"""The verify report as a typed result: what `verify --json` prints, what `verify --report`
writes and what `calibrate` reads.

The ranks build it as plain JSON (rank 0 writes it to a file the local launcher reads back:
`compare.compare` and `launch.failure_report`); `verify_plan` returns it validated as a
VerifyReport. Parts whose shape depends on the run (the run's description, the numerics of
training or serving, time, the hardware probes) are kept as JSON objects.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

Progress = Callable[[str], None]  # one line per event: launch, each phase, each rank's result


def _is_none(value: Any) -> bool:
    return value is None


class _Report(BaseModel):
    # NaN and infinities (a diverged loss) print as JSON's NaN/Infinity constants, as before.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class ComponentCheck(_Report):
    """One memory component of one rank: measured against the cost model."""

    component: str = Field(description="weights, gradients, optimizer_states, kv_cache, activations, ...")
    measured_bytes: int = Field(description="what torch allocated for it on the rank (bytes)")
    predicted_bytes: float = Field(description="the cost model applied to what ran (bytes)")
    relative_error: float | None = Field(description="(measured - predicted) / predicted; None: predicted 0 and measured not")
    tolerance: float | None = Field(description="allowed |relative_error| (fraction); None: reported, not checked")
    ok: bool = Field(description="within tolerance (always true when not checked)")
    note: str | None = Field(None, exclude_if=_is_none, description="how the figure was measured, when it needs saying")


class RankCheck(_Report):
    """One rank's coordinates, memory comparison and timings."""

    rank: int
    pp: int = Field(description="pipeline coordinate")
    dp: int = Field(description="data-parallel coordinate")
    tp: int = Field(description="tensor-parallel coordinate")
    stage: int = Field(description="pipeline stage whose prediction applies")
    cp: int = Field(description="context-parallel coordinate")
    components: list[ComponentCheck]
    step_seconds: list[float] = Field(description="wall time of each step (seconds)")
    wall_seconds: float = Field(description="the rank's whole run (seconds)")
    extra_measured_bytes: dict[str, int] = Field(description="other measurements, e.g. cuda_max_allocated_bytes (bytes)")


class ReportHardware(_Report):
    profile: str = Field(description="the hardware profile the predictions used")
    num_nodes: int
    gpus_per_node: int


class VerifyReport(_Report):
    """What `verify --json` prints for a run that completed (a failed run exits 5 instead)."""

    plan: str = Field(description="the manifest verified")
    status: Literal["ok", "mismatch"] = Field(description="mismatch: a component or the numerics out of tolerance")
    backend: str = Field(description="nccl or gloo")
    device: str = Field(description="cuda or cpu")
    world_size: int = Field(description="ranks (count)")
    run: dict[str, Any] = Field(description="what ran: scale, model, dtype, work, notes")
    layout: dict[str, Any] = Field(description="the layout as the estimate prints its plan")
    tolerances: dict[str, float | None] = Field(description="relative tolerance per memory component (fraction)")
    ranks: list[RankCheck]
    numerics: dict[str, Any] = Field(description="loss (training) or logits and tokens (serving) against the unsharded reference")
    time: dict[str, Any] = Field(description="measured and predicted seconds; compared on GPUs only")
    hardware: ReportHardware
    probes: list[dict[str, Any]] = Field(description="per rank hardware probes (GPU runs): FLOP/s and bytes/s")
    mismatches: list[str] = Field(description="one line per check out of tolerance")
    pids: list[int] | None = Field(None, exclude_if=_is_none, description="the ranks' process ids (local launch only)")
    run_dir: str | None = Field(None, exclude_if=_is_none, description="the ranks' logs and status files (local launch only)")
