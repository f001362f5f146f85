"""The search's side of `knowledge/targets.yaml`: the facts of one candidate plan, and the
declared rules split by the stage of the search at which they can be checked, so that a
`--target` search builds only what that target runs (and the exporters and verify, which read
the same rules through `facts_of`, refuse nothing it returns).

Facts are computed from the layout and a `Setting` (workload, model and cluster), each by the
function of its name in FACT_TABLE, which also lists the layout fields it reads (the search
caches each stage's verdicts by them); knowledge/targets.py FACTS names the facts, with their
stage (tests/search/test_targets.py holds the lists equal and the fields complete).
Pure: no yaml, rich or typer.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from shardplan.cost.layout import Layout, Offload, layout_stage_ranges
from shardplan.cost.memo import hash_once
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.knowledge.targets import Rule
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec


@hash_once
@dataclass(frozen=True)
class Setting:
    """What the facts read besides the layout: the workload, the model and the cluster."""

    workload: str  # "inference" or "training"
    gpus_per_node: int  # GPUs the plan uses per node (all of them on a part of one node)
    num_nodes: int
    num_layers: int  # decoder layers
    kv_heads: int  # KV heads (MLA models: the query heads, as engines split them)
    moe: bool
    tied_embeddings: bool
    seq_len: int = 0  # training: tokens per sequence; serving: 0
    global_batch_size: int = 0  # training: sequences per step; serving: 0
    weight_format: str = "none"  # serving: the quantization; training: none
    kv_format: str = "bf16"  # serving: the KV cache's format, resolved; training: the activation dtype
    activation_dtype: str = "bf16"
    speculative: str = "none"  # serving: the method, or none
    finetune: str = "none"  # training: full, lora, qlora; serving: none
    optimizer: str = "none"  # training: the optimizer; serving: none
    param_dtype: str = "bf16"  # training: weights and gradients; serving: the activation dtype
    master_dtype: str = "none"  # training: the optimizer's master weights; serving: none
    moment_dtype: str = "none"  # training: the optimizer's moments; serving: none
    grad_reduce_dtype: str = "none"  # training: the main gradients (Megatron's grad_reduce_in_fp32); serving: none


def used_gpus_per_node(num_gpus: int, gpus_per_node: int, num_nodes: int) -> int:
    """GPUs a plan uses per node: a node's, or all of them on part of one node."""
    return gpus_per_node if num_nodes > 1 else min(num_gpus, gpus_per_node)


def setting(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload | TrainingWorkload) -> Setting:
    """The setting of a search over `hw` (one GPU count) for `wl`."""
    model = dict(num_layers=spec.num_layers, kv_heads=spec.num_attention_heads if spec.mla is not None else spec.kv_heads,
                 moe=spec.moe is not None, tied_embeddings=spec.tie_word_embeddings,
                 gpus_per_node=used_gpus_per_node(hw.num_gpus, hw.gpus_per_node, hw.num_nodes), num_nodes=hw.num_nodes)
    if isinstance(wl, TrainingWorkload):
        return Setting(workload="training", seq_len=wl.seq_len, global_batch_size=wl.global_batch_size,
                       kv_format=wl.activation_dtype.value, activation_dtype=wl.activation_dtype.value,
                       finetune=wl.finetune.value, optimizer=wl.optimizer.value, param_dtype=wl.param_dtype.value,
                       master_dtype=wl.master_dtype.value, moment_dtype=wl.moment_dtype.value,
                       grad_reduce_dtype=wl.grad_reduce_dtype.value, **model)
    act = wl.activation_dtype.value
    return Setting(workload="inference", weight_format=wl.quantization.value,
                   kv_format=(wl.kv_cache_dtype or wl.activation_dtype).value, activation_dtype=act,
                   speculative=wl.speculative.method.value if wl.speculative is not None else "none",
                   param_dtype=act, **model)


# ----- the facts ----------------------------------------------------------------------------

Fact = Callable[[Layout, Setting], Any]


def _group_size(L: Layout, s: Setting) -> int:
    return L.ep * L.expert_tp


def _group_whole(L: Layout, s: Setting) -> bool:
    size = _group_size(L, s)
    return s.workload != "inference" or size <= L.tp or size % L.tp == 0


