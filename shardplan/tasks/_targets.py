"""`--target` for recommend, capacity and replan (knowledge/targets.yaml): the rules a search
holds, the up-front checks that the target can run the model and the workload at all, and
which targets run a plan (`runs_on`). Shared by the tasks; not a task itself.

With a target the search holds its rules, the rule sets it uses, and what `verify` runs (the
`always` sets) unless verify cannot build the model at all; verify's limits on the workload
itself (LoRA, 8-bit AdamW) narrow nothing, as no layout changes them. Without a target a
training search holds the runtime rules of its stack (`stacks`: torchtitan's torch pipelining)."""

from __future__ import annotations

from typing import Iterable

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import ShardplanError
from shardplan.knowledge import model_support
from shardplan.knowledge.load import targets_file
from shardplan.knowledge.targets import Rule
from shardplan.search.targets import TargetRules, refusal, setting, target_rules
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec

Workload = InferenceWorkload | TrainingWorkload


def _kind(wl: Workload) -> str:
    return "training" if isinstance(wl, TrainingWorkload) else "inference"


def known(target: str) -> None:
    """An unknown target is a one-line error naming --target and the valid values."""
    names = list(targets_file().targets)
    if target not in names:
        raise ShardplanError(f"unknown target '{target}'", field="--target", hint=f"choose one of {', '.join(names)}")


def verify_builds(spec: ModelSpec) -> bool:
    """Whether verify's model can be built for `spec` at all (its layout limits apply only then)."""
    return model_support.verify(spec) is None


def model_refusal(target: str, spec: ModelSpec) -> model_support.ModelRefusal | None:
    """Why `target` cannot build this model whatever the layout (what its exporter refuses; for
    fsdp, verify's model), or None (knowledge/model_support.py)."""
    return model_support.model_refusal(target, spec)


def _labelled(target: str, spec: ModelSpec) -> list[tuple[str, Rule]]:
    f = targets_file()
    out = [(f"{target}: {r.id}", r) for r in f.rules_of(target)]
    if verify_builds(spec):
        out += [(f"verify: {r.id}", r) for name in f.always for r in f.rule_sets[name] if r.stage != "fixed"]
    return out


def check_target(target: str, spec: ModelSpec, hw: HardwareProfile, wl: Workload, *, plan: str | None = None) -> None:
    """Refuse up front, one line naming --target, what no layout can fix: a workload the target
    does not run, a model it cannot build, the engine or stack of another target, and its rules
    on the workload itself (speculative decoding on llama.cpp, LoRA on Megatron, ...). `plan`:
    the workload is that plan's (replan), whose engine or stack cannot be changed here."""
    known(target)
    t = targets_file().targets[target]
    kind = _kind(wl)
    if kind not in t.workloads:
        others = [n for n, x in targets_file().targets.items() if kind in x.workloads]
        raise ShardplanError(f"{target} runs {' and '.join(t.workloads)}, not {kind}", field="--target",
                             hint=f"for {kind} use one of {', '.join(others)}")
    ours = t.engine if isinstance(wl, InferenceWorkload) else t.stack
    theirs = wl.engine if isinstance(wl, InferenceWorkload) else wl.stack
    if ours is not None and theirs is not None and theirs != ours:
        option = "--engine" if isinstance(wl, InferenceWorkload) else "--stack"
        if plan is not None:
            raise ShardplanError(f"{plan} was sized with {theirs}'s rules, and --target {target} plans with {ours}'s",
                                 field="--target", hint=f"plan afresh with shardplan recommend --target {target}")
        raise ShardplanError(f"--target {target} plans with {ours}'s rules, and the workload is {theirs}'s",
                             field=option, hint=f"drop {option}, or give {option} {ours}")
    found = model_refusal(target, spec)
    if found is not None:
        raise ShardplanError(f"{target} cannot build this model: {found.says}", field="--target", hint=found.hint)
    fixed = [(label, r) for label, r in _labelled(target, spec) if r.stage == "fixed"]
    hit = refusal(fixed, Layout(), setting(spec, hw, wl))
    if hit is not None:
        _, rule, fact = hit
        raise ShardplanError(f"{target} cannot run this workload: {rule.words(fact)}", field="--target",
                             hint=rule.fix(fact))


def engine_label(workload: InferenceWorkload) -> str:
    """'vLLM 0.21.0' from the workload's engine fields (display name as the knowledge file gives it)."""
    from shardplan.knowledge.load import engine_file

    return f"{engine_file(workload.engine).display_name} {workload.engine_version}"


