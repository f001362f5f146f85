"""A serving plan whose expert group spans replicas (DP attention + EP) says that the engines align
their steps and that shardplan steps them together under traffic (docs/research/dp-attention-groups.md);
plans whose replicas are independent say nothing of it."""

from __future__ import annotations

import pytest

from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload
from shardplan.search.space import topology
from shardplan.specs.loading import load_hardware, load_model

H100x8 = topology(load_hardware("h100-sxm-80gb"), 8)


def _notes(model: str, layout: Layout) -> list[str]:
    report = estimate(load_model(model).spec, H100x8, layout, InferenceWorkload(max_model_len=8192))
    return [a for a in report.assumptions if "expert group" in a]


@pytest.mark.parametrize("layout,replicas", [(Layout(tp=1, dp=8, ep=8), 8), (Layout(tp=2, dp=4, ep=8), 4),
                                             (Layout(tp=2, dp=4, ep=4), 2)])
def test_an_expert_group_over_replicas_is_named_with_its_replica_count(layout, replicas):
    (note,) = _notes("mixtral-8x7b", layout)
    assert f"spans {replicas} replicas of tp={layout.tp}" in note and f"steps the {replicas} replicas together" in note


@pytest.mark.parametrize("model,layout", [("mixtral-8x7b", Layout(tp=2, dp=4, ep=2)),  # experts within each replica
                                          ("mixtral-8x7b", Layout(tp=4, dp=2)),  # every expert in each replica
                                          ("mixtral-8x7b", Layout(tp=8, ep=8)),  # one replica
                                          ("llama-3.1-8b", Layout(tp=1, dp=8))])  # dense
def test_independent_replicas_carry_no_such_note(model, layout):
    assert _notes(model, layout) == []
