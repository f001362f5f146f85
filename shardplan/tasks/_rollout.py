"""The serving rollout of a re-plan: in which order to start the new layout's replicas and drain
the old ones so that the served rate stays above a floor. Pure: no files are read or written.

Units. A unit is what one serving engine runs: a replica of tp x pp (x cp) ranks, or, when the
experts are split over several replicas (ep x etp > tp x cp), the group of replicas that share
them. Its GPUs are its ranks' (rank = ((pp_i x dp + dp_i) x cp + cp_i) x tp + tp_i, so a
replica's ranks are strided when pp > 1), placed as `_moves.Devices` places them: old rank r is
GPU r % g of old node r // g; new rank q is GPU q % g of the old node `Devices.new_node(q)`
(nodes that join are numbered after the old cluster's last). A GPU is named "node:gpu" in that
numbering. Every old unit serves the old plan's predicted rate per unit (a), every new one the
new plan's (b): generated tokens per second, the plan's
`predicted.time.throughput_tokens_per_second_per_replica` times the replicas of a unit. Shares
are of the old plan's full rate (every old unit up).

What already is. An old unit with a lost rank serves nothing and holds nothing: it is `down`,
its surviving GPUs free from the start. A GPU of a lost node is not in the new cluster and is
never used; a lost rank's GPU on a node that stays is reused empty (as the move list has it).
An old unit whose GPUs are a new unit's, rank for rank, with the same per-replica layout,
workload and profile (`same_engine`) and the same predicted rate (a = b; plans whose figures
are for different batches restart their units), is `kept`: it is that new unit already, and
neither drains nor restarts.

Steps. `drain j`: old unit j stops serving and frees its GPUs (drains are taken as instant: the
router stops sending it requests; in-flight requests finishing is not modelled). `start k`: new
unit k starts on its GPUs, which must all be free (never used, or freed by earlier drains), and
serves from `ready_seconds` = start + its load time: the largest of its ranks' weight bytes (the
plan's bytes at rest; with a checkpoint, the file bytes read) over the storage link of
`_moves.link_costs` (the node's NVMe read bandwidth x efficiency shared by its GPUs; a profile
with none reads over the inter-node network) plus the link's latency. Engine start-up beyond
reading weights (memory profiling, CUDA graph capture) is not counted.

The order. Join old and new units whose GPUs overlap into groups (connected components of the
overlap graph); a new unit can start only once every old unit of its group that it overlaps is
drained. A group that drains m old units and then starts n new ones is a job: its dip is
d = a x m (the rate lost before anything it starts is up) and its net e = b x n - a x m. The
jobs are run in this order: first those with e >= 0 by increasing d, then those with e < 0 by
decreasing d + e (what they give back); each drain waits, when it would take the rate below
the floor, until units already started are loaded. Groups with nothing to drain (new units on
free GPUs) come first and start at once; old units no new one needs come last.

Why that order keeps the highest floor any order keeps, when every group is complete (each of
its new units overlaps each of its old ones; with power-of-two GPU counts and degrees and
nothing lost, the replicas' strided rank blocks nest, so every group is complete, as a test
checks for 4-32 GPUs, tp and pp of 1-8 and 4 or 8 GPUs per node):
  1. Starting a new unit as soon as its GPUs are free never hurts: no other unit needs them.
  2. Waiting for started units to load costs time, never rate; so the floor an order keeps is
     min over its drains of (the rate before it, every started unit up) minus a.
  3. Moving a drain later, up to the first start that needs it, raises the rate in between and
     changes nothing after. In a complete group every start needs every drain, so some best
     order drains each group's units together, just before starting its units: a sequence of
     jobs, job i keeping rate L - d_i when started at rate L, leaving L + e_i.
  4. Two adjacent jobs i, j at rate L keep min(L - d_i, L + e_i - d_j) in the order i, j and
     leave L + e_i + e_j either way. If e_i >= 0 > e_j: i first keeps at least as much (j first
     keeps <= L + e_j - d_i < L - d_i, and <= L - d_j <= L + e_i - d_j). Both e >= 0: the
     smaller d first. Both e < 0: the larger d + e first. (Each by comparing the two minima
     term by term.) So no swap of neighbours out of the rule's order ever raises the floor, and
     bubble-sorting any job order into it never lowers it: the rule's order is optimal.
A group that is not complete (degrees like tp 3 against tp 2, or nodes renumbered after a
loss) is run as a job of its own, inside it the new unit needing fewest further drains first;
the floor it keeps is then the best found, not proven the highest (`optimal` says which).
With a floor below the highest, the same order is run, each drain as early as the floor
allows, so more units load at once and the rollout ends sooner.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import AbstractSet, Callable, Mapping, Sequence

from pydantic import Field

from shardplan.plan.placement import box_numel, bytes_per_element, rank_holdings
from shardplan.plan.schema import DeploymentManifest, ServingTime
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.tasks._moves import Devices, LinkCost, link_costs, num
from shardplan.tasks._results import Result
from shardplan.tasks._safetensors import StoredTensor, box_read

Gpu = tuple[int, int]  # (node, as the old cluster numbers it; GPU on it)
REL_TOL = 1e-9  # rates are sums of floats: a floor met to this share of the full rate is met


# ----- the pure core -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One serving engine's ranks and their GPUs, in rank order."""

    index: int
    ranks: tuple[int, ...]
    gpus: tuple[Gpu, ...]


