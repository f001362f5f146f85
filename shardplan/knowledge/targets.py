"""What each deployment target can run: the schema of `knowledge/targets.yaml`.

A target (vLLM, DeepSpeed, torchtitan, ...) is declared once, as rules over named facts of a
plan ("pp > 1 needs ZeRO 0-1", "no expert parallelism"), each rule with the exporter field it
refuses, the words, the fix and its source. Both the search (`search/targets.py`, which narrows
the space to what a `--target` runs) and the exporters' refusals (`exporters/targets.py`) and
verify's up-front checks read these rules, so they cannot drift apart.

A rule: when every `when` condition holds, every `require` condition must hold, else the rule
refuses the plan. A condition is a fact and either a list of allowed values or a comparison
with a number ("> 1", "<= 1"). Facts are named in FACTS below, with the stage of the search at
which they are known (a rule is checked as soon as all its facts are): `fixed` (the workload
and the model, the same for every candidate), `degrees`, then one of `pipeline`,
`sequence_parallel`, `recompute` or `state` (a rule may read at most one of these four, so that
each stage of the training search is filtered on its own).

Pure: pydantic only (no yaml, rich, typer, torch); `knowledge.load` reads the file.
"""

from __future__ import annotations

import re
import string
from typing import Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# fact -> (stage, meaning). search/targets.py computes each one (a test holds the two lists equal).
FACTS: dict[str, tuple[str, str]] = {
    "workload": ("fixed", "inference or training"),
    "moe": ("fixed", "the model has routed experts"),
    "tied_embeddings": ("fixed", "the lm_head is the token embedding"),
    "weight_format": ("fixed", "serving weight format (none, fp8, int8, int4, awq, gptq, nf4, q4_k_m, ...); training: none"),
    "kv_format": ("fixed", "serving KV-cache format, resolved (bf16, fp16, fp8, ...); training: the activation dtype"),
    "activation_dtype": ("fixed", "activation (and unquantized weight) format"),
    "speculative": ("fixed", "speculative decoding method (draft_model, mtp, ngram) or none"),
    "finetune": ("fixed", "training: full, lora or qlora; serving: none"),
    "optimizer": ("fixed", "training: the optimizer (adamw, adam, sgd, adamw8bit); serving: none"),
    "param_dtype": ("fixed", "training: weight and gradient format; serving: the activation dtype"),
    "master_dtype": ("fixed", "training: the optimizer's master weights (fp32, bf16); serving: none"),
    "moment_dtype": ("fixed", "training: the optimizer's moments (fp32, bf16); serving: none"),
    "optimizer_dtypes": ("fixed", "training: master/moments dtypes, e.g. fp32/fp32, bf16/bf16; serving: none"),
    "grad_reduce_dtype": ("fixed", "training: the main gradients (fp32; bf16: Megatron's --grad-reduce-in-bf16); serving: none"),
    "seq_len": ("fixed", "training: tokens per sequence; serving: 0"),
    "tp": ("degrees", "tensor-parallel degree"),
    "pp": ("degrees", "pipeline stages"),
    "dp": ("degrees", "data-parallel degree (serving: replicas)"),
    "cp": ("degrees", "context-parallel degree"),
    "ep": ("degrees", "expert-parallel degree"),
    "etp": ("degrees", "tensor-parallel degree inside each expert (resolved: tp without ep, else 1 unless set)"),
    "num_nodes": ("degrees", "nodes of the plan"),
    "gpus_per_node": ("degrees", "GPUs the plan uses per node"),
    "model_parallel": ("degrees", "tp x pp x cp: GPUs of one model copy"),
    "zero_ranks": ("degrees", "dp x cp: the ranks ZeRO shards model states over"),
    "tp_within_node": ("degrees", "tp <= GPUs per node"),
    "tp_within_kv_heads": ("degrees", "tp <= the KV heads (no replicated KV heads)"),
    "expert_group_size": ("degrees", "ep x etp: ranks of one expert group"),
    "expert_group_whole": ("degrees", "serving: an expert group wider than tp is a whole number of replicas"),
    "expert_group_replicas": ("degrees", "serving: replicas one expert group spans (ep x etp / tp, at least 1)"),
    "experts_split_by_tp": ("degrees", "etp = tp: each expert split like the dense layers"),
    "ep_in_tp_units": ("degrees", "ep / tp when tp divides ep, else 0"),
    "ep_on_inner_mesh_axes": ("degrees", "ep is tp, tp x cp or tp x cp x dp (the innermost mesh axes)"),
    "replica_nodes": ("degrees", "nodes one engine process group spans (a replica, or a dp x ep group)"),
    "replicas_tile_nodes": ("degrees", "a replica fits a node, and a node and an expert group are whole numbers of replicas"),
    "cp_chunks": ("degrees", "2 x cp: the chunks context parallelism cuts a sequence into (a head and a tail per rank)"),
    "seq_len_splits_over_cp": ("degrees", "training: the sequence splits into 2 x cp equal chunks"),
    "micro_batch_size": ("pipeline", "training: sequences per micro-batch"),
    "num_microbatches": ("pipeline", "training: micro-batches per step and data-parallel rank"),
    "microbatches_fill_stages": ("pipeline", "training: at least as many micro-batches as pipeline stages"),
    "virtual_stages": ("pipeline", "model chunks per pipeline stage"),
    "pp_schedule": ("pipeline", "pipeline schedule: 1f1b, gpipe or interleaved"),
    "empty_pipeline_chunk": ("pipeline", "some pipeline chunk holds no decoder layer (only the embedding or loss)"),
    "sequence_parallel": ("sequence_parallel", "Megatron sequence parallelism"),
    "recompute": ("recompute", "activation recomputation: none, selective or full"),
    "zero_stage": ("state", "ZeRO stage 0-3"),
    "hybrid_shard": ("state", "ZeRO/FSDP shards within a node only"),
    "offload_optimizer": ("state", "where optimizer states live off the GPU: none, cpu, nvme"),
    "offload_params": ("state", "where parameters live off the GPU: none, cpu, nvme"),
    "offload": ("state", "the --offload choice: none, optimizer-cpu, optimizer-nvme, all-cpu, all-nvme, "
                         "params-cpu or params-nvme (serving weight offload)"),
    "offload_layers": ("state", "serving: decoder layers whose weights live off the GPU"),
    "offload_expert_layers": ("state", "serving: MoE layers whose routed experts live in host memory (llama.cpp --n-cpu-moe)"),
}
STAGES = ("fixed", "degrees", "pipeline", "sequence_parallel", "recompute", "state")
WORKLOADS = ("inference", "training")