# Engines whose target's layout rules are the engine's own limits (no pipeline stages in TGI, one split
# at a time in llama.cpp, ...): a layout they refuse cannot run on the engine, whatever the export.
ENGINE_TARGETS = {"tgi": "tgi", "llamacpp": "llamacpp"}
# Of those targets' layout rules, the ones that are the engine's (not its export's): TGI shards with
# tensor parallelism on one node only; llama.cpp has no expert or context parallelism and splits a
# model one way (knowledge/targets.yaml, each with its source).
ENGINE_LAYOUT_RULES = {"tgi": {"pipeline stages", "expert parallelism", "shards across nodes"},
                       "llamacpp": {"expert parallelism", "context parallelism", "tensor and pipeline splits together"}}


def engine_layout_rules(spec: ModelSpec, wl: InferenceWorkload) -> list[tuple[str, Rule]]:
    """The rules on the layout (`layout.*` fields) of the target that is the serving engine itself
    (ENGINE_TARGETS); empty for the other engines."""
    target = ENGINE_TARGETS.get(wl.engine)
    if target is None:
        return []
    return [(label, r) for label, r in _labelled(target, spec)
            if r.field.split(".")[0] == "layout" and r.id in ENGINE_LAYOUT_RULES[target]]


def engine_refuses(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload) -> bool:
    """Whether the serving engine cannot run `layout` (`engine_layout_rules`)."""
    rules = engine_layout_rules(spec, wl)
    return bool(rules) and refusal(rules, layout, setting(spec, hw, wl)) is not None


def check_engine_layout(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload) -> None:
    """Refuse, one line naming the layout option, a serving layout the workload's engine cannot run
    (`estimate --engine tgi --pp 2`); the search holds the same rules (`search_rules`)."""
    layout_rules = engine_layout_rules(spec, wl)
    if not layout_rules:
        return
    hit = refusal(layout_rules, layout, setting(spec, hw, wl))
    if hit is not None:
        _, rule, fact = hit
        option = rule.field.partition(".")[2].replace("_", "-")
        raise ShardplanError(f"{rule.words(fact)}", field=f"--{option}" if option else "--tp/--pp", hint=rule.fix(fact))


def search_rules(target: str | None, spec: ModelSpec, wl: Workload) -> TargetRules | None:
    """What a search holds: the target's rules (and verify's), or without one the runtime rules
    of the training stack or the layout rules of the serving engine (`engine_layout_rules`); None
    when there are none."""
    f = targets_file()
    if target is not None:
        known(target)
        return target_rules(target, _labelled(target, spec))
    if isinstance(wl, InferenceWorkload):
        layout_rules = engine_layout_rules(spec, wl)
        return target_rules(f"{wl.engine} engine", layout_rules) if layout_rules else None
    stack = wl.stack if isinstance(wl, TrainingWorkload) else None
    seen: set[int] = set()
    labelled = []
    for r in f.stack_capabilities(stack) if stack else ():
        if id(r) not in seen:  # a rule set both listed and used by the stack's target counts once
            seen.add(id(r))
            labelled.append((f"{stack} stack: {r.id}", r))
    return target_rules(f"{stack} stack", labelled) if labelled else None


def workload_refused(rules: TargetRules | None, spec: ModelSpec, hw: HardwareProfile, wl: Workload) -> bool:
    """Whether `rules` refuse the workload itself, whatever the layout (a weight format the target
    does not load)."""
    if rules is None:
        return False
    fixed = [(label, r) for label, r in rules.early if r.stage == "fixed"]
    return refusal(fixed, Layout(), setting(spec, hw, wl)) is not None


class RunsOn:
    """Which targets run a plan of one model: those that build the model and whose rules (and
    the rule sets they use) the plan keeps, as their exporters would check them."""

    def __init__(self, spec: ModelSpec, targets: Iterable[str] | None = None) -> None:
        self.spec = spec
        f = targets_file()
        names = list(targets) if targets is not None else list(f.targets)
        self._rules = {n: tuple((n, r) for r in f.rules_of(n)) for n in names if model_refusal(n, spec) is None}

    def of(self, hw: HardwareProfile, layout: Layout, wl: Workload) -> list[str]:
        f = targets_file()
        s = setting(self.spec, hw, wl)
        return [n for n, rules in self._rules.items()
                if _kind(wl) in f.targets[n].workloads and refusal(rules, layout, s) is None]


def target_for_export(export: str, wl: Workload) -> str | None:
    """The target `recommend --export X` implies for the workload (None: X launches none)."""
    return targets_file().target_for_export(export, _kind(wl))


__all__ = ["RunsOn", "check_target", "known", "model_refusal", "search_rules", "target_for_export",
           "verify_builds", "workload_refused"]
