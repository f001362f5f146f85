"""`shardplan replan`: the debug model from 16 to 8 GPUs and from 8 to 16, serving and training.
The new manifest loads; the move list gives every slice a new rank holds exactly one source
that really holds it; its bytes add up to what the new ranks hold, and agree with what the
new plan would read from a real safetensors checkpoint."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import build_plan
from safetensors.torch import save_file

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.plan.manifest import load_manifest, write_manifest
from shardplan.plan.placement import box_numel, model_tensors, rank_holdings
from shardplan.tasks.replan import intersect, subtract
from shardplan.specs.loading import load_model

SPEC = load_model("debug").spec
NUM_PARAMS = 5_247_232
BF16 = 2
ADAMW_STATE_BYTES = 12  # fp32 master weights, m and v per bf16 parameter (ZeRO paper's K)
SERVE = InferenceWorkload(max_model_len=512, input_len=384, output_len=128)
TRAIN = TrainingWorkload(seq_len=512, global_batch_size=64)


def _old(tmp_path: Path, gpus: int, layout: Layout, workload) -> Path:
    m, _ = build_plan("debug", gpus, layout, workload, gpus_per_node=8)
    path = tmp_path / "old.yaml"
    write_manifest(m, path)
    return path


def _replan(cli, old: Path, tmp_path: Path, *args: str) -> tuple[dict, dict, Path]:
    """Run replan -o new.yaml; the move list goes beside it as new.moves.json."""
    r = cli("replan", old, *args, "-o", tmp_path / "new.yaml", "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    assert out["manifest"] == str(tmp_path / "new.yaml")
    assert out["moves_file"] == str(tmp_path / "new.moves.json")
    return out, json.loads((tmp_path / "new.moves.json").read_text()), tmp_path / "new.yaml"


def _check_exact_cover(old_path: Path, new_path: Path, moves: dict) -> dict[str, float]:
    """Every slice of every new rank is covered by its pieces exactly once, and each piece comes
    from an old rank that holds it. Returns bytes held per state over all new ranks."""
    old, new = load_manifest(old_path), load_manifest(new_path)
    pieces = defaultdict(list)
    for mv in moves["moves"]:
        pieces[(mv["state"], mv["to_rank"], mv["tensor"])].append(mv)
        assert (mv["route"] == "local") == (mv["from_rank"] == mv["to_rank"])
    held_bytes = defaultdict(float)
    states = ("weights", "optimizer") if new.workload.kind == "training" else ("weights",)
    for state in states:
        old_boxes = [{h.tensor.name: h.box for h in held} for held in rank_holdings(old, SPEC, state)]
        for q, held in enumerate(rank_holdings(new, SPEC, state)):
            for h in held:
                got = pieces.pop((state, q, h.tensor.name))
                boxes = [tuple(map(tuple, mv["slice"])) for mv in got]
                assert sum(box_numel(b) for b in boxes) == box_numel(h.box), (state, q, h.tensor.name)
                rest = [h.box]
                for b in boxes:  # carving each piece out of what is left: overlaps or strays would fail here
                    assert sum(box_numel(intersect(r, b) or ((0, 0),)) for r in rest) == box_numel(b)
                    rest = [x for r in rest for x in subtract(r, b)]
                assert rest == []
                for mv, b in zip(got, boxes):
                    src = old_boxes[mv["from_rank"]].get(h.tensor.name)
                    assert src is not None and intersect(src, b) == b, mv
                held_bytes[state] += sum(mv["bytes"] for mv in got)
    assert not pieces, f"moves for slices the new plan does not hold: {list(pieces)[:3]}"
    moved = sum(mv["bytes"] for mv in moves["moves"] if mv["route"] != "local")
    kept = sum(mv["bytes"] for mv in moves["moves"] if mv["route"] == "local")
    assert moved == moves["moved_bytes"] and kept == moves["kept_bytes"]
    assert moved + kept == sum(held_bytes.values())
    return held_bytes


def test_serving_16_to_8(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8")
    held = _check_exact_cover(old, new, moves)
    chosen = out["candidates"][out["chosen"] - 1]
    assert chosen["chosen"] and chosen["plan"]["tp"] * chosen["plan"]["pp"] * chosen["plan"]["dp"] == 8
    # the winner, dp=8 replicas of the whole model: 8 bf16 copies
    assert (chosen["plan"]["tp"], chosen["plan"]["pp"], chosen["plan"]["dp"]) == (1, 1, 8)
    assert held["weights"] == 8 * NUM_PARAMS * BF16 == 83_955_712
    # each new rank already holds a quarter of its old stage's half of the model on its GPU
    assert moves["kept_bytes"] == 21_004_288 and moves["moved_bytes"] == 62_951_424
    assert moves["moved_bytes_by_route"] == {"intra_node": 20_971_520, "inter_node": 41_979_904, "storage": 0}
    assert out["moves"]["max_received_bytes_per_rank"] == 7_868_928
    # sends are spread over the old ranks that hold the same slice, not all taken from the lowest
    senders = {mv["from_rank"] for mv in moves["moves"] if mv["route"] == "inter_node"}
    assert senders == set(range(8, 16))


def test_serving_8_to_16_over_two_nodes(tmp_path, cli):
    old = _old(tmp_path, 8, Layout(tp=2, dp=4), SERVE)
    out, moves, new = _replan(cli, old, tmp_path, "--nodes", "2")
    assert load_manifest(new).hardware.num_nodes == 2
    held = _check_exact_cover(old, new, moves)
    assert out["to_num_gpus"] == 16 and out["from"]["num_gpus"] == 8
    ranks = out["moves"]["ranks"]
    assert len(ranks) == 16 and all(r["node"] == r["rank"] // 8 for r in ranks)
    chosen = out["candidates"][out["chosen"] - 1]["plan"]
    assert (chosen["tp"], chosen["pp"], chosen["dp"]) == (1, 1, 16)
    full_copy = NUM_PARAMS * BF16
    assert held["weights"] == 16 * full_copy
    # ranks 0-7 keep their tp=2 half (and the replicated norms) and fetch the other half next door;
    # the new node's GPUs held nothing, so each gets a whole copy from node 0
    assert all(r["kept_bytes"] == 0 and r["received_inter_node_bytes"] == full_copy for r in ranks[8:])
    assert moves["kept_bytes"] == 8 * (NUM_PARAMS + 8 * 2 * 256 + 256) == 42_012_672
    assert moves["moved_bytes_by_route"] == {"intra_node": 41_943_040, "inter_node": 8 * full_copy, "storage": 0}
    assert moves["moved_bytes"] == sum(r["received_bytes"] for r in ranks) == 125_898_752


def test_training_moves_weights_and_optimizer_states(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4, zero_stage=1), TRAIN)
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8", "--margin", "0")
    m = load_manifest(new)
    held = _check_exact_cover(old, new, moves)
    assert out["chosen"] == 1  # margin 0: the best objective, whatever it moves
    L = m.layout
    # ZeRO >= 1 partitions the optimizer states: every element's state sits on one rank per tp slice
    replicas = 1 if L.zero_stage >= 1 else L.dp * L.cp
    norms_extra = (L.tp - 1) * (8 * 2 * 256 + 256)
    assert held["optimizer"] == ADAMW_STATE_BYTES * replicas * (NUM_PARAMS + norms_extra)
    assert set(moves["moved_bytes_by_state"]) == {"weights", "optimizer"}


def test_bf16_optimizer_states_move_at_their_own_size(tmp_path, cli):
    """A plan with bf16 master weights and moments (--master-dtype/--moment-dtype bf16) keeps 6
    bytes of optimizer state a parameter where the default keeps 12; a re-plan moves those."""
    from dataclasses import replace

    from shardplan.units import DType

    wl = replace(TRAIN, master_dtype=DType.BF16, moment_dtype=DType.BF16)
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4, zero_stage=1), wl)
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8", "--margin", "0")
    m = load_manifest(new)
    assert m.workload.master_dtype == "bf16" and m.workload.moment_dtype == "bf16"
    held = _check_exact_cover(old, new, moves)
    norms_extra = (m.layout.tp - 1) * (8 * 2 * 256 + 256)
    assert held["optimizer"] == 6 * (NUM_PARAMS + norms_extra)


def test_margin_picks_the_least_moving_layout_within_it(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4, zero_stage=3), TRAIN)
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8", "--margin", "0.05", "--top", "6")
    _check_exact_cover(old, new, moves)
    cands = out["candidates"]
    assert all((c["gap_fraction"] <= 0.05) == c["within_margin"] for c in cands)
    within = [c for c in cands if c["within_margin"]]
    chosen = next(c for c in cands if c["chosen"])
    assert chosen["moved_bytes"] == min(c["moved_bytes"] for c in within)
    assert chosen["moved_bytes"] < cands[0]["moved_bytes"]  # here a slower-by-<5% layout moves less
    assert out["moves"]["moved_bytes"] == chosen["moved_bytes"]


def test_moves_agree_with_the_checkpoint_plan_of_the_new_manifest(tmp_path, cli):
    """What a new rank holds (kept + received) is what it would read from a real checkpoint,
    at the plan's bf16 against the checkpoint's fp32."""
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)
    r = cli("replan", old, "--gpus", "8", "-o", tmp_path / "new.yaml", "--moves", tmp_path / "moves.yaml", "--top", "3",
            "--json")
    assert r.exit_code == 0, r.stderr
    out, new = r.json(), tmp_path / "new.yaml"
    assert out["moves_file"] == str(tmp_path / "moves.yaml") and not (tmp_path / "new.moves.json").exists()
    import torch

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({t.name: torch.zeros(t.shape) for t in model_tensors(SPEC)}, str(ckpt / "model.safetensors"))
    loads = cli("checkpoint", new, ckpt, "--json").json()
    for rk, plan_rank in zip(out["moves"]["ranks"], loads["ranks"]):
        assert (rk["kept_bytes"] + rk["received_bytes"]) * 4 / BF16 == plan_rank["bytes"]
    import yaml

    listed = yaml.safe_load((tmp_path / "moves.yaml").read_text())
    assert listed["moved_bytes"] == out["moves"]["moved_bytes"] and len(listed["moves"]) == out["moves"]["num_pieces"]


def test_table_output_and_bad_input(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)
    r = cli("replan", old, "--gpus", "8")
    assert r.exit_code == 0 and "chosen" in r.stdout and "Per new rank" in r.stdout
    assert not list(tmp_path.glob("*.moves.*"))  # nothing written without -o / --moves
    r = cli("replan", old)
    assert r.exit_code == 2 and "--gpus N or --nodes N" in r.stderr
    r = cli("replan", old, "--gpus", "12")
    assert r.exit_code == 2 and "whole node" in r.stderr
    text = old.read_text().replace(load_manifest(old).model.spec_sha256, "0" * 64)
    (tmp_path / "edited.yaml").write_text(text)
    r = cli("replan", tmp_path / "edited.yaml", "--gpus", "8")
    assert r.exit_code == 2 and "field 'model.spec_sha256'" in r.stderr and "\n" not in r.stderr.strip()


def test_nothing_fits_exits_3(tmp_path, cli):
    m, _ = build_plan("llama-3.1-70b", 8, Layout(tp=8), InferenceWorkload(max_model_len=8192))
    write_manifest(m, tmp_path / "old.yaml")
    r = cli("replan", tmp_path / "old.yaml", "--gpus", "1", "--json")
    assert r.exit_code == 3
    out = r.json()
    assert out["chosen"] is None and out["candidates"] == [] and out["num_feasible"] == 0


@pytest.mark.parametrize("a,b,parts", [
    (((0, 4), (0, 4)), ((1, 3), (1, 3)), 4),
    (((0, 4), (0, 4)), ((0, 4), (2, 6)), 1),
    (((0, 4),), ((5, 6),), 1),
])
def test_box_subtraction_partitions(a, b, parts):
    rest = subtract(a, b)
    assert len(rest) == parts
    inter = intersect(a, b)
    assert sum(map(box_numel, rest)) + (box_numel(inter) if inter else 0) == math.prod(h - l for l, h in a)


# ----- failure-aware replan: lost ranks, the checkpoint, link times -------------------------------

from functools import lru_cache  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from shardplan.plan.placement import bytes_per_element  # noqa: E402
from shardplan.specs.loading import load_hardware  # noqa: E402
from shardplan.tasks._safetensors import StoredTensor  # noqa: E402
from shardplan.tasks.replan import Devices, link_costs, lost_old_ranks, move_summary, moves_between  # noqa: E402

GPN = 4  # GPUs per node in the property test: 2-4 nodes are 8-16 ranks
H100 = load_hardware("h100-sxm-80gb")
HW = H100.with_topology(gpus_per_node=GPN)
F32 = 4
TRAIN_ANY_DP = TrainingWorkload(seq_len=512, global_batch_size=48)  # 48: a multiple of every dp of 4-16 ranks


def _expected_link(route: str) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a route, from the profile's own figures: DGX H100
    NVSwitch 450 GB/s x 0.82, NDR InfiniBand 50 GB/s x 0.90 (latencies 6 and 5 us), and the
    node's NVMe 50 GB/s x efficiency.nvme shared by its GPUs (no latency)."""
    if route == "intra_node":
        assert (HW.intra_node.bandwidth_bytes_per_second, HW.intra_node.latency_seconds) == pytest.approx((450e9, 6e-6))
        return 450e9 * HW.intra_node.efficiency, 6e-6
    if route == "inter_node":
        assert (HW.inter_node.bandwidth_bytes_per_second, HW.inter_node.latency_seconds) == pytest.approx((50e9, 5e-6))
        return 50e9 * HW.inter_node.efficiency, 5e-6
    assert route == "storage" and HW.nvme_bandwidth_bytes_per_second_per_node == 50e9
    return 50e9 * HW.nvme_efficiency / GPN, 0.0


