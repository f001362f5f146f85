"""`shardplan replan`: a new plan for a changed cluster, and what it costs to get there.

The old plan's model, hardware profile, workload and objective are searched again on the new
GPU count (the same search as `recommend`). For each of the top candidates, every tensor
slice a new rank holds at rest (`placement.rank_holdings`: weights, and for training the
optimizer states) is given exactly one source among the old ranks, preferring
  1. the same device (old rank r and new rank r are one GPU for r < min(old, new)): it moves
     zero bytes;
  2. an old rank on the same node (device d sits on node d // gpus_per_node);
  3. an old rank on another node;
and within a tier the old rank that has been asked to send the fewest bytes so far (then the
lowest), so that many new ranks needing the same layer do not all pull from one GPU.
A slice is cut where the old holders' slices end, so the pieces of one new slice cover it
exactly once. The winner is the candidate that moves the fewest bytes among those whose
objective is within `margin` of the best (objective values are lower-better; within means
value <= best + margin x |best|); ties go to the better objective.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from shardplan.cost.estimate import estimate
from shardplan.cost.workload import InferenceWorkload
from shardplan.errors import ShardplanError
from shardplan.fileio import write_text_atomic
from shardplan.plan import readback
from shardplan.plan.manifest import DeploymentManifest, build_manifest, write_manifest
from shardplan.tasks._bands import banded
from shardplan.plan.placement import Box, box_numel, bytes_per_element, check_nameable, rank_holdings, states
from shardplan.search import Goal, Objective, Space, search
from shardplan.search import explain
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.tasks._results import Result

ROUTES = ("local", "intra_node", "inter_node")
Progress = Callable[[int, int], None]  # (done, total)
Number = int | float  # a byte count: an int when whole


# ----- the result ----------------------------------------------------------------------------


class RankMoves(Result):
    """What one new rank keeps and receives."""

    rank: int = Field(description="new rank (the same GPU as old rank `rank` where both exist)")
    node: int = Field(description="rank // gpus_per_node")
    kept_bytes: Number = Field(description="bytes it already holds as old rank `rank` (bytes)")
    received_bytes: Number = Field(description="bytes it receives from other GPUs (bytes)")
    received_intra_node_bytes: Number = Field(description="of which from its own node (bytes)")
    received_inter_node_bytes: Number = Field(description="of which from other nodes (bytes)")
    sources: list[int] = Field(description="old ranks it receives from")


class MoveSummary(Result):
    """The chosen candidate's moves: bytes by route and state, and per new rank."""

    num_moves: int = Field(description="slices that move between GPUs (count)")
    num_pieces: int = Field(description="slices including those kept in place (count)")
    moved_bytes: Number = Field(description="bytes sent between GPUs (bytes)")
    kept_bytes: Number = Field(description="bytes that stay on their GPU (bytes)")
    moved_bytes_by_route: dict[str, Number] = Field(description="intra_node and inter_node (bytes)")
    moved_bytes_by_state: dict[str, Number] = Field(description="weights, optimizer (bytes)")
    max_received_bytes_per_rank: Number = Field(description="the most one new rank receives (bytes)")
    ranks: list[RankMoves]


class ReplanCandidate(Result):
    """One candidate layout on the new GPU count, with the cost of moving to it."""

    rank: int = Field(description="1-based position by objective")
    plan: dict[str, Any] = Field(description="the layout and workload knobs (as recommend prints them)")
    objective_value: float = Field(description="the objective, lower-better (throughput negated)")
    gap_fraction: float = Field(description="(value - best) / |best|: how much worse than the best (fraction)")
    within_margin: bool = Field(description="gap_fraction <= margin")
    chosen: bool = Field(description="the one taken")
    figures: dict[str, Any] = Field(description="the candidate's headline figures (units in the keys)")
    moved_bytes: Number = Field(description="bytes sent between GPUs to reach it (bytes)")
    kept_bytes: Number = Field(description="bytes that stay on their GPU (bytes)")
    moved_bytes_by_route: dict[str, Number] = Field(description="intra_node and inter_node (bytes)")
    moved_bytes_by_state: dict[str, Number] = Field(description="weights, optimizer (bytes)")
    max_received_bytes_per_rank: Number = Field(description="the most one new rank receives (bytes)")


