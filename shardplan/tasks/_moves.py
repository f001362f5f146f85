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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardplan.errors import ShardplanError
from shardplan.plan.placement import Box, box_numel, bytes_per_element, rank_holdings, states
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.tasks._safetensors import Read, StoredTensor, box_read

ROUTES = ("local", "intra_node", "inter_node", "storage")
LINK_ROUTES = ROUTES[1:]  # the routes that take time


# ----- boxes -----------------------------------------------------------------------------------


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as disjoint boxes (at most two per dimension)."""
    inter = intersect(a, b)
    if inter is None:
        return [a]
    out, rest = [], list(a)
    for d, ((lo, hi), (ilo, ihi)) in enumerate(zip(a, inter)):
        if lo < ilo:
            out.append(tuple(rest[:d]) + ((lo, ilo),) + tuple(rest[d + 1:]))
        if ihi < hi:
            out.append(tuple(rest[:d]) + ((ihi, hi),) + tuple(rest[d + 1:]))
        rest[d] = (ilo, ihi)
    return out


# ----- where the ranks sit ---------------------------------------------------------------------


@dataclass(frozen=True)
class Devices:
    """The old and new ranks' GPUs, and the old ranks whose memory is lost."""

    gpus_per_node: int
    old_num_gpus: int
    new_num_gpus: int
    lost: frozenset[int]
    new_nodes: tuple[int, ...]  # per new node index, the old node it is (>= the old node count: one that joined)

    @classmethod
    def build(cls, *, gpus_per_node: int, old_num_gpus: int, new_num_gpus: int, lost: frozenset[int]) -> "Devices":
        g = gpus_per_node
        num_old_nodes = -(-old_num_gpus // g)
        gone = {n for n in range(num_old_nodes) if all(r in lost for r in range(n * g, min((n + 1) * g, old_num_gpus)))}
        survivors = [n for n in range(num_old_nodes) if n not in gone]
        num_new_nodes = -(-new_num_gpus // g)
        joined = range(num_old_nodes, num_old_nodes + max(0, num_new_nodes - len(survivors)))
        return cls(g, old_num_gpus, new_num_gpus, frozenset(lost), tuple((survivors + list(joined))[:num_new_nodes]))

    def old_node(self, r: int) -> int:
        return r // self.gpus_per_node

    def new_node(self, q: int) -> int:
        """The old node new rank q's GPU is on (>= the old node count: a node that joined)."""
        return self.new_nodes[q // self.gpus_per_node]

    def same_gpu(self, r: int, q: int) -> bool:
        return self.old_node(r) == self.new_node(q) and r % self.gpus_per_node == q % self.gpus_per_node

    def route(self, r: int, q: int) -> str:
        if self.same_gpu(r, q):
            return "local"
        return "intra_node" if self.old_node(r) == self.new_node(q) else "inter_node"

    def num_old_nodes(self) -> int:
        return -(-self.old_num_gpus // self.gpus_per_node)


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


def moves_between(old: DeploymentManifest, new: DeploymentManifest, spec: ModelSpec, devices: Devices,
                  hw: HardwareProfile, checkpoint: dict[str, StoredTensor] | None = None,
                  ) -> tuple[list[Move], list[Unrecoverable]]:
    """Every piece of every slice the new plan's ranks hold with its one source, and the pieces
    that have none (see the module docstring for the order of preference)."""
    links = link_costs(hw)
    out: list[Move] = []
    lost: list[Unrecoverable] = []
    sent: dict[int, float] = {}  # bytes each old rank has been asked to send so far
    for state in states(new):
        holders: dict[str, list[tuple[int, Box]]] = {}
        for r, held in enumerate(rank_holdings(old, spec, state)):
            if r not in devices.lost:
                for h in held:
                    holders.setdefault(h.tensor.name, []).append((r, h.box))
        for q, held in enumerate(rank_holdings(new, spec, state)):
            node_q = devices.new_node(q)
            for h in held:
                per_element = bytes_per_element(new, h.tensor, state)
                sources = sorted(holders.get(h.tensor.name, ()), key=lambda rb: (
                    not devices.same_gpu(rb[0], q), devices.old_node(rb[0]) != node_q, sent.get(rb[0], 0.0), rb[0]))
                remaining = [h.box]
                for r, box in sources:
                    if not remaining:
                        break
                    route = devices.route(r, q)
                    left: list[Box] = []
                    for piece in remaining:
                        got = intersect(piece, box)
                        if got is not None:
                            nbytes = box_numel(got) * per_element
                            seconds = 0.0 if route == "local" else links[route].seconds(nbytes)
                            out.append(Move(h.tensor.name, state, got, q, route, nbytes, r,
                                            transfer_bytes=nbytes, time_seconds=seconds))
                            if route != "local":
                                sent[r] = sent.get(r, 0.0) + nbytes
                        left += subtract(piece, box)
                    remaining = left
                for piece in remaining:  # held by no surviving rank
                    stored = checkpoint.get(h.tensor.name) if checkpoint is not None and state == "weights" else None
                    if stored is None:
                        lost.append(Unrecoverable(h.tensor.name, state, piece, q))
                        continue
                    read = box_read(stored, piece)
                    out.append(Move(h.tensor.name, state, piece, q, "storage", box_numel(piece) * per_element, None,
                                    file=stored.file, read=read, transfer_bytes=read.nbytes,
                                    time_seconds=_storage_seconds(links["storage"], read.nbytes)))
    return out, lost


def _storage_seconds(link: LinkCost, nbytes: float) -> float:
    if link.bandwidth_bytes_per_second <= 0:
        raise ShardplanError("the hardware profile gives no storage read bandwidth, which reading from the checkpoint "
                             "needs", field="node.nvme_bandwidth_gb_per_s",
                             hint="set the node's NVMe (or shared storage) read bandwidth in the profile")
    return link.seconds(nbytes)


# ----- totals ----------------------------------------------------------------------------------


def move_summary(moves: list[Move], devices: Devices, links: dict[str, LinkCost]) -> dict[str, Any]:
    """Bytes by route, source and state; per new rank what it keeps and receives, and its time
    (the largest of its per-link sums); the whole move's time (the slowest rank's)."""
    by_route = {r: 0.0 for r in ROUTES}
    by_source = {"rank": 0.0, "checkpoint": 0.0}
    by_state: dict[str, float] = {}
    ranks: list[dict[str, Any]] = [{
        "rank": q, "node": q // devices.gpus_per_node,
        "old_node": devices.new_node(q) if devices.new_node(q) < devices.num_old_nodes() else None,
        "kept_bytes": 0.0, "received_bytes": 0.0, **{f"received_{r}_bytes": 0.0 for r in LINK_ROUTES},
        "time_seconds_by_route": {r: 0.0 for r in LINK_ROUTES}, "sources": set(), "checkpoint_files": set()}
        for q in range(devices.new_num_gpus)]
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
    for r in ranks:
        r["sources"] = sorted(r["sources"])
        r["checkpoint_files"] = sorted(r["checkpoint_files"])
        r["time_seconds"] = max(r["time_seconds_by_route"].values())
        for k in ("kept_bytes", "received_bytes", *(f"received_{x}_bytes" for x in LINK_ROUTES)):
            r[k] = num(r[k])
    slowest = max(ranks, key=lambda r: (r["time_seconds"], -r["rank"]))
    moved = sum(by_route[r] for r in LINK_ROUTES)
    return {
        "num_moves": sum(1 for mv in moves if mv.route != "local"),
        "num_pieces": len(moves),
        "moved_bytes": num(moved),
        "kept_bytes": num(by_route["local"]),
        "moved_bytes_by_route": {k: num(by_route[k]) for k in LINK_ROUTES},
        "moved_bytes_by_source": {k: num(v) for k, v in by_source.items()},
        "moved_bytes_by_state": {k: num(v) for k, v in sorted(by_state.items())},
        "max_received_bytes_per_rank": num(max((r["received_bytes"] for r in ranks), default=0)),
        "time_seconds": slowest["time_seconds"],
        "slowest_rank": slowest["rank"],
        "links": {k: {"kind": v.kind, "bandwidth_bytes_per_second": v.bandwidth_bytes_per_second,
                      "latency_seconds": v.latency_seconds} for k, v in links.items()},
        "ranks": ranks,
    }