@dataclass(frozen=True)
class Job:
    """A group of overlapping units, as (drain these, then start those) sub-steps."""

    substeps: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    dip: float  # the most the rate falls below where the job starts (tokens/s)
    net: float  # the rate after minus before (tokens/s)
    complete: bool  # each new unit overlaps each old one


@dataclass(frozen=True)
class Event:
    action: str  # "drain" or "start"
    unit: int  # the old unit (drain) or the new one (start)
    at_seconds: float
    ready_seconds: float | None  # start: when it serves
    rate: float  # served right after this step: old units up plus new units loaded by then (tokens/s)
    after_drains: tuple[int, ...]  # start: the old units whose draining freed its GPUs


@dataclass(frozen=True)
class Order:
    events: list[Event]
    kept: dict[int, int]  # new unit -> the old unit it already is
    down: tuple[int, ...]
    start_rate: float  # served before the first step
    end_rate: float  # served once every new unit is loaded
    max_floor_rate: float  # the highest floor any order keeps (proven when `optimal`)
    floor_rate: float  # the floor this order was built to keep
    limited_by: str  # what sets max_floor_rate: start, end or swap (Rollout.limited_by)
    min_rate: float  # the lowest the rate falls to
    keeps_floor: bool  # the floor asked for (if any) is kept
    optimal: bool
    duration_seconds: float


def _groups(old: Sequence[Unit], new: Sequence[Unit], old_ids: list[int], new_ids: list[int],
            ) -> tuple[list[tuple[list[int], list[int]]], dict[int, tuple[int, ...]]]:
    """Connected components of the overlap graph, and each new unit's overlapping old units."""
    holder = {gpu: j for j in old_ids for gpu in old[j].gpus}
    blockers = {k: tuple(sorted({holder[g] for g in new[k].gpus if g in holder})) for k in new_ids}
    parent = {("o", j): ("o", j) for j in old_ids} | {("n", k): ("n", k) for k in new_ids}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for k, js in blockers.items():
        for j in js:
            parent[find(("o", j))] = find(("n", k))
    members: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for j in old_ids:
        members.setdefault(find(("o", j)), ([], []))[0].append(j)
    for k in new_ids:
        members.setdefault(find(("n", k)), ([], []))[1].append(k)
    groups = sorted(members.values(), key=lambda g: (min(g[1], default=1 << 60), min(g[0], default=1 << 60)))
    return groups, blockers


