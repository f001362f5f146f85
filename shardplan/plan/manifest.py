"""The deployment manifest: what `shardplan recommend -o plan.yaml` writes and `verify` and
the exporters read back.

The same inputs give the same bytes: no timestamps, mappings in a fixed order, floats
written with `repr`. Writing is atomic (a new file beside the target, fsync, os.replace).
Loading checks the version before anything else, then every field (`manifest_schema`), then
that the layout can exist on the recorded model and cluster, so a hand-edited plan fails
with one line naming the file, the field and the fix.
"""

from __future__ import annotations

import math

import hashlib
import json
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from shardplan import __version__
from shardplan.cost.layout import Layout, layout_stage_ranges
from shardplan.cost.report import CostReport, LoadReport, TrainingMemoryReport, TrainingTimeReport
from shardplan.cost.serving_load import LoadResult
from shardplan.cost.params import block_weights, embedding_weights, head_weights, layer_kinds, tied_lm_head_copy
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import InputFileError
from shardplan.fileio import write_text_atomic
from shardplan.plan.schema import (
    MESH_AXIS_ORDER,
    SCHEMA_VERSION,
    BandSection,
    DeploymentManifest,
    FitAtBandEdgeSection,
    HardwareSection,
    InferenceWorkloadSection,
    Invalid,
    KvCacheSection,
    LayoutSection,
    LongRunSection,
    MemorySection,
    MeshAxis,
    ModelSection,
    PercentilesSection,
    PlacementSection,
    PredictedLoadSection,
    PredictedSection,
    ServingTime,
    SlaSection,
    StageMemory,
    TrainingTime,
    TrainingWorkloadSection,
    all_field_names,
    expert_placement,
    stage_placements,
)
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.loading import LoadedModel, model_specs_dir, read_structured, validation_error
from shardplan.specs.model import ModelSpec

if TYPE_CHECKING:
    from shardplan.search.results import LongRun

__all__ = [
    "SCHEMA_VERSION",
    "MESH_AXIS_ORDER",
    "DeploymentManifest",
    "build_manifest",
    "long_run_section",
    "dump_manifest",
    "write_manifest",
    "load_manifest",
    "manifest_json_schema",
    "spec_sha256",
]

_YAML_WIDTH = 1 << 30  # never fold a line: folding would depend on the text's length


def _source(origin: str) -> str:
    """Where the spec came from: `bundled:<name>` for the catalog (the same on every machine),
    else the path as given."""
    path = Path(origin)
    try:
        if path.resolve().parent == model_specs_dir().resolve():
            return f"bundled:{path.stem}"
    except OSError:
        pass
    return origin


def spec_sha256(spec: ModelSpec) -> str:
    """sha256 of the spec's fields as canonical JSON; `source` (a path) is provenance, not shape.
    Fields at their defaults are left out, so a field added later with a default (a mechanism the
    spec did not use) does not change the hash of plans written before it."""
    return _sha256_json(spec.model_dump(mode="json", exclude={"source"}, exclude_defaults=True))


# ModelSpec fields added after plans began recording a hash of the full dump (defaults included);
# a plan written before them carries that hash, which `legacy_spec_sha256` reproduces.
_FIELDS_ADDED_SINCE_FULL_DUMP = ("layer_types", "attention_chunk_size", "attention_sinks", "attention_output_gate",
                                 "linear_attention", "vision", "measured_num_params", "expert_dtype",
                                 "fp8_weight_block_size", "head", "num_labels", "word_embed_proj_dim",
                                 "position_embedding_offset", "checkpoint_quantization",
                                 "checkpoint_group_size", "embedding_norm")
_MOE_FIELDS_ADDED_SINCE_FULL_DUMP = ("router_linear_bias",)