@lru_cache(maxsize=None)
def _manifest(gpus: int, tp: int, pp: int, dp: int, training: bool, zero: int):
    layout = Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero) if training else Layout(tp=tp, pp=pp, dp=dp)
    return build_plan("debug", gpus, layout, TRAIN_ANY_DP if training else SERVE, gpus_per_node=GPN)[0]


def _stored() -> dict[str, StoredTensor]:
    """A checkpoint's headers as `read_checkpoint` returns them (fp32, one file), without a file."""
    out, offset = {}, 8 + 4096
    for t in model_tensors(SPEC):
        out[t.name] = StoredTensor(t.name, "model.safetensors", "F32", t.shape, offset, t.numel * F32)
        offset += t.numel * F32
    return out


@st.composite
def _layout(draw, gpus: int) -> tuple[int, int, int]:
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if gpus % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2, 4) if gpus // tp % d == 0]))
    return tp, pp, gpus // (tp * pp)


@st.composite
def _scenario(draw):
    old_nodes, new_nodes = draw(st.integers(2, 4)), draw(st.integers(1, 4))
    training = draw(st.booleans())
    zero = draw(st.sampled_from([0, 1, 3])) if training else 0
    old = _manifest(old_nodes * GPN, *draw(_layout(old_nodes * GPN)), training, zero)
    new = _manifest(new_nodes * GPN, *draw(_layout(new_nodes * GPN)), training, zero)
    if draw(st.booleans()):
        nodes = draw(st.lists(st.integers(0, old_nodes - 1), min_size=1, max_size=old_nodes - 1, unique=True))
        lost = lost_old_ranks(old, GPN, lost_nodes=nodes)
    else:
        ranks = draw(st.lists(st.integers(0, old_nodes * GPN - 1), min_size=1, max_size=old_nodes * GPN - 1,
                              unique=True))
        lost = lost_old_ranks(old, GPN, lost_ranks=ranks)
    return old, new, lost, draw(st.booleans())