def _job(olds: list[int], news: list[int], blockers: Mapping[int, tuple[int, ...]], a: float, b: float) -> Job:
    complete = all(set(blockers[k]) == set(olds) for k in news)
    if complete:
        substeps = [(tuple(olds), tuple(news))]
    else:  # the new unit that needs fewest further drains first, then every unit those free
        substeps, drained, waiting = [], set(), list(news)
        while waiting:
            k = min(waiting, key=lambda k: (len(set(blockers[k]) - drained), k))
            drain = tuple(sorted(set(blockers[k]) - drained))
            drained |= set(drain)
            start = tuple(x for x in waiting if set(blockers[x]) <= drained)
            waiting = [x for x in waiting if x not in start]
            substeps.append((drain, start))
    rel = dip = 0.0
    for drain, start in substeps:
        rel -= a * len(drain)
        dip = max(dip, -rel)
        rel += b * len(start)
    return Job(tuple(substeps), dip, rel, complete)


def _ordered(jobs: list[Job], tol: float) -> list[Job]:
    """Gaining jobs by increasing dip, then losing jobs by decreasing dip + net (module docstring, 4)."""
    gain = sorted((j for j in jobs if j.net >= -tol), key=lambda j: j.dip)
    lose = sorted((j for j in jobs if j.net < -tol), key=lambda j: -(j.dip + j.net))
    return gain + lose  # sorted() is stable: ties keep the groups' order


def rollout_order(old: Sequence[Unit], new: Sequence[Unit], *, old_rate: float, new_rate: float, full_rate: float,
                  load_seconds: Sequence[float], down: AbstractSet[int], reuse: bool,
                  floor_rate: float | None) -> Order:
    """The rollout from `old` to `new` units (each list indexed by unit index). `old_rate`,
    `new_rate`: tokens/s per unit; `full_rate`: the old plan's with every unit up; `down`: old
    units that serve nothing (a lost rank); `reuse`: a new unit on exactly an up old unit's GPUs
    is that unit (same engine settings); `floor_rate`: the rate to keep, None for the highest
    any order keeps. Asked for more than that, the order keeps the highest instead."""
    a, b, tol = old_rate, new_rate, REL_TOL * max(full_rate, 1.0)
    up = [u.index for u in old if u.index not in down]
    by_gpus = {old[j].gpus: j for j in up}
    kept = {u.index: by_gpus[u.gpus] for u in new if reuse and u.gpus in by_gpus}
    old_ids = [j for j in up if j not in kept.values()]
    new_ids = [u.index for u in new if u.index not in kept]
    groups, blockers = _groups(old, new, old_ids, new_ids)
    jobs = _ordered([_job(o, n, blockers, a, b) for o, n in groups], tol)
    num_old, num_new = len(old_ids), len(kept)  # units up (rates as a x count + b x count: no drift)
    start_rate = floor = a * num_old + b * num_new
    for job in jobs:  # every unit started before a drain is loaded by then (module docstring, 2)
        for drain, start in job.substeps:
            num_old -= len(drain)
            floor = min(floor, a * num_old + b * num_new)
            num_new += len(start)
    end_rate = a * num_old + b * num_new
    target = floor if floor_rate is None or floor_rate > floor + tol else floor_rate
    events = _schedule(jobs, a=a, b=b, num_old=len(old_ids), num_kept=len(kept), target=target, tol=tol,
                       load_seconds=load_seconds, blockers=blockers)
    end = max((e.ready_seconds if e.ready_seconds is not None else e.at_seconds for e in events), default=0.0)
    limited_by = "start" if floor >= start_rate - tol else "end" if floor >= end_rate - tol else "swap"
    return Order(events=events, kept=kept, down=tuple(sorted(down)), start_rate=start_rate, end_rate=end_rate,
                 max_floor_rate=floor, floor_rate=target, limited_by=limited_by,
                 min_rate=min([start_rate] + [e.rate for e in events if e.action == "drain"]),
                 keeps_floor=floor_rate is None or target == floor_rate, optimal=all(j.complete for j in jobs),
                 duration_seconds=end)


