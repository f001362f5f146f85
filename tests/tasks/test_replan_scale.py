"""`replan` at scale: the move list is computed per shard make-up, not per rank x tensor.

- The pieces of the listed ranks are exactly those of the rule in `tasks/_moves.py` applied
  rank by rank, tensor by tensor, source by source (written out plainly here: `_reference`),
  for dense and MoE plans, lost ranks and nodes, with and without a checkpoint.
- The ranks past the listed ones, taken in groups, add up to what listing them would give:
  every total, each rank's bytes by route, the slowest rank's time, the pieces with no source.
- 2^24 GPUs: a 2-GPU plan grown to 2^24 replicas, and a 2^24-replica plan that lost one rank,
  with their figures known in closed form; the CLI lists 512 ranks and says how many it left out.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache

import pytest
from conftest import REPO, build_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.plan.manifest import load_manifest, write_manifest
from shardplan.plan.placement import box_numel, bytes_per_element, model_tensors, rank_holdings, states
from shardplan.specs.loading import load_hardware, load_model
from shardplan.tasks import _moves
from shardplan.tasks._moves import Devices, Move, Unrecoverable, link_costs, move_summary, moves_between, plan_moves
from shardplan.tasks._safetensors import StoredTensor, box_read

SERVE = InferenceWorkload(max_model_len=512, input_len=256, output_len=64)
TRAIN = TrainingWorkload(seq_len=512, global_batch_size=960)  # 960: a multiple of every dp used here
TINY_MOE = str(REPO / "tests" / "data" / "models" / "tiny-qwen3-next.yaml")
H100 = load_hardware("h100-sxm-80gb")
DEBUG_BF16_BYTES = 5_247_232 * 2  # one whole copy of the debug model's weights
ROUTES = ("intra_node", "inter_node", "storage")


def _reference(old, new, spec, devices, hw, checkpoint):
    """The rule of `tasks/_moves.py` as it reads: for each new rank and tensor, every surviving old
    rank holding the tensor, sorted by (not on its GPU, not on its node, bytes sent so far, rank),
    cuts what is still missing; what none holds comes from the checkpoint, or is unrecoverable."""
    links = link_costs(hw)
    g = devices.gpus_per_node
    num_old_nodes = -(-devices.old_num_gpus // g)
    alive = [n for n in range(num_old_nodes)
             if not set(range(n * g, min((n + 1) * g, devices.old_num_gpus))) <= devices.lost]
    new_nodes = alive + list(range(num_old_nodes, num_old_nodes + devices.new_num_gpus // g))  # then nodes that join

    def tier(r: int, q: int) -> tuple[bool, bool]:  # (not on q's GPU, not on q's node)
        same_node = r // g == new_nodes[q // g]
        return not (same_node and r % g == q % g), not same_node

    out, lost, sent = [], [], {}
    for state in states(new):
        holders = {}
        for r, held in enumerate(rank_holdings(old, spec, state)):
            if r not in devices.lost:
                for h in held:
                    holders.setdefault(h.tensor.name, []).append((r, h.box))
        for q, held in enumerate(rank_holdings(new, spec, state)):
            for h in held:
                per_element = bytes_per_element(new, h.tensor, state)
                sources = sorted(holders.get(h.tensor.name, ()), key=lambda rb: (*tier(rb[0], q), sent.get(rb[0], 0.0),
                                                                                 rb[0]))
                remaining = [h.box]
                for r, box in sources:
                    route, left = ("local", "intra_node", "inter_node")[sum(tier(r, q))], []
                    for piece in remaining:
                        got = _moves.intersect(piece, box)
                        if got is not None:
                            nbytes = box_numel(got) * per_element
                            out.append(Move(h.tensor.name, state, got, q, route, nbytes, r, transfer_bytes=nbytes,
                                            time_seconds=0.0 if route == "local" else links[route].seconds(nbytes)))
                            if route != "local":
                                sent[r] = sent.get(r, 0.0) + nbytes
                        left += _moves.subtract(piece, box)
                    remaining = left
                for piece in remaining:
                    stored = checkpoint.get(h.tensor.name) if checkpoint is not None and state == "weights" else None
                    if stored is None:
                        lost.append(Unrecoverable(h.tensor.name, state, piece, q))
                        continue
                    read = box_read(stored, piece)
                    out.append(Move(h.tensor.name, state, piece, q, "storage", box_numel(piece) * per_element, None,
                                    file=stored.file, read=read, transfer_bytes=read.nbytes,
                                    time_seconds=links["storage"].seconds(read.nbytes)))
    return out, lost


@lru_cache(maxsize=None)
def _plan(model: str, gpus: int, gpn: int, tp: int, pp: int, ep: int, training: bool, zero: int, hybrid: bool):
    dp = gpus // (tp * pp)
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 else None, zero_stage=zero, hybrid_shard=hybrid) \
        if training else Layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=1 if ep > 1 else None)
    return build_plan(model, gpus, layout, TRAIN if training else SERVE, gpus_per_node=gpn)[0]


@lru_cache(maxsize=None)
def _checkpoint(model: str) -> dict[str, StoredTensor]:
    out, offset = {}, 8 + 4096
    for t in model_tensors(load_model(model).spec):
        out[t.name] = StoredTensor(t.name, "model.safetensors", "BF16", t.shape, offset, t.numel * 2)
        offset += t.numel * 2
    return out


@st.composite
def _layout(draw, model: str, gpus: int) -> tuple[int, int, int]:
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if gpus % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2, 4) if gpus // tp % d == 0]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if gpus // pp % d == 0])) if model == TINY_MOE else 1
    return tp, pp, ep


@st.composite
def _scenario(draw, max_nodes: int):
    model = draw(st.sampled_from(["debug", "debug", TINY_MOE]))
    training = model == "debug" and draw(st.booleans())
    zero = draw(st.sampled_from([0, 1, 3])) if training else 0
    hybrid = training and zero > 0 and draw(st.booleans())
    gpn_old, gpn_new = draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4]))
    nodes = [n for n in (1, 2, 3, 4, 5, 6, 8, 10, 12) if n <= max_nodes]
    old_gpus, new_gpus = gpn_old * draw(st.sampled_from(nodes)), gpn_new * draw(st.sampled_from(nodes))
    old = _plan(model, old_gpus, gpn_old, *draw(_layout(model, old_gpus)), training, zero, hybrid)
    new = _plan(model, new_gpus, gpn_new, *draw(_layout(model, new_gpus)), training, zero, hybrid)
    g = max(gpn_old, gpn_new)
    num_old_nodes = -(-old_gpus // g)
    lost: set[int] = set()
    if num_old_nodes > 1 and draw(st.booleans()):
        for n in draw(st.lists(st.integers(0, num_old_nodes - 1), max_size=num_old_nodes - 1, unique=True)):
            lost |= set(range(n * g, min((n + 1) * g, old_gpus)))
    alive = sorted(set(range(old_gpus)) - lost)
    lost |= set(draw(st.lists(st.sampled_from(alive), max_size=len(alive) - 1, unique=True)))
    devices = Devices.build(gpus_per_node=g, old_num_gpus=old_gpus, new_num_gpus=new_gpus, lost=frozenset(lost))
    checkpoint = _checkpoint(model) if draw(st.booleans()) else None
    return old, new, load_model(model).spec, devices, H100.with_topology(gpus_per_node=g), checkpoint


def _fixed(model: str, old: tuple, new: tuple, *, lost=(), training=False, zero=0, hybrid=False, checkpoint=False):
    """A scenario by hand: old and new as (gpus, GPUs per node, tp, pp, ep)."""
    (old_gpus, gpn_old, *old_layout), (new_gpus, gpn_new, *new_layout) = old, new
    g = max(gpn_old, gpn_new)
    devices = Devices.build(gpus_per_node=g, old_num_gpus=old_gpus, new_num_gpus=new_gpus, lost=frozenset(lost))
    return (_plan(model, old_gpus, gpn_old, *old_layout, training, zero, hybrid),
            _plan(model, new_gpus, gpn_new, *new_layout, training, zero, hybrid), load_model(model).spec, devices,
            H100.with_topology(gpus_per_node=g), _checkpoint(model) if checkpoint else None)


FIXED = {  # cases a random draw may miss
    "node 0 gone, its ranks renumbered": lambda: _fixed("debug", (16, 4, 2, 2, 1), (16, 4, 1, 1, 1),
                                                        lost=range(4), checkpoint=True),
    "nodes 1 and 3 gone, rank 9 lost": lambda: _fixed("debug", (24, 4, 1, 2, 1), (24, 4, 2, 1, 1),
                                                      lost=[4, 5, 6, 7, 9, 12, 13, 14, 15]),
    "ZeRO-3 over 24 ranks on 2-GPU nodes: node patterns cycle": lambda: _fixed(
        "debug", (24, 2, 1, 1, 1), (20, 2, 1, 1, 1), training=True, zero=3),
    "ZeRO-3 over 24 ranks, node 3 gone": lambda: _fixed("debug", (24, 2, 1, 1, 1), (24, 2, 1, 1, 1), lost=[6, 7],
                                                        training=True, zero=3),
    "tp 4 on 2-GPU nodes, node 3 gone: the nodes after it shift": lambda: _fixed(
        "debug", (24, 2, 4, 1, 1), (24, 2, 4, 1, 1), lost=[6, 7]),
    "stages that start inside a node": lambda: _fixed("debug", (12, 4, 1, 2, 1), (24, 4, 1, 4, 1), lost=[7]),
    "experts over 4 ranks, a node lost": lambda: _fixed(TINY_MOE, (16, 4, 2, 1, 4), (8, 4, 1, 1, 2),
                                                        lost=range(4, 8), checkpoint=True),
}


@pytest.mark.parametrize("case", FIXED)
def test_listed_pieces_by_hand(case):
    _check_listed(FIXED[case]())


@pytest.mark.parametrize("case", FIXED)
@pytest.mark.parametrize("listed", [0, 5])
def test_groups_by_hand(case, listed):
    _check_groups(FIXED[case](), listed)


@given(_scenario(max_nodes=4))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_listed_pieces_are_the_rule_applied_rank_by_rank(scenario):
    _check_listed(scenario)


def _check_listed(scenario) -> None:
    old, new, spec, devices, hw, checkpoint = scenario
    want_moves, want_lost = _reference(old, new, spec, devices, hw, checkpoint)
    moves, lost = moves_between(old, new, spec, devices, hw, checkpoint)
    assert moves == want_moves  # every piece, its source, route, bytes and time, in the same order
    assert lost == want_lost


def _rank_figures(r: dict) -> tuple:
    return r["kept_bytes"], tuple(r[f"received_{k}_bytes"] for k in ROUTES)


def _group_figures(g: _moves.RankGroup) -> tuple:
    return _moves.num(g.kept_bytes), tuple(_moves.num(g.received_bytes[k]) for k in ROUTES)


@given(_scenario(max_nodes=12), st.integers(0, 48))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_ranks_in_groups_add_up_to_the_ranks_listed(scenario, listed):
    _check_groups(scenario, listed)


def _check_groups(scenario, listed: int) -> None:
    old, new, spec, devices, hw, checkpoint = scenario
    links = link_costs(hw)
    every = move_summary(*moves_between(old, new, spec, devices, hw, checkpoint)[:1], devices, links)
    _, every_lost = moves_between(old, new, spec, devices, hw, checkpoint)
    plan = plan_moves(old, new, spec, devices, hw, checkpoint, max_listed_ranks=listed)
    some = move_summary(plan.moves, devices, links, plan.rest, plan.num_listed)
    assert plan.num_listed == min(listed, devices.new_num_gpus)
    assert [r["rank"] for r in some["ranks"]] == list(range(plan.num_listed))
    # the listed ranks' figures (their senders too, but for a later state's: the sends of the ranks
    # left out no longer weigh in which replica is asked)
    for mine, theirs in zip(some["ranks"], every["ranks"]):
        assert _rank_figures(mine) == _rank_figures(theirs)
        assert mine["time_seconds"] == pytest.approx(theirs["time_seconds"], rel=1e-12)
    for key in ("moved_bytes", "kept_bytes", "moved_bytes_by_route", "moved_bytes_by_source", "moved_bytes_by_state",
                "max_received_bytes_per_rank", "num_moves", "num_pieces"):
        assert some[key] == every[key], key
    assert some["time_seconds"] == pytest.approx(every["time_seconds"], rel=1e-12)
    assert every["ranks"][some["slowest_rank"]]["time_seconds"] == pytest.approx(every["time_seconds"], rel=1e-12)
    assert some["num_ranks_not_listed"] == devices.new_num_gpus - plan.num_listed
    assert some["num_pieces_not_listed"] == every["num_pieces"] - len(plan.moves)
    # each group's figures are those of each of its ranks
    assert sum(g.num_ranks for g in plan.rest) == some["num_ranks_not_listed"]
    grouped = Counter()
    for g in plan.rest:
        grouped[_group_figures(g)] += g.num_ranks
        assert _group_figures(g) == _rank_figures(every["ranks"][g.first_rank])
        assert g.time_seconds == pytest.approx(every["ranks"][g.first_rank]["time_seconds"], rel=1e-12)
    assert grouped == Counter(_rank_figures(r) for r in every["ranks"][plan.num_listed:])
    assert {(u.state, u.tensor) for u in plan.missing} == {(u.state, u.tensor) for u in every_lost}


def test_two_gpus_grown_to_2_to_the_24():
    """Replicas of debug on 2 GPUs to 2^24: new ranks 0-1 keep their copy, 2-7 share old node 0
    with them, every other rank receives a whole copy over the network; rank 8 is the first."""
    old, _ = build_plan("debug", 2, Layout(dp=2), SERVE, gpus_per_node=2)
    new, _ = build_plan("debug", 1 << 24, Layout(dp=1 << 24), SERVE, gpus_per_node=8)
    spec = load_model("debug").spec
    hw = H100.with_topology(gpus_per_node=8)
    devices = Devices.build(gpus_per_node=8, old_num_gpus=2, new_num_gpus=1 << 24, lost=frozenset())
    plan = plan_moves(old, new, spec, devices, hw)
    s = move_summary(plan.moves, devices, link_costs(hw), plan.rest, plan.num_listed)
    assert plan.num_listed == len(s["ranks"]) == 512 and s["num_ranks_not_listed"] == (1 << 24) - 512
    assert len(plan.rest) == 1 and plan.rest[0].first_rank == 512  # one group: the ranks on joined nodes
    assert s["kept_bytes"] == 2 * DEBUG_BF16_BYTES
    assert s["moved_bytes_by_route"] == {"intra_node": 6 * DEBUG_BF16_BYTES,
                                         "inter_node": ((1 << 24) - 8) * DEBUG_BF16_BYTES, "storage": 0}
    assert s["num_pieces"] == (1 << 24) * 75 and s["num_pieces_not_listed"] == ((1 << 24) - 512) * 75
    assert s["slowest_rank"] == 8 and s["time_seconds"] == s["ranks"][8]["time_seconds"]
    assert s["max_received_bytes_per_rank"] == DEBUG_BF16_BYTES
    assert {mv.to_rank for mv in plan.moves} == set(range(512))
    senders = Counter(mv.from_rank for mv in plan.moves if mv.route == "inter_node")
    assert set(senders) == {0, 1}  # spread over both replicas


def test_2_to_the_24_replicas_that_lost_one_rank():
    """The same GPUs, one rank's memory lost: its GPU is reused empty and receives a whole copy,
    from the replica next to it; nothing else moves."""
    m, _ = build_plan("debug", 1 << 24, Layout(dp=1 << 24), SERVE, gpus_per_node=8)
    spec = load_model("debug").spec
    hw = H100.with_topology(gpus_per_node=8)
    devices = Devices.build(gpus_per_node=8, old_num_gpus=1 << 24, new_num_gpus=1 << 24, lost=frozenset({5_000_003}))
    plan = plan_moves(m, m, spec, devices, hw)
    s = move_summary(plan.moves, devices, link_costs(hw), plan.rest, plan.num_listed)
    assert s["moved_bytes"] == s["moved_bytes_by_route"]["intra_node"] == DEBUG_BF16_BYTES
    assert s["kept_bytes"] == ((1 << 24) - 1) * DEBUG_BF16_BYTES
    assert s["slowest_rank"] == 5_000_003 and s["time_seconds"] > 0
    assert len(plan.rest) <= 3  # the lost rank, its node's other ranks, every other rank


def test_cli_lists_the_first_512_ranks_and_counts_the_rest(tmp_path, cli):
    old, _ = build_plan("debug", 2, Layout(dp=2), SERVE, gpus_per_node=2)
    write_manifest(old, tmp_path / "old.yaml")
    r = cli("replan", tmp_path / "old.yaml", "--gpus", "1024", "-o", tmp_path / "new.yaml", "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()["moves"]
    listed = json.loads((tmp_path / "new.moves.json").read_text())
    assert len(out["ranks"]) == len(listed["ranks"]) == 512 and out["num_ranks_not_listed"] == 512
    assert {mv["to_rank"] for mv in listed["moves"]} == set(range(512))
    assert len(listed["moves"]) == out["num_pieces"] - out["num_pieces_not_listed"]
    # the totals count every rank: as listing all 1,024 gives them
    new = load_manifest(tmp_path / "new.yaml")
    devices = Devices.build(gpus_per_node=8, old_num_gpus=2, new_num_gpus=1024, lost=frozenset())
    every = move_summary(moves_between(old, new, load_model("debug").spec, devices, H100)[0], devices, link_costs(H100))
    for key in ("moved_bytes", "kept_bytes", "moved_bytes_by_route", "max_received_bytes_per_rank", "num_pieces",
                "slowest_rank"):
        assert out[key] == every[key], key


def test_too_many_shard_make_ups_is_a_one_line_error(tmp_path, cli, monkeypatch):
    old, _ = build_plan("debug", 16, Layout(tp=2, pp=2, dp=4, zero_stage=3), TRAIN, gpus_per_node=8)
    write_manifest(old, tmp_path / "old.yaml")
    monkeypatch.setattr(_moves, "MAX_DISTINCT_SLICES", 100)
    r = cli("replan", tmp_path / "old.yaml", "--gpus", "8", "--json")
    assert r.exit_code == 2 and r.stdout == ""
    assert "distinct shard make-ups" in r.stderr and "field 'layout'" in r.stderr and "\n" not in r.stderr.strip()