def legacy_spec_sha256(spec: ModelSpec) -> str | None:
    """The hash a plan written before `spec_sha256` left defaults out would carry for this spec,
    or None when the spec uses a field those plans could not express."""
    defaults = ModelSpec.model_fields
    if any(getattr(spec, f) != defaults[f].get_default(call_default_factory=True) for f in _FIELDS_ADDED_SINCE_FULL_DUMP):
        return None
    if spec.moe is not None and spec.moe.router_linear_bias:
        return None
    data = spec.model_dump(mode="json", exclude={"source", *_FIELDS_ADDED_SINCE_FULL_DUMP})
    if data.get("moe") is not None:
        data["moe"] = {k: v for k, v in data["moe"].items() if k not in _MOE_FIELDS_ADDED_SINCE_FULL_DUMP}
    return _sha256_json(data)


def _sha256_json(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode("ascii")).hexdigest()


def _tp_splits(spec: ModelSpec, pp: int) -> dict[str, str]:
    """Split per weight name, over every layer kind the model has (dense or MoE MLP, softmax or
    linear attention: `layer_kinds`), dense before MoE and softmax before linear attention."""
    kinds = list(embedding_weights(spec))
    for moe_layer, linear in sorted(layer_kinds(spec)):
        kinds += block_weights(spec, moe_layer, linear)
    kinds += head_weights(spec) + (tied_lm_head_copy(spec) if pp > 1 else ())
    return {w.name: w.split.value for w in kinds}


def _plain(workload: InferenceWorkload | TrainingWorkload) -> dict[str, Any]:
    out = {}
    for f in fields(workload):
        v = getattr(workload, f.name)
        out[f.name] = v.value if isinstance(v, Enum) else list(v) if isinstance(v, tuple) else v

    sp = out.get("speculative")
    if sp is not None:
        out["speculative"] = dict(method=sp.method.value, num_speculative_tokens=sp.num_speculative_tokens,
                                  draft_model=sp.draft_name,
                                  draft_source=_source(sp.draft_source) if sp.draft_source is not None else None,
                                  draft_hf_id=sp.draft_hf_id)
    if out.get("load") is not None:
        out["load"] = _load_section(out["load"])
    if "python_ops_per_layer_parts" in out:
        out["python_ops_per_layer_parts"] = dict(out["python_ops_per_layer_parts"])
    for key in ("static_fraction_by_tp", "static_fraction_by_tp_pipelined"):
        if key in out:
            out[key] = [{"min_tp": t, "fraction": f} for t, f in out[key]]
    if "cuda_graph_max_batch_by_tp" in out:
        out["cuda_graph_max_batch_by_tp"] = [{"min_tp": t, "batch": b} for t, b in out["cuda_graph_max_batch_by_tp"]]
    return out


def _load_section(load: Any) -> dict[str, Any]:
    def bins(b: Any) -> dict[str, Any]:
        return {"min_tokens": list(b.min_tokens), "max_tokens": list(b.max_tokens), "weights": list(b.weights)}

    d = load.lengths
    lengths = None if d is None else {
        "kind": d.kind.value, "input_bins": bins(d.input_bins), "output_bins": bins(d.output_bins), "paired": d.paired,
        "source": d.source, "max_total_tokens": d.max_total_tokens, "refused_fraction": d.refused_fraction}
    rate = load.request_rate_per_second
    return {"request_rate_per_second": None if math.isinf(rate) else rate, "max_concurrency": load.max_concurrency,
            "num_requests": load.num_requests, "lengths": lengths, "lengths_name": load.lengths_name,
            "prefix_cache_hit_fraction": load.prefix_cache_hit_fraction, "poisson": load.poisson, "seed": load.seed,
            "spec_acceptance_rate": load.spec_acceptance_rate}


def _floats(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}


def _percentiles(p: Any) -> PercentilesSection | None:
    """Mean and percentiles, from a LoadReport's or a LoadResult's; None where they are undefined
    (NaN: TPOT when every output is one token, anything when no request completed)."""
    values = (float(p.mean), float(p.p50), float(p.p90), float(p.p99))
    if not all(math.isfinite(v) for v in values):
        return None
    return PercentilesSection(mean=values[0], p50=values[1], p90=values[2], p99=values[3])