def _schedule(jobs: list[Job], *, a: float, b: float, num_old: int, num_kept: int, target: float, tol: float,
              load_seconds: Sequence[float], blockers: Mapping[int, tuple[int, ...]]) -> list[Event]:
    """The jobs' steps in order, each drain at the earliest time it keeps `target`."""
    t, num_new = 0.0, num_kept  # new units serving: kept ones, then those loaded
    pending: list[float] = []  # ready times of started units not yet loaded
    events: list[Event] = []

    def advance_to(time: float) -> None:
        nonlocal num_new
        while pending and pending[0] <= time:
            heapq.heappop(pending)
            num_new += 1

    for job in jobs:
        for drain, start in job.substeps:
            for j in drain:
                while a * (num_old - 1) + b * num_new < target - tol and pending:
                    t = pending[0]  # wait for the next unit to load
                    advance_to(t)
                num_old -= 1
                events.append(Event("drain", j, t, None, a * num_old + b * num_new, ()))
            for k in start:
                ready = t + load_seconds[k]
                heapq.heappush(pending, ready)
                advance_to(t)
                events.append(Event("start", k, t, ready, a * num_old + b * num_new, blockers[k]))
    return events


# ----- from manifests --------------------------------------------------------------------------


def engine_replicas(m: DeploymentManifest) -> int:
    """Replicas one engine runs: 1, or those an expert group spans (ep x etp over tp x cp);
    an expert group that is not a whole number of replicas couples them all."""
    L = m.layout
    span, per_replica = L.ep * L.etp, L.tp * L.cp
    if span <= per_replica:
        return 1
    group = span // per_replica
    return group if span % per_replica == 0 and L.dp % group == 0 else L.dp


def units(m: DeploymentManifest, gpu_of: Callable[[int], Gpu]) -> list[Unit]:
    """The plan's serving engines, each with its ranks (rank order) and their GPUs."""
    L = m.layout
    return layout_units(m.hardware.num_gpus, tp=L.tp, cp=L.cp, dp=L.dp, replicas_per_unit=engine_replicas(m),
                        gpu_of=gpu_of)