Value = Union[bool, int, str]
FactGetter = Callable[[str], object]  # fact name -> its value for one plan
_COMPARISON = re.compile(r"^\s*(==|!=|<=|>=|<|>)\s*(-?\d+)\s*$")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class Condition(Frozen):
    """One fact's test: `values` (one of them) or `op number`."""

    fact: str
    values: tuple[Value, ...] | None = None
    op: Literal["==", "!=", "<=", ">=", "<", ">"] | None = None
    number: int | None = None

    def holds(self, value: object) -> bool:
        if self.values is not None:  # True is not 1 here: a fact's type is the values' type
            return any(value == v and type(value) is type(v) for v in self.values)
        if not isinstance(value, int) or isinstance(value, bool) or self.number is None:
            return False
        n = self.number
        return {"==": value == n, "!=": value != n, "<=": value <= n, ">=": value >= n, "<": value < n,
                ">": value > n}[self.op or "=="]


def _conditions(raw: dict[str, object], where: str) -> tuple[Condition, ...]:
    out = []
    for fact, spec in raw.items():
        if fact not in FACTS:
            raise ValueError(f"{where}: unknown fact '{fact}' (known: {', '.join(FACTS)})")
        if isinstance(spec, list) and spec and all(isinstance(v, (bool, int, str)) for v in spec):
            out.append(Condition(fact=fact, values=tuple(spec)))
            continue
        m = _COMPARISON.match(spec) if isinstance(spec, str) else None
        if m is None:
            raise ValueError(f"{where}: '{fact}' takes a list of values or a comparison such as '> 1', not {spec!r}")
        out.append(Condition(fact=fact, op=m.group(1), number=int(m.group(2))))  # type: ignore[arg-type]
    return tuple(out)


class Rule(Frozen):
    """When every `when` condition holds, every `require` condition must; else the plan is refused
    with `field`, the words `says` (facts in braces are filled in) and the fix `hint`."""

    id: str = Field(min_length=1, description="a short name, what the search counts refusals by")
    when: tuple[Condition, ...] = Field((), description="fact -> values or comparison; empty: always")
    require: tuple[Condition, ...] = Field(min_length=1, description="fact -> values or comparison")
    field: str = Field(description="the manifest field a refusal names (layout.pp, workload.speculative, ...)")
    says: str = Field(description="what the target cannot do, in words; {fact} is replaced by its value")
    hint: str = Field(description="the fix ({fact} as in `says`)")
    source: str = Field(min_length=1, description="where the rule comes from (the engine's code or docs, at a tag)")

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, data: object) -> object:
        if isinstance(data, dict):
            data = dict(data)
            where = f"rule {data.get('id', '?')}"
            for key in ("when", "require"):
                raw = data.get(key, {})
                if isinstance(raw, dict):
                    data[key] = _conditions(raw, where)
        return data

    @field_validator("says", "hint")
    @classmethod
    def _placeholders_are_facts(cls, text: str) -> str:
        for _, name, _, _ in string.Formatter().parse(text):
            if name is not None and name not in FACTS:
                raise ValueError(f"'{{{name}}}' is not a fact (known: {', '.join(FACTS)})")
        return text

    @model_validator(mode="after")
    def _one_late_stage(self) -> "Rule":
        if len(self.late_stages) > 1:
            raise ValueError(f"rule {self.id} reads facts of {' and '.join(self.late_stages)}: a rule may read at "
                             "most one of pipeline, sequence_parallel, recompute and state facts (split it)")
        return self

    @property
    def facts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.fact for c in (*self.when, *self.require)))

    @property
    def late_stages(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(FACTS[f][0] for f in self.facts if FACTS[f][0] not in ("fixed", "degrees")))

    @property
    def stage(self) -> str:
        """When the search can check it: the latest stage of its facts."""
        stages = [FACTS[f][0] for f in self.facts]
        return max(stages, key=STAGES.index)

    def refuses(self, fact: FactGetter) -> bool:
        return all(c.holds(fact(c.fact)) for c in self.when) and not all(c.holds(fact(c.fact)) for c in self.require)

    def words(self, fact: FactGetter) -> str:
        """`says` with the plan's facts filled in."""
        return _filled(self.says, fact)

    def fix(self, fact: FactGetter) -> str:
        """`hint` with the plan's facts filled in."""
        return _filled(self.hint, fact)


