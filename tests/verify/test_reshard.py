"""`verify NEW --from OLD` without torch.distributed: the pairing of the plans, the model both
legs run, the move list applied to what ran (checked against an analytic count), the loss
continuation check and the bytes check, and the report built from two legs' results."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import build_plan
from shardplan.cost.layout import Layout
from shardplan.cost.params import count_params
from shardplan.cost.workload import InferenceWorkload, Optimizer, TrainingWorkload
from shardplan.errors import EXIT_BAD_INPUT, CannotVerify, ShardplanError
from shardplan.plan import manifest as mf
from shardplan.tasks._moves import Devices
from shardplan.verify import reshard
from shardplan.verify.reshard_launch import build_report

SGD = TrainingWorkload(seq_len=256, global_batch_size=64, optimizer=Optimizer.SGD)
FP32_BYTES = 4


def write_plan(tmp_path: Path, name: str, gpus: int, workload=SGD, model: str = "debug", **layout) -> Path:
    """A manifest for a pinned layout of the bundled `debug` model, two GPUs a node (so a
    4-GPU plan has a node 1 to lose)."""
    m, _ = build_plan(model, gpus, Layout(**layout), workload, gpus_per_node=2)
    path = tmp_path / f"{name}.yaml"
    mf.write_manifest(m, path)
    return path


@pytest.fixture
def tp2dp2_to_dp2(tmp_path):
    """The dist test's change: tp2 x dp2 (replicated over dp) -> dp2 ZeRO-3, node 1 lost."""
    old = write_plan(tmp_path, "old", 4, tp=2, dp=2)
    new = write_plan(tmp_path, "new", 2, dp=2, zero_stage=3)
    return reshard.load_pair(new, old, scale="proxy", steps=2)


def _devices(pair: reshard.ReshardPair, lost=frozenset({2, 3})) -> Devices:
    return Devices.build(gpus_per_node=2, old_num_gpus=pair.old.hardware.num_gpus,
                         new_num_gpus=pair.new.hardware.num_gpus, lost=frozenset(lost))


def _planned(pair: reshard.ReshardPair, lost=frozenset({2, 3})):
    from shardplan.verify.outofmemory import hardware_for

    hw, _ = hardware_for(pair.new, pair.new_run)
    return reshard.move_split(reshard.as_ran(pair.old, pair.old_run), reshard.as_ran(pair.new, pair.new_run),
                              pair.old_run.spec, _devices(pair, lost), hw)


# ----- the pairing and the runs ------------------------------------------------------------------

def test_both_legs_run_one_model_one_batch_in_fp32(tp2dp2_to_dp2):
    pair = tp2dp2_to_dp2
    assert pair.old_run.spec == pair.new_run.spec
    assert pair.old_run.dtype.value == pair.new_run.dtype.value == "fp32"
    assert reshard.global_rows(pair.old_run) == reshard.global_rows(pair.new_run)
    assert pair.reference_run().steps == 4 and pair.reference_run().layout == pair.old_run.layout
    assert (pair.old_run.world_size, pair.new_run.world_size) == (4, 2)


def test_joint_proxy_is_split_by_both_layouts(tmp_path):
    """pp2 (8 proxy layers) -> tp2 (MLP width and vocabulary multiples of 16): one model for both."""
    pair = reshard.load_pair(write_plan(tmp_path, "new", 2, tp=2), write_plan(tmp_path, "old", 4, pp=2, dp=2),
                             scale="proxy", steps=1)
    spec = pair.old_run.spec
    assert spec.num_layers == 8 and spec.intermediate_size % 16 == 0 and spec.vocab_size % 16 == 0
    assert pair.new_run.spec == spec
    assert reshard.global_rows(pair.new_run) == reshard.global_rows(pair.old_run)
    assert any("least common multiples" in n for n in pair.notes)