def layout_units(num_gpus: int, *, tp: int, cp: int, dp: int, replicas_per_unit: int,
                 gpu_of: Callable[[int], Gpu]) -> list[Unit]:
    """Rank r is in replica dp_i = (r // (tp x cp)) % dp (rank = ((pp_i x dp + dp_i) x cp + cp_i)
    x tp + tp_i), and in unit dp_i // replicas_per_unit."""
    ranks: list[list[int]] = [[] for _ in range(dp // replicas_per_unit)]
    for r in range(num_gpus):
        ranks[(r // (tp * cp)) % dp // replicas_per_unit].append(r)
    return [Unit(i, tuple(rs), tuple(gpu_of(r) for r in rs)) for i, rs in enumerate(ranks)]


def replica_rate(m: DeploymentManifest) -> float:
    """Generated tokens/s of one replica; plans written before the per-replica figure recorded
    one replica's under throughput_tokens_per_second."""
    t = m.predicted.time
    if not isinstance(t, ServingTime):
        return 0.0
    per = t.throughput_tokens_per_second_per_replica
    return per if per is not None else t.throughput_tokens_per_second


def same_engine(old: DeploymentManifest, new: DeploymentManifest) -> bool:
    """A unit of one plan can serve as a unit of the other: same model, hardware profile,
    per-replica layout, stages and workload (the batch its figures are for aside: no export
    passes it to the engine)."""
    def layout(m: DeploymentManifest) -> dict:
        return m.layout.model_dump(exclude={"dp"})

    def engine(m: DeploymentManifest) -> dict:
        return m.workload.model_dump(exclude={"batch_size"})

    def stages(m: DeploymentManifest) -> list:
        return [(s.layer_ranges, s.embedding, s.lm_head) for s in m.placement.stages]

    return (old.model.spec_sha256 == new.model.spec_sha256 and old.hardware.profile_name == new.hardware.profile_name
            and layout(old) == layout(new) and engine(old) == engine(new) and stages(old) == stages(new)
            and engine_replicas(old) == engine_replicas(new))


def load_link(hw: HardwareProfile) -> LinkCost:
    """What a starting engine reads its weights over: storage, or the network when the profile
    gives no storage bandwidth."""
    links = link_costs(hw)
    return links["storage"] if links["storage"].bandwidth_bytes_per_second > 0 else links["inter_node"]


def load_bytes_per_rank(m: DeploymentManifest, spec: ModelSpec, stored: dict[str, StoredTensor] | None) -> list[float]:
    """Bytes each rank reads to start: its weights at rest in the plan's format, or with a
    checkpoint the file bytes of its slices (the checkpoint's dtype may be wider)."""
    out = []
    for held in rank_holdings(m, spec, "weights"):
        if stored is None:
            out.append(sum(box_numel(h.box) * bytes_per_element(m, h.tensor) for h in held))
        else:
            out.append(sum(box_read(stored[h.tensor.name], h.box).nbytes for h in held))
    return out


# ----- the result --------------------------------------------------------------------------------


class LoadLink(Result):
    kind: str = Field(description="nvme (the node's storage), or the inter-node link when the profile gives no storage")
    bandwidth_bytes_per_second: float = Field(description="per reading GPU, efficiency applied (bytes/s)")
    latency_seconds: float = Field(description="added once per load (s)")
    bytes_from: str = Field(description="plan: the bytes a rank holds at rest; checkpoint: the file bytes it reads")


class RolloutReplica(Result):
    """One unit (a replica, or the replicas one engine runs) of the old or the new layout."""

    replica: int = Field(description="its index in its layout")
    ranks: list[int] = Field(description="its ranks in its plan")
    gpus: list[str] = Field(description="'node:gpu' per rank; nodes as the old cluster numbers them, joined ones after")
    status: str = Field(description="old: drained, down (a lost rank: serves nothing from the start) or kept; "
                                    "new: started or kept (an old unit already is it)")
    kept_as: int | None = Field(description="kept: the unit of the other layout it is")
    load_bytes: float | None = Field(description="new, started: the most one of its GPUs reads (bytes)")
    load_seconds: float | None = Field(description="new, started: its load time (s)")


class RolloutStep(Result):
    step: int = Field(description="1-based, in time order")
    action: str = Field(description="drain (an old unit stops serving, its GPUs freed) or start (a new unit)")
    replica: int = Field(description="the old unit drained or the new unit started")
    gpus: list[str] = Field(description="its GPUs, 'node:gpu'")
    at_seconds: float = Field(description="when the step is taken, from the rollout's start (s)")
    ready_seconds: float | None = Field(description="start: when it has loaded and serves (s)")
    after_drains: list[int] = Field(description="start: the old units whose GPUs it takes (drained before)")
    capacity_tokens_per_second: float = Field(description="served right after the step: old units up and new ones "
                                                          "loaded by then (generated tokens/s)")
    capacity_share: float = Field(description="that over the old plan's full rate (fraction)")


class Rollout(Result):
    """Serving: the order that starts the new layout's units and drains the old ones, keeping
    the served rate above a floor (a share of the old plan's full rate)."""

    full_capacity_tokens_per_second: float = Field(description="the old plan's rate, every unit up "
                                                               "(generated tokens/s)")
    old_replica_tokens_per_second: float = Field(description="one old unit's (generated tokens/s)")
    new_replica_tokens_per_second: float = Field(description="one new unit's (generated tokens/s)")
    min_capacity: float | None = Field(description="the floor asked for (--min-capacity, fraction); None: the highest")
    floor_share: float = Field(description="the floor the order keeps: the one asked, or the highest any order keeps "
                                           "when none was asked or it cannot be kept (fraction)")
    max_floor_share: float = Field(description="the highest floor any order keeps (fraction; see `optimal`)")
    keeps_floor: bool = Field(description="the floor asked is kept (false: exit 3; the order keeps max_floor_share)")
    limited_by: str = Field(description="what sets max_floor_share: start (units lost before the rollout serve "
                                        "nothing), end (the new layout serves less), or swap (old units must drain "
                                        "before new ones can start on their GPUs)")
    optimal: bool = Field(description="max_floor_share is proven the highest (every group of overlapping units is "
                                      "complete); false: the best this order finds")
    start_share: float = Field(description="served before the first step: lost units serve nothing (fraction)")
    min_share: float = Field(description="the lowest the served rate falls to (fraction)")
    end_share: float = Field(description="served once every new unit is up (fraction)")
    duration_seconds: float = Field(description="until the last new unit serves (s)")
    load_link: LoadLink
    old_replicas: list[RolloutReplica]
    new_replicas: list[RolloutReplica]
    steps: list[RolloutStep]


def _label(g: Gpu) -> str:
    return f"{g[0]}:{g[1]}"


def plan_rollout(old: DeploymentManifest, new: DeploymentManifest, spec: ModelSpec, devices: Devices,
                 hw: HardwareProfile, stored: dict[str, StoredTensor] | None, min_capacity: float | None,
                 ) -> Rollout | None:
    """The rollout from the old serving plan to the new one on the devices the move list uses;
    None when the old plan predicts no rate to take shares of."""
    g = devices.gpus_per_node
    old_units = units(old, lambda r: (r // g, r % g))
    new_units = units(new, lambda q: (devices.new_node(q), q % g))
    a = replica_rate(old) * engine_replicas(old)
    b = replica_rate(new) * engine_replicas(new)
    full = a * len(old_units)
    if not full > 0:
        return None
    link = load_link(hw)
    per_rank = load_bytes_per_rank(new, spec, stored)
    load_bytes = [max(per_rank[q] for q in u.ranks) for u in new_units]
    load_seconds = [link.seconds(x) for x in load_bytes]
    down = {u.index for u in old_units if set(u.ranks) & devices.lost}
    order = rollout_order(old_units, new_units, old_rate=a, new_rate=b, full_rate=full, load_seconds=load_seconds,
                          down=down, reuse=same_engine(old, new) and math.isclose(a, b, rel_tol=REL_TOL),
                          floor_rate=None if min_capacity is None else min_capacity * full)
    kept_old = {j: k for k, j in order.kept.items()}

    def share(rate: float) -> float:
        return rate / full

    olds = [RolloutReplica(replica=u.index, ranks=list(u.ranks), gpus=[_label(x) for x in u.gpus],
                           status="down" if u.index in down else "kept" if u.index in kept_old else "drained",
                           kept_as=kept_old.get(u.index), load_bytes=None, load_seconds=None) for u in old_units]
    news = [RolloutReplica(replica=u.index, ranks=list(u.ranks), gpus=[_label(x) for x in u.gpus],
                           status="kept" if u.index in order.kept else "started", kept_as=order.kept.get(u.index),
                           load_bytes=None if u.index in order.kept else num(load_bytes[u.index]),
                           load_seconds=None if u.index in order.kept else load_seconds[u.index]) for u in new_units]
    steps = [RolloutStep(step=i + 1, action=e.action, replica=e.unit,
                         gpus=[_label(x) for x in (old_units if e.action == "drain" else new_units)[e.unit].gpus],
                         at_seconds=e.at_seconds, ready_seconds=e.ready_seconds, after_drains=list(e.after_drains),
                         capacity_tokens_per_second=e.rate, capacity_share=share(e.rate))
             for i, e in enumerate(order.events)]
    return Rollout(
        full_capacity_tokens_per_second=full, old_replica_tokens_per_second=a, new_replica_tokens_per_second=b,
        min_capacity=min_capacity, floor_share=share(order.floor_rate), max_floor_share=share(order.max_floor_rate),
        keeps_floor=order.keeps_floor, limited_by=order.limited_by, optimal=order.optimal,
        start_share=share(order.start_rate), min_share=share(order.min_rate), end_share=share(order.end_rate),
        duration_seconds=order.duration_seconds,
        load_link=LoadLink(kind=link.kind, bandwidth_bytes_per_second=link.bandwidth_bytes_per_second,
                           latency_seconds=link.latency_seconds, bytes_from="plan" if stored is None else "checkpoint"),
        old_replicas=olds, new_replicas=news, steps=steps,
    )
