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


class MemoryPeak(_Report):
    """One rank's peak memory over the steps against the cost model's total (reported, not
    checked: the model adds every component's own peak, which a step never holds at once)."""

    allocated_peak_bytes: int = Field(description="GPU: torch's allocated_bytes.all.peak; CPU: the peak of the "
                                                  "rank's live tensors (bytes)")
    predicted_allocated_bytes: float = Field(description="the predicted total less the runtime's share (CUDA context, "
                                                         "non-torch, NCCL), which torch does not allocate (bytes)")
    allocated_relative_error: float | None = Field(description="(measured - predicted) / predicted")
    reserved_peak_bytes: int | None = Field(description="GPU: torch's reserved_bytes.all.peak (bytes); null: not "
                                                        "measured (a CPU has no caching allocator)")
    predicted_reserved_bytes: float = Field(description="the predicted reserve (the total plus a fresh block for the "
                                                        "largest tensor) less the runtime's share (bytes)")
    reserved_relative_error: float | None = Field(description="(measured - predicted) / predicted; null: not measured")
    largest_allocation_bytes: float = Field(description="the largest tensor the prediction names (bytes)")
    peak_component: str | None = Field(None, exclude_if=_is_none,
                                       description="CPU: what the allocation that set the peak was (as the cost model "
                                                   "names components; loss: the loss head)")
    peak_op: str | None = Field(None, exclude_if=_is_none, description="CPU: the op that set the peak")
    note: str = Field(description="how the peaks were measured")


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
    memory_peak: MemoryPeak | None = Field(None, exclude_if=_is_none,
                                           description="peak allocated and reserved memory against the prediction")


class ReportHardware(_Report):
    profile: str = Field(description="the hardware profile the predictions used")
    num_nodes: int
    gpus_per_node: int


class FitChange(_Report):
    """One change to the layout that ran, costed by the cost model at the device's memory."""

    change: str = Field(description="what changes, e.g. 'micro_batch_size 4 -> 1'")
    layout: dict[str, Any] = Field(description="the changed layout as the estimate prints its plan")
    predicted_total_bytes: float = Field(description="the cost model's total on the binding rank (bytes)")
    predicted_reserved_bytes: float = Field(description="the total plus a fresh block for the largest tensor (bytes)")
    fits: bool = Field(description="the cost model says it fits the device (and, when it had said the run that failed "
                                   "fits, frees at least what the failure lacked)")


class OutOfMemory(_Report):
    """Where a run ran out of device memory, what the cost model predicted for what was being
    allocated, and the smallest change the cost model says fits."""

    rank: int = Field(description="the rank that failed first")
    stage: int = Field(description="its pipeline stage")
    step: int | None = Field(description="the step it was in (0-based); null: building the model")
    steps_completed: int = Field(description="steps it had completed (count)")
    simulated: bool = Field(description="true: a CPU run of a GPU plan, the device's memory enforced by verify")
    op: str | None = Field(description="the operation that allocated, e.g. aten.mm.default")
    shape: list[int] | None = Field(description="the shape of the tensor it allocated")
    dtype: str | None = Field(description="its format")
    allocation_bytes: int | None = Field(description="the allocation that did not fit (bytes)")
    live_bytes: int | None = Field(description="the rank's live tensors before it (bytes)")
    limit_bytes: int | None = Field(description="what torch could allocate: the device's memory less the runtime's share "
                                                "(bytes); null: the GPU's own limit")
    capacity_bytes: int = Field(description="the device's memory, as the profile's memory_capacity_gib (bytes)")
    component: str | None = Field(description="what the allocation was: weights, gradients, optimizer_states, "
                                              "activations, loss (the logits and the loss head), kv_cache, temporary")
    predicted_component_bytes: float | None = Field(description="the cost model's figure for that component (bytes)")
    predicted_total_bytes: float = Field(description="the cost model's total for the rank (bytes)")
    predicted_reserved_bytes: float = Field(description="the cost model's reserve for the rank (bytes)")
    predicted_fits: bool = Field(description="whether the cost model said the run fits the device")
    message: str | None = Field(description="torch's own message (a GPU's out-of-memory error)")
    measured_components: list[str] = Field(description="components measured before the failure (in `ranks`)")
    unmeasured_components: list[str] = Field(description="components the run did not get to measure")
    suggestion: FitChange | None = Field(description="the first change tried that the cost model says fits; null: none")
    tried: list[FitChange] = Field(description="every change tried, in order")
    out_of_memory_ranks: list[int] = Field(description="every rank that ran out of memory")


class VerifyReport(_Report):
    """What `verify --json` prints for a run that completed or ran out of memory (any other
    failed run exits 5 with one line instead)."""

    plan: str = Field(description="the manifest verified")
    status: Literal["ok", "mismatch", "oom"] = Field(description="mismatch: a component or the numerics out of "
                                                                 "tolerance; oom: a rank ran out of device memory")
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
    mismatches: list[str] = Field(description="one line per check out of tolerance (and the out-of-memory error)")
    oom: OutOfMemory | None = Field(None, exclude_if=_is_none, description="where the run ran out of memory")
    pids: list[int] | None = Field(None, exclude_if=_is_none, description="the ranks' process ids (local launch only)")
    run_dir: str | None = Field(None, exclude_if=_is_none, description="the ranks' logs and status files (local launch only)")


# ----- verify NEW --from OLD: resharding through a checkpoint ------------------------------------