def _filled(text: str, fact: FactGetter) -> str:
    names = [n for _, n, _, _ in string.Formatter().parse(text) if n]
    return text.format(**{n: _shown(fact(n)) for n in names})


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class Target(Frozen):
    """One deployment target: what it runs and the rules that say so."""

    summary: str = Field(description="what it is, in words")
    workloads: tuple[Literal["inference", "training"], ...] = Field(min_length=1, description="what it runs")
    exports: tuple[str, ...] = Field(min_length=1, description="`export --to` names that launch it "
                                     "(`recommend --export X` implies the target whose list has X for the workload)")
    engine: str | None = Field(None, description="serving: the engine whose rules size its plans (--engine)")
    stack: str | None = Field(None, description="training: the stack whose rules size its plans (--stack)")
    uses: tuple[str, ...] = Field((), description="shared rule sets it also holds (rule_sets)")
    rules: tuple[Rule, ...] = Field((), description="its own rules, in the order its exporter checks them")


class StackTarget(Frozen):
    """The target that runs a training stack, whose rules are the stack's capabilities."""

    target: str = Field(description="the target's name (under targets)")
    exporter_only: tuple[str, ...] = Field((), description="ids of that target's rules that say what its exporter "
                                           "writes, not what the stack offers (left out of the capabilities)")


class TargetsFile(Frozen):
    """`knowledge/targets.yaml`."""

    rule_sets: dict[str, tuple[Rule, ...]] = Field(description="named rules several targets share")
    always: tuple[str, ...] = Field(description="rule sets every --target search also holds (what `verify` checks "
                                    "before it runs a plan), lifted for a model verify cannot build at all")
    stacks: dict[str, tuple[str, ...]] = Field(description="training stack -> rule sets of how it runs, held "
                                               "without --target too")
    targets: dict[str, Target] = Field(description="target name -> what it runs")
    stack_targets: dict[str, StackTarget] = Field(default_factory=dict, description=(
        "training stack -> the target that runs it as its users do: that target's training rules are the stack's "
        "capabilities (what it offers of ZeRO, sequence, pipeline, context and expert parallelism, recompute, "
        "schedules, offload), held by every search sized with the stack, without --target too"))

    @model_validator(mode="after")
    def _names_resolve(self) -> "TargetsFile":
        for where, names in [("always", self.always), *((f"stacks.{s}", n) for s, n in self.stacks.items()),
                             *((f"targets.{t}.uses", v.uses) for t, v in self.targets.items())]:
            for n in names:
                if n not in self.rule_sets:
                    raise ValueError(f"{where}: no rule set named '{n}' (known: {', '.join(self.rule_sets)})")
        for stack, st in self.stack_targets.items():
            t = self.targets.get(st.target)
            if t is None or t.stack != stack or "training" not in t.workloads:
                raise ValueError(f"stack_targets.{stack}: '{st.target}' is not a training target whose stack is {stack}")
            ids = {r.id for r in self.rules_of(st.target)}
            for rid in st.exporter_only:
                if rid not in ids:
                    raise ValueError(f"stack_targets.{stack}.exporter_only: {st.target} has no rule '{rid}'")
        return self

    def stack_capabilities(self, stack: str) -> tuple[Rule, ...]:
        """The rules a search sized with `stack` holds: its runtime rule sets (`stacks`), then the
        rules of the target that runs it (`stack_targets`), rule sets it uses first."""
        own = tuple(r for name in self.stacks.get(stack, ()) for r in self.rule_sets[name])
        st = self.stack_targets.get(stack)
        if st is None:
            return own
        return own + tuple(r for r in self.rules_of(st.target) if r.id not in st.exporter_only)

    def rules_of(self, target: str) -> tuple[Rule, ...]:
        """The rules of the rule sets a target uses, then its own: the order its exporter checks them."""
        t = self.targets[target]
        return (*(r for name in t.uses for r in self.rule_sets[name]), *t.rules)

    def target_for_export(self, export: str, workload: str) -> str | None:
        """The target an `export --to` name launches for a workload: the first whose `exports` lists it."""
        return next((n for n, t in self.targets.items() if export in t.exports and workload in t.workloads), None)


__all__ = ["FACTS", "STAGES", "WORKLOADS", "Condition", "Rule", "StackTarget", "Target", "TargetsFile"]
