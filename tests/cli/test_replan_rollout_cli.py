"""`shardplan replan --min-capacity`: the serving rollout, run through the CLI and read back
from `--json`. The debug model on 16 H100s (two nodes of 8): its steps replayed here keep every
GPU to one replica and the served rate above the floor; load times come from the profile's
storage link; a floor no order keeps exits 3 with the best order printed; training plans and
shares outside (0, 1] exit 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import build_plan

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.plan.manifest import write_manifest
from shardplan.specs.loading import load_hardware

NUM_PARAMS = 5_247_232  # the debug model's parameters
BF16 = 2
H100 = load_hardware("h100-sxm-80gb")
SERVE = InferenceWorkload(max_model_len=512, input_len=384, output_len=128)


def _plan(tmp_path: Path, gpus: int, layout: Layout, workload=SERVE) -> Path:
    m, _ = build_plan("debug", gpus, layout, workload, gpus_per_node=8)
    path = tmp_path / "old.yaml"
    write_manifest(m, path)
    return path


def _storage_bytes_per_second() -> float:
    """The DGX H100 node's NVMe, 50 GB/s x efficiency.nvme, shared by its 8 GPUs."""
    assert H100.nvme_bandwidth_bytes_per_second_per_node == 50e9
    return 50e9 * H100.nvme_efficiency / 8


def _replay(ro: dict) -> None:
    """Walk the steps: a start takes only free GPUs; the rate after each step, counted here from
    the replicas up and those loaded by then, matches and keeps the floor."""
    holds = {g: ("old", r["replica"]) for r in ro["old_replicas"] if r["status"] != "down" for g in r["gpus"]}
    for r in ro["new_replicas"]:
        if r["status"] == "kept":
            assert holds[r["gpus"][0]] == ("old", r["kept_as"])
    old_up = {r["replica"] for r in ro["old_replicas"] if r["status"] in ("drained", "kept")}
    kept = sum(1 for r in ro["new_replicas"] if r["status"] == "kept")
    ready: list[float] = []
    full, a, b = (ro[k] for k in ("full_capacity_tokens_per_second", "old_replica_tokens_per_second",
                                  "new_replica_tokens_per_second"))
    assert full == pytest.approx(a * len(ro["old_replicas"]))
    for st in ro["steps"]:
        if st["action"] == "drain":
            assert st["replica"] in old_up
            old_up.discard(st["replica"])
            for g in st["gpus"]:
                assert holds.pop(g) == ("old", st["replica"])
        else:
            for g in st["gpus"]:
                assert g not in holds, g  # no GPU hosts two replicas
                holds[g] = ("new", st["replica"])
            ready.append(st["ready_seconds"])
        rate = a * (len(old_up) - kept) + b * (kept + sum(1 for t in ready if t <= st["at_seconds"]))
        assert st["capacity_tokens_per_second"] == pytest.approx(rate)
        assert st["capacity_share"] == pytest.approx(rate / full)
        assert st["capacity_share"] >= ro["floor_share"] - 1e-9
    assert old_up == {r["replica"] for r in ro["old_replicas"] if r["status"] == "kept"}  # all others drained
    started = {st["replica"] for st in ro["steps"] if st["action"] == "start"}
    assert started == {r["replica"] for r in ro["new_replicas"] if r["status"] == "started"}
    assert ro["min_share"] == pytest.approx(min([ro["start_share"]] + [st["capacity_share"] for st in ro["steps"]]))
    assert ro["duration_seconds"] == pytest.approx(max(ready + [st["at_seconds"] for st in ro["steps"]] + [0.0]))


def test_growing_keeps_every_replica_and_starts_new_ones_on_the_new_node(tmp_path, cli):
    old = _plan(tmp_path, 8, Layout(tp=1, dp=8))
    r = cli("replan", old, "--nodes", "2", "--json")
    assert r.exit_code == 0, r.stderr
    ro = r.json()["rollout"]
    _replay(ro)
    assert [x["status"] for x in ro["old_replicas"]] == ["kept"] * 8  # the same engine on the same GPU
    assert [x["status"] for x in ro["new_replicas"]] == ["kept"] * 8 + ["started"] * 8
    assert {st["action"] for st in ro["steps"]} == {"start"} and all(st["at_seconds"] == 0 for st in ro["steps"])
    assert [st["gpus"] for st in ro["steps"]] == [[f"1:{g}"] for g in range(8)]  # node 1 joined
    assert ro["min_share"] == ro["start_share"] == 1.0 and ro["end_share"] == pytest.approx(2.0)
    # one replica per GPU reads the whole bf16 model at the node's NVMe share per GPU
    new = ro["new_replicas"][8]
    assert new["load_bytes"] == NUM_PARAMS * BF16
    assert new["load_seconds"] == pytest.approx(NUM_PARAMS * BF16 / _storage_bytes_per_second())
    assert ro["load_link"] == {"kind": "nvme", "bandwidth_bytes_per_second": pytest.approx(5e9),
                               "latency_seconds": 0.0, "bytes_from": "plan"}
    assert ro["duration_seconds"] == pytest.approx(new["load_seconds"])


