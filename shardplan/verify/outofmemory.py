"""The device memory a verify run may use, and the report of a run that ran out of it: where
it failed (the op, the tensor, its bytes and the component it belongs to), what the cost model
predicted for that component, and the smallest change the cost model says fits. No torch:
the rank hands over what it knows as plain data (worker.RankOutOfMemory); `hardware_for`
reads the plan's profile, everything else is pure.

The device's memory is the profile's `memory_capacity_gib` (the total torch reports), or
--device-memory-gib. Torch may allocate that less the runtime's share the cost model charges
outside its tensors (the CUDA context, non-torch libraries, NCCL buffers with peers): that is
the limit a CPU run enforces on its live tensors and a GPU run gives the caching allocator.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout, Recompute, validate_layout
from shardplan.errors import CannotVerify, ShardplanError
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs import loading
from shardplan.specs.cluster import cluster
from shardplan.specs.hardware import HardwareProfile
from shardplan.units import BYTES_PER_GIB
from shardplan.verify.compare import (
    TOLERANCES,
    _serving_components,
    _training_components,
    memory_peak,
    serving_kv_bytes,
)
from shardplan.verify.runspec import RunSpec

FALLBACK_PROFILE = "h100-sxm-80gb"
TRAINING_COMPONENTS = ("weights", "gradients", "optimizer_states", "activations")
SERVING_COMPONENTS = ("weights", "kv_cache", "activations")


def hardware_for(m: DeploymentManifest, run: RunSpec) -> tuple[HardwareProfile, str | None]:
    """The plan's profile at the run's size; a bundled stand-in (named in the report) when the
    plan's custom profile is not on this machine: memory figures do not depend on it."""
    note = None
    try:
        hw = loading.load_hardware(m.hardware.profile_name)
    except ShardplanError:
        hw = loading.load_hardware(FALLBACK_PROFILE)
        note = f"profile {m.hardware.profile_name!r} not found here; time predictions use {FALLBACK_PROFILE}"
    return cluster(hw, gpus=run.world_size, nodes=m.hardware.num_nodes if run.world_size == m.hardware.num_gpus else None,
                   gpus_per_node=m.hardware.gpus_per_node), note


def runtime_bytes(hw: HardwareProfile, world_size: int) -> int:
    """Device memory outside torch's tensors, as the cost model charges it (its `overhead`)."""
    return hw.cuda_context_bytes + hw.non_torch_bytes + (hw.nccl_buffer_bytes if world_size > 1 else 0)


def allocator_limit_bytes(run: RunSpec, hw: HardwareProfile) -> int | None:
    """What torch may allocate on a rank: the device's memory less the runtime's share. None:
    no limit but the device's own (a proxy run without --device-memory-gib)."""
    if run.device_memory_bytes is None:
        return None
    return run.device_memory_bytes - runtime_bytes(hw, run.world_size)


def check_limit(run: RunSpec, hw: HardwareProfile, plan: str) -> None:
    """Refuse up front a --device-memory-gib that leaves torch nothing."""
    limit = allocator_limit_bytes(run, hw)
    if limit is not None and limit <= 0 and run.device_memory_from_option:
        need = runtime_bytes(hw, run.world_size) / BYTES_PER_GIB
        raise CannotVerify(f"--device-memory-gib {run.device_memory_bytes / BYTES_PER_GIB:g} leaves torch nothing: the "
                           f"{hw.name} profile's runtime (CUDA context, non-torch, NCCL) takes {need:.2f} GiB",
                           source=plan, field="--device-memory-gib", hint=f"give more than {need:.2f} GiB")


def at_capacity(hw: HardwareProfile, capacity_bytes: int) -> HardwareProfile:
    return dataclasses.replace(hw, memory_capacity_bytes=int(capacity_bytes))


# --- what the cost model says about a run --------------------------------------------------------

def _serving_stage_bytes(run: RunSpec, report: Any, stage: int, hw: HardwareProfile) -> dict[str, float]:
    """A serving stage's own memory in verify's run: weights, the KV cache of the run's tokens,
    the prefill's activations, and the runtime's share as the limit counts it (not vLLM's
    budget, whose graphs and pool the run does not have)."""
    per = next(r for r in report.memory.per_rank if r.stage == stage).per_gpu_bytes
    return {"weights": per["weights"], "kv_cache": serving_kv_bytes(run, stage), "activations": per["activations"],
            "overhead": float(runtime_bytes(hw, run.world_size))}


def _costed(run: RunSpec, hw: HardwareProfile) -> tuple[Any, float, float, bool]:
    """(the cost report, the binding rank's total, its reserve, fits) for `run` on `hw`."""
    if run.training:
        report = estimate(run.spec, hw, run.layout, run.training_workload())
        total = report.memory.per_gpu_bytes["total"]
        reserved = max(r.reserved_bytes for r in report.memory.per_rank)
        return report, total, reserved, report.fits
    report = estimate(run.spec, hw, run.layout, run.inference_workload())
    total = max(sum(_serving_stage_bytes(run, report, r.stage, hw).values()) for r in report.memory.per_rank)
    return report, total, total, total <= hw.memory_capacity_bytes