def long_run_section(lr: LongRun, run: LoadResult, held: LoadResult | None) -> LongRunSection:
    """recommend's long run of its pick (`lr`, with one replica's `run` at the judged rate and,
    where that breaks the SLA, `held`: the run at the rate that holds)."""
    return LongRunSection(
        request_rate_per_second=float(lr.request_rate), num_requests=lr.num_requests, sla_percentile=lr.percentile,
        ttft_seconds=_percentiles(run.ttft_seconds), tpot_seconds=_percentiles(run.tpot_seconds),
        within_sla=lr.within_sla, why=lr.why,
        held_request_rate_per_second=None if held is None else float(lr.held_request_rate),  # type: ignore[arg-type]
        held_ttft_seconds=None if held is None else _percentiles(held.ttft_seconds),
        held_tpot_seconds=None if held is None else _percentiles(held.tpot_seconds))


def _load(load: LoadReport, long_run: LongRunSection | None) -> PredictedLoadSection:
    return PredictedLoadSection(
        request_rate_per_second=None if load.request_rate is None else float(load.request_rate),
        max_concurrency=load.max_concurrency, num_requests=load.num_requests, num_replicas=load.num_replicas,
        ttft_seconds=_percentiles(load.ttft_seconds), tpot_seconds=_percentiles(load.tpot_seconds),
        e2e_seconds=_percentiles(load.e2e_seconds),
        request_throughput_per_second=float(load.request_throughput_per_second),
        output_tokens_per_second=float(load.output_tokens_per_second),
        total_tokens_per_second=float(load.total_tokens_per_second),
        saturation_request_rate_per_second=float(load.saturation_request_rate), saturated=load.saturated,
        long_run=long_run)


def _predicted(report: CostReport, long_run: LongRunSection | None = None) -> PredictedSection:
    mem, t = report.memory, report.time
    stages = [StageMemory(stage=r.stage, num_ranks=r.num_ranks, per_gpu_bytes=_floats(r.per_gpu_bytes),
                          headroom_bytes=float(r.headroom_bytes), host_offload_bytes=float(r.host_offload_bytes),
                          nvme_offload_bytes=float(r.nvme_offload_bytes)) for r in mem.per_rank]
    memory = MemorySection(per_gpu_bytes=_floats(mem.per_gpu_bytes), headroom_bytes=float(mem.headroom_bytes),
                           budget_bytes=float(mem.budget_bytes), binding_stage=mem.binding_stage,
                           binding_component=mem.binding_component, stages=stages)
    kv = None
    if isinstance(t, TrainingTimeReport):
        assert isinstance(mem, TrainingMemoryReport)  # the estimate builds them together
        time: TrainingTime | ServingTime = TrainingTime(
            kind="training", num_microbatches=mem.num_microbatches, breakdown_seconds=_floats(t.breakdown),
            step_seconds=float(t.step_seconds), tokens_per_second_per_gpu=float(t.tokens_per_second_per_gpu),
            tokens_per_second=float(t.tokens_per_second), mfu=float(t.mfu), hfu=float(t.hfu),
            model_flops_per_step=float(t.model_flops_per_step))
    else:
        time = ServingTime(
            kind="inference", batch_size=t.batch_size, batch_fits_kv_cache=t.batch_fits_kv_cache,
            best_batch_size=t.best_batch_size, prefill_breakdown_seconds=_floats(t.breakdown.prefill),
            decode_step_breakdown_seconds=_floats(t.breakdown.decode_step),
            ttft_seconds=float(t.ttft_seconds), tpot_seconds=float(t.tpot_seconds),
            e2e_latency_seconds=float(t.e2e_latency_seconds),
            throughput_tokens_per_second=float(t.throughput_tokens_per_second),
            throughput_tokens_per_second_per_gpu=float(t.throughput_tokens_per_second_per_gpu),
            throughput_tokens_per_second_per_replica=float(t.throughput_tokens_per_second_per_replica))
        c = report.kv_cache
        assert c is not None  # serving reports always carry the KV cache
        kv = KvCacheSection(
            bytes_per_token=float(c.bytes_per_token), bytes_per_token_per_gpu=float(c.bytes_per_token_per_gpu),
            capacity_tokens=int(c.capacity_tokens), num_blocks=int(c.num_blocks), block_size_tokens=c.block_size,
            max_model_len_tokens=c.max_model_len, bytes_per_sequence=float(c.bytes_per_sequence),
            max_concurrent_sequences=float(c.max_concurrency))
    bands = [BandSection(**b.model_dump()) for b in report.bands or []]
    edge = report.fit_at_band_edge
    at_edge = None if edge is None else FitAtBandEdgeSection(verdict=edge.verdict, band_abs_error=edge.band_abs_error,
                                                              note=edge.note)
    load = None if report.load is None else _load(report.load, long_run)
    return PredictedSection(fits=report.fits, reason=report.reason, memory=memory, time=time, kv_cache=kv,
                            bands=bands, fit_at_band_edge=at_edge, load=load)


