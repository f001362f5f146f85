"""The move list of a re-plan: for every slice a new rank holds, where each piece comes from,
which link it crosses and how long that takes. Pure: no files are read or written here.

Where the ranks sit (`Devices`). Old rank r is GPU r % g of old node r // g (g: GPUs per
physical node). A lost rank's memory is gone: it is never a source. A node all of whose ranks
are lost (`--lost-nodes`, or every rank named by `--lost-ranks`) has left the cluster; a node
that lost only some ranks stays, its lost GPUs reused empty (a crashed process restarted, a
GPU reset or swapped). The new cluster's nodes are the surviving old nodes in order, then
nodes that join; new rank q is GPU q % g of the new cluster's node q // g. With nothing lost
this is the old numbering: new rank q and old rank q are one GPU for q < min(old, new).

Sources, for each piece of a new rank's slice, in this order of preference:
  1. the same GPU (a surviving old rank on new rank q's GPU): nothing moves (route `local`);
  2. a surviving old rank on the same node (route `intra_node`: NVLink/NVSwitch, xGMI, PCIe);
  3. a surviving old rank on another node (route `inter_node`: InfiniBand, RoCE, Ethernet);
  and within a tier the old rank asked to send the fewest bytes so far (then the lowest), so
  that new ranks needing the same layer spread over the surviving replicas;
  4. what no surviving rank holds: the safetensors checkpoint, read from storage (route
     `storage`; weights only: a safetensors checkpoint holds no optimizer states), as its
     file and byte range (`_safetensors.box_read`, the ranges `checkpoint` computes);
  5. otherwise the piece is unrecoverable and is returned as such.
A slice is cut where the sources' slices end, so the pieces of one slice cover it exactly once.

Time. A piece over a link takes transfer_bytes / bandwidth + latency (`LinkCost`), with the
profile's figures per GPU and direction times the link's efficiency (as `cost.comm` does):
intra_node from `node.intra_node_link`, inter_node from `node.inter_node_link`, storage from
`node.nvme_bandwidth_gb_per_s` x `efficiency.nvme` shared by the node's GPUs, which all read
at once (as `cost.time_training` shares NVMe offload), with no latency (the profile gives
none). A local piece takes 0. transfer_bytes is the plan's bytes for a piece from a rank and
the file bytes read for a piece from the checkpoint (its dtype may be wider than the plan's).
Per new rank, the pieces over one link run one after another and different links in
parallel: its time is the largest of its per-link sums. The whole move takes the time of its
slowest new rank (the ranks receive in parallel; a sender's own link is not modelled: the
spreading in 1-3 keeps senders few per piece).

Scale. Ranks of one shard make-up (`placement.Holdings`: the replicas of a data-parallel group)
hold the same slices, so the sources are looked up per make-up, never per rank. The first
`max_listed_ranks` new ranks (MAX_LISTED_RANKS) get their pieces one by one, as above (the bytes
each sender was asked for count the listed ranks' pieces only); the ranks past them are taken in
groups that hold the same slices and see the same sources (their make-up, the old make-up on
their GPU, the old make-ups on their node): one cover per group, a tier's boxes in box order,
counted once per rank in every total and in the slowest rank (`RankGroup`), never listed. Which
replica sends does not change a rank's bytes by route, so these are what listing every rank gives.
The work grows with the make-ups and the listed ranks: 2^24 GPUs cost about what 512 do.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator

from shardplan.errors import ShardplanError
from shardplan.plan.placement import Box, Holding, Holdings, box_numel, bytes_per_element, states
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.tasks._safetensors import Read, StoredTensor, box_read

ROUTES = ("local", "intra_node", "inter_node", "storage")
LINK_ROUTES = ROUTES[1:]  # the routes that take time


# ----- boxes -----------------------------------------------------------------------------------


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (x0, x1), (y0, y1) in zip(a, b):
        lo, hi = max(x0, y0), min(x1, y1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as disjoint boxes (at most two per dimension)."""
    return carve(a, b)[1]


def carve(a: Box, b: Box) -> tuple[Box | None, list[Box]]:
    """(`a` and `b`'s intersection or None, `a` minus `b` as `subtract` cuts it)."""
    inter = intersect(a, b)
    if inter is None:
        return None, [a]
    if inter == a:
        return inter, []
    out, rest = [], list(a)
    for d, ((lo, hi), (ilo, ihi)) in enumerate(zip(a, inter)):
        if lo < ilo:
            out.append(tuple(rest[:d]) + ((lo, ilo),) + tuple(rest[d + 1:]))
        if ihi < hi:
            out.append(tuple(rest[:d]) + ((ihi, hi),) + tuple(rest[d + 1:]))
        rest[d] = (ilo, ihi)
    return inter, out