@pytest.mark.parametrize("what", ["serving", "model", "seq_len", "interleaved"])
def test_plans_that_cannot_pair_are_refused(tmp_path, what):
    old = write_plan(tmp_path, "old", 4, tp=2, dp=2)
    if what == "serving":
        new = write_plan(tmp_path, "new", 2, workload=InferenceWorkload(max_model_len=512, input_len=384, output_len=128), tp=2)
    elif what == "model":
        new = write_plan(tmp_path, "new", 2, model="llama-3.2-1b", dp=2, zero_stage=3)
    elif what == "seq_len":
        new = write_plan(tmp_path, "new", 2, workload=replace(SGD, seq_len=512), dp=2)
    else:
        new = write_plan(tmp_path, "new", 4, pp=2, dp=2, pp_schedule="interleaved", virtual_stages=2)
    with pytest.raises(ShardplanError) as e:
        reshard.load_pair(new, old, scale="proxy", steps=1)
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert isinstance(e.value, CannotVerify) == (what == "interleaved")
    field = {"serving": "workload.kind", "model": "model.spec_sha256", "seq_len": "workload.seq_len",
             "interleaved": "layout.virtual_stages"}[what]
    assert e.value.field == field


# ----- the move list for what ran -----------------------------------------------------------------

def test_move_list_for_what_ran_matches_an_analytic_count(tp2dp2_to_dp2):
    """New rank q is old rank q's GPU. It keeps its old tp slice of the column-parallel, vocab and
    replicated tensors, which FSDP's dim-0 half is, and half of its row-parallel (o_proj,
    down_proj) slice; the other quarter of those comes from the other surviving old rank. Nothing
    is only on the lost node (dp1 was a replica). fp32 weights and SGD momentum alike."""
    pair = tp2dp2_to_dp2
    spec = pair.old_run.spec
    total = count_params(spec).total
    row = spec.num_layers * (spec.num_attention_heads * spec.attention_head_dim * spec.hidden_size
                             + spec.intermediate_size * spec.hidden_size)
    planned = _planned(pair)
    assert len(planned) == 2
    for q in range(2):
        for state in reshard.STATES:
            split = planned[q][state]
            assert split["kept"] + split["from_ranks"] + split["from_checkpoint"] == total / 2 * FP32_BYTES
            assert split["from_ranks"] == row / 4 * FP32_BYTES
            assert split["from_checkpoint"] == 0


def test_pieces_only_lost_ranks_held_come_from_the_checkpoint(tmp_path):
    """ZeRO-3 over dp2: losing node 1 loses every tensor's dp1 half; without the loss none is missing."""
    pair = reshard.load_pair(write_plan(tmp_path, "new", 2, dp=2, zero_stage=3),
                             write_plan(tmp_path, "old", 4, tp=2, dp=2, zero_stage=3), scale="proxy", steps=1)
    total = count_params(pair.old_run.spec).total * FP32_BYTES
    lost = _planned(pair)
    assert sum(r["weights"]["from_checkpoint"] for r in lost) == pytest.approx(total / 2)
    nothing_lost = _planned(pair, lost=frozenset())
    assert sum(r[s]["from_checkpoint"] for r in nothing_lost for s in reshard.STATES) == 0
    assert sum(r["weights"]["kept"] + r["weights"]["from_ranks"] for r in nothing_lost) == pytest.approx(total)


def test_as_ran_shards_whatever_fsdp_shards(tp2dp2_to_dp2):
    pair = tp2dp2_to_dp2
    assert reshard.as_ran(pair.old, pair.old_run).layout.zero_stage == 0  # replicated over dp
    assert reshard.as_ran(pair.new, pair.new_run).layout.zero_stage == 3
    assert reshard.fsdp_shards(Layout(dp=2, zero_stage=1)) and not reshard.fsdp_shards(Layout(dp=1, zero_stage=3))


# ----- the checks ------------------------------------------------------------------------------------

REFERENCE = [6.9898343, 6.9811435, 6.9647417, 6.9416976]


def _continuation(measured, reference=REFERENCE, before=2):
    return reshard.loss_continuation(measured[:before], measured[before:], reference, rtol=reshard.LOSS_RTOL,
                                     atol=reshard.LOSS_ATOL)


def test_loss_continuation_within_fp32_rounding_passes():
    c = _continuation([v * (1 + 3e-7) for v in REFERENCE])
    assert c.ok and c.first_bad_step is None and c.max_relative_error == pytest.approx(3e-7, rel=1e-3)
    assert (c.steps_before, c.steps_after) == (2, 2)


def test_a_perturbed_reference_after_resharding_is_caught():
    perturbed = list(REFERENCE)
    perturbed[3] *= 1 + 5e-5  # five times the tolerance, on the second step after loading
    c = _continuation(REFERENCE, perturbed)
    assert not c.ok and c.first_bad_step == 3