def _assumptions(report: CostReport, hw: HardwareProfile) -> list[str]:
    t = report.time
    out = [f"{k}: {v}" for k, v in t.overlap_assumptions.items()]
    if isinstance(t, TrainingTimeReport):
        out.append(f"flop_convention: {t.flop_convention}")
    out.append(
        f"hardware_efficiency: profile '{hw.name}' attains matmul {hw.matmul_efficiency:g}, attention "
        f"{hw.attention_efficiency:g}, HBM bandwidth {hw.memory_bandwidth_efficiency:g}, intra-node link "
        f"{hw.intra_node.efficiency:g}, inter-node link {hw.inter_node.efficiency:g} of peak"
    )
    return out


def build_manifest(*, loaded: LoadedModel, hw: HardwareProfile, layout: Layout,
                   workload: InferenceWorkload | TrainingWorkload, report: CostReport,
                   objective: str | None = None, search: dict[str, Any] | None = None,
                   runs_on: list[str] | None = None, long_run: LongRunSection | None = None,
                   sla: SlaSection | None = None) -> DeploymentManifest:
    """The manifest of one estimated plan; `report` is `estimate(...)` for these inputs;
    `runs_on`: the targets that run it (recommend says so); `long_run`: recommend's long run
    of it at its judged rate (`long_run_section`); `sla`: the limits it was ranked within."""
    spec, serving = loaded.spec, isinstance(workload, InferenceWorkload)
    chunks = layout_stage_ranges(spec.num_layers, layout)
    ranges = [[[r.start, r.stop - 1] for r in stage] for stage in chunks]
    num_experts = spec.moe.num_experts if spec.moe is not None else None
    return DeploymentManifest(
        schema_version=SCHEMA_VERSION,
        shardplan_version=__version__,
        model=ModelSection(
            name=spec.name, source=_source(loaded.origin), hf_id=loaded.hf_id, spec_sha256=spec_sha256(spec),
            num_params=report.model.num_params, num_active_params=report.model.num_active_params,
            num_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
            num_kv_heads=spec.num_attention_heads if spec.mla is not None else spec.kv_heads, num_experts=num_experts),
        hardware=HardwareSection(profile_name=hw.name, gpu_model=hw.gpu_model, num_nodes=hw.num_nodes,
                                 gpus_per_node=hw.gpus_per_node, num_gpus=hw.num_gpus,
                                 memory_capacity_bytes=hw.memory_capacity_bytes),
        workload=(InferenceWorkloadSection if serving else TrainingWorkloadSection)(
            kind="inference" if serving else "training", **_plain(workload)),
        layout=LayoutSection(
            tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, ep=layout.ep, etp=layout.expert_tp,
            zero_stage=layout.zero_stage, hybrid_shard=layout.hybrid_shard, sequence_parallel=layout.sequence_parallel,
            recompute=layout.recompute.value, pp_schedule=layout.pp_schedule.value, virtual_stages=layout.virtual_stages,
            micro_batch_size=layout.micro_batch_size, offload_optimizer=layout.offload_optimizer.value,
            offload_params=layout.offload_params.value, offload_layers=layout.offload_layers,
            offload_expert_layers=layout.offload_expert_layers,
            pp_embedding_as_layer=layout.pp_embedding_as_layer,
            pp_loss_as_layer=layout.pp_loss_as_layer, pp_first_stage_layers=layout.pp_first_stage_layers,
            pp_last_stage_layers=layout.pp_last_stage_layers,
            weight_quantization=workload.quantization.value if serving else None,
            kv_cache_dtype=(workload.kv_cache_dtype or workload.activation_dtype).value if serving else None),
        placement=PlacementSection(
            mesh_axis_order=list(MESH_AXIS_ORDER),
            mesh_shape=[MeshAxis(axis=a, size=getattr(layout, a)) for a in MESH_AXIS_ORDER],
            gpus_per_node=hw.gpus_per_node,
            stages=stage_placements(ranges, layout.tp * layout.cp * layout.dp, hw.gpus_per_node),
            experts=expert_placement(num_experts, layout.ep), tp_splits=_tp_splits(spec, layout.pp)),
        predicted=_predicted(report, long_run),
        assumptions=_assumptions(report, hw),
        objective=objective,
        search=dict(search) if search is not None else None,
        runs_on=list(runs_on) if runs_on is not None else None,
        sla=sla,
    )