def _same_gpu_old_rank(q: int, old_num_gpus: int, lost: frozenset[int]) -> int | None:
    """The test's own reading of the device rule: surviving old nodes first, in order."""
    nodes = [n for n in range(old_num_gpus // GPN) if not set(range(n * GPN, (n + 1) * GPN)) <= lost]
    if q // GPN >= len(nodes):
        return None  # a node that joined
    return nodes[q // GPN] * GPN + q % GPN


@given(_scenario())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_lost_ranks_are_never_sources_and_every_byte_is_covered_once(scenario):
    old, new, lost, with_checkpoint = scenario
    devices = Devices.build(gpus_per_node=GPN, old_num_gpus=old.hardware.num_gpus, new_num_gpus=new.hardware.num_gpus,
                            lost=lost)
    stored = _stored() if with_checkpoint else None
    moves, missing = moves_between(old, new, SPEC, devices, HW, stored)
    pieces = defaultdict(list)
    for mv in moves:
        assert mv.from_rank not in lost  # the must-show: a lost rank is never a source
        pieces[(mv.state, mv.to_rank, mv.tensor)].append(mv.box)
    for u in missing:
        pieces[(u.state, u.to_rank, u.tensor)].append(u.box)
    states = ("weights", "optimizer") if new.workload.kind == "training" else ("weights",)
    received = defaultdict(float)
    for mv in moves:
        if mv.route != "local":
            received[mv.to_rank] += mv.nbytes
    for state in states:
        old_held = [{h.tensor.name: h.box for h in held} for held in rank_holdings(old, SPEC, state)]
        survivors = [r for r in range(old.hardware.num_gpus) if r not in lost]
        for q, held in enumerate(rank_holdings(new, SPEC, state)):
            same = _same_gpu_old_rank(q, old.hardware.num_gpus, lost)
            for h in held:
                boxes = pieces.pop((state, q, h.tensor.name))
                rest = [h.box]
                for b in boxes:  # exact cover: each piece carved out of what is left
                    assert sum(box_numel(intersect(r, b) or ((0, 0),)) for r in rest) == box_numel(b)
                    rest = [x for r in rest for x in subtract(r, b)]
                assert rest == []
                per_element = bytes_per_element(new, h.tensor, state)
                need = box_numel(h.box) * per_element
                kept_box = intersect(h.box, old_held[same][h.tensor.name]) \
                    if same is not None and same not in lost and h.tensor.name in old_held[same] else None
                kept = box_numel(kept_box) * per_element if kept_box else 0
                lost_bytes = sum(box_numel(u.box) * per_element for u in missing
                                 if (u.state, u.to_rank, u.tensor) == (state, q, h.tensor.name))
                received[q] -= need - kept - lost_bytes  # what it needs minus what it holds (minus what is lost)
        for mv in (m for m in moves if m.state == state):
            if mv.from_rank is None:  # the checkpoint: weights only, where no survivor holds any of it
                assert with_checkpoint and state == "weights" and mv.route == "storage"
                assert mv.file == "model.safetensors" and mv.read.nbytes == box_numel(mv.box) * F32
                assert mv.transfer_bytes == mv.read.nbytes
            else:
                assert intersect(old_held[mv.from_rank][mv.tensor], mv.box) == mv.box
                assert (mv.route == "local") == (mv.from_rank == _same_gpu_old_rank(mv.to_rank, old.hardware.num_gpus,
                                                                                    lost))
                assert mv.transfer_bytes == mv.nbytes
        for u in (u for u in missing if u.state == state):  # truly unrecoverable: no survivor holds any element
            assert not with_checkpoint or state == "optimizer"
            assert all(intersect(old_held[r].get(u.tensor, ((0, 0),) * len(u.box)), u.box) is None for r in survivors)
    assert not pieces
    assert all(abs(v) < 1e-6 for v in received.values()), dict(received)
    # time: each piece's = transfer bytes / its link's bandwidth + latency, computed here from the profile
    for mv in moves:
        if mv.route == "local":
            assert mv.time_seconds == 0
        else:
            bw, lat = _expected_link(mv.route)
            assert mv.time_seconds == pytest.approx(mv.transfer_bytes / bw + lat, rel=1e-12)
    summary = move_summary(moves, devices, link_costs(HW))
    for r in summary["ranks"]:
        assert not set(r["sources"]) & lost
        per_route = {route: sum(mv.time_seconds for mv in moves if mv.to_rank == r["rank"] and mv.route == route)
                     for route in ("intra_node", "inter_node", "storage")}
        assert r["time_seconds"] == pytest.approx(max(per_route.values()))  # links in parallel, pieces in turn
        assert r["received_bytes"] == r["received_intra_node_bytes"] + r["received_inter_node_bytes"] \
            + r["received_storage_bytes"]
    assert summary["time_seconds"] == max(r["time_seconds"] for r in summary["ranks"])


def _two_nodes_of_8(tmp_path: Path) -> Path:
    """16 ranks, tp2 x pp2 x dp4: stage 0 is ranks 0-7 (node 0), stage 1 ranks 8-15 (node 1)."""
    return _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)


def test_losing_a_stages_only_node_exits_3_naming_from_checkpoint(tmp_path, cli):
    """The issue's case: node 1 leaves; before, the new ranks were told to receive from 8-15."""
    old = _two_nodes_of_8(tmp_path)
    m = load_manifest(old)
    stage1 = {h.tensor.name for h in rank_holdings(m, SPEC)[8]} - {h.tensor.name for h in rank_holdings(m, SPEC)[0]}
    # stage 1 also sits only on node 1: losing node 1 loses it, as losing node 0 loses stage 0
    r = cli("replan", old, "--gpus", "8", "--lost-nodes", "1", "--json")
    assert r.exit_code == 3 and "\n" not in r.stderr.strip() and "--from-checkpoint" in r.stderr
    assert any(name in r.stderr for name in stage1) and r.stdout == ""


def test_lost_ranks_leave_replicas_to_send_from(tmp_path, cli):
    old = _two_nodes_of_8(tmp_path)  # stage 1's tp slices are on ranks 8,10,12,14 and 9,11,13,15
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8", "--lost-ranks", "8-13")
    assert out["from"]["lost_ranks"] == list(range(8, 14))
    assert all(mv["source"] == "rank" and mv["from_rank"] not in range(8, 14) for mv in moves["moves"])
    # stage 1 survives only on ranks 14 and 15 (one tp half each): every stage-1 byte crosses from them
    senders = {mv["from_rank"] for mv in moves["moves"] if mv["route"] == "inter_node"}
    assert senders == {14, 15}
    assert [r["old_node"] for r in out["moves"]["ranks"]] == [0] * 8  # new node 0 is old node 0
    links = moves["links"]
    for mv in moves["moves"]:  # each piece's time from the profile: bytes / (bandwidth x efficiency) + latency
        if mv["route"] == "inter_node":
            assert links["inter_node"]["kind"] == "infiniband"
            assert mv["time_seconds"] == pytest.approx(mv["bytes"] / (50e9 * H100.inter_node.efficiency) + 5e-6)
        elif mv["route"] == "intra_node":
            assert mv["time_seconds"] == pytest.approx(mv["bytes"] / (450e9 * H100.intra_node.efficiency) + 6e-6)
    ranks = out["moves"]["ranks"]
    assert out["moves"]["time_seconds"] == max(r["time_seconds"] for r in ranks) > 0
    slowest = ranks[out["moves"]["slowest_rank"]]
    assert slowest["time_seconds"] == out["moves"]["time_seconds"]
    assert out["moves"]["moved_bytes_by_source"]["checkpoint"] == 0


def test_losing_node_0_renumbers_the_survivors_first(tmp_path, cli):
    """Node 0 leaves and a new node joins: new node 0 is old node 1 (its ranks keep stage 1's
    slices in place), new node 1 is the one that joined; stage 0, held only on node 0, is read
    from the checkpoint's files and byte ranges, which read exactly the tensor's slice."""
    import torch

    old = _two_nodes_of_8(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors, start = {}, 0
    for t in model_tensors(SPEC):  # distinct values: a wrong byte range reads the wrong numbers
        tensors[t.name] = (torch.arange(t.numel, dtype=torch.float64) + start).reshape(t.shape).to(torch.float32)
        start += t.numel
    names = list(tensors)
    weight_map = {}
    for i in range(2):
        rel = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in names[i::2]}, str(ckpt / rel))
        weight_map.update({n: rel for n in names[i::2]})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    r = cli("replan", old, "--nodes", "2", "--lost-nodes", "0", "--json")
    assert r.exit_code == 3 and "--from-checkpoint" in r.stderr and "model.embed_tokens.weight" in r.stderr
    out, moves, new = _replan(cli, old, tmp_path, "--nodes", "2", "--lost-nodes", "0", "--from-checkpoint", ckpt)
    ranks = out["moves"]["ranks"]
    assert [rk["old_node"] for rk in ranks] == [1] * 8 + [None] * 8
    assert out["checkpoint"] == str(ckpt)
    from_ckpt = [mv for mv in moves["moves"] if mv["source"] == "checkpoint"]
    assert from_ckpt and all(mv["from_rank"] is None and mv["route"] == "storage" and mv["link"] == "nvme"
                             for mv in from_ckpt)
    assert {mv["file"] for mv in from_ckpt} == set(weight_map.values())
    assert all(mv["from_rank"] is None or mv["from_rank"] >= 8 for mv in moves["moves"])
    storage_bw = 50e9 * H100.nvme_efficiency / 8
    for mv in from_ckpt:
        br = mv["byte_range"]
        assert mv["transfer_bytes"] == br["bytes"] == br["length"] * br["count"] == mv["bytes"] * 4 / BF16
        assert mv["time_seconds"] == pytest.approx(br["bytes"] / storage_bw)
        raw = b""
        with open(ckpt / mv["file"], "rb") as f:
            for i in range(br["count"]):
                f.seek(br["start"] + i * br["stride"])
                raw += f.read(br["length"])
        want = tensors[mv["tensor"]][tuple(slice(a, b) for a, b in mv["slice"])].contiguous()
        assert raw == want.numpy().tobytes(), mv["tensor"]
    by_source = out["moves"]["moved_bytes_by_source"]
    assert by_source["checkpoint"] == sum(mv["bytes"] for mv in from_ckpt) > 0
    assert sum(rk["received_storage_bytes"] for rk in ranks) == by_source["checkpoint"]
    _check_exact_cover_survivors(old, new, moves, lost=set(range(8)))


def _check_exact_cover_survivors(old_path: Path, new_path: Path, moves: dict, lost: set[int]) -> None:
    """Every slice is covered once; pieces from ranks come from survivors that hold them."""
    old, new = load_manifest(old_path), load_manifest(new_path)
    pieces = defaultdict(list)
    for mv in moves["moves"]:
        pieces[(mv["to_rank"], mv["tensor"])].append(mv)
    old_boxes = [{h.tensor.name: h.box for h in held} for held in rank_holdings(old, SPEC)]
    for q, held in enumerate(rank_holdings(new, SPEC)):
        for h in held:
            got = pieces.pop((q, h.tensor.name))
            rest = [h.box]
            for mv in got:
                b = tuple(map(tuple, mv["slice"]))
                rest = [x for r in rest for x in subtract(r, b)]
                if mv["from_rank"] is not None:
                    assert mv["from_rank"] not in lost and intersect(old_boxes[mv["from_rank"]][h.tensor.name], b) == b
            assert rest == [] and sum(box_numel(tuple(map(tuple, mv["slice"]))) for mv in got) == box_numel(h.box)
    assert not pieces


def test_zero3_training_loses_shards_the_checkpoint_gives_weights_not_optimizer_states(tmp_path, cli):
    """ZeRO-3 keeps one copy of each weight and optimizer-state shard: losing rank 15 loses
    its shards. The checkpoint gives the weights back; nothing gives the optimizer states."""
    import torch

    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4, zero_stage=3), TRAIN)
    r = cli("replan", old, "--gpus", "8", "--lost-ranks", "15", "--json")
    assert r.exit_code == 3 and "weight tensor(s)" in r.stderr and "--from-checkpoint" in r.stderr
    assert "\n" not in r.stderr.strip() and r.stdout == ""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({t.name: torch.zeros(t.shape) for t in model_tensors(SPEC)}, str(ckpt / "model.safetensors"))
    r = cli("replan", old, "--gpus", "8", "--lost-ranks", "15", "--from-checkpoint", ckpt, "--json")
    assert r.exit_code == 3 and "optimizer states" in r.stderr and "weights only" in r.stderr
    assert "\n" not in r.stderr.strip()


