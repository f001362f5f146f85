"""The serving rollout's order (`tasks/_rollout.py`), as a property over random old and new
replica sizes, GPU counts and losses, replayed step by step here: no GPU hosts two units at
once, a unit starts only on free GPUs of the new cluster (never a lost node's), every old unit
is drained (or was down, or is kept) and every new one started (or kept), the served rate never
falls below the floor reported, and, where the order says it is optimal, no order of drains keeps
a higher floor (brute force over every order)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.tasks._moves import Devices
from shardplan.tasks._rollout import REL_TOL, Unit, layout_units, rollout_order

GPN = 4  # GPUs per node: 1-4 nodes are 4-16 GPUs
BRUTE_FORCE_MAX_UNITS = 6  # 720 orders at most


def _divisors(n: int, of: tuple[int, ...] = (1, 2, 3, 4, 6, 8)) -> list[int]:
    return [d for d in of if n % d == 0]


@st.composite
def _layout(draw, gpus: int) -> tuple[int, int, int]:
    """(tp, pp, dp): tp and pp from 1-8, including 3 and 6, whose blocks do not nest with 2 and 4."""
    tp = draw(st.sampled_from(_divisors(gpus)))
    pp = draw(st.sampled_from(_divisors(gpus // tp)))
    return tp, pp, gpus // (tp * pp)


@st.composite
def _scenario(draw):
    old_nodes, new_nodes = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    old_gpus, new_gpus = old_nodes * GPN, new_nodes * GPN
    (tp0, _, dp0), (tp1, _, dp1) = draw(_layout(old_gpus)), draw(_layout(new_gpus))
    lost: set[int] = set()
    kind = draw(st.sampled_from(["none", "nodes", "ranks"]))
    if kind == "nodes" and old_nodes > 1:
        for n in draw(st.lists(st.integers(0, old_nodes - 1), min_size=1, max_size=old_nodes - 1, unique=True)):
            lost |= set(range(n * GPN, (n + 1) * GPN))
    elif kind == "ranks":
        lost = set(draw(st.lists(st.integers(0, old_gpus - 1), min_size=1, max_size=old_gpus - 1, unique=True)))
    devices = Devices.build(gpus_per_node=GPN, old_num_gpus=old_gpus, new_num_gpus=new_gpus, lost=frozenset(lost))
    old = layout_units(old_gpus, tp=tp0, cp=1, dp=dp0, replicas_per_unit=1, gpu_of=lambda r: (r // GPN, r % GPN))
    new = layout_units(new_gpus, tp=tp1, cp=1, dp=dp1, replicas_per_unit=1,
                       gpu_of=lambda q: (devices.new_node(q), q % GPN))
    old_rate = draw(st.sampled_from([1.0, 2.0, 3.0, 0.7]))
    new_rate = draw(st.sampled_from([1.0, 2.0, 3.0, 0.7, 1.3]))
    loads = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5]), min_size=len(new), max_size=len(new)))
    share = draw(st.one_of(st.none(), st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9, 1.0])))
    reuse = draw(st.booleans())
    return devices, old, new, old_rate, new_rate, loads, lost, share, reuse


def _brute_force_floor(old: list[Unit], new: list[Unit], drainable: list[int], kept: dict[int, int], a: float,
                       b: float) -> float:
    """The highest floor over every order of drains, each new unit up (loaded) as soon as the
    old units on its GPUs are drained: waiting for loads costs time, never rate."""
    holder = {g: j for j in drainable for g in old[j].gpus}
    needs = {k.index: {holder[g] for g in k.gpus if g in holder} for k in new if k.index not in kept}
    best = float("-inf")
    for order in itertools.permutations(drainable):
        up_old, drained = len(drainable), set()
        floor = a * up_old + b * len(kept)
        for j in order:
            up_new = len(kept) + sum(1 for need in needs.values() if need <= drained)
            up_old -= 1
            floor = min(floor, a * up_old + b * up_new)
            drained.add(j)
        best = max(best, floor)
    return best


@given(_scenario())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_rollout_keeps_its_floor_and_swaps_every_unit_once(scenario):
    devices, old, new, a, b, loads, lost, share, reuse = scenario
    down = {u.index for u in old if set(u.ranks) & lost}
    full = a * len(old)
    order = rollout_order(old, new, old_rate=a, new_rate=b, full_rate=full, load_seconds=loads, down=down,
                          reuse=reuse, floor_rate=None if share is None else share * full)
    tol = REL_TOL * full

    # the GPUs: the new cluster's, and those of nodes whose every rank is lost (gone)
    g = GPN
    cluster = {(devices.new_node(q), q % g) for q in range(devices.new_num_gpus)}
    gone_nodes = {n for n in range(devices.num_old_nodes()) if set(range(n * g, (n + 1) * g)) <= lost}
    assert not any(node in gone_nodes for u in new for node, _ in u.gpus)  # lost nodes' GPUs are never used

    # replay: who holds each GPU; a unit starts only on free GPUs of the new cluster
    kept_old = set(order.kept.values())
    assert set(order.down) == down and not kept_old & down
    assert all(old[j].gpus == new[k].gpus for k, j in order.kept.items()) and (reuse or not order.kept)
    holds = {gpu: ("old", u.index) for u in old if u.index not in down for gpu in u.gpus}
    holds.update({gpu: ("new", k) for k in order.kept for gpu in new[k].gpus})
    drained, started, ready_at, t = set(), set(), {}, 0.0
    for e in order.events:
        assert e.at_seconds >= t  # time order
        t = e.at_seconds
        if e.action == "drain":
            assert e.unit not in drained | down | kept_old
            for gpu in old[e.unit].gpus:
                assert holds.pop(gpu) == ("old", e.unit)
            drained.add(e.unit)
        else:
            assert e.action == "start" and e.unit not in started and e.unit not in order.kept
            for gpu in new[e.unit].gpus:
                assert gpu in cluster and gpu not in holds, (gpu, holds.get(gpu))  # no GPU hosts two units
                holds[gpu] = ("new", e.unit)
            assert e.ready_seconds == pytest.approx(t + loads[e.unit])
            assert set(e.after_drains) <= drained
            started.add(e.unit)
            ready_at[e.unit] = e.ready_seconds
        # the served rate, counted here: old units up, new ones kept or loaded by now
        rate = a * (len(old) - len(down) - len(kept_old) - len(drained)) \
            + b * (len(order.kept) + sum(1 for r in ready_at.values() if r <= t))
        assert e.rate == pytest.approx(rate, abs=tol)
        assert rate >= order.floor_rate - tol and rate >= order.min_rate - tol
    assert drained | down | kept_old == {u.index for u in old} and not drained & kept_old  # every old unit drained
    assert started | set(order.kept) == {u.index for u in new} and not started & set(order.kept)  # every new started
    assert order.start_rate >= order.floor_rate - tol

    # the floor: the one asked when some order keeps it, else the highest, and never above the ends
    assert order.max_floor_rate <= min(order.start_rate, order.end_rate) + tol
    assert order.end_rate == pytest.approx(b * len(new))
    assert order.min_rate >= order.floor_rate - tol
    if share is None:
        assert order.keeps_floor and order.floor_rate == order.max_floor_rate
    elif share * full <= order.max_floor_rate + tol:
        assert order.keeps_floor and order.floor_rate == share * full
    else:
        assert not order.keeps_floor and order.floor_rate == order.max_floor_rate
    assert order.duration_seconds == max([order.events[-1].at_seconds if order.events else 0.0]
                                         + list(ready_at.values()))

    # optimality: no order of drains keeps more (and when proven, none keeps as much or more but equal)
    drainable = [u.index for u in old if u.index not in down and u.index not in kept_old]
    if len(drainable) <= BRUTE_FORCE_MAX_UNITS:
        best = _brute_force_floor(old, new, drainable, order.kept, a, b)
        assert order.max_floor_rate <= best + tol
        if order.optimal:
            assert order.max_floor_rate == pytest.approx(best, abs=tol)


def test_the_exchange_rule_puts_gaining_groups_first_and_beats_index_order():
    """Four 1-GPU old units (1 tok/s each) -> new units of 1.5 tok/s: one on GPUs 0-1 (drains
    two for one: dip 2, net -0.5) and one on each of GPUs 2 and 3 (dip 1, net +0.5). Draining
    in index order falls to 2; the rule swaps the one-for-one units first and keeps 3."""
    gpu = lambda r: (0, r)  # noqa: E731
    old = layout_units(4, tp=1, cp=1, dp=4, replicas_per_unit=1, gpu_of=gpu)
    new = [Unit(0, (0, 1), (gpu(0), gpu(1))), Unit(1, (2,), (gpu(2),)), Unit(2, (3,), (gpu(3),))]
    order = rollout_order(old, new, old_rate=1.0, new_rate=1.5, full_rate=4.0, load_seconds=[1.0, 1.0, 1.0],
                          down=set(), reuse=False, floor_rate=None)
    assert order.optimal and order.max_floor_rate == 3.0 and order.limited_by == "swap"
    assert [(e.action, e.unit) for e in order.events] == [
        ("drain", 2), ("start", 1), ("drain", 3), ("start", 2), ("drain", 0), ("drain", 1), ("start", 0)]
    assert [e.at_seconds for e in order.events if e.action == "drain"] == [0.0, 1.0, 2.0, 2.0]  # each waits a load
    assert order.duration_seconds == 3.0 and order.min_rate == 3.0 and order.end_rate == 4.5


def test_a_floor_below_the_highest_drains_sooner_and_ends_sooner():
    gpu = lambda r: (0, r)  # noqa: E731
    old = layout_units(8, tp=1, cp=1, dp=8, replicas_per_unit=1, gpu_of=gpu)
    new = layout_units(8, tp=2, cp=1, dp=4, replicas_per_unit=1, gpu_of=gpu)
    kw = dict(old_rate=1.0, new_rate=2.5, full_rate=8.0, load_seconds=[10.0] * 4, down=set(), reuse=False)
    highest = rollout_order(old, new, floor_rate=None, **kw)
    half = rollout_order(old, new, floor_rate=4.0, **kw)
    assert highest.max_floor_rate == half.max_floor_rate == 6.0  # one tp2 swap at a time: 8 - 2
    assert highest.duration_seconds == 40.0  # each swap waits for the one before to load
    assert half.keeps_floor and half.min_rate == 4.0 and half.duration_seconds == 20.0
    too_high = rollout_order(old, new, floor_rate=7.0, **kw)
    assert not too_high.keeps_floor and too_high.floor_rate == 6.0 and too_high.min_rate == 6.0


def test_power_of_two_layouts_with_nothing_lost_form_complete_groups():
    """The docstring's claim, every pair of layouts checked: 4-32 GPUs, tp and pp of 1-8, nodes
    of 4 or 8 GPUs; the order is then proven to keep the highest floor."""
    checked = 0
    for old_gpus, new_gpus, gpn in itertools.product((4, 8, 16, 32), (4, 8, 16, 32), (4, 8)):
        devices = Devices.build(gpus_per_node=gpn, old_num_gpus=old_gpus, new_num_gpus=new_gpus, lost=frozenset())
        for tp0, pp0, tp1, pp1 in itertools.product((1, 2, 4, 8), repeat=4):
            if old_gpus % (tp0 * pp0) or new_gpus % (tp1 * pp1):
                continue
            old = layout_units(old_gpus, tp=tp0, cp=1, dp=old_gpus // (tp0 * pp0), replicas_per_unit=1,
                               gpu_of=lambda r: (r // gpn, r % gpn))
            new = layout_units(new_gpus, tp=tp1, cp=1, dp=new_gpus // (tp1 * pp1), replicas_per_unit=1,
                               gpu_of=lambda q: (devices.new_node(q), q % gpn))
            order = rollout_order(old, new, old_rate=1.0, new_rate=1.3, full_rate=float(len(old)),
                                  load_seconds=[1.0] * len(new), down=set(), reuse=False, floor_rate=None)
            assert order.optimal, (old_gpus, new_gpus, gpn, tp0, pp0, tp1, pp1)
            checked += 1
    assert checked == 3872