# ----- text and files ----------------------------------------------------------------------


def dump_manifest(m: DeploymentManifest) -> str:
    """YAML text in field order; floats as `repr`, so load -> dump gives the same bytes."""
    return yaml.safe_dump(m.model_dump(mode="json"), sort_keys=False, default_flow_style=False,
                          allow_unicode=False, width=_YAML_WIDTH)


def write_manifest(m: DeploymentManifest, path: str | Path) -> None:
    """Write atomically (`fileio.write_text_atomic`): a reader sees the old file or the new one."""
    write_text_atomic(path, dump_manifest(m))


def load_manifest(path: str | Path) -> DeploymentManifest:
    """Read and check a manifest; every problem is an InputFileError naming the file and field."""
    label = str(path)
    data = read_structured(Path(path))
    if not isinstance(data, dict):
        raise InputFileError(f"expected a mapping at the top level, got {type(data).__name__}", source=label,
                             hint="pass a plan written by `shardplan recommend -o`")
    version = data.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:  # before the fields: a newer schema may add some
        raise InputFileError(f"written by a newer shardplan (schema {version}; this one reads up to {SCHEMA_VERSION})",
                             source=label, field="schema_version", hint="upgrade shardplan")
    try:
        return DeploymentManifest.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        cause = errors[0].get("ctx", {}).get("error")
        if isinstance(cause, Invalid):
            raise InputFileError(str(cause), source=label, field=cause.field, hint=cause.hint) from None
        err = validation_error(e, label, known=all_field_names())
        err.field = _without_union_members(err.field)
        raise err from None


def _without_union_members(field: str | None) -> str | None:
    """pydantic puts the union member it tried into the path ('workload.training.seq_len',
    'search.n.int'); the file has no such key, so leave it out."""
    if field is None:
        return None
    parts = field.split(".")
    keep = [
        p for i, p in enumerate(parts)
        if not ((parts[:i] in (["workload"], ["predicted", "time"]) and p in ("inference", "training"))
                or (parts[0] == "search" and i == 2))
    ]
    return ".".join(keep)


def manifest_json_schema() -> dict[str, Any]:
    return DeploymentManifest.model_json_schema()
