"""`placement.Holdings`: what a rank holds is computed once per shard make-up (stage, position in
the stage modulo the layout's period). Checked against the placement rules applied rank by rank
(the docstring of `plan/placement.py`, written out here), over dense and MoE layouts with ZeRO
and hybrid sharding, and for a plan of 2^24 replicas, which has one make-up."""

from __future__ import annotations

import pytest
from conftest import REPO, build_plan

from shardplan.cost.layout import Layout
from shardplan.cost.memory_training import zero_shard_degrees
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.plan.placement import Holdings, _stage_tensors, _tp_box, box_numel, chunk, model_tensors, rank_holdings
from shardplan.specs.loading import load_model

SERVE = InferenceWorkload(max_model_len=512, input_len=256, output_len=64)
TRAIN = TrainingWorkload(seq_len=512, global_batch_size=64)
TINY_MOE = str(REPO / "tests" / "data" / "models" / "tiny-qwen3-next.yaml")  # 8 routed experts


def _rank_by_rank(m, spec, state: str) -> list[list[tuple[str, tuple]]]:
    """The placement rules for each rank on its own: stage = rank // (tp cp dp); tp rank = local % tp;
    ep rank = (local // etp) % ep, etp rank = local % etp; ZeRO chunks dim 0 over its group."""
    L = m.layout
    by_layer = {}
    for t in model_tensors(spec):
        by_layer.setdefault(t.layer, []).append(t)
    per_stage = L.tp * L.cp * L.dp
    sharded = m.workload.kind == "training" and (L.zero_stage >= 3 if state == "weights" else L.zero_stage >= 1)
    dense_group, expert_group = zero_shard_degrees(
        Layout(tp=L.tp, pp=L.pp, dp=L.dp, cp=L.cp, ep=L.ep, etp=L.etp, hybrid_shard=L.hybrid_shard),
        m.placement.gpus_per_node)
    ranges = m.placement.experts.expert_ranges if m.placement.experts is not None else None
    out = []
    for rank in range(m.hardware.num_gpus):
        stage, local = divmod(rank, per_stage)
        held = []
        for t in _stage_tensors(spec, m, stage, by_layer):
            split = m.placement.tp_splits[t.split_name]
            if t.expert is not None:
                ep_rank = (local // L.etp) % L.ep
                if ranges is not None and not ranges[ep_rank][0] <= t.expert <= ranges[ep_rank][1]:
                    continue
                box = _tp_box(t, split, L.etp, local % L.etp, m.model.num_kv_heads)
                group, index = expert_group, (local // (L.ep * L.etp)) % expert_group
            else:
                box = _tp_box(t, split, L.tp, local % L.tp, m.model.num_kv_heads)
                group, index = dense_group, (local // L.tp) % dense_group
            if sharded and group > 1:
                box = (chunk(*box[0], group, index), *box[1:])
            if box_numel(box):
                held.append((t.name, t.split_name, box))
        out.append(held)
    return out


PLANS = [
    ("debug", 16, Layout(tp=2, pp=2, dp=4), SERVE, 8),
    ("debug", 16, Layout(tp=2, pp=2, dp=4, zero_stage=1), TRAIN, 8),
    ("debug", 16, Layout(tp=2, pp=2, dp=4, zero_stage=3), TRAIN, 8),
    ("debug", 16, Layout(tp=1, dp=16, zero_stage=3, hybrid_shard=True), TRAIN, 4),
    ("debug", 8, Layout(tp=8), SERVE, 8),  # tp over the 4 KV heads: pairs of ranks share one
    (TINY_MOE, 8, Layout(tp=2, dp=4, ep=4, etp=1), SERVE, 8),
    (TINY_MOE, 8, Layout(tp=2, dp=4, ep=2, etp=2, zero_stage=3), TrainingWorkload(seq_len=256, global_batch_size=16),
     8),
]


@pytest.mark.parametrize("model,gpus,layout,workload,gpn", PLANS)
def test_holdings_per_make_up_are_the_rules_applied_rank_by_rank(model, gpus, layout, workload, gpn):
    m, _ = build_plan(model, gpus, layout, workload, gpus_per_node=gpn)
    spec = load_model(model).spec
    for state in ("weights", "optimizer") if m.workload.kind == "training" else ("weights",):
        want = _rank_by_rank(m, spec, state)
        got = [[(h.tensor.name, h.tensor.split_name, h.box) for h in held] for held in rank_holdings(m, spec, state)]
        assert got == want
        h = Holdings(m, spec, state)
        members = sorted(r for i in range(h.num_make_ups) for r in h.members(i))
        assert members == list(range(gpus))  # the make-ups partition the ranks
        for i in range(h.num_make_ups):
            assert all(h.make_up(r) == i and want[r] == want[h.members(i)[0]] for r in h.members(i))


def test_replicas_are_one_make_up_at_any_scale():
    """2^24 serving replicas of the whole model: one make-up, one list of slices for every rank."""
    m, _ = build_plan("debug", 1 << 24, Layout(dp=1 << 24), SERVE, gpus_per_node=8)
    spec = load_model("debug").spec
    h = Holdings(m, spec)
    assert (h.period, h.num_make_ups) == (1, 1)
    assert h.members(0) == range(0, 1 << 24)
    last = h.of_rank((1 << 24) - 1)
    assert last is h.of_rank(0)
    assert sum(box_numel(x.box) for x in last) == 5_247_232  # every parameter of debug, once


def test_zero_shards_past_the_rows_share_one_list():
    """ZeRO-3 over 2,048 ranks of a model whose widest dim 0 is 1,024 rows (the vocabulary):
    every rank is its own make-up, and those past row 1,024 of every tensor hold nothing, under
    one key (the shard index is clamped at the rows), so they cost one empty list."""
    m, _ = build_plan("debug", 2048, Layout(dp=2048, zero_stage=3),
                      TrainingWorkload(seq_len=512, global_batch_size=2048), gpus_per_node=8)
    spec = load_model("debug").spec
    h = Holdings(m, spec)
    assert h.period == 2048 and h.num_make_ups == 2048
    assert h.of_rank(1024) == [] and h.of_rank(2047) is h.of_rank(1024)
    assert h.key(1500) == h.key(2047) != h.key(1023)
    assert sum(box_numel(x.box) for r in range(2048) for x in h.of_rank(r)) == 5_247_232  # each element once
