"""`shardplan verify NEW --from OLD` for real on CPU with gloo: the old layout trains and saves a
DCP checkpoint, a fresh launch of the new layout loads it and trains on; the loss must continue
as one unsharded process's, and each new rank must load what the move list says. A reshard that
drops the optimizer's state must be caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import build_plan
from shardplan.cost.layout import Layout
from shardplan.cost.params import count_params
from shardplan.cost.workload import Optimizer, TrainingWorkload
from shardplan.errors import EXIT_OK, EXIT_VERIFY_FAILED, EXIT_VERIFY_MISMATCH
from shardplan.plan import manifest as mf
from shardplan.verify import reshard
from shardplan.verify.worker import RESHARD_FAULT_ENV

SGD = TrainingWorkload(seq_len=256, global_batch_size=64, optimizer=Optimizer.SGD)
STEPS = 2  # per leg: the second new step runs on the momentum the checkpoint restored
FP32_BYTES = 4


def _plan(tmp_path: Path, name: str, gpus: int, **layout) -> Path:
    m, _ = build_plan("debug", gpus, Layout(**layout), SGD, gpus_per_node=2)  # node 1 = ranks 2, 3
    path = tmp_path / f"{name}.yaml"
    mf.write_manifest(m, path)
    return path


def _reshard(cli, tmp_path: Path, new: Path, old: Path, *extra: str):
    report = tmp_path / "report.json"
    res = cli("verify", str(new), "--from", str(old), "--steps", str(STEPS), "--timeout", "240", "--report",
              str(report), "--json", *extra)
    return res, json.loads(report.read_text()) if report.is_file() else None


@pytest.mark.dist
def test_tp2_dp2_to_dp2_after_losing_a_node(cli, tmp_path):
    old, new = _plan(tmp_path, "old", 4, tp=2, dp=2), _plan(tmp_path, "new", 2, dp=2, zero_stage=3)
    res, report = _reshard(cli, tmp_path, new, old, "--lost-nodes", "1")
    assert res.exit_code == EXIT_OK, res.stderr
    assert res.json() == report  # --json prints what --report writes
    assert report["status"] == "ok", report["mismatches"]
    assert (report["old_world_size"], report["new_world_size"], report["lost_ranks"]) == (4, 2, [2, 3])

    num = report["numerics"]
    measured, reference = num["measured"], num["reference"]
    assert (num["steps_before"], num["steps_after"]) == (STEPS, STEPS) and len(measured) == len(reference) == 2 * STEPS
    for m, r in zip(measured, reference):
        assert abs(m - r) <= 1e-6 + 1e-5 * abs(r)
    # The check is sharp: the first resharded step is step 2's loss, far (in tolerances) from a
    # restart at step 0 and from the step before it.
    assert abs(measured[STEPS] - reference[0]) > 100 * (1e-6 + 1e-5 * reference[0])
    assert measured[STEPS] < measured[STEPS - 1]

    # Bytes: each new rank loads half of every tensor (FSDP's dim-0 shard over dp2), weights and
    # SGD momentum alike, as the move list says; of it the row-parallel tensors' other quarter
    # came from the other surviving old rank's tp slice (nothing was only on the lost node).
    pair = reshard.load_pair(new, old, scale="proxy", steps=STEPS)
    spec = pair.old_run.spec
    half = count_params(spec).total / 2 * FP32_BYTES
    row = spec.num_layers * (spec.num_attention_heads * spec.attention_head_dim + spec.intermediate_size) * spec.hidden_size
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        states = {s["state"]: s for s in rank["states"]}
        assert set(states) == {"weights", "optimizer_states"}
        for s in states.values():
            assert s["measured_bytes"] == s["planned_bytes"] == half and s["ok"]
            assert s["planned_from_ranks_bytes"] == row / 4 * FP32_BYTES and s["planned_from_checkpoint_bytes"] == 0
        assert rank["file_bytes_read"] >= 2 * half  # whole saved chunks are read, then narrowed
    assert report["checkpoint_bytes"] >= 2 * 2 * half  # every weight and its momentum, once
    assert report["wall_seconds"]["total"] < 200


@pytest.mark.dist
def test_a_reshard_that_drops_the_optimizer_state_is_caught(cli, tmp_path, monkeypatch):
    """The new layout loads the weights only (a testing hook): the first resharded step's loss is
    still right, the second (the first update without the restored momentum) is not."""
    monkeypatch.setenv(RESHARD_FAULT_ENV, "drop-optimizer")
    old, new = _plan(tmp_path, "old", 2, tp=2), _plan(tmp_path, "new", 2, dp=2, zero_stage=3)
    res, report = _reshard(cli, tmp_path, new, old)
    assert res.exit_code == EXIT_VERIFY_MISMATCH, res.stderr
    assert report["status"] == "mismatch"
    assert report["numerics"]["first_bad_step"] == STEPS + 1 and not report["numerics"]["ok"]
    for rank in report["ranks"]:
        states = {s["state"]: s for s in rank["states"]}
        assert states["weights"]["ok"] and not states["optimizer_states"]["ok"]
        assert states["optimizer_states"]["measured_bytes"] == 0


@pytest.mark.dist
def test_a_failed_old_run_exits_5_and_names_the_leg_and_rank(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_VERIFY_FAULT", "raise:1")  # worker.FAULT_ENV: rank 1 raises after step 0
    old, new = _plan(tmp_path, "old", 2, tp=2), _plan(tmp_path, "new", 2, dp=2, zero_stage=3)
    res, report = _reshard(cli, tmp_path, new, old)
    assert res.exit_code == EXIT_VERIFY_FAILED, res.stderr
    assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1 and "old layout" in res.stderr
    assert report["leg"] == "old" and report["failed_ranks"] == [1] and "injected fault" in report["cause"][0]
