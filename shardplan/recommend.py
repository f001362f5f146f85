"""recommend: search, explain, and (optionally) write the winner's manifest. Returns the
object `recommend --json` prints; the CLI only parses options and renders it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.errors import ShardplanError
from shardplan.manifest import build_manifest, write_manifest
from shardplan.options import layout_from_options
from shardplan.search import Goal, SearchResult, Space, search
from shardplan.search import explain
from shardplan.search.space import Progress
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.loading import LoadedModel
from shardplan.units import DType


def parse_layout(text: str, num_gpus: int) -> Layout:
    """`tp=8,pp=16,dp=128,zero_stage=1,...` -> Layout (dp defaults to what the GPUs leave)."""
    allowed = {f for f in Layout.__dataclass_fields__} | {"offload"}
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in allowed:
            raise ShardplanError(
                f"cannot read {part!r}", field="--compare",
                hint="give key=value pairs such as tp=8,pp=16,dp=128; keys: " + ", ".join(sorted(allowed)),
            )
        raw = raw.strip()
        if raw.lower() in ("true", "false"):
            values[key] = raw.lower() == "true"
        else:
            try:
                values[key] = int(raw)
            except ValueError:
                values[key] = raw
    if "dp" in values:
        num_gpus = values["dp"] * values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
    try:
        return layout_from_options(  # the same rules as estimate's flags
            num_gpus=num_gpus,
            tp=values.get("tp", 1), pp=values.get("pp", 1), dp=values.get("dp"), cp=values.get("cp", 1),
            ep=values.get("ep", 1), etp=values.get("etp"), zero_stage=values.get("zero_stage", 0),
            hybrid_shard=values.get("hybrid_shard", False), sequence_parallel=values.get("sequence_parallel", False),
            recompute=values.get("recompute", "none"), pp_schedule=values.get("pp_schedule", "1f1b"),
            virtual_stages=values.get("virtual_stages", 1), micro_batch_size=values.get("micro_batch_size", 1),
            offload=values.get("offload", "none"),
        )
    except (ValueError, KeyError) as e:
        raise ShardplanError(f"bad value: {e}", field="--compare", hint="see `shardplan estimate --help` for the values") from None


def recommend(
    loaded: LoadedModel,
    hw: HardwareProfile,
    workload: InferenceWorkload | TrainingWorkload,
    space: Space,
    goal: Goal,
    *,
    num_gpus: int | None,
    max_gpus: int | None,
    compare_layout: str | None = None,
    manifest_path: Path | None = None,
    progress: Progress | None = None,
    suggest: bool = True,
) -> dict[str, Any]:
    spec = loaded.spec
    res = search(spec, hw, workload, space, goal, num_gpus=num_gpus, max_gpus=max_gpus, progress=progress)
    top = [explain.entry(spec, e, goal, i + 1) for i, e in enumerate(res.top)]
    binding = explain.binding_constraint(top[0], goal) if top else None
    out: dict[str, Any] = {
        "model": spec.name,
        "hardware": hw.name,
        "workload": "training" if res.training else "inference",
        "objective": goal.objective.value,
        "gpu_counts": res.gpu_counts,
        "smallest_num_gpus": res.smallest_num_gpus,
        "num_candidates": res.num_candidates,
        "num_evaluated": res.num_evaluated,
        "num_costed": res.num_costed,
        "num_feasible": res.num_feasible,
        "elapsed_seconds": res.elapsed_seconds,
        "evaluated_per_second": res.num_evaluated / res.elapsed_seconds if res.elapsed_seconds > 0 else None,
        "rejected": dict(sorted(res.rejected.items(), key=lambda kv: (-kv[1], kv[0]))),
        "top": top,
        "pareto": [explain.pareto_point(e) for e in res.pareto],
        "binding_constraint": binding,
        "runner_up_gap_fraction": explain.gap(top[0], top[1]) if len(top) > 1 else None,
        "why": explain.why(top, goal, binding),
        "compare": None,
        "suggestions": [],
        "manifest": None,
    }
    if compare_layout:
        layout = parse_layout(compare_layout, top[0]["num_gpus"] if top else (num_gpus or hw.num_gpus))
        out["compare"] = explain.compare(spec, hw, workload, layout, goal, top[0] if top else None)
    if not top and suggest:
        n = num_gpus or (res.gpu_counts[-1] if res.gpu_counts else hw.num_gpus)

        def run(wl: Any, sp: Space, g: Goal, *, num_gpus: int | None, max_gpus: int | None, first_fit: bool = False) -> SearchResult:
            return search(spec, hw, wl, sp, g, num_gpus=num_gpus, max_gpus=max_gpus, first_fit=first_fit)

        out["suggestions"] = explain.suggestions(spec, hw, workload, space, goal, n, run)
    if manifest_path is not None and res.top:
        best = res.top[0]
        report = estimate(spec, best.hw, best.layout, best.workload).as_dict()
        summary = {k: out[k] for k in ("num_candidates", "num_evaluated", "num_costed", "num_feasible")}
        if out["runner_up_gap_fraction"] is not None:
            summary["runner_up_gap_fraction"] = out["runner_up_gap_fraction"]
        m = build_manifest(
            loaded=loaded, hw=best.hw, layout=best.layout, workload=best.workload, report=report,
            objective=goal.objective.value, search=summary,
        )
        write_manifest(m, manifest_path)
        out["manifest"] = str(manifest_path)
    return out


def with_allowed_dtypes(space: Space, allowed: list[str]) -> Space:
    """--allow-quantization fp8,int8,int4: weight formats (and, for fp8, the KV cache) the
    search may use besides the model's own."""
    quants = list(space.quantizations)
    kvs = list(space.kv_cache_dtypes)
    for a in allowed:
        a = a.strip().lower()
        if a not in ("fp8", "int8", "int4"):
            raise ShardplanError(f"unknown format {a!r}", field="--allow-quantization", hint="use a list of fp8, int8, int4")
        q = Quantization(a)
        if q not in quants:
            quants.append(q)
        if a == "fp8" and DType.FP8 not in kvs:
            kvs.append(DType.FP8)
    return replace(space, quantizations=tuple(quants), kv_cache_dtypes=tuple(kvs))
