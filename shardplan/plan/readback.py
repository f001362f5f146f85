"""The one place a plan file turns back into inputs: its model (the spec at `model.source`,
hash-checked against `model.spec_sha256`), hardware profile, workload and layout.

Export, checkpoint, replan and verify all read plans through here, so a plan means the same
thing to each of them. This module does no parsing of its own: files are read through
`specs.loading` (bounded, regular files only) and `plan.manifest`; it imports no yaml, rich
or typer (tests/test_architecture.py).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any
from pathlib import Path

from shardplan.cost.finetune import BaseFormat, FineTune
from shardplan.cost.layout import Layout, Offload, PipelineSchedule, Recompute
from shardplan.cost.speculative import Speculative, SpeculativeMethod
from shardplan.cost.workload import ServingLoad, Framework, InferenceWorkload, Optimizer, Quantization, TrainingWorkload
from shardplan.errors import ShardplanError, UnknownNameError
from shardplan.plan.manifest import legacy_spec_sha256, load_manifest, spec_sha256
from shardplan.plan.schema import DeploymentManifest
from shardplan.search.targets import Setting, used_gpus_per_node
from shardplan.specs import loading
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.units import DType

BUNDLED_PREFIX = "bundled:"


def source_model(m: DeploymentManifest, plan: str | None = None) -> loading.LoadedModel:
    """The model at the plan's `model.source`: a bundled name (`bundled:<name>` names the catalog
    only, never a path), or a model file. The plan may be anyone's, so the path is read as a
    model spec and nothing else (regular files, size-limited). Raises ShardplanError."""
    src = m.model.source
    if src.startswith(BUNDLED_PREFIX):
        name = src.removeprefix(BUNDLED_PREFIX)
        if name not in loading.bundled_names(loading.model_specs_dir()):
            raise UnknownNameError(f"no bundled model named {name!r}", source=plan, field="model.source",
                                   hint="run `shardplan models` for the list, or re-plan")
        src = name
    return loading.load_model(src)


def source_spec(m: DeploymentManifest) -> ModelSpec | None:
    """The spec at the plan's `model.source` when it can be read, else None (it may live on
    another machine: exporters that need only the manifest still work)."""
    try:
        return source_model(m).spec
    except ShardplanError:
        return None


def matches_plan(spec: ModelSpec, m: DeploymentManifest) -> bool:
    """The spec hashes to what the plan recorded when it was written (by this version's rule, or
    by the full-dump rule of plans written before it)."""
    if m.model.spec_sha256 in (spec_sha256(spec), legacy_spec_sha256(spec)):
        return True
    # A plan written before shardplan read a 4-bit AWQ/GPTQ quantization_config (the same config file,
    # read with fewer fields): it still names this model.
    if spec.checkpoint_quantization is not None:
        older = spec.model_copy(update={"checkpoint_quantization": None, "checkpoint_group_size": None})
        return m.model.spec_sha256 in (spec_sha256(older), legacy_spec_sha256(older))
    return False


def _changed(m: DeploymentManifest, plan: str | None) -> ShardplanError:
    return ShardplanError(f"the model spec at {m.model.source} has changed since this plan was made", source=plan,
                          field="model.spec_sha256", hint="re-plan from the spec with shardplan recommend")


def plan_spec(m: DeploymentManifest) -> ModelSpec | None:
    """The plan's model spec when its source still exists and hashes to what the plan recorded;
    None when it is missing or changed."""
    spec = source_spec(m)
    return spec if spec is not None and matches_plan(spec, m) else None


def checked_model(m: DeploymentManifest, plan: str | None = None) -> loading.LoadedModel:
    """The plan's model, which must be readable and still hash to what the plan recorded."""
    loaded = source_model(m, plan)
    if not matches_plan(loaded.spec, m):
        raise _changed(m, plan)
    return loaded


def optional_checked_spec(m: DeploymentManifest, plan: str | None = None) -> ModelSpec | None:
    """The plan's spec if it can be read (None if not), refusing one that changed since."""
    spec = source_spec(m)
    if spec is not None and not matches_plan(spec, m):
        raise _changed(m, plan)
    return spec


def plan_hardware(m: DeploymentManifest, plan: str | None = None, override: str | None = None) -> HardwareProfile:
    """The plan's hardware profile (or `override`, which must describe the same GPU), at the
    profile's own size: callers size it to a cluster with `specs.cluster.cluster`."""
    hw = loading.load_hardware(override or m.hardware.profile_name)
    if hw.gpu_model != m.hardware.gpu_model:
        raise ShardplanError(f"profile '{hw.name}' is a {hw.gpu_model}, the plan's GPUs are {m.hardware.gpu_model}",
                             source=plan, field="hardware.profile_name", hint="pass --hardware with the plan's profile")
    return hw