class OldCluster(Result):
    """The old plan's cluster and layout."""

    num_gpus: int
    num_nodes: int
    layout: dict[str, Any] = Field(description="the old manifest's layout section")


class ReplanResult(Result):
    """What `replan --json` prints. `chosen`, `moves` are None when nothing fits on the new
    count; `manifest`, `moves_file` are None unless written."""

    plan: str = Field(description="the old manifest")
    model: str
    hardware: str
    workload: str = Field(description="inference or training")
    objective: str = Field(description="what candidates are ranked by")
    margin: float = Field(description="objective tolerance within which the least-moving candidate wins (fraction)")
    from_: OldCluster = Field(alias="from")
    to_num_gpus: int = Field(description="GPUs of the new cluster (count)")
    num_evaluated: int = Field(description="layouts the search evaluated (count)")
    num_feasible: int = Field(description="of which fit (count)")
    rejected: dict[str, int] = Field(description="layouts rejected per reason (count), most first")
    candidates: list[ReplanCandidate]
    chosen: int | None = Field(description="rank of the chosen candidate; None: nothing fits")
    manifest: str | None = Field(description="where the chosen manifest was written")
    moves_file: str | None = Field(description="where the move list was written")
    moves: MoveSummary | None = Field(description="the chosen candidate's moves")


@dataclass(frozen=True)
class Move:
    """One piece of a new rank's slice and where it comes from."""

    tensor: str
    state: str  # "weights" or "optimizer"
    box: Box
    from_rank: int
    to_rank: int
    route: str  # local (same GPU: nothing moves), intra_node, inter_node
    nbytes: float

    def as_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "state": self.state, "slice": [list(d) for d in self.box],
                "from_rank": self.from_rank, "to_rank": self.to_rank, "route": self.route, "bytes": _num(self.nbytes)}


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


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


# ----- moves -----------------------------------------------------------------------------------


