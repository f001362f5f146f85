"""The exporters' refusals, read from the one declaration of what each target runs
(`knowledge/targets.yaml`): a plan is refused with the first rule of its target it breaks, in
the declared order, with that rule's field, words and fix. The search reads the same rules
(`search/targets.py`), so nothing `recommend --target T` returns is refused here.

What a rule cannot say stays out of it: the model itself (knowledge/model_support.py: torchtitan's
flavors, transformers' module names, Megatron's model flags), and facts only an export needs
(the spec's largest tensor for NVMe offload, a pinned engine version's features)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from shardplan.exporters.base import ExportContext, cannot
from shardplan.knowledge.load import targets_file
from shardplan.knowledge.targets import Rule
from shardplan.plan.readback import plan_layout, plan_setting
from shardplan.plan.schema import DeploymentManifest
from shardplan.search.targets import refusal
from shardplan.specs.model import ModelSpec


def first_refusal(m: DeploymentManifest, spec: ModelSpec | None, rules: Sequence[Rule]) -> tuple[Rule, Callable[[str], Any]] | None:
    """The first of `rules` the plan breaks, with the plan's facts; None when it breaks none."""
    found = refusal([("", r) for r in rules], plan_layout(m), plan_setting(m, spec))
    return None if found is None else (found[1], found[2])


def refuse(target: str, rules: Sequence[Rule], ctx: ExportContext) -> None:
    """Raise CannotExpress (`target cannot express this plan: ...`) for the first rule broken."""
    found = first_refusal(ctx.manifest, ctx.spec, rules)
    if found is not None:
        rule, fact = found
        raise cannot(target, rule.field, rule.words(fact), rule.fix(fact))


def check(ctx: ExportContext, target: str) -> None:
    """Refuse a plan `target` cannot run, by its declared rules (and the rule sets it uses)."""
    refuse(target, targets_file().rules_of(target), ctx)


def check_rule_set(ctx: ExportContext, name: str, target: str) -> None:
    """Refuse by one shared rule set (e.g. `engine_groups`), naming `target`."""
    refuse(target, targets_file().rule_sets[name], ctx)


__all__ = ["check", "check_rule_set", "first_refusal", "refuse"]