# The workload fields that come from the engine's knowledge file as a whole (not an era), added after plans
# were first written.
ENGINE_RULE_FIELDS = ("kv_heads_copied", "speculative_with_pp", "fp8_marlin_architectures")


def plan_workload(m: DeploymentManifest) -> InferenceWorkload | TrainingWorkload:
    """The workload the plan was costed for, as the cost model's own type."""
    w = m.workload.model_dump()
    w.pop("kind")
    if m.workload.kind == "training":
        return TrainingWorkload(**{**w, "optimizer": Optimizer(w["optimizer"]), "framework": Framework(w["framework"]),
                                   "param_dtype": DType(w["param_dtype"]),
                                   "activation_dtype": DType(w["activation_dtype"]),
                                   "recompute_offered": tuple(w["recompute_offered"]),
                                   "attention_kernels": tuple(w["attention_kernels"]),
                                   "matmul_dtype": DType(w["matmul_dtype"]),
                                   "finetune": FineTune(w["finetune"]), "lora_targets": tuple(w["lora_targets"]),
                                   "base_format": BaseFormat(w["base_format"]),
                                   "master_dtype": DType(w["master_dtype"]), "moment_dtype": DType(w["moment_dtype"]),
                                   "grad_reduce_dtype": DType(w["grad_reduce_dtype"]),
                                   "recompute_modules": tuple(w["recompute_modules"])})
    kv = w["kv_cache_dtype"]
    # Lists in the manifest are tuples in the cost model's frozen (hashable, cached) workload.
    w = {k: tuple(v) if isinstance(v, list) else v for k, v in w.items()}
    if w.get("batches_in_flight") is None:  # written before it was recorded: costed with one batch at a time
        w["batches_in_flight"] = 1
    # Engine rules a plan written before they were recorded does not carry: the engine version's own.
    unrecorded = [k for k in ENGINE_RULE_FIELDS if k not in m.workload.model_fields_set]
    if unrecorded:
        from shardplan.knowledge.load import engine_rules

        try:
            rules = engine_rules(w["engine"], w.get("engine_version"))
        except ShardplanError:  # an engine or version this shardplan has no rules for: the defaults
            rules = None
        if rules is not None:
            w.update({k: getattr(rules, k) for k in unrecorded})
    return InferenceWorkload(**{**w, "speculative": plan_speculative(m), "kv_cache_dtype": DType(kv) if kv else None,
                                "activation_dtype": DType(w["activation_dtype"]),
                                "quantization": Quantization(w["quantization"]),
                                "assumptions": tuple(w["assumptions"]),
                                "static_fraction_by_tp": tuple((r["min_tp"], r["fraction"]) for r in w["static_fraction_by_tp"]),
                                "static_fraction_by_tp_pipelined": tuple(
                                    (r["min_tp"], r["fraction"]) for r in w.get("static_fraction_by_tp_pipelined", ())),
                                "cuda_graph_max_batch_by_tp": tuple(
                                    (r["min_tp"], r["batch"]) for r in w.get("cuda_graph_max_batch_by_tp", ())),
                                "admission": tuple(w["admission"]) if w["admission"] is not None else None,
                                "python_ops_per_layer_parts": tuple(sorted(w["python_ops_per_layer_parts"].items())),
                                "load": plan_load(w["load"])})


def plan_load(d: dict[str, Any] | None) -> ServingLoad | None:
    """The traffic a plan was judged under, as the cost model's own type."""
    if d is None:
        return None
    from shardplan.specs.lengths import LengthDistribution, LengthKind, TokenBins

    lengths = None
    if d["lengths"] is not None:
        x = d["lengths"]

        def bins(b: dict[str, Any]) -> TokenBins:
            return TokenBins(tuple(b["min_tokens"]), tuple(b["max_tokens"]), tuple(b["weights"]))

        lengths = LengthDistribution(LengthKind(x["kind"]), bins(x["input_bins"]), bins(x["output_bins"]),
                                     paired=x["paired"], source=x["source"], max_total_tokens=x["max_total_tokens"],
                                     refused_fraction=x["refused_fraction"])
    rate = d["request_rate_per_second"]
    return ServingLoad(request_rate_per_second=math.inf if rate is None else rate, max_concurrency=d["max_concurrency"],
                       num_requests=d["num_requests"], lengths=lengths, lengths_name=d["lengths_name"],
                       prefix_cache_hit_fraction=d["prefix_cache_hit_fraction"], poisson=d["poisson"], seed=d["seed"],
                       spec_acceptance_rate=d.get("spec_acceptance_rate"))