def test_reshaping_drains_one_replica_at_a_time_and_exits_3_above_the_highest_floor(tmp_path, cli):
    """tp2 x pp2 x dp4 -> tp1 x dp16 on the same 16 GPUs: each old replica's GPUs (0-1 and 8-9
    for replica 0) hold four new ones and there is no spare GPU, so one old replica of four
    must drain first: 75% is the highest floor."""
    old = _plan(tmp_path, 16, Layout(tp=2, pp=2, dp=4))
    out = cli("replan", old, "--gpus", "16", "--min-capacity", "0.7", "--json")
    assert out.exit_code == 0, out.stderr
    res = out.json()
    plan = res["candidates"][res["chosen"] - 1]["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"]) == (1, 1, 16)
    ro = res["rollout"]
    _replay(ro)
    assert ro["min_capacity"] == 0.7 and ro["floor_share"] == 0.7 and ro["keeps_floor"]
    assert ro["max_floor_share"] == pytest.approx(0.75) and ro["optimal"] and ro["limited_by"] == "swap"
    first = ro["steps"][0]
    assert (first["action"], first["replica"], first["gpus"]) == ("drain", 0, ["0:0", "0:1", "1:0", "1:1"])
    starts = [st for st in ro["steps"] if st["action"] == "start" and st["after_drains"] == [0]]
    assert sorted(g for st in starts for g in st["gpus"]) == ["0:0", "0:1", "1:0", "1:1"]
    # every new replica counts once loaded: its start plus its load time
    load = NUM_PARAMS * BF16 / _storage_bytes_per_second()
    assert all(st["ready_seconds"] == pytest.approx(st["at_seconds"] + load) for st in ro["steps"]
               if st["action"] == "start")

    # the same at 80%: no order keeps it; the best order (75%) is still printed, exit 3
    r = cli("replan", old, "--gpus", "16", "--min-capacity", "0.8", "--json")
    assert r.exit_code == 3 and r.stderr == ""
    ro = r.json()["rollout"]
    _replay(ro)
    assert not ro["keeps_floor"] and ro["floor_share"] == pytest.approx(0.75) and ro["min_share"] == pytest.approx(0.75)
    # the table says so in one line, with the highest floor and why
    r = cli("replan", old, "--gpus", "16", "--min-capacity", "0.8")
    assert r.exit_code == 3 and "Rollout" in r.stdout
    assert "no order keeps --min-capacity 80.0%: the highest is 75.0% (old replicas must drain before" in r.stdout


def test_a_floor_below_the_highest_drains_more_at_once(tmp_path, cli):
    old = _plan(tmp_path, 16, Layout(tp=2, pp=2, dp=4))
    highest = cli("replan", old, "--gpus", "16", "--json").json()["rollout"]
    half = cli("replan", old, "--gpus", "16", "--min-capacity", "0.5", "--json").json()["rollout"]
    assert highest["min_capacity"] is None and highest["floor_share"] == highest["max_floor_share"] == 0.75

    def drained_at_once(ro: dict) -> int:
        return sum(1 for st in ro["steps"] if st["action"] == "drain" and st["at_seconds"] == 0)

    # before any new replica loads: one old replica of four drained (75% kept), or two (50%)
    assert (drained_at_once(highest), drained_at_once(half)) == (1, 2)
    assert half["min_share"] == pytest.approx(0.5) and half["duration_seconds"] <= highest["duration_seconds"]
    _replay(half)