@pytest.mark.parametrize("bad", ["nan", "inf", "missing", "extra"])
def test_nan_or_a_missing_step_fails(bad):
    measured = list(REFERENCE)
    if bad == "nan":
        measured[2] = math.nan
    elif bad == "inf":
        measured[3] = math.inf
    elif bad == "missing":
        measured = measured[:3]
    else:
        measured = [*measured, 6.9]
    c = _continuation(measured)
    assert not c.ok and c.first_bad_step == {"nan": 2, "inf": 3, "missing": 3, "extra": 4}[bad]
    if bad in ("nan", "inf"):
        assert c.max_abs_error is None


def test_loaded_bytes_compare_with_all_the_pieces():
    split = {"kept": 3.0e6, "from_ranks": 1.0e6, "from_checkpoint": 0.0}
    assert reshard.loaded_bytes("weights", 4_000_000, split).ok
    off = reshard.loaded_bytes("weights", 4_100_000, split)  # 2.5% more than the move list
    assert not off.ok and off.relative_error == pytest.approx(0.025)
    assert not reshard.loaded_bytes("optimizer_states", 0, split).ok
    none_planned = reshard.loaded_bytes("optimizer_states", 10, dict.fromkeys(split, 0.0))
    assert not none_planned.ok and none_planned.relative_error is None


# ----- the report from two legs ------------------------------------------------------------------------

def _legs(pair, planned, losses, reference, loaded_scale: float = 1.0):
    old = {"results": [{"rank": r, "losses": losses[:2] if r == 0 else None,
                        "checkpoint": {"written_bytes": 1000 + r, "num_write_items": 3, "seconds": 0.1}}
                       for r in range(pair.old_run.world_size)]}
    new = {"reference": reference, "results": [
        {"rank": q, "losses": losses[2:] if q == 0 else None,
         "checkpoint": {"loaded_bytes": {s: int(sum(planned[q][s].values()) * loaded_scale) for s in reshard.STATES}
                                        | {"other": 64},
                        "file_bytes_read": 10_000_000, "num_read_items": 40, "seconds": 0.2}}
        for q in range(pair.new_run.world_size)]}
    return old, new


def _report(pair, losses=REFERENCE, reference=REFERENCE, loaded_scale=1.0):
    planned = _planned(pair)
    old, new = _legs(pair, planned, list(losses), list(reference), loaded_scale)
    return build_report(pair, old, new, planned, planned, _devices(pair), backend="gloo", device="cpu",
                        wall_seconds={"old_run": 1.0, "new_run": 1.0, "total": 2.0})


def test_report_of_a_matching_reshard(tp2dp2_to_dp2):
    r = _report(tp2dp2_to_dp2)
    assert r.status == "ok" and not r.mismatches
    assert r.lost_ranks == [2, 3] and (r.old_world_size, r.new_world_size) == (4, 2)
    assert [x.old_rank_on_gpu for x in r.ranks] == [0, 1]
    assert r.checkpoint_bytes == sum(1000 + i for i in range(4))
    assert all(s.ok for x in r.ranks for s in x.states)
    assert r.model_dump(mode="json")["numerics"]["ok"]  # the --json object


def test_report_catches_a_loss_that_does_not_continue(tp2dp2_to_dp2):
    resumed_wrong = [*REFERENCE[:3], REFERENCE[3] + 0.01]  # e.g. the optimizer's moments not restored
    r = _report(tp2dp2_to_dp2, losses=resumed_wrong)
    assert r.status == "mismatch" and r.numerics.first_bad_step == 3
    assert any("after resharding" in m for m in r.mismatches)


def test_report_catches_bytes_off_the_move_list(tp2dp2_to_dp2):
    r = _report(tp2dp2_to_dp2, loaded_scale=1.05)
    assert r.status == "mismatch" and r.numerics.ok
    assert sum("new rank" in m for m in r.mismatches) == 4  # two ranks, two states each


def test_reshard_report_renders(tp2dp2_to_dp2, capsys):
    from shardplan.cli import render_verify

    render_verify.reshard_report(_report(tp2dp2_to_dp2, losses=[*REFERENCE[:3], math.nan]))
    assert "verify" in capsys.readouterr().out