def test_prefer_fast_recovery_takes_the_soonest_back(tmp_path, cli):
    """With a wide margin the layout that moves fewest bytes is not the one back soonest."""
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)
    args = ("replan", old, "--gpus", "8", "--margin", "0.95", "--top", "6", "--lost-ranks", "15", "--json")
    least, fast = cli(*args).json(), cli(*args, "--prefer-fast-recovery").json()
    assert (least["prefer"], fast["prefer"]) == ("moved_bytes", "move_time_seconds")
    assert [c["move_time_seconds"] for c in least["candidates"]] == [c["move_time_seconds"] for c in fast["candidates"]]
    within = [c for c in fast["candidates"] if c["within_margin"]]
    chosen = next(c for c in fast["candidates"] if c["chosen"])
    assert chosen["move_time_seconds"] == min(c["move_time_seconds"] for c in within)
    assert fast["moves"]["time_seconds"] == chosen["move_time_seconds"]
    other = next(c for c in least["candidates"] if c["chosen"])
    assert other["moved_bytes"] == min(c["moved_bytes"] for c in within)
    assert chosen["move_time_seconds"] < other["move_time_seconds"] and chosen["moved_bytes"] > other["moved_bytes"]


@pytest.mark.parametrize("args,words", [
    (("--lost-nodes", "2"), "node 2 is not a node of the old plan"),
    (("--lost-nodes", "0,1"), "all 16 ranks"),
    (("--lost-ranks", "16"), "rank 16 is not a rank"),
    (("--lost-ranks", "0-15"), "all 16 ranks"),
    (("--lost-ranks", "a"), "not an index or a range"),
    (("--lost-ranks", "5-3"), "empty or too long"),
    (("--from-checkpoint", "nowhere"), "no such file or folder"),
])
def test_bad_losses_exit_2_with_one_line(tmp_path, cli, args, words):
    old = _two_nodes_of_8(tmp_path)
    r = cli("replan", old, "--gpus", "8", *args)
    assert r.exit_code == 2 and words in r.stderr and "\n" not in r.stderr.strip(), r.stderr
