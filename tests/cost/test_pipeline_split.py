"""Uneven pipeline splits as large runs use them (issue: training per stack): the embedding and
the loss counted as layers (Megatron-LM --account-for-embedding/loss-in-pipeline-split) and
explicit first/last stage layer counts (--decoder-first/last-pipeline-num-layers)."""

from __future__ import annotations

import pytest

from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, PipelineSchedule, Recompute, chunk_sizes, layout_stage_ranges, validate_layout
from shardplan.errors import LayoutError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model

LLAMA405B = load_model("llama-3.1-405b").spec


def test_llama3_405b_split_one_layer_per_chunk_with_embedding_and_loss_as_layers():
    """Llama 3 405B (126 layers) over 16 stages x 8 chunks: 128 units, one a chunk; the first
    chunk holds the embedding only and the last the loss only (Llama 3 paper, Sec. 3.3.2: the
    first and last stages hold one layer fewer)."""
    sizes = chunk_sizes(126, 16, 8, embedding_as_layer=True, loss_as_layer=True)
    assert sizes[0] == 0 and sizes[-1] == 0 and set(sizes[1:-1]) == {1} and sum(sizes) == 126
    layout = Layout(tp=8, pp=16, dp=16, pp_schedule=PipelineSchedule.INTERLEAVED, virtual_stages=8,
                    pp_embedding_as_layer=True, pp_loss_as_layer=True)
    validate_layout(LLAMA405B, layout, 2048, training=True)
    per_stage = [sum(len(r) for r in chunks) for chunks in layout_stage_ranges(126, layout)]
    assert per_stage == [7] + [8] * 14 + [7]


def test_first_and_last_stage_counts():
    assert chunk_sizes(126, 16, first=7, last=7) == (7,) + (8,) * 14 + (7,)
    assert chunk_sizes(61, 8, first=5) == (5, 8, 8, 8, 8, 8, 8, 8)  # DeepSeek-V3-like: 61 = 5 + 7 x 8


@pytest.mark.parametrize(("fields", "field"), [
    (dict(pp_first_stage_layers=200), "pp_first_stage_layers"),  # more than the model has
    (dict(pp_first_stage_layers=7, virtual_stages=2, pp_schedule=PipelineSchedule.INTERLEAVED), "virtual_stages"),
    (dict(pp_embedding_as_layer=True, pp=1, dp=128), "pp"),
])
def test_impossible_splits_are_refused_with_the_field(fields, field):
    base = dict(tp=8, pp=16, dp=16)
    base.update(fields)
    layout = Layout(**base)
    with pytest.raises(LayoutError) as e:
        validate_layout(LLAMA405B, layout, layout.world_size, training=True)
    assert e.value.field == field


def test_counting_the_loss_as_a_layer_unloads_the_slowest_stage():
    """With an even split the last stage also runs the 128k-vocabulary output layer and the
    loss; counting them as a layer moves one decoder layer off it, so the slowest stage (and
    the step) gets faster."""
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=1024, nodes=None, gpus_per_node=None)
    wl = training_workload(seq_len=8192, global_batch_size=1024, optimizer="adamw", framework=None,
                           flash_attention=None, dropout=False, stack=stack_rules("megatron"))
    even = Layout(tp=8, pp=16, dp=8, zero_stage=1, sequence_parallel=True, recompute=Recompute.FULL)
    split = Layout(tp=8, pp=16, dp=8, zero_stage=1, sequence_parallel=True, recompute=Recompute.FULL,
                   pp_embedding_as_layer=True, pp_loss_as_layer=True)
    a, b = estimate(LLAMA405B, hw, even, wl), estimate(LLAMA405B, hw, split, wl)
    assert a.plan.stage_layers == [8] * 14 + [7, 7]
    assert b.plan.stage_layers == [7] + [8] * 14 + [7]
    assert b.time.step_seconds < a.time.step_seconds


def test_estimate_cli_takes_the_split(cli):
    r = cli("estimate", "llama-3.1-405b", "--workload", "training", "--gpus", "2048", "--hardware", "h100-sxm-80gb",
            "--tp", "8", "--pp", "16", "--pp-schedule", "interleaved", "--virtual-stages", "8",
            "--pp-embedding-as-layer", "--pp-loss-as-layer", "--zero-stage", "1", "--sequence-parallel",
            "--recompute", "full", "--seq-len", "8192", "--global-batch-size", "2048", "--stack", "megatron", "--json")
    assert r.exit_code in (0, 3), r.stderr
    assert r.json()["plan"]["stage_layers"] == [7] + [8] * 14 + [7]