def moves_between(old: DeploymentManifest, new: DeploymentManifest, spec: ModelSpec) -> list[Move]:
    """Every piece of every slice the new plan's ranks hold, with its one source."""
    gpn = node_size(old, new)
    out: list[Move] = []
    sent: dict[int, float] = {}  # bytes each old rank has been asked to send so far
    for state in states(new):
        holders: dict[str, list[tuple[int, Box]]] = {}
        for r, held in enumerate(rank_holdings(old, spec, state)):
            for h in held:
                holders.setdefault(h.tensor.name, []).append((r, h.box))
        for q, held in enumerate(rank_holdings(new, spec, state)):
            for h in held:
                per_element = bytes_per_element(new, h.tensor, state)
                sources = sorted(holders.get(h.tensor.name, ()),
                                 key=lambda rb: (rb[0] != q, rb[0] // gpn != q // gpn, sent.get(rb[0], 0.0), rb[0]))
                remaining = [h.box]
                for r, box in sources:
                    if not remaining:
                        break
                    route = "local" if r == q else "intra_node" if r // gpn == q // gpn else "inter_node"
                    left: list[Box] = []
                    for piece in remaining:
                        got = intersect(piece, box)
                        if got is not None:
                            nbytes = box_numel(got) * per_element
                            out.append(Move(h.tensor.name, state, got, r, q, route, nbytes))
                            if route != "local":
                                sent[r] = sent.get(r, 0.0) + nbytes
                        left += subtract(piece, box)
                    remaining = left
                if remaining:  # every element is held by some old rank: a bug if not
                    raise ShardplanError(f"no old rank holds {state} of '{h.tensor.name}' {remaining[0]}",
                                         hint="report this plan pair")
    return out


def node_size(old: DeploymentManifest, new: DeploymentManifest) -> int:
    """GPUs per physical node: a plan on part of one node records only the GPUs it uses."""
    return max(old.placement.gpus_per_node, new.placement.gpus_per_node)


def move_summary(moves: list[Move], num_ranks: int, gpus_per_node: int) -> dict[str, Any]:
    """Bytes by route and state, and per new rank what it keeps and receives."""
    by_route = {r: 0.0 for r in ROUTES}
    by_state: dict[str, float] = {}
    ranks = [{"rank": q, "node": q // gpus_per_node, "kept_bytes": 0.0, "received_bytes": 0.0,
              "received_intra_node_bytes": 0.0, "received_inter_node_bytes": 0.0, "sources": set()}
             for q in range(num_ranks)]
    for mv in moves:
        by_route[mv.route] += mv.nbytes
        r = ranks[mv.to_rank]
        if mv.route == "local":
            r["kept_bytes"] += mv.nbytes
            continue
        by_state[mv.state] = by_state.get(mv.state, 0.0) + mv.nbytes
        r["received_bytes"] += mv.nbytes
        r[f"received_{mv.route}_bytes"] += mv.nbytes
        r["sources"].add(mv.from_rank)
    for r in ranks:
        r["sources"] = sorted(r["sources"])
        for k in ("kept_bytes", "received_bytes", "received_intra_node_bytes", "received_inter_node_bytes"):
            r[k] = _num(r[k])
    moved = by_route["intra_node"] + by_route["inter_node"]
    return {
        "num_moves": sum(1 for mv in moves if mv.route != "local"),
        "num_pieces": len(moves),
        "moved_bytes": _num(moved),
        "kept_bytes": _num(by_route["local"]),
        "moved_bytes_by_route": {k: _num(v) for k, v in by_route.items() if k != "local"},
        "moved_bytes_by_state": {k: _num(v) for k, v in sorted(by_state.items())},
        "max_received_bytes_per_rank": _num(max((r["received_bytes"] for r in ranks), default=0)),
        "ranks": ranks,
    }


# ----- the old plan's inputs ---------------------------------------------------------------------


def _default_objective(m: DeploymentManifest) -> Objective:
    if m.objective is not None:
        return Objective(m.objective)
    return Objective.STEP_TIME if m.workload.kind == "training" else Objective.THROUGHPUT


# ----- the command -----------------------------------------------------------------------------


def replan(old: DeploymentManifest, *, source: str, hw: HardwareProfile, num_gpus: int, margin: float,
           top_k: int, objective: str | None = None, manifest_path: Path | None = None,
           moves_path: Path | None = None, progress: Progress | None = None) -> ReplanResult:
    """What `shardplan replan --json` prints; writes the chosen manifest and its move list when
    paths are given. Raises ShardplanError (exit 2) for bad input; `chosen` is None when
    nothing fits on the new count (the CLI exits 3). `progress(done, total)` is passed to the
    search, then called once per candidate costed."""
    if not 0 <= margin < 1:
        raise ShardplanError(f"margin {margin} is not a fraction in [0, 1)", field="--margin", hint="e.g. 0.05")
    loaded = readback.checked_model(old, source)
    spec = loaded.spec
    check_nameable(spec, source)
    workload = readback.plan_workload(old)
    goal = Goal(objective=Objective(objective) if objective else _default_objective(old), top_k=top_k * 8)
    space = Space()
    if isinstance(workload, InferenceWorkload):
        space = replace(space, quantizations=(workload.quantization,), kv_cache_dtypes=(workload.kv_cache_dtype,))
    res = search(spec, hw, workload, space, goal, num_gpus=num_gpus, progress=progress)
    seen, candidates = set(), []
    for e in res.top:  # serving ranks batch sizes of one layout apart; the moves depend on the layout
        key = (e.layout, getattr(e.workload, "quantization", None), getattr(e.workload, "kv_cache_dtype", None))
        if key not in seen:
            seen.add(key)
            candidates.append(e)
    candidates = candidates[:top_k]
    head: dict[str, Any] = dict(
        plan=source, model=spec.name, hardware=hw.name, workload=old.workload.kind,
        objective=goal.objective.value, margin=margin,
        from_=OldCluster(num_gpus=old.hardware.num_gpus, num_nodes=old.hardware.num_nodes,
                         layout=old.layout.model_dump(mode="json")),
        to_num_gpus=num_gpus, num_evaluated=res.num_evaluated, num_feasible=res.num_feasible,
        rejected=dict(sorted(res.rejected.items(), key=lambda kv: (-kv[1], kv[0]))),
    )
    if not candidates:
        return ReplanResult(**head, candidates=[], chosen=None, manifest=None, moves_file=None, moves=None)
    best = candidates[0].objective_value
    built, rows = [], []
    for i, e in enumerate(candidates):
        report = banded(estimate(spec, e.hw, e.layout, e.workload), e.hw)  # the manifest records the bands
        m = build_manifest(loaded=loaded, hw=e.hw, layout=e.layout, workload=e.workload, report=report,
                           objective=goal.objective.value,
                           search={"num_evaluated": res.num_evaluated, "num_feasible": res.num_feasible})
        moves = moves_between(old, m, spec)
        summary = move_summary(moves, m.hardware.num_gpus, node_size(old, m))
        built.append((m, moves, summary))
        rows.append({
            "rank": i + 1, "plan": explain.plan_dict(e, report), "objective_value": e.objective_value,
            "gap_fraction": (e.objective_value - best) / abs(best) if best else 0.0,
            "within_margin": e.objective_value <= best + margin * abs(best), "figures": e.figures,
            **{k: summary[k] for k in ("moved_bytes", "kept_bytes", "moved_bytes_by_route", "moved_bytes_by_state",
                                       "max_received_bytes_per_rank")},
        })
        if progress is not None:
            progress(i + 1, len(candidates))
    pick = min((c for c in rows if c["within_margin"]), key=lambda c: (c["moved_bytes"], c["rank"]))["rank"]
    m, moves, summary = built[pick - 1]
    manifest = moves_file = None
    if manifest_path is not None:
        write_manifest(m, manifest_path)
        manifest = str(manifest_path)
        moves_path = moves_path or manifest_path.with_name(manifest_path.stem + ".moves.json")
    if moves_path is not None:
        write_moves(moves_path, old, m, source, moves, summary)
        moves_file = str(moves_path)
    return ReplanResult(
        **head,
        candidates=[ReplanCandidate(**c, chosen=c["rank"] == pick) for c in rows],
        chosen=pick, manifest=manifest, moves_file=moves_file, moves=MoveSummary.model_validate(summary),
    )


def write_moves(path: Path, old: DeploymentManifest, new: DeploymentManifest, source: str, moves: list[Move],
                summary: dict[str, Any]) -> None:
    """The move list as JSON (or YAML for a .yaml/.yml path), written atomically."""
    doc = {
        "from_plan": source, "from_num_gpus": old.hardware.num_gpus, "to_num_gpus": new.hardware.num_gpus,
        "gpus_per_node": node_size(old, new),
        "note": "new rank r and old rank r are the same GPU; route local moves nothing",
        **{k: v for k, v in summary.items() if k != "ranks"},
        "moves": [mv.as_dict() for mv in moves],
    }
    if path.suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=1 << 30)
    else:  # one move per line: the list is long and read by scripts and by eye
        head = json.dumps({k: v for k, v in doc.items() if k != "moves"}, indent=1)
        lines = ",\n  ".join(json.dumps(mv.as_dict(), separators=(", ", ": ")) for mv in moves)
        text = head[:-2] + ',\n "moves": [\n  ' + lines + "\n ]\n}\n"
    write_text_atomic(path, text)


__all__ = ["Move", "MoveSummary", "ReplanCandidate", "ReplanResult", "moves_between", "move_summary", "replan",
           "intersect", "subtract", "write_moves"]