def plan_speculative(m: DeploymentManifest, plan: str | None = None) -> Speculative | None:
    """The plan's speculative setup, its draft spec read again from `draft_source` (bundled:<name>
    or a model file, read as a model spec and nothing else)."""
    s = getattr(m.workload, "speculative", None)
    if s is None:
        return None
    draft = None
    if s.draft_source is not None:
        src = s.draft_source
        if src.startswith(BUNDLED_PREFIX):
            src = src.removeprefix(BUNDLED_PREFIX)
            if src not in loading.bundled_names(loading.model_specs_dir()):
                raise UnknownNameError(f"no bundled model named {src!r}", source=plan,
                                       field="workload.speculative.draft_source", hint="re-plan with --speculative-model")
        draft = loading.load_model(src).spec
    return Speculative(method=SpeculativeMethod(s.method), num_speculative_tokens=s.num_speculative_tokens,
                       draft=draft, draft_source=s.draft_source, draft_hf_id=s.draft_hf_id)


def plan_layout(m: DeploymentManifest) -> Layout:
    """The plan's parallel layout as the cost model's `Layout`."""
    L = m.layout
    return Layout(
        tp=L.tp, pp=L.pp, dp=L.dp, cp=L.cp, ep=L.ep, etp=L.etp if L.ep > 1 else None, zero_stage=L.zero_stage,
        hybrid_shard=L.hybrid_shard, sequence_parallel=L.sequence_parallel, recompute=Recompute(L.recompute),
        pp_schedule=PipelineSchedule(L.pp_schedule), virtual_stages=L.virtual_stages,
        micro_batch_size=L.micro_batch_size, offload_optimizer=Offload(L.offload_optimizer),
        offload_params=Offload(L.offload_params), offload_layers=L.offload_layers,
        offload_expert_layers=L.offload_expert_layers,
        pp_embedding_as_layer=L.pp_embedding_as_layer,
        pp_loss_as_layer=L.pp_loss_as_layer, pp_first_stage_layers=L.pp_first_stage_layers,
        pp_last_stage_layers=L.pp_last_stage_layers,
    )


def plan_setting(m: DeploymentManifest, spec: ModelSpec | None = None) -> Setting:
    """What a plan's target facts read besides its layout (search/targets.py): its workload, model
    and cluster, as the manifest records them (`spec`, when it can be read, adds tied embeddings)."""
    hw, wl = m.hardware, m.workload
    base: dict = dict(
        gpus_per_node=used_gpus_per_node(hw.num_gpus, hw.gpus_per_node, hw.num_nodes), num_nodes=hw.num_nodes,
        num_layers=m.model.num_layers, kv_heads=m.model.num_kv_heads, moe=m.model.num_experts is not None,
        tied_embeddings=bool(spec is not None and spec.tie_word_embeddings), activation_dtype=wl.activation_dtype)
    if wl.kind == "training":
        return Setting(workload="training", seq_len=wl.seq_len, global_batch_size=wl.global_batch_size,
                       kv_format=wl.activation_dtype, finetune=wl.finetune, optimizer=wl.optimizer,
                       param_dtype=wl.param_dtype, master_dtype=wl.master_dtype, moment_dtype=wl.moment_dtype,
                       grad_reduce_dtype=wl.grad_reduce_dtype, **base)
    return Setting(workload="inference", weight_format=m.layout.weight_quantization or wl.quantization,
                   kv_format=m.layout.kv_cache_dtype or wl.kv_cache_dtype or wl.activation_dtype,
                   speculative=wl.speculative.method if wl.speculative is not None else "none",
                   param_dtype=wl.activation_dtype, **base)


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan file stands for, read back and checked."""

    manifest: DeploymentManifest
    source: str
    model: loading.LoadedModel
    hardware: HardwareProfile
    workload: InferenceWorkload | TrainingWorkload
    layout: Layout


def read_plan(path: Path, *, hardware_override: str | None = None) -> PlanInputs:
    """Load a manifest and everything it names; the model must still hash to the plan's."""
    m = load_manifest(path)
    source = str(path)
    return PlanInputs(manifest=m, source=source, model=checked_model(m, source),
                      hardware=plan_hardware(m, source, hardware_override), workload=plan_workload(m),
                      layout=plan_layout(m))


__all__ = ["PlanInputs", "read_plan", "source_model", "source_spec", "plan_spec", "checked_model",
           "optional_checked_spec", "matches_plan", "plan_hardware", "plan_workload", "plan_layout"]