def _candidates(run: RunSpec) -> list[tuple[str, RunSpec, int]]:
    """Changes to try, smallest first: halve the micro-batch (serving: the batch) until 1,
    recompute full, twice the tensor parallelism (over half the data-parallel ranks, else over
    twice the GPUs), ZeRO-3 over the data-parallel ranks. (description, the run, its GPUs)."""
    L = run.layout
    out: list[tuple[str, RunSpec, int]] = []
    if run.training:
        mbs = L.micro_batch_size // 2
        while mbs >= 1:
            out.append((f"micro_batch_size {L.micro_batch_size} -> {mbs}",
                        dataclasses.replace(run, layout=dataclasses.replace(L, micro_batch_size=mbs),
                                            num_microbatches=run.num_microbatches * L.micro_batch_size // mbs),
                        run.world_size))
            mbs //= 2
        if L.recompute is not Recompute.FULL:
            out.append((f"recompute {L.recompute.value} -> full",
                        dataclasses.replace(run, layout=dataclasses.replace(L, recompute=Recompute.FULL)), run.world_size))
    else:
        batch = run.batch_size // 2
        while batch >= 1:
            out.append((f"batch_size {run.batch_size} -> {batch}", dataclasses.replace(run, batch_size=batch),
                        run.world_size))
            batch //= 2
    if L.dp % 2 == 0 and L.ep == 1:
        tp = dataclasses.replace(L, tp=2 * L.tp, dp=L.dp // 2)
        out.append((f"tp {L.tp} -> {2 * L.tp}, dp {L.dp} -> {L.dp // 2} (the same {run.world_size} GPUs)",
                    dataclasses.replace(run, layout=tp, num_microbatches=2 * run.num_microbatches), run.world_size))
    elif L.ep == 1:
        out.append((f"tp {L.tp} -> {2 * L.tp} ({2 * run.world_size} GPUs)",
                    dataclasses.replace(run, layout=dataclasses.replace(L, tp=2 * L.tp)), 2 * run.world_size))
    if run.training and L.dp * L.cp > 1 and L.zero_stage < 3:
        out.append((f"zero_stage {L.zero_stage} -> 3",
                    dataclasses.replace(run, layout=dataclasses.replace(L, zero_stage=3)), run.world_size))
    return out


def fit_changes(run: RunSpec, hw: HardwareProfile, *, predicted_fits: bool, predicted_total: float,
                shortfall_bytes: float) -> list[dict[str, Any]]:
    """Each candidate change costed at `hw`'s memory. When the cost model had said the failed
    run fits, it underestimates it, and a change "fits" only if it also saves at least the
    `shortfall_bytes` the failure lacked."""
    out = []
    for what, cand, gpus in _candidates(run):
        layout: Layout = cand.layout
        try:
            validate_layout(cand.spec, layout, layout.world_size, training=run.training)
            cand_hw = hw if gpus == run.world_size else cluster(hw, gpus=gpus, nodes=None, gpus_per_node=None)
            cand_hw = at_capacity(cand_hw, hw.memory_capacity_bytes)
            report, total, reserved, fits = _costed(cand, cand_hw)
        except ShardplanError:
            continue  # a layout the model cannot take (tp beyond its heads, ...)
        if predicted_fits:
            fits = fits and total <= predicted_total - shortfall_bytes
        out.append({"change": what, "layout": report.plan.model_dump(mode="json"), "predicted_total_bytes": total,
                    "predicted_reserved_bytes": reserved, "fits": fits})
    return _first_halving_only(out)


def _first_halving_only(tried: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of the halvings, keep those up to the first that fits (halving further is a bigger change)."""
    out, fitted = [], False
    for c in tried:
        halving = c["change"].startswith(("micro_batch_size", "batch_size"))
        if halving and fitted:
            continue
        fitted = fitted or (halving and c["fits"])
        out.append(c)
    return out


# --- the report ------------------------------------------------------------------------------------

def _predicted_component(run: RunSpec, report: Any, stage: int, component: str | None,
                         hw: HardwareProfile) -> float | None:
    if component is None:
        return None
    if not run.training:
        parts = _serving_stage_bytes(run, report, stage, hw)
        return parts.get(component)
    rank = next(r for r in report.memory.per_rank if r.stage == stage)
    if component == "loss":
        return rank.detail_bytes.get("activations.loss", 0.0)
    return rank.per_gpu_bytes.get(component)


def oom_report(run: RunSpec, hw: HardwareProfile, ranks: list[dict[str, Any]], *, plan: str, backend: str,
               device: str, notes: list[str] | None = None) -> dict[str, Any]:
    """The verify report of a run whose `ranks` (each a worker.RankOutOfMemory's details, the
    first to fail first) ran out of memory: status "oom", the components each measured before
    it, and `oom` for the first."""
    first = ranks[0]
    f = first["failure"]
    capacity = run.device_memory_bytes or first.get("device_total_bytes") or hw.memory_capacity_bytes
    hw_cap = at_capacity(hw, capacity)
    report, total, reserved, fits = _costed(run, hw_cap)
    per_stage = {r.stage: r for r in report.memory.per_rank}
    limit = f.get("limit_bytes") if f.get("limit_bytes") is not None else allocator_limit_bytes(run, hw)
    shortfall = 0.0
    if f.get("live_bytes") is not None and f.get("allocation_bytes") is not None and limit is not None:
        shortfall = max(0.0, f["live_bytes"] + f["allocation_bytes"] - limit)
    tried = fit_changes(run, hw_cap, predicted_fits=fits, predicted_total=total, shortfall_bytes=shortfall)
    entries = []
    for d in ranks:
        m = d.get("measured", {})
        pr = per_stage[d["stage"]]
        comps = (_training_components(run, dict(pr.per_gpu_bytes), m, pr.host_offload_bytes) if run.training
                 else _serving_components(run, d["stage"], dict(pr.per_gpu_bytes), m))
        entry = {k: d[k] for k in ("rank", "pp", "dp", "tp", "stage", "cp")} | {
            "components": comps, "step_seconds": [], "wall_seconds": float(d.get("wall_seconds", 0.0)),
            "extra_measured_bytes": {}}
        peak = memory_peak(run, pr, m, device)
        if peak is not None:
            entry["memory_peak"] = peak
        entries.append(entry)
    measured = [c["component"] for c in entries[0]["components"]]
    expected = TRAINING_COMPONENTS if run.training else SERVING_COMPONENTS
    component = f.get("component")
    oom = {
        "rank": first["rank"], "stage": first["stage"], "step": first.get("step"),
        "steps_completed": first.get("steps_completed", 0), "simulated": bool(f.get("simulated")),
        "op": f.get("op"), "shape": f.get("shape"), "dtype": f.get("dtype"), "allocation_bytes": f.get("allocation_bytes"),
        "live_bytes": f.get("live_bytes"), "limit_bytes": limit, "capacity_bytes": int(capacity),
        "component": component, "predicted_component_bytes": _predicted_component(run, report, first["stage"], component, hw_cap),
        "predicted_total_bytes": total, "predicted_reserved_bytes": reserved, "predicted_fits": fits,
        "message": f.get("message"), "measured_components": measured,
        "unmeasured_components": [c for c in expected if c not in measured],
        "suggestion": next((c for c in tried if c["fits"]), None), "tried": tried,
        "out_of_memory_ranks": sorted(d["rank"] for d in ranks),
    }
    what = f"{oom['op'] or 'an allocation'}"
    if oom["allocation_bytes"] is not None:
        what += f" allocating {oom['allocation_bytes'] / BYTES_PER_GIB:.3g} GiB"
    mismatches = [f"rank {d['rank']} ran out of memory "
                  f"{'while building the model' if d.get('step') is None else 'in step ' + str(d['step'])} "
                  f"({d['failure'].get('component') or '?'}: {d['failure'].get('op') or d.get('error')})" for d in ranks]
    run_notes = [*(notes or [])]
    if fits:
        run_notes.append(f"the cost model said this run fits ({total / BYTES_PER_GIB:.3g} GiB of "
                         f"{capacity / BYTES_PER_GIB:.3g}): it underestimates it; a change counts as fitting only if it "
                         f"also saves the {shortfall / BYTES_PER_GIB:.3g} GiB the failure lacked")
    t = report.time
    predicted_time = ({"step_seconds": t.step_seconds} if run.training
                      else {"ttft_seconds": t.ttft_seconds, "tpot_seconds": t.tpot_seconds})
    run_dict = run.as_dict()
    run_dict["notes"] = [*run_dict["notes"], *run_notes]
    return {
        "plan": plan, "status": "oom", "backend": backend, "device": device, "world_size": run.world_size,
        "run": run_dict, "layout": report.plan.model_dump(mode="json"), "tolerances": TOLERANCES, "ranks": entries,
        "numerics": {"check": f"not run: rank {first['rank']} ran out of memory ({what})", "ok": False, "checked": False},
        "time": {"measured": {}, "predicted": predicted_time, "compared": False, "reason": "the run ran out of memory"},
        "hardware": {"profile": hw.name, "num_nodes": hw.num_nodes, "gpus_per_node": hw.gpus_per_node},
        "probes": [d["probes"] | {"rank": d["rank"]} for d in ranks if "probes" in d],
        "mismatches": mismatches, "oom": oom,
    }