def _group_replicas(L: Layout, s: Setting) -> int:
    size = _group_size(L, s)
    return max(1, size // L.tp) if s.workload == "inference" and size > L.tp else 1


def _replica_nodes(L: Layout, s: Setting) -> int:
    return max(1, math.ceil(L.tp * L.pp * L.cp * _group_replicas(L, s) / s.gpus_per_node))


def _replicas_tile_nodes(L: Layout, s: Setting) -> bool:
    g, r = s.gpus_per_node, L.tp * L.pp * L.cp
    return r <= g and g % r == 0 and (_group_replicas(L, s) * r) % g == 0


def _ep_on_inner_mesh_axes(L: Layout, s: Setting) -> bool:
    """ep is the product of the innermost axes of the mesh (tensor, then context, then data)."""
    prod = 1
    for size in (L.tp, L.cp, L.dp):
        if prod == L.ep:
            break
        prod *= size
    return prod == L.ep


def _num_microbatches(L: Layout, s: Setting) -> int:
    return s.global_batch_size // (L.dp * L.micro_batch_size) if s.workload == "training" else 1


def _empty_chunk(L: Layout, s: Setting) -> bool:
    if L.pp == 1:
        return False
    return min(len(r) for chunks in layout_stage_ranges(s.num_layers, L) for r in chunks) == 0


_OFFLOAD_CHOICES = {
    (Offload.NONE, Offload.NONE): "none", (Offload.CPU, Offload.NONE): "optimizer-cpu",
    (Offload.NVME, Offload.NONE): "optimizer-nvme", (Offload.CPU, Offload.CPU): "all-cpu",
    (Offload.NVME, Offload.NVME): "all-nvme", (Offload.NONE, Offload.CPU): "params-cpu",
    (Offload.NONE, Offload.NVME): "params-nvme",
}


def _offload(L: Layout, s: Setting) -> str:
    pair = (L.offload_optimizer, L.offload_params)
    return _OFFLOAD_CHOICES.get(pair, f"optimizer-{pair[0].value} params-{pair[1].value}")


_EXPERTS = ("tp", "ep", "etp")
_SPLIT = ("pp", "virtual_stages", "pp_embedding_as_layer", "pp_loss_as_layer", "pp_first_stage_layers",
          "pp_last_stage_layers")

# fact -> (the Layout fields it reads, besides the Setting; how it is computed). The fields key the
# search's caches: two layouts that agree on them have the same fact (tests/search/test_targets.py).
FACT_TABLE: dict[str, tuple[tuple[str, ...], Fact]] = {
    "workload": ((), lambda L, s: s.workload),
    "moe": ((), lambda L, s: s.moe),
    "tied_embeddings": ((), lambda L, s: s.tied_embeddings),
    "weight_format": ((), lambda L, s: s.weight_format),
    "kv_format": ((), lambda L, s: s.kv_format),
    "activation_dtype": ((), lambda L, s: s.activation_dtype),
    "speculative": ((), lambda L, s: s.speculative),
    "finetune": ((), lambda L, s: s.finetune),
    "optimizer": ((), lambda L, s: s.optimizer),
    "param_dtype": ((), lambda L, s: s.param_dtype),
    "master_dtype": ((), lambda L, s: s.master_dtype),
    "moment_dtype": ((), lambda L, s: s.moment_dtype),
    "optimizer_dtypes": ((), lambda L, s: f"{s.master_dtype}/{s.moment_dtype}"),
    "grad_reduce_dtype": ((), lambda L, s: s.grad_reduce_dtype),
    "seq_len": ((), lambda L, s: s.seq_len),
    "tp": (("tp",), lambda L, s: L.tp),
    "pp": (("pp",), lambda L, s: L.pp),
    "dp": (("dp",), lambda L, s: L.dp),
    "cp": (("cp",), lambda L, s: L.cp),
    "ep": (("ep",), lambda L, s: L.ep),
    "etp": (_EXPERTS, lambda L, s: L.expert_tp),
    "num_nodes": ((), lambda L, s: s.num_nodes),
    "gpus_per_node": ((), lambda L, s: s.gpus_per_node),
    "model_parallel": (("tp", "pp", "cp"), lambda L, s: L.tp * L.pp * L.cp),
    "zero_ranks": (("dp", "cp"), lambda L, s: L.dp * L.cp),
    "tp_within_node": (("tp",), lambda L, s: L.tp <= s.gpus_per_node),
    "tp_within_kv_heads": (("tp",), lambda L, s: L.tp <= s.kv_heads),
    "expert_group_size": (_EXPERTS, _group_size),
    "expert_group_whole": (_EXPERTS, _group_whole),
    "expert_group_replicas": (_EXPERTS, _group_replicas),
    "experts_split_by_tp": (_EXPERTS, lambda L, s: L.expert_tp == L.tp),
    "ep_in_tp_units": (("tp", "ep"), lambda L, s: L.ep // L.tp if L.ep % L.tp == 0 else 0),
    "ep_on_inner_mesh_axes": (("tp", "cp", "dp", "ep"), _ep_on_inner_mesh_axes),
    "replica_nodes": (("pp", "cp", *_EXPERTS), _replica_nodes),
    "replicas_tile_nodes": (("pp", "cp", *_EXPERTS), _replicas_tile_nodes),
    "cp_chunks": (("cp",), lambda L, s: 2 * L.cp),
    "seq_len_splits_over_cp": (("cp",), lambda L, s: s.workload != "training" or L.cp == 1 or s.seq_len % (2 * L.cp) == 0),
    "micro_batch_size": (("micro_batch_size",), lambda L, s: L.micro_batch_size),
    "num_microbatches": (("dp", "micro_batch_size"), _num_microbatches),
    "microbatches_fill_stages": (("dp", "micro_batch_size", "pp"), lambda L, s: _num_microbatches(L, s) >= L.pp),
    "virtual_stages": (("virtual_stages",), lambda L, s: L.virtual_stages),
    "pp_schedule": (("pp_schedule",), lambda L, s: L.pp_schedule.value),
    "empty_pipeline_chunk": (_SPLIT, _empty_chunk),
    "sequence_parallel": (("sequence_parallel",), lambda L, s: L.sequence_parallel),
    "recompute": (("recompute",), lambda L, s: L.recompute.value),
    "zero_stage": (("zero_stage",), lambda L, s: L.zero_stage),
    "hybrid_shard": (("hybrid_shard",), lambda L, s: L.hybrid_shard),
    "offload_optimizer": (("offload_optimizer",), lambda L, s: L.offload_optimizer.value),
    "offload_params": (("offload_params",), lambda L, s: L.offload_params.value),
    "offload": (("offload_optimizer", "offload_params"), _offload),
    "offload_layers": (("offload_layers",), lambda L, s: L.offload_layers),
    "offload_expert_layers": (("offload_expert_layers",), lambda L, s: L.offload_expert_layers),
}
FACT_FUNCTIONS: dict[str, Fact] = {name: fn for name, (_, fn) in FACT_TABLE.items()}


def fields_read(rules: Iterable[tuple[str, Rule]]) -> tuple[str, ...]:
    """The Layout fields the facts of `rules` read (what their verdict on a layout depends on)."""
    return tuple(sorted({f for _, r in rules for fact in r.facts for f in FACT_TABLE[fact][0]}))


def facts_of(layout: Layout, s: Setting) -> Callable[[str], Any]:
    """The facts of one plan, each computed once when a rule first reads it."""
    known: dict[str, Any] = {}

    def fact(name: str) -> Any:
        if name not in known:
            known[name] = FACT_FUNCTIONS[name](layout, s)
        return known[name]

    return fact


# ----- rules by stage -------------------------------------------------------------------------

Labelled = tuple[tuple[str, Rule], ...]  # (label refusals are counted under, rule), in order


@hash_once
@dataclass(frozen=True)
class TargetRules:
    """The rules one search holds, by the stage at which the search checks them: `early` (the
    workload, the model and the degrees), then `pipeline` (micro-batch, virtual stages,
    schedule), `sequence_parallel`, `recompute` and `state` (ZeRO, hybrid sharding, offload)."""

    name: str  # what it is for: a target ("vllm") or a stack's runtime ("torchtitan stack")
    early: Labelled = ()
    pipeline: Labelled = ()
    sequence_parallel: Labelled = ()
    recompute: Labelled = ()
    state: Labelled = ()

    @property
    def all(self) -> Labelled:
        return (*self.early, *self.pipeline, *self.sequence_parallel, *self.recompute, *self.state)


def target_rules(name: str, labelled: Iterable[tuple[str, Rule]]) -> TargetRules:
    """Rules (label, rule), each filed under the stage of the latest fact it reads; a rule given
    twice (a rule set two sources use) is kept once, under its first label."""
    by: dict[str, list[tuple[str, Rule]]] = {k: [] for k in ("early", "pipeline", "sequence_parallel", "recompute", "state")}
    seen: set[Rule] = set()
    for label, rule in labelled:
        if rule in seen:
            continue
        seen.add(rule)
        stage = rule.stage
        by["early" if stage in ("fixed", "degrees") else stage].append((label, rule))
    return TargetRules(name=name, **{k: tuple(v) for k, v in by.items()})


def refusal(rules: Sequence[tuple[str, Rule]], layout: Layout, s: Setting) -> tuple[str, Rule, Callable[[str], Any]] | None:
    """The first rule that refuses the plan: (its label, the rule, the plan's facts); None: none does."""
    if not rules:
        return None
    fact = facts_of(layout, s)
    for label, rule in rules:
        if rule.refuses(fact):
            return label, rule, fact
    return None


@dataclass
class Admission:
    """One search's (one GPU count's) view of the rules: each stage's verdicts cached by the
    layout fields its rules read (`fields_read`), and the refusals counted by label (each
    distinct verdict once)."""

    rules: TargetRules
    setting: Setting
    refused: Counter = field(default_factory=Counter)
    _cache: dict = field(default_factory=dict)
    _fields: dict = field(default_factory=dict)

    def _first(self, stage: str, rules: Labelled, base: Layout, changes: dict[str, Any]) -> str | None:
        """The label of the first of `rules` that refuses `base` with `changes`, or None; cached by
        the values of the fields the rules read, so the layout is built only for a new verdict."""
        if stage not in self._fields:
            self._fields[stage] = fields_read(rules)
        values = base.__dict__
        key = (stage, *(changes[f] if f in changes else values[f] for f in self._fields[stage]))
        if key in self._cache:
            return self._cache[key]
        found = refusal(rules, _with(base, **changes) if changes else base, self.setting)
        label = self._cache[key] = None if found is None else found[0]
        if label is not None:
            self.refused[label] += 1
        return label

    def early(self, layout: Layout) -> str | None:
        """The label of the first workload, model or degree rule that refuses `layout`, or None."""
        found = refusal(self.rules.early, layout, self.setting)
        return None if found is None else found[0]

    def pipelines(self, deg: Layout, mbs: int, pipes: tuple[tuple[int, Any], ...]) -> tuple[tuple[int, Any], ...]:
        """The (virtual stages, schedule) pairs of one micro-batch size the rules admit."""
        rules = self.rules.pipeline
        if not rules:
            return pipes
        key = ("pipes", deg, mbs, pipes)  # asked again by the count, the bound and the expansion
        if key not in self._cache:
            self._cache[key] = tuple(p for p in pipes if self._first(
                "pipeline", rules, deg, {"micro_batch_size": mbs, "virtual_stages": p[0], "pp_schedule": p[1]}) is None)
        return self._cache[key]

    def flags(self, deg: Layout, sps: list[bool], rcs: list[Any]) -> tuple[list[bool], list[Any]]:
        """The sequence-parallel and recompute choices the rules admit."""
        if self.rules.sequence_parallel:
            sps = [sp for sp in sps if self._first("sp", self.rules.sequence_parallel, deg,
                                                   {"sequence_parallel": sp}) is None]
        if self.rules.recompute:
            rcs = [rc for rc in rcs if self._first("rc", self.rules.recompute, deg, {"recompute": rc}) is None]
        return sps, rcs

    def state(self, layout: Layout) -> bool:
        """Whether the rules admit the ZeRO stage, hybrid sharding and offload of `layout`."""
        return not self.rules.state or self._first("state", self.rules.state, layout, {}) is None


def _with(layout: Layout, **changes: Any) -> Layout:
    """`dataclasses.replace` without `__init__` (the search's hot loops pass values of the fields' types)."""
    new = object.__new__(Layout)
    new.__dict__.update(layout.__dict__, **changes)
    return new


def serving_refusal(rules: TargetRules | None, spec: ModelSpec, hw: HardwareProfile, layout: Layout,
                    wl: InferenceWorkload) -> str | None:
    """The label of the first rule that refuses a serving replica (every stage at once), or None."""
    if rules is None:
        return None
    found = refusal(rules.all, layout, setting(spec, hw, wl))
    return None if found is None else found[0]


__all__ = ["FACT_FUNCTIONS", "FACT_TABLE", "Admission", "fields_read", "Setting", "TargetRules", "facts_of", "refusal", "serving_refusal",
           "setting", "target_rules", "used_gpus_per_node"]