# ----- where the ranks sit ---------------------------------------------------------------------


@dataclass(frozen=True)
class Devices:
    """The old and new ranks' GPUs, and the old ranks whose memory is lost."""

    gpus_per_node: int
    old_num_gpus: int
    new_num_gpus: int
    lost: frozenset[int]
    gone_nodes: tuple[int, ...]  # old nodes all of whose ranks are lost, in order: not in the new cluster

    @classmethod
    def build(cls, *, gpus_per_node: int, old_num_gpus: int, new_num_gpus: int, lost: frozenset[int]) -> "Devices":
        g = gpus_per_node
        lost_per_node = Counter(r // g for r in lost)  # counted from the lost ranks: never a walk over every rank
        gone = sorted(n for n, k in lost_per_node.items() if k == min(g, old_num_gpus - n * g))
        return cls(g, old_num_gpus, new_num_gpus, frozenset(lost), tuple(gone))

    @cached_property
    def _survivors_before_gone(self) -> tuple[int, ...]:
        """Per gone node, the surviving nodes before it (non-decreasing)."""
        return tuple(n - i for i, n in enumerate(self.gone_nodes))

    def old_node(self, r: int) -> int:
        return r // self.gpus_per_node

    def num_surviving_nodes(self) -> int:
        return self.num_old_nodes() - len(self.gone_nodes)

    def new_node(self, q: int) -> int:
        """The old node new rank q's GPU is on (>= the old node count: a node that joined): the
        new cluster's nodes are the surviving old nodes in order, then those that join."""
        n = q // self.gpus_per_node
        survivors = self.num_surviving_nodes()
        if n >= survivors:
            return self.num_old_nodes() + n - survivors
        return n + bisect_right(self._survivors_before_gone, n)  # the n-th node not gone

    def same_gpu(self, r: int, q: int) -> bool:
        return self.old_node(r) == self.new_node(q) and r % self.gpus_per_node == q % self.gpus_per_node

    def route(self, r: int, q: int) -> str:
        if self.same_gpu(r, q):
            return "local"
        return "intra_node" if self.old_node(r) == self.new_node(q) else "inter_node"

    def num_old_nodes(self) -> int:
        return -(-self.old_num_gpus // self.gpus_per_node)

    def old_ranks_on(self, node: int) -> range:
        """The old ranks on `node` (none on a node that joined)."""
        g = self.gpus_per_node
        return range(min(node * g, self.old_num_gpus), min((node + 1) * g, self.old_num_gpus))


# ----- links -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkCost:
    """What one piece over this link costs: transfer_bytes / bandwidth + latency."""

    route: str
    kind: str  # the profile's link kind (nvswitch, infiniband, ...), or "nvme"
    bandwidth_bytes_per_second: float  # per receiving GPU, efficiency applied
    latency_seconds: float

    def seconds(self, transfer_bytes: float) -> float:
        return transfer_bytes / self.bandwidth_bytes_per_second + self.latency_seconds


def link_costs(hw: HardwareProfile) -> dict[str, LinkCost]:
    """intra_node, inter_node and storage as the module docstring derives them."""
    intra, inter = hw.intra_node, hw.inter_node
    return {
        "intra_node": LinkCost("intra_node", intra.kind.value, intra.bandwidth_bytes_per_second * intra.efficiency,
                               intra.latency_seconds),
        "inter_node": LinkCost("inter_node", inter.kind.value, inter.bandwidth_bytes_per_second * inter.efficiency,
                               inter.latency_seconds),
        "storage": LinkCost("storage", "nvme",
                            hw.nvme_bandwidth_bytes_per_second_per_node * hw.nvme_efficiency / hw.gpus_per_node, 0.0),
    }


# ----- pieces ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Move:
    """One piece of a new rank's slice, where it comes from and what it costs."""

    tensor: str
    state: str  # "weights" or "optimizer"
    box: Box
    to_rank: int
    route: str  # local (same GPU: nothing moves), intra_node, inter_node, storage
    nbytes: float  # in the new plan's format
    from_rank: int | None  # None: from the checkpoint
    file: str | None = None  # checkpoint file, relative to its folder
    read: Read | None = None  # its byte range in that file
    transfer_bytes: float = 0.0  # bytes over the link: nbytes, or the file bytes read
    time_seconds: float = 0.0

    @property
    def source(self) -> str:
        return "rank" if self.from_rank is not None else "checkpoint"

    def as_dict(self, links: dict[str, LinkCost]) -> dict[str, Any]:
        out: dict[str, Any] = {"tensor": self.tensor, "state": self.state, "slice": [list(d) for d in self.box],
                               "source": self.source, "from_rank": self.from_rank}
        if self.read is not None:
            r = self.read
            out["file"] = self.file
            out["byte_range"] = {"start": r.start, "length": r.length, "count": r.count, "stride": r.stride,
                                 "bytes": r.nbytes}
        return {**out, "to_rank": self.to_rank, "route": self.route,
                "link": links[self.route].kind if self.route in links else "none", "bytes": num(self.nbytes),
                "transfer_bytes": num(self.transfer_bytes), "time_seconds": self.time_seconds}


@dataclass(frozen=True)
class Unrecoverable:
    """A piece no surviving rank holds and no checkpoint was given for (or an optimizer state)."""

    tensor: str
    state: str
    box: Box
    to_rank: int


def num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


MAX_LISTED_RANKS = 512  # new ranks whose pieces are listed one by one; the rest are counted in groups
MAX_DISTINCT_SLICES = 1 << 22  # make-ups x tensors a plan may ask to place: past it, refused (exit 2)


@dataclass(frozen=True)
class RankGroup:
    """New ranks past the listed ones that hold the same slices and see the same sources: what
    each of them keeps, receives and waits, figured once."""

    first_rank: int
    num_ranks: int
    kept_bytes: float  # per rank
    received_bytes: dict[str, float]  # per rank, per link route
    time_seconds_by_route: dict[str, float]  # per rank: its pieces over each link, one after another
    moved_bytes_by_state: dict[str, float]  # per rank
    num_pieces: int  # per rank, kept ones included
    num_moves: int  # per rank, over a link or from storage

    @property
    def time_seconds(self) -> float:
        return max(self.time_seconds_by_route.values())


@dataclass(frozen=True)
class MovePlan:
    """The pieces of the first `num_listed` new ranks one by one (`moves`), the ranks past them in
    groups (`rest`), and the pieces no source holds (`missing`: the listed ranks' own, and one
    per group of the rest, named for its first rank)."""

    moves: list[Move]
    missing: list[Unrecoverable]
    rest: list[RankGroup]
    num_listed: int


def moves_between(old: DeploymentManifest, new: DeploymentManifest, spec: ModelSpec, devices: Devices,
                  hw: HardwareProfile, checkpoint: dict[str, StoredTensor] | None = None,
                  ) -> tuple[list[Move], list[Unrecoverable]]:
    """Every piece of every slice the new plan's ranks hold with its one source, and the pieces
    that have none (see the module docstring for the order of preference)."""
    plan = plan_moves(old, new, spec, devices, hw, checkpoint, max_listed_ranks=None)
    return plan.moves, plan.missing


def plan_moves(old: DeploymentManifest, new: DeploymentManifest, spec: ModelSpec, devices: Devices,
               hw: HardwareProfile, checkpoint: dict[str, StoredTensor] | None = None, *,
               max_listed_ranks: int | None = MAX_LISTED_RANKS, source: str | None = None) -> MovePlan:
    """The pieces of the first `max_listed_ranks` new ranks (None: all), and the rest in groups.
    `source`: the old plan's file, for errors."""
    links = link_costs(hw)
    num_listed = devices.new_num_gpus if max_listed_ranks is None else min(max_listed_ranks, devices.new_num_gpus)
    out: list[Move] = []
    missing: list[Unrecoverable] = []
    sent: dict[int, float] = {}  # bytes each old rank has been asked to send so far
    sources, targets = {}, {}
    for state in states(new):
        sources[state] = _Sources(Holdings(old, spec, state), devices, sent, source)
        targets[state] = _checked(Holdings(new, spec, state), "the new plan")
        cost = _Cost(new, state, links, checkpoint)
        for q in range(num_listed):
            _listed_rank(q, targets[state].of_rank(q), sources[state], cost, out, missing)
    rest = _groups(sources, targets, devices, links, checkpoint, new, num_listed, missing)
    return MovePlan(out, missing, rest, num_listed)


# ----- the sources: surviving old ranks, per make-up ----------------------------------------------


def _checked(holdings: Holdings, what: str, source: str | None = None) -> Holdings:
    """`holdings`, refused (exit 2) when its make-ups would hold more than MAX_DISTINCT_SLICES
    slices in all (ZeRO over a huge group without hybrid sharding: every rank its own make-up)."""
    per_make_up = max(len(holdings.of_key(holdings.make_up_key(i)))
                      for i in range(0, holdings.num_make_ups, holdings.width))  # one per stage
    if holdings.num_make_ups * max(per_make_up, 1) > MAX_DISTINCT_SLICES:
        L = holdings.manifest.layout
        raise ShardplanError(f"{what} gives its {holdings.num_ranks:,} ranks {holdings.num_make_ups:,} distinct shard "
                             f"make-ups of up to {per_make_up:,} slices (tp {L.tp}, pp {L.pp}, ZeRO {L.zero_stage} "
                             f"over {holdings.dense_group:,} ranks): more than the {MAX_DISTINCT_SLICES:,} slices a "
                             "move list is computed for", source=source, field="layout",
                             hint="shard ZeRO within a node (hybrid_shard) or use fewer ranks")
    return holdings


class _Sources:
    """The surviving old ranks of one state: per tensor, each distinct box and the make-ups that
    hold it; and, for a box, the rank to ask in each tier (module docstring, 1-3): the one asked to
    send the fewest bytes so far, then the lowest."""

    def __init__(self, holdings: Holdings, devices: Devices, sent: dict[int, float], source: str | None) -> None:
        self.h, self.devices, self.sent = _checked(holdings, "the old plan", source), devices, sent
        self.g = devices.gpus_per_node
        lost_per_make_up = Counter(holdings.make_up(r) for r in devices.lost)
        boxes: dict[str, dict[Box, set[int]]] = {}
        for i in range(holdings.num_make_ups):
            if len(holdings.members(i)) > lost_per_make_up[i]:  # some rank of it survives
                for held in holdings.of_key(holdings.make_up_key(i)):
                    boxes.setdefault(held.tensor.name, {}).setdefault(held.box, set()).add(i)
        self.boxes = {name: {b: frozenset(ids) for b, ids in by_box.items()} for name, by_box in boxes.items()}
        self._cursor: dict[int, int] = {}  # make-up -> index of its first member perhaps not yet asked
        self._asked: dict[int, list[tuple[float, int]]] = {}  # make-up -> heap of (sent, rank), stale kept
        self._givers: dict[tuple[str, Box], list[tuple[Box, frozenset[int]]]] = {}
        self._members: dict[int, range] = {}
        self._cuts: dict[tuple[Box, tuple[Box, ...]], tuple[list[tuple[int, Box, int]], list[Box]]] = {}
        for r in sent:  # ranks asked in an earlier state's moves
            self.asked(r)

    def givers(self, name: str, box: Box) -> list[tuple[Box, frozenset[int]]]:
        """The distinct boxes of tensor `name` that overlap `box`, each with the make-ups holding it."""
        key = (name, box)
        found = self._givers.get(key)
        if found is None:
            found = self._givers[key] = [(b, ids) for b, ids in self.boxes.get(name, {}).items()
                                         if intersect(box, b) is not None]
        return found

    def cut(self, box: Box, order: tuple[Box, ...]) -> tuple[list[tuple[int, Box, int]], list[Box]]:
        """`box` covered by the boxes of `order` in turn: (per piece, the index of the box it comes
        from, the piece and its elements; what no box covers). The same for every rank that asks."""
        key = (box, order)
        found = self._cuts.get(key)
        if found is None:
            pieces, remaining = [], [box]
            for k, source in enumerate(order):
                if not remaining:
                    break
                left: list[Box] = []
                for piece in remaining:
                    got, rest = carve(piece, source)
                    if got is not None:
                        pieces.append((k, got, box_numel(got)))
                    left += rest
                remaining = left
            found = self._cuts[key] = (pieces, remaining)
        return found

    def asked(self, r: int) -> None:
        """`r` was asked to send: it now ranks by its bytes sent."""
        heapq.heappush(self._asked.setdefault(self.h.make_up(r), []), (self.sent[r], r))

    def farthest(self, make_ups: frozenset[int], node: int) -> tuple[float, int] | None:
        """(sent, rank) of the best surviving rank off `node` among those of `make_ups`."""
        best = None
        for i in make_ups:
            for cand in (self._first_unasked(i, node), self._least_sent(i, node)):
                if cand is not None and (best is None or cand < best):
                    best = cand
        return best

    def _first_unasked(self, i: int, node: int) -> tuple[float, int] | None:
        members = self._members.get(i)
        if members is None:
            members = self._members[i] = self.h.members(i)
        lost, sent = self.devices.lost, self.sent
        k = self._cursor.get(i, 0)
        while k < len(members) and (members[k] in lost or members[k] in sent):  # skipped for good
            k += 1
        self._cursor[i] = k
        for k in range(k, len(members)):
            r = members[k]
            if r // self.g != node and r not in lost and r not in sent:
                return 0.0, r
        return None

    def _least_sent(self, i: int, node: int) -> tuple[float, int] | None:
        heap = self._asked.get(i)
        if not heap:
            return None
        aside, found = [], None
        while heap:
            nbytes, r = heap[0]
            if self.sent[r] != nbytes:  # stale: it has sent more since
                heapq.heappop(heap)
            elif r // self.g == node:  # on the node: at most g of these
                aside.append(heapq.heappop(heap))
            else:
                found = (nbytes, r)
                break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found


@dataclass
class _Cost:
    """Bytes and seconds of pieces of one state in the new plan's format."""

    new: DeploymentManifest
    state: str
    links: dict[str, LinkCost]
    checkpoint: dict[str, StoredTensor] | None
    _per_element: dict[int, tuple[Any, float]] = field(default_factory=dict)  # id(kind) -> (kind, bytes)

    def per_element(self, held: Holding) -> float:
        kind = held.tensor.kind
        found = self._per_element.get(id(kind))
        if found is None or found[0] is not kind:
            found = self._per_element[id(kind)] = (kind, bytes_per_element(self.new, held.tensor, self.state))
        return found[1]

    def stored(self, name: str) -> StoredTensor | None:
        """The checkpoint's tensor to read a piece no surviving rank holds from: weights only."""
        return self.checkpoint.get(name) if self.checkpoint is not None and self.state == "weights" else None


# ----- the listed ranks: piece by piece ---------------------------------------------------------


def _listed_rank(q: int, held: list[Holding], src: _Sources, cost: _Cost, out: list[Move],
                 missing: list[Unrecoverable]) -> None:
    """New rank q's pieces of one state, each from its best source (module docstring)."""
    devices, sent, links, state = src.devices, src.sent, cost.links, cost.state
    node = devices.new_node(q)
    on_gpu = node * devices.gpus_per_node + q % devices.gpus_per_node
    if not (node < devices.num_old_nodes() and on_gpu < devices.old_num_gpus and on_gpu not in devices.lost):
        on_gpu = None
    make_up_on_gpu = src.h.make_up(on_gpu) if on_gpu is not None else None
    near = [(r, src.h.make_up(r)) for r in devices.old_ranks_on(node) if r != on_gpu and r not in devices.lost]
    for h in held:
        per_element = cost.per_element(h)
        ranked = []
        for box, make_ups in src.givers(h.tensor.name, h.box):
            if make_up_on_gpu in make_ups:
                key = (0, sent.get(on_gpu, 0.0), on_gpu)
            else:
                best = min(((sent.get(r, 0.0), r) for r, i in near if i in make_ups), default=None)
                if best is None:
                    best = src.farthest(make_ups, node)
                if best is None:  # not expected: the box's make-ups have a surviving rank, none on this node
                    continue
                key = (1 if best[1] // devices.gpus_per_node == node else 2, *best)
            ranked.append((key, box))
        ranked.sort()
        pieces, remaining = src.cut(h.box, tuple(box for _, box in ranked))
        for k, got, numel in pieces:
            tier, _, r = ranked[k][0]
            route = ROUTES[tier]
            nbytes = numel * per_element
            seconds = 0.0 if route == "local" else links[route].seconds(nbytes)
            out.append(Move(h.tensor.name, state, got, q, route, nbytes, r, transfer_bytes=nbytes,
                            time_seconds=seconds))
            if route != "local":
                sent[r] = sent.get(r, 0.0) + nbytes
                src.asked(r)
        for piece in remaining:  # held by no surviving rank
            stored = cost.stored(h.tensor.name)
            if stored is None:
                missing.append(Unrecoverable(h.tensor.name, state, piece, q))
                continue
            read = box_read(stored, piece)
            out.append(Move(h.tensor.name, state, piece, q, "storage", box_numel(piece) * per_element, None,
                            file=stored.file, read=read, transfer_bytes=read.nbytes,
                            time_seconds=_storage_seconds(links["storage"], read.nbytes)))


def _storage_seconds(link: LinkCost, nbytes: float) -> float:
    if link.bandwidth_bytes_per_second <= 0:
        raise ShardplanError("the hardware profile gives no storage read bandwidth, which reading from the checkpoint "
                             "needs", field="node.nvme_bandwidth_gb_per_s",
                             hint="set the node's NVMe (or shared storage) read bandwidth in the profile")
    return link.seconds(nbytes)


# ----- the ranks past them: per group -------------------------------------------------------------

# What a new rank sees of one state: (its make-up's key, the key of the surviving old rank on its
# GPU or None, the keys of the surviving old ranks on its node).
Sight = tuple[tuple[int, ...], tuple[int, ...] | None, frozenset[tuple[int, ...]]]


def _groups(sources: dict[str, _Sources], targets: dict[str, Holdings], devices: Devices,
            links: dict[str, LinkCost], checkpoint: dict[str, StoredTensor] | None, new: DeploymentManifest,
            first: int, missing: list[Unrecoverable]) -> list[RankGroup]:
    """The new ranks from `first` on, grouped by what they see in every state."""
    counts: dict[tuple[Sight, ...], list[int]] = {}  # sights -> [ranks, first rank]

    def add(sights: tuple[Sight, ...], num_ranks: int, first_rank: int) -> None:
        c = counts.setdefault(sights, [0, first_rank])
        c[0] += num_ranks
        c[1] = min(c[1], first_rank)

    for sights, num_ranks, first_rank in _sights(sources, targets, devices, first):
        add(sights, num_ranks, first_rank)
    figures: dict[tuple[str, Sight], _Figures] = {}
    costs = {state: _Cost(new, state, links, checkpoint) for state in sources}
    out = []
    for sights, (num_ranks, first_rank) in sorted(counts.items(), key=lambda kv: kv[1][1]):
        total = _Figures()
        for state, sight in zip(sources, sights):
            f = figures.get((state, sight))
            if f is None:
                f = figures[(state, sight)] = _cover(sight, sources[state], targets[state], costs[state])
            total = total + f
            missing += [Unrecoverable(name, state, box, first_rank) for name, box in f.missing]
        out.append(RankGroup(first_rank, num_ranks, total.kept_bytes, total.received_bytes,
                             total.time_seconds_by_route, total.moved_bytes_by_state, total.num_pieces,
                             total.num_moves))
    return out


def _sights(sources: dict[str, _Sources], targets: dict[str, Holdings], devices: Devices, first: int,
            ) -> Iterator[tuple[tuple[Sight, ...], int, int]]:
    """(what they see, how many ranks, the first of them) for the new ranks from `first` on: those on
    surviving old nodes node by node (nodes alike by their position in the plans' periods counted
    once), those on nodes that joined per make-up."""
    g, num_new = devices.gpus_per_node, devices.new_num_gpus
    on_old_nodes = min(num_new, devices.num_surviving_nodes() * g)
    old_h = [s.h for s in sources.values()]
    new_h = list(targets.values())
    old_period = math.lcm(*(h.period for h in old_h))
    new_period = math.lcm(*(h.period for h in new_h))

    def sight_of(q: int, r_on_gpu: int | None, near: list[int]) -> tuple[Sight, ...]:
        return tuple((nh.key(q), oh.key(r_on_gpu) if r_on_gpu is not None else None,
                      frozenset(oh.key(r) for r in near)) for oh, nh in zip(old_h, new_h))

    def node_sights(n_new: int) -> list[tuple[Sight, ...]]:
        node = devices.new_node(n_new * g)
        old_ranks = devices.old_ranks_on(node)
        near = [r for r in old_ranks if r not in devices.lost]
        out = []
        for j in range(g):
            r = node * g + j
            out.append(sight_of(n_new * g + j, r if r in old_ranks and r not in devices.lost else None, near))
        return out

    def pattern(n_new: int) -> tuple[Any, ...] | None:
        """Where whole node n_new sits in both plans' periods; None: it must be looked at rank by rank."""
        node = devices.new_node(n_new * g)
        old_ranks = devices.old_ranks_on(node)
        q0 = n_new * g
        if len(old_ranks) < g or any(r in devices.lost for r in old_ranks) or q0 + g > num_new:
            return None
        spans = []
        for h, period, first_rank in ((old_h[0], old_period, old_ranks[0]), (new_h[0], new_period, q0)):
            stage, local = divmod(first_rank, h.per_stage)
            if local + g > h.per_stage:  # straddles two stages
                return None
            spans.append((stage, local % period))
        return tuple(spans)

    def one_by_one(n_new: int) -> Iterator[tuple[tuple[Sight, ...], int, int]]:
        for j, sights in enumerate(node_sights(n_new)):
            q = n_new * g + j
            if first <= q < on_old_nodes:
                yield sights, 1, q

    # Whole new nodes [n_first, n_end) on surviving old nodes are cut into runs where neither plan's
    # stage nor the count of gone nodes before changes; inside a run a node's pattern repeats every
    # `cycle` nodes, so each run costs `cycle` looks, not one per node. Nodes with lost ranks,
    # part-filled nodes and nodes across a stage boundary are looked at rank by rank.
    n_first, n_end = -(-first // g), on_old_nodes // g
    gone = devices.gone_nodes
    survivor_index = lambda o: o - bisect_left(gone, o)  # noqa: E731  (the new node an old one is)
    cuts, single = {n_first, n_end, *devices._survivors_before_gone}, set()
    for o in {r // g for r in devices.lost} | {devices.num_old_nodes() - 1}:
        single.add(survivor_index(o))
    for h, to_new in ((old_h[0], survivor_index), (new_h[0], lambda n: n)):
        for stage in range(1, h.num_stages):
            node, inside = divmod(stage * h.per_stage, g)
            cuts.add(to_new(node))
            if inside:
                single.add(to_new(node))
    cuts |= single | {n + 1 for n in single}
    for n_new in sorted({first // g, n_end} | single):  # with the node `first` is in and the last, part-filled
        in_runs = n_first <= n_new < n_end
        if (in_runs and n_new in single) or (not in_runs and n_new * g < on_old_nodes):
            yield from one_by_one(n_new)
    cycle = math.lcm(old_period // math.gcd(old_period, g), new_period // math.gcd(new_period, g))
    cached: dict[tuple[Any, ...], list[tuple[Sight, ...]]] = {}
    nodes: Counter[tuple[Any, ...]] = Counter()
    first_node: dict[tuple[Any, ...], int] = {}
    edges = sorted(c for c in cuts if n_first <= c <= n_end)
    for a, b in zip(edges, edges[1:]):
        if a in single:
            continue
        keys = [pattern(n) for n in range(a, min(b, a + cycle))]
        if None in keys:  # not expected: every node of a run is whole and clean
            for n_new in range(a, b):
                yield from one_by_one(n_new)
            continue
        for t, key in enumerate(keys):
            nodes[key] += len(range(a + t, b, cycle))
            first_node[key] = min(first_node.get(key, a + t), a + t)
            if key not in cached:
                cached[key] = node_sights(a + t)
    for key, num_nodes in nodes.items():
        for j, sights in enumerate(cached[key]):
            yield sights, num_nodes, first_node[key] * g + j
    joined_from = max(first, on_old_nodes)
    if joined_from >= num_new:
        return
    # Nodes that joined see no old rank near: a rank's sight is its make-up's in each state.
    joint = new_h[0]
    per_stage, width = joint.per_stage, min(new_period, joint.per_stage)
    for stage in range(joint.num_stages):
        for residue in range(width):
            base = stage * per_stage + residue
            start = base if base >= joined_from else base + -(-(joined_from - base) // new_period) * new_period
            ranks = range(start, min((stage + 1) * per_stage, num_new), new_period)
            if ranks:
                yield tuple((nh.key(ranks[0]), None, frozenset()) for nh in new_h), len(ranks), ranks[0]


@dataclass(frozen=True)
class _Figures:
    """One rank's pieces of one or more states, summed."""

    kept_bytes: float = 0.0
    received_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINK_ROUTES, 0.0))
    time_seconds_by_route: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINK_ROUTES, 0.0))
    moved_bytes_by_state: dict[str, float] = field(default_factory=dict)
    num_pieces: int = 0
    num_moves: int = 0
    missing: tuple[tuple[str, Box], ...] = ()

    def __add__(self, o: "_Figures") -> "_Figures":
        states_ = {**self.moved_bytes_by_state}
        for k, v in o.moved_bytes_by_state.items():
            states_[k] = states_.get(k, 0.0) + v
        return _Figures(self.kept_bytes + o.kept_bytes,
                        {k: self.received_bytes[k] + o.received_bytes[k] for k in LINK_ROUTES},
                        {k: self.time_seconds_by_route[k] + o.time_seconds_by_route[k] for k in LINK_ROUTES},
                        states_, self.num_pieces + o.num_pieces, self.num_moves + o.num_moves,
                        self.missing + o.missing)


def _cover(sight: Sight, src: _Sources, target: Holdings, cost: _Cost) -> _Figures:
    """One rank's pieces of one state as its sight gives them: the boxes on its GPU, then on its
    node, then anywhere, each tier's in box order, then the checkpoint."""
    own, on_gpu, near = sight
    old = src.h
    on_gpu_boxes = {h.tensor.name: h.box for h in old.of_key(on_gpu)} if on_gpu is not None else {}
    near_boxes: dict[str, set[Box]] = {}
    for k in near:
        for h in old.of_key(k):
            near_boxes.setdefault(h.tensor.name, set()).add(h.box)
    links = cost.links
    kept = 0.0
    received = dict.fromkeys(LINK_ROUTES, 0.0)
    seconds = dict.fromkeys(LINK_ROUTES, 0.0)
    pieces = moves = 0
    missing = []
    for h in target.of_key(own):
        name, per_element = h.tensor.name, cost.per_element(h)
        tiers: list[tuple[str, Box]] = []
        seen: set[Box] = set()
        mine = on_gpu_boxes.get(name)
        for route, boxes in (("local", [mine] if mine is not None else []),
                             ("intra_node", sorted(near_boxes.get(name, ()))),
                             ("inter_node", sorted(src.boxes.get(name, {})))):
            for box in boxes:
                if box not in seen and intersect(h.box, box) is not None:
                    seen.add(box)
                    tiers.append((route, box))
        remaining = [h.box]
        for route, box in tiers:
            left: list[Box] = []
            for piece in remaining:
                got, rest = carve(piece, box)
                if got is not None:
                    nbytes = box_numel(got) * per_element
                    pieces += 1
                    if route == "local":
                        kept += nbytes
                    else:
                        moves += 1
                        received[route] += nbytes
                        seconds[route] += links[route].seconds(nbytes)
                left += rest
            remaining = left
        for piece in remaining:
            stored = cost.stored(name)
            if stored is None:
                missing.append((name, piece))
                continue
            read = box_read(stored, piece)
            pieces += 1
            moves += 1
            received["storage"] += box_numel(piece) * per_element
            seconds["storage"] += _storage_seconds(links["storage"], read.nbytes)
    moved = sum(received.values())
    return _Figures(kept, received, seconds, {cost.state: moved} if moved else {}, pieces, moves, tuple(missing))


# ----- totals ----------------------------------------------------------------------------------


def move_summary(moves: list[Move], devices: Devices, links: dict[str, LinkCost],
                 rest: list[RankGroup] = (), num_listed: int | None = None) -> dict[str, Any]:
    """Bytes by route, source and state; per listed new rank what it keeps and receives, and its
    time (the largest of its per-link sums); the whole move's time (the slowest rank's, listed or
    not). `rest`: the ranks past the first `num_listed` (None: all are listed), in groups."""
    num_listed = devices.new_num_gpus if num_listed is None else num_listed
    by_route = {r: 0.0 for r in ROUTES}
    by_source = {"rank": 0.0, "checkpoint": 0.0}
    by_state: dict[str, float] = {}
    ranks: list[dict[str, Any]] = [{
        "rank": q, "node": q // devices.gpus_per_node,
        "old_node": devices.new_node(q) if devices.new_node(q) < devices.num_old_nodes() else None,
        "kept_bytes": 0.0, "received_bytes": 0.0, **{f"received_{r}_bytes": 0.0 for r in LINK_ROUTES},
        "time_seconds_by_route": {r: 0.0 for r in LINK_ROUTES}, "sources": set(), "checkpoint_files": set()}
        for q in range(num_listed)]
    for mv in moves:
        by_route[mv.route] += mv.nbytes
        r = ranks[mv.to_rank]
        if mv.route == "local":
            r["kept_bytes"] += mv.nbytes
            continue
        by_source[mv.source] += mv.nbytes
        by_state[mv.state] = by_state.get(mv.state, 0.0) + mv.nbytes
        r["received_bytes"] += mv.nbytes
        r[f"received_{mv.route}_bytes"] += mv.nbytes
        r["time_seconds_by_route"][mv.route] += mv.time_seconds
        if mv.from_rank is not None:
            r["sources"].add(mv.from_rank)
        else:
            r["checkpoint_files"].add(mv.file)
    for group in rest:  # each figure once per rank of the group
        n = group.num_ranks
        by_route["local"] += n * group.kept_bytes
        for route, nbytes in group.received_bytes.items():
            by_route[route] += n * nbytes
            by_source["checkpoint" if route == "storage" else "rank"] += n * nbytes
        for state, nbytes in group.moved_bytes_by_state.items():
            by_state[state] = by_state.get(state, 0.0) + n * nbytes
    for r in ranks:
        r["sources"] = sorted(r["sources"])
        r["checkpoint_files"] = sorted(r["checkpoint_files"])
        r["time_seconds"] = max(r["time_seconds_by_route"].values())
        for k in ("kept_bytes", "received_bytes", *(f"received_{x}_bytes" for x in LINK_ROUTES)):
            r[k] = num(r[k])
    # (time, rank) of the slowest rank, listed or in a group, and the most one rank receives
    tops = [(r["time_seconds"], -r["rank"]) for r in ranks] + [(g.time_seconds, -g.first_rank) for g in rest]
    slowest_time, slowest_rank = max(tops, default=(0.0, 0))
    most = max([r["received_bytes"] for r in ranks] + [sum(g.received_bytes.values()) for g in rest], default=0)
    moved = sum(by_route[r] for r in LINK_ROUTES)
    return {
        "num_moves": sum(1 for mv in moves if mv.route != "local") + sum(g.num_ranks * g.num_moves for g in rest),
        "num_pieces": len(moves) + sum(g.num_ranks * g.num_pieces for g in rest),
        "moved_bytes": num(moved),
        "kept_bytes": num(by_route["local"]),
        "moved_bytes_by_route": {k: num(by_route[k]) for k in LINK_ROUTES},
        "moved_bytes_by_source": {k: num(v) for k, v in by_source.items()},
        "moved_bytes_by_state": {k: num(v) for k, v in sorted(by_state.items())},
        "max_received_bytes_per_rank": num(most),
        "time_seconds": slowest_time,
        "slowest_rank": -slowest_rank,
        "links": {k: {"kind": v.kind, "bandwidth_bytes_per_second": v.bandwidth_bytes_per_second,
                      "latency_seconds": v.latency_seconds} for k, v in links.items()},
        "num_ranks_not_listed": devices.new_num_gpus - num_listed,
        "num_pieces_not_listed": sum(g.num_ranks * g.num_pieces for g in rest),
        "ranks": ranks,
    }