class LossContinuation(_Report):
    """The loss of every step, the old layout's and then the new layout's after loading the
    checkpoint, against one unsharded process that trained the same steps without stopping."""

    check: str = Field(description="what is compared")
    steps_before: int = Field(description="steps the old layout trained before saving (count)")
    steps_after: int = Field(description="steps the new layout trained after loading (count)")
    measured: list[float] = Field(description="the loss per step: the old layout's, then the new layout's")
    reference: list[float] = Field(description="the unsharded process's loss per step")
    max_abs_error: float | None = Field(description="largest |measured - reference|; null: a value is not finite")
    max_relative_error: float | None = Field(description="largest |measured - reference| / |reference|; null: not finite")
    rtol: float = Field(description="allowed relative error (fraction): |m - r| <= atol + rtol x |r|")
    atol: float = Field(description="allowed absolute error (loss units)")
    first_bad_step: int | None = Field(description="the first step out of tolerance (0-based); null: none")
    ok: bool = Field(description="every step within tolerance and finite (a NaN fails)")


class LoadedBytes(_Report):
    """One state of one new rank: the bytes it loaded from the checkpoint against the move list."""

    state: Literal["weights", "optimizer_states"]
    measured_bytes: int = Field(description="bytes of the tensor pieces DCP loaded into the rank's state (bytes)")
    planned_bytes: float = Field(description="the move list's pieces for the rank, kept + from ranks + from the "
                                             "checkpoint: the whole slice it holds at rest (bytes)")
    planned_kept_bytes: float = Field(description="of which already on its GPU in a live reshard (route local, bytes)")
    planned_from_ranks_bytes: float = Field(description="of which a surviving old rank sends in a live reshard (bytes)")
    planned_from_checkpoint_bytes: float = Field(description="of which only lost ranks held: a live reshard reads "
                                                             "them from a checkpoint too (bytes)")
    relative_error: float | None = Field(description="(measured - planned) / planned; null: planned 0 and measured not")
    tolerance: float = Field(description="allowed |relative_error| (fraction)")
    ok: bool


class PlanScaleMoves(_Report):
    """The same change at the plan's scale, as `shardplan replan` lists it (the plan's model and
    formats): reported, not compared."""

    kept_bytes: float = Field(description="bytes already on the new rank's GPU (bytes)")
    from_ranks_bytes: float = Field(description="bytes surviving old ranks send it (bytes)")
    from_checkpoint_bytes: float = Field(description="bytes only lost ranks held (bytes)")


class ReshardRank(_Report):
    """One rank of the new layout: what it loaded from the checkpoint against the move list."""

    rank: int = Field(description="new rank")
    node: int = Field(description="its node in the new cluster (rank // gpus_per_node)")
    old_rank_on_gpu: int | None = Field(description="the surviving old rank that ran on its GPU; null: none")
    states: list[LoadedBytes]
    other_bytes: int = Field(description="loaded besides: optimizer step counters and hyper-parameters (bytes)")
    file_bytes_read: int = Field(description="bytes of checkpoint file read: DCP's file reader reads each saved "
                                             "chunk a piece overlaps whole, then narrows it (bytes)")
    num_read_items: int = Field(description="pieces DCP read (count)")
    load_seconds: float = Field(description="wall time of the load (s)")
    plan_scale: PlanScaleMoves


class CheckpointWrite(_Report):
    """One old rank's share of the checkpoint (after DCP's de-duplication of replicas)."""

    rank: int = Field(description="old rank")
    written_bytes: int = Field(description="tensor and other bytes it wrote (bytes)")
    num_write_items: int = Field(description="pieces it wrote (count)")
    save_seconds: float = Field(description="wall time of the save (s)")


class ReshardReport(_Report):
    """What `verify NEW --from OLD --json` prints: train the old layout, save a DCP checkpoint,
    load it into the new layout (a fresh launch, lost ranks gone), train on, and check the loss
    continues as one unsharded process's and that each new rank loaded what the move list says."""

    plan: str = Field(description="the new manifest")
    from_plan: str = Field(description="the old manifest, whose layout trained first and wrote the checkpoint")
    status: Literal["ok", "mismatch"] = Field(description="mismatch: the loss or a rank's bytes out of tolerance")
    backend: str = Field(description="nccl or gloo")
    device: str = Field(description="cuda or cpu")
    old_world_size: int = Field(description="ranks of the old layout (count)")
    new_world_size: int = Field(description="ranks of the new layout (count)")
    lost_ranks: list[int] = Field(description="old ranks named lost: never sources in the move list")
    old_layout: str = Field(description="the old layout as ran")
    new_layout: str = Field(description="the new layout as ran")
    run: dict[str, Any] = Field(description="what ran: scale, model, dtype, work per leg, notes")
    numerics: LossContinuation
    compared: str = Field(description="what the bytes comparison compares, and why it may differ")
    saved: list[CheckpointWrite]
    checkpoint_bytes: int = Field(description="all the ranks wrote (bytes)")
    ranks: list[ReshardRank]
    mismatches: list[str] = Field(description="one line per check out of tolerance")
    wall_seconds: dict[str, float] = Field(description="old_run, new_run (each launch, start-up included) and total (s)")
    leg_dirs: dict[str, str] | None = Field(None, exclude_if=_is_none, description="old, new: each launch's logs and "
                                                                                 "status files (the checkpoint is removed)")
