"""`verify NEW --from OLD`: what runs and what it is compared with. Pure: no torch, no
processes (the launches are `reshard_launch`, a rank `reshard_rank`).

The two plans must train one model on one workload (a re-plan changes the layout, not the
job). Both legs run one model (`joint_spec`: at --scale proxy the proxy of a layout whose tp
and pipeline chunks are multiples of both plans', so either layout splits it), in fp32 (the
continuation is checked at fp32 tolerance), with the plan's optimizer, on one global batch
(`ReshardPair.new_run` takes the old one's batch, its micro-batches re-counted for its dp).

The bytes each new rank loaded are compared with the move list `tasks/_moves.moves_between`
computes for the same change, applied to what ran (`as_ran`): the model that ran, fp32 states,
and the data-parallel states as FSDP2 keeps them at rest (sharded whenever it shards: it
reshards parameters after backward even under ZeRO-1/2). A checkpoint restart loads a rank's
whole slice, so the measurement is compared with all its pieces (kept + from ranks + from the
checkpoint); the split says what a live reshard would move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from shardplan.cost.layout import Layout, Offload, layout_stage_ranges
from shardplan.errors import CannotVerify, ShardplanError
from shardplan.plan.manifest import load_manifest
from shardplan.plan.placement import box_numel, bytes_per_element, model_tensors
from shardplan.plan.readback import plan_spec
from shardplan.plan.schema import DeploymentManifest, stage_placements
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.tasks._moves import Devices, moves_between
from shardplan.verify.report import LoadedBytes, LossContinuation, PlanScaleMoves
from shardplan.verify.runspec import RunSpec, plan_run, proxy_spec

# The loss of every step within LOSS_ATOL + LOSS_RTOL x |reference| of the unsharded run's.
# fp32 runs differ from the reference only in the order of their sums (verify measured 5e-8
# relative on tp2 x dp2 with SGD); Adam divides by the root of its second moment, which
# amplifies that noise (VERIFY-NOTES: parameters 5e-5 apart after 3 steps): compare.LOSS_RTOL.
LOSS_RTOL = 1e-5
LOSS_ATOL = 1e-6
LOSS_RTOL_ADAM = 1e-4
# A rank's loaded tensor bytes are exact element counts: the band only absorbs uneven splits
# that FSDP and the move list might round differently.
BYTES_TOLERANCE = 0.02
STATES = ("weights", "optimizer_states")
_MOVE_STATE = {"weights": "weights", "optimizer": "optimizer_states"}

COMPARED = (
    "per new rank, the tensor bytes DCP loaded into its weights and its optimizer states (the optimizer's moments, "
    "step counters and hyper-parameters apart) against the move list replan computes for the same change "
    "(tasks/_moves.py), applied to what ran: the model that ran, fp32, and FSDP2's at-rest sharding. A restart "
    "loads a rank's whole slice, so it is compared with all its pieces: kept on its GPU + sent by surviving old "
    "ranks + only lost ranks held (a live reshard moves the second and reads the third from a checkpoint). They "
    "differ where the run holds states the plan does not count, or the other way round; `plan_scale` is the same "
    "change for the plan's own model and formats, as replan prints it (not compared)")


@dataclass(frozen=True)
class ReshardPair:
    """The two plans and the run of each: the old one trains `steps` and saves, the new one
    loads and trains `steps` more."""

    old_path: str
    new_path: str
    old: DeploymentManifest
    new: DeploymentManifest
    spec: ModelSpec  # the plans' model (the plan's scale)
    old_run: RunSpec
    new_run: RunSpec
    notes: tuple[str, ...] = ()

    def reference_run(self) -> RunSpec:
        """The unsharded reference: the old run's model and batch for both legs' steps."""
        return replace(self.old_run, steps=self.old_run.steps + self.new_run.steps)


def _bad(message: str, field: str, hint: str, source: str | None = None) -> ShardplanError:
    return ShardplanError(message, source=source, field=field, hint=hint)


def check_pair(old: DeploymentManifest, new: DeploymentManifest, old_path: str, new_path: str) -> None:
    """One model, both training, one workload; and no layout the checkpoint path does not run."""
    for m, path in ((old, old_path), (new, new_path)):
        if m.workload.kind != "training":
            raise _bad("verify --from resumes training from a checkpoint; this is a serving plan", "workload.kind",
                       "give two training plans of one model (e.g. the old plan and the one replan wrote)", path)
    if old.model.spec_sha256 != new.model.spec_sha256:
        raise _bad(f"the plan is for model '{new.model.name}', the --from plan for '{old.model.name}' (spec sha256 "
                   f"{new.model.spec_sha256[:12]} vs {old.model.spec_sha256[:12]})", "model.spec_sha256",
                   "give --from a plan of the same model", new_path)
    keys = ("seq_len", "global_batch_size", "optimizer", "finetune")
    differ = [k for k in keys if getattr(old.workload, k) != getattr(new.workload, k)]
    if differ:
        k = differ[0]
        raise _bad(f"the plans train different workloads: {k} {getattr(new.workload, k)} here, "
                   f"{getattr(old.workload, k)} in the --from plan", f"workload.{k}",
                   "a re-plan changes the layout, not the job: give plans of one workload", new_path)
    for m, path in ((old, old_path), (new, new_path)):
        if m.layout.virtual_stages > 1:
            raise CannotVerify("verify --from does not run interleaved pipelines yet (more than one model chunk per "
                               "rank)", source=path, field="layout.virtual_stages", hint="verify layouts with "
                               "virtual_stages 1")
        if m.layout.ep > 1:
            raise CannotVerify("verify --from does not run expert parallelism yet", source=path, field="layout.ep",
                               hint="verify layouts with ep 1")


def joint_spec(spec: ModelSpec, a: Layout, b: Layout, scale: str) -> ModelSpec:
    """The model both legs run: the spec itself at --scale full; else the proxy of a layout
    whose tp and pipeline chunks are the least common multiples of both (a proxy's MLP width
    and vocabulary are multiples of 8 x tp, its layers 4 per chunk), which both layouts split."""
    if scale != "proxy":
        return spec
    merged = replace(a, tp=math.lcm(a.tp, b.tp), pp=math.lcm(a.num_virtual_chunks, b.num_virtual_chunks),
                     virtual_stages=1)
    return proxy_spec(spec, merged)


def _same_model(run: RunSpec, spec: ModelSpec) -> RunSpec:
    return replace(run, spec=spec.model_copy(update={"dtype": run.spec.dtype,
                                                     "max_position_embeddings": run.spec.max_position_embeddings}))


def global_rows(run: RunSpec) -> int:
    """Sequences per optimizer step over all data-parallel ranks (`worker.training_batch`)."""
    return run.layout.dp * run.num_microbatches * run.layout.micro_batch_size


def read_pair(new_path: Path, old_path: Path) -> tuple[DeploymentManifest, DeploymentManifest]:
    """(old, new) manifests, read and paired (`check_pair`): exit 2 before anything starts."""
    old, new = load_manifest(old_path), load_manifest(new_path)
    check_pair(old, new, str(old_path), str(new_path))
    return old, new


def load_pair(new_path: Path, old_path: Path, *, scale: str, steps: int) -> ReshardPair:
    """Both plans read and checked, and the run of each (CannotVerify / ShardplanError: exit 2)."""
    old, new = read_pair(new_path, old_path)
    spec = plan_spec(new)
    if spec is None:
        raise CannotVerify(f"the model spec '{new.model.source}' is missing or changed since the plan was written",
                           source=str(new_path), field="model.source", hint="re-run shardplan recommend with the spec")
    runs = []
    for m, path in ((old, old_path), (new, new_path)):
        try:
            runs.append(plan_run(m, spec, scale=scale, steps=steps, dtype="fp32"))
        except ShardplanError as e:
            e.source = e.source or str(path)
            raise
    old_run, new_run = runs
    if old_run.seq_len != new_run.seq_len:
        raise CannotVerify(f"the runs' sequences differ ({old_run.seq_len} and {new_run.seq_len} tokens: context "
                           "parallelism cuts them into equal chunks)", source=str(new_path), field="layout.cp",
                           hint="verify plans whose cp both divide the sequence alike")
    model = joint_spec(spec, old_run.layout, new_run.layout, scale)
    shape = lambda s: (s.num_layers, s.intermediate_size, s.vocab_size)  # noqa: E731
    widened = shape(model) not in (shape(old_run.spec), shape(new_run.spec)) or shape(old_run.spec) != shape(new_run.spec)
    old_run, new_run = _same_model(old_run, model), _same_model(new_run, model)
    rows = global_rows(old_run)
    per_micro = new_run.layout.dp * new_run.layout.micro_batch_size
    if rows % per_micro:
        raise CannotVerify(f"the old run's {rows} sequences a step do not split over the new layout's dp "
                           f"{new_run.layout.dp} x micro-batch {new_run.layout.micro_batch_size}", source=str(new_path),
                           field="layout.dp", hint="verify layouts whose dp x micro_batch_size divide the batch")
    new_run = replace(new_run, num_microbatches=rows // per_micro)
    formats = sorted({m.workload.param_dtype for m in (old, new)})
    notes = [f"both legs run fp32 (the plans: {', '.join(formats)}; the continuation is checked at fp32 tolerance) "
             f"with {old_run.optimizer.value}, {rows} sequences of {old_run.seq_len} tokens a step"]
    if widened:
        notes.append(f"both legs run one proxy model that either layout splits ({model.num_layers} layers, MLP width "
                     f"{model.intermediate_size}, vocabulary {model.vocab_size}: tp and pipeline chunks the least "
                     "common multiples of both plans')")
    return ReshardPair(old_path=str(old_path), new_path=str(new_path), old=old, new=new, spec=spec, old_run=old_run,
                       new_run=new_run, notes=tuple(notes))


# ----- the move list for what ran ----------------------------------------------------------------


def fsdp_shards(layout: Layout) -> bool:
    """Whether the run keeps data-parallel states sharded at rest (`parallel.fsdp_sharder`)."""
    return layout.zero_stage > 0 and (layout.dp * layout.cp > 1 or layout.offload_params is not Offload.NONE)


def as_ran(m: DeploymentManifest, run: RunSpec) -> DeploymentManifest:
    """The plan as the run holds it at rest: its model (the stages re-split over the run's
    layers), fp32 weights with the optimizer's moments beside them (no separate master), and
    ZeRO-3's sharding wherever FSDP2 shards (it reshards after backward at every stage), none
    elsewhere. Not a valid manifest to write: an input for the move list only."""
    L = run.layout
    ranges = layout_stage_ranges(run.spec.num_layers, L)
    stages = stage_placements([[[r[0], r[-1]] for r in chunks] for chunks in ranges], L.tp * L.cp * L.dp,
                              m.placement.gpus_per_node)
    return m.model_copy(update={
        "layout": m.layout.model_copy(update={"zero_stage": 3 if fsdp_shards(L) else 0}),
        "workload": m.workload.model_copy(update={"param_dtype": "fp32", "activation_dtype": "fp32",
                                                  "framework": "zero", "optimizer": run.optimizer.value}),
        "placement": m.placement.model_copy(update={"stages": stages}),
        "model": m.model.model_copy(update={"num_layers": run.spec.num_layers}),
    })


Split = dict[str, float]  # kept, from_ranks, from_checkpoint (bytes)


def move_split(old: DeploymentManifest, new: DeploymentManifest, spec: ModelSpec, devices: Devices,
               hw: HardwareProfile) -> list[dict[str, Split]]:
    """Per new rank and state (weights, optimizer_states): the move list's bytes by where they
    come from. Pieces no surviving rank holds (`moves_between`'s unrecoverable ones) are the
    checkpoint's: here a checkpoint of every state exists."""
    out: list[dict[str, Split]] = [{s: {"kept": 0.0, "from_ranks": 0.0, "from_checkpoint": 0.0} for s in STATES}
                                   for _ in range(new.hardware.num_gpus)]
    moves, missing = moves_between(old, new, spec, devices, hw)
    for mv in moves:
        out[mv.to_rank][_MOVE_STATE[mv.state]]["kept" if mv.route == "local" else "from_ranks"] += mv.nbytes
    if missing:
        tensors = {t.name: t for t in model_tensors(spec)}
        for u in missing:
            out[u.to_rank][_MOVE_STATE[u.state]]["from_checkpoint"] += (
                box_numel(u.box) * bytes_per_element(new, tensors[u.tensor], u.state))
    return out


def old_rank_on_gpu(devices: Devices, q: int) -> int | None:
    """The surviving old rank that ran on new rank q's GPU, if any."""
    g = devices.gpus_per_node
    r = devices.new_node(q) * g + q % g
    return r if r < devices.old_num_gpus and r not in devices.lost and devices.same_gpu(r, q) else None


# ----- the checks --------------------------------------------------------------------------------


def loss_tolerance(run: RunSpec) -> tuple[float, float]:
    """(rtol, atol) of the continuation check for the run's optimizer."""
    return (LOSS_RTOL_ADAM if run.optimizer.value in ("adam", "adamw") else LOSS_RTOL), LOSS_ATOL


def loss_continuation(before: list[float], after: list[float], reference: list[float], *, rtol: float,
                      atol: float) -> LossContinuation:
    """Every step's loss against the reference's: |m - r| <= atol + rtol x |r|, both finite. A
    missing step, an extra one or a NaN fails."""
    measured = [*before, *after]
    first_bad = None
    worst_abs = worst_rel = 0.0
    for i in range(max(len(measured), len(reference))):
        if i >= len(measured) or i >= len(reference):
            first_bad = i if first_bad is None else first_bad
            continue
        m, r = measured[i], reference[i]
        finite = math.isfinite(m) and math.isfinite(r)
        err = abs(m - r) if finite else math.inf
        worst_abs = max(worst_abs, err)
        worst_rel = max(worst_rel, err / abs(r) if finite and r != 0 else (0.0 if err == 0 else math.inf))
        if not (finite and err <= atol + rtol * abs(r)) and first_bad is None:
            first_bad = i
    return LossContinuation(
        check="loss per step: the old layout's steps, then the new layout's after loading the checkpoint, against "
              "one unsharded process that trained every step without stopping",
        steps_before=len(before), steps_after=len(after), measured=measured, reference=list(reference),
        max_abs_error=worst_abs if math.isfinite(worst_abs) else None,
        max_relative_error=worst_rel if math.isfinite(worst_rel) else None,
        rtol=rtol, atol=atol, first_bad_step=first_bad, ok=first_bad is None and bool(measured),
    )


def loaded_bytes(state: str, measured: int, planned: Split, tolerance: float = BYTES_TOLERANCE) -> LoadedBytes:
    total = planned["kept"] + planned["from_ranks"] + planned["from_checkpoint"]
    if total == 0:
        err = 0.0 if measured == 0 else None
    else:
        err = (measured - total) / total
    return LoadedBytes(state=state, measured_bytes=measured, planned_bytes=total, planned_kept_bytes=planned["kept"],
                       planned_from_ranks_bytes=planned["from_ranks"],
                       planned_from_checkpoint_bytes=planned["from_checkpoint"], relative_error=err,
                       tolerance=tolerance, ok=err is not None and abs(err) <= tolerance)


def plan_scale(split: dict[str, Split]) -> PlanScaleMoves:
    return PlanScaleMoves(kept_bytes=sum(s["kept"] for s in split.values()),
                          from_ranks_bytes=sum(s["from_ranks"] for s in split.values()),
                          from_checkpoint_bytes=sum(s["from_checkpoint"] for s in split.values()))


def layout_label(L: Layout) -> str:
    """'tp2 x dp2, ZeRO-3 (FSDP2)': the degrees above 1, and how data-parallel states are held."""
    degrees = [f"{k}{v}" for k, v in (("tp", L.tp), ("pp", L.pp), ("cp", L.cp), ("dp", L.dp)) if v > 1] or ["1 rank"]
    held = f"ZeRO-{L.zero_stage} (FSDP2)" if fsdp_shards(L) else "replicated" if L.dp * L.cp > 1 else "unsharded data"
    return " x ".join(degrees) + (f", {held}" if L.dp * L.cp > 1 or fsdp_shards(L) else "")