def test_lost_replicas_serve_nothing_and_their_gpus_start_new_ones_at_once(tmp_path, cli):
    """Ranks 8-13 are stage 1 of replicas 0-2: those are down from the start (25% served), and
    the new replicas on their GPUs start at once; 50% cannot be kept (exit 3, limited by the start)."""
    old = _plan(tmp_path, 16, Layout(tp=2, pp=2, dp=4))
    r = cli("replan", old, "--gpus", "16", "--lost-ranks", "8-13", "--json")
    assert r.exit_code == 0, r.stderr
    ro = r.json()["rollout"]
    _replay(ro)
    assert [x["status"] for x in ro["old_replicas"]] == ["down"] * 3 + ["drained"]
    assert ro["start_share"] == pytest.approx(0.25) and ro["max_floor_share"] == pytest.approx(0.25)
    down_gpus = {g for x in ro["old_replicas"][:3] for g in x["gpus"]}
    at_once = [st for st in ro["steps"] if st["action"] == "start" and st["at_seconds"] == 0 and not st["after_drains"]]
    assert {g for st in at_once for g in st["gpus"]} == down_gpus
    r = cli("replan", old, "--gpus", "16", "--lost-ranks", "8-13", "--min-capacity", "0.5", "--json")
    assert r.exit_code == 3 and r.json()["rollout"]["limited_by"] == "start"


def test_table_shows_the_rollout(tmp_path, cli):
    old = _plan(tmp_path, 16, Layout(tp=2, pp=2, dp=4))
    r = cli("replan", old, "--gpus", "16", "--min-capacity", "0.75")
    assert r.exit_code == 0, r.stderr
    assert "Rollout" in r.stdout and "start (after draining old 0)" in r.stdout
    assert "capacity never below 75.0% (asked 75.0%; the highest any order keeps: 75.0%)" in r.stdout


def test_training_plans_have_no_rollout_and_refuse_min_capacity(tmp_path, cli):
    old = _plan(tmp_path, 16, Layout(tp=2, pp=2, dp=4), TrainingWorkload(seq_len=512, global_batch_size=64))
    r = cli("replan", old, "--gpus", "8", "--json")
    assert r.exit_code == 0 and r.json()["rollout"] is None
    r = cli("replan", old, "--gpus", "8", "--min-capacity", "0.5")
    assert r.exit_code == 2 and r.stdout == "" and "\n" not in r.stderr.strip()
    assert "field '--min-capacity'" in r.stderr and "training plan" in r.stderr


@pytest.mark.parametrize("value", ["0", "1.5", "-0.25", "nan"])
def test_min_capacity_outside_zero_to_one_exits_2_with_one_line(tmp_path, cli, value):
    old = _plan(tmp_path, 16, Layout(tp=2, pp=2, dp=4))
    r = cli("replan", old, "--gpus", "8", "--min-capacity", value)
    assert r.exit_code == 2 and r.stdout == "" and "\n" not in r.stderr.strip(), r.stderr
    assert "is not a share in (0, 1]" in r.stderr and "field '--min-capacity'" in r.stderr


def test_help_documents_min_capacity_with_an_example(cli):
    out = " ".join(cli("replan", "--help").stdout.replace("│", " ").split())
    assert "--min-capacity" in out and "e.g. --min-capacity 0.75" in out


def test_past_the_replicas_a_rollout_is_planned_for_it_says_so(tmp_path, cli, monkeypatch):
    """More replicas, old and new, than ROLLOUT_MAX_REPLICAS: the layout and its moves as always, no
    rollout but a line saying why (its per-replica lists would not be bounded work: 2^24 GPUs); with
    --min-capacity, which needs the rollout, one line and exit 2."""
    from shardplan.tasks import replan

    old = _plan(tmp_path, 8, Layout(tp=1, dp=8))
    planned = json.loads(cli("replan", old, "--nodes", "2", "--json").stdout)
    monkeypatch.setattr(replan, "ROLLOUT_MAX_REPLICAS", 8 + 16 - 1)  # one fewer than the replicas, old and new
    r = cli("replan", old, "--nodes", "2", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert planned["rollout"] is not None and out["rollout"] is None
    assert out["rollout_not_planned"].startswith("8 old and 16 new replicas")
    assert out["moves"] == planned["moves"] and out["chosen"] == planned["chosen"]
    r = cli("replan", old, "--nodes", "2", "--min-capacity", "0.5")
    assert r.exit_code == 2 and "--min-capacity" in r.stderr and len(r.stderr.strip().splitlines()) == 1
