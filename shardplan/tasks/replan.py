"""`shardplan replan`: a new plan for a changed cluster, and what it costs to get there.

The old plan's model, hardware profile, workload and objective are searched again on the new
GPU count (the same search as `recommend`). For each of the top candidates, every tensor
slice a new rank holds at rest (`placement.rank_holdings`: weights, and for training the
optimizer states) is given exactly one source: the same GPU, a surviving old rank on the same
node, one on another node, or (`--from-checkpoint`) the checkpoint's file and byte range when
every old rank that held it is lost; each piece with the link it crosses and its predicted
time (`tasks/_moves.py` says how, and where lost ranks' nodes go). The winner is the
candidate that moves the fewest bytes (with `prefer_fast_recovery`: that is back soonest)
among those whose objective is within `margin` of the best (objective values are
lower-better; within means value <= best + margin x |best|); ties go to the better objective.
Pieces no surviving rank holds and no checkpoint can give raise `Unrecoverable` (exit 3).
For a serving plan the chosen layout also comes with its rollout (`tasks/_rollout.py`): the
order that starts the new replicas and drains the old ones keeping the served rate above
`min_capacity` (a share of the old plan's full rate; None: the highest any order keeps), with
each step's time and rate; a floor no order keeps gives `rollout.keeps_floor` false (exit 3).
Past MAX_LISTED_RANKS (512) new ranks, the per-rank table (`moves.ranks`) and the move list
hold the first 512 only; the totals, the slowest rank and the candidates' figures count every
rank, and `num_ranks_not_listed` / `num_pieces_not_listed` say what was left out.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import Field

from shardplan.cost.estimate import estimate
from shardplan.cost.workload import InferenceWorkload
from shardplan.errors import EXIT_DOES_NOT_FIT, ShardplanError
from shardplan.fileio import PendingFile, write_files_atomic, write_text_atomic
from shardplan.plan import readback
from shardplan.plan.manifest import DeploymentManifest, build_manifest, dump_manifest
from shardplan.plan.placement import check_nameable
from shardplan.search import Goal, Objective, Space, search
from shardplan.search import explain
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.tasks._bands import banded
from shardplan.tasks._moves import (
    ROUTES,
    Devices,
    Move,
    Unrecoverable,
    intersect,
    link_costs,
    MAX_LISTED_RANKS,
    move_summary,
    moves_between,
    plan_moves,
    subtract,
)
from shardplan.tasks._results import Result
from shardplan.tasks._rollout import Rollout, plan_rollout

# Replicas (old and new together) a rollout is planned for: it orders and lists each of them.
ROLLOUT_MAX_REPLICAS = 65_536
from shardplan.tasks._targets import RunsOn, check_target, search_rules
from shardplan.tasks._safetensors import StoredTensor, check_tensors, expected_dtype, read_checkpoint

Progress = Callable[[int, int], None]  # (done, total)
Number = int | float  # a byte count: an int when whole


class UnrecoverableError(ShardplanError):
    """Slices that every old rank holding them lost, with no checkpoint to read them from."""

    exit_code = EXIT_DOES_NOT_FIT


# ----- the result ----------------------------------------------------------------------------


class LinkFigures(Result):
    kind: str = Field(description="the profile's link kind (nvswitch, infiniband, ...), or nvme for storage")
    bandwidth_bytes_per_second: float = Field(description="per receiving GPU, efficiency applied (bytes/s)")
    latency_seconds: float = Field(description="added once per piece (s)")


class RankMoves(Result):
    """What one new rank keeps and receives, and how long receiving takes."""

    rank: int = Field(description="new rank")
    node: int = Field(description="rank // gpus_per_node: its node in the new cluster")
    old_node: int | None = Field(description="the old cluster's node its GPU is on; None: a node that joined")
    kept_bytes: Number = Field(description="bytes it already holds on its GPU (bytes)")
    received_bytes: Number = Field(description="bytes it receives from other GPUs and storage (bytes)")
    received_intra_node_bytes: Number = Field(description="of which from its own node (bytes)")
    received_inter_node_bytes: Number = Field(description="of which from other nodes (bytes)")
    received_storage_bytes: Number = Field(description="of which read from the checkpoint, in the plan's format (bytes)")
    time_seconds_by_route: dict[str, float] = Field(description="per link, its pieces one after another (s)")
    time_seconds: float = Field(description="the largest per-link time: links run in parallel (s)")
    sources: list[int] = Field(description="old ranks it receives from")
    checkpoint_files: list[str] = Field(description="checkpoint files it reads from")


class MoveSummary(Result):
    """The chosen candidate's moves: bytes by route, source and state, time, and per new rank."""

    num_moves: int = Field(description="pieces that move, over a link or from storage (count)")
    num_pieces: int = Field(description="pieces including those kept in place (count)")
    moved_bytes: Number = Field(description="bytes the new ranks receive (bytes)")
    kept_bytes: Number = Field(description="bytes that stay on their GPU (bytes)")
    moved_bytes_by_route: dict[str, Number] = Field(description="intra_node, inter_node, storage (bytes)")
    moved_bytes_by_source: dict[str, Number] = Field(description="rank (surviving old ranks), checkpoint (bytes)")
    moved_bytes_by_state: dict[str, Number] = Field(description="weights, optimizer (bytes)")
    max_received_bytes_per_rank: Number = Field(description="the most one new rank receives (bytes)")
    time_seconds: float = Field(description="predicted time of the whole move: its slowest new rank's (s)")
    slowest_rank: int = Field(description="the new rank that takes longest")
    links: dict[str, LinkFigures] = Field(description="the figures each piece's time is computed from")
    num_ranks_not_listed: int = Field(0, description=f"new ranks past the first {MAX_LISTED_RANKS:,}: in every total "
                                      "and in slowest_rank, but not in `ranks` nor in the move list (count)")
    num_pieces_not_listed: int = Field(0, description="their pieces, in num_pieces but not in the move list (count)")
    ranks: list[RankMoves] = Field(description=f"the first {MAX_LISTED_RANKS:,} new ranks")


class ReplanCandidate(Result):
    """One candidate layout on the new GPU count, with the cost of moving to it."""

    rank: int = Field(description="1-based position by objective")
    plan: dict[str, Any] = Field(description="the layout and workload knobs (as recommend prints them)")
    objective_value: float = Field(description="the objective, lower-better (throughput negated)")
    gap_fraction: float = Field(description="(value - best) / |best|: how much worse than the best (fraction)")
    within_margin: bool = Field(description="gap_fraction <= margin")
    chosen: bool = Field(description="the one taken")
    figures: dict[str, Any] = Field(description="the candidate's headline figures (units in the keys)")
    moved_bytes: Number = Field(description="bytes the new ranks receive to reach it (bytes)")
    kept_bytes: Number = Field(description="bytes that stay on their GPU (bytes)")
    moved_bytes_by_route: dict[str, Number] = Field(description="intra_node, inter_node, storage (bytes)")
    moved_bytes_by_state: dict[str, Number] = Field(description="weights, optimizer (bytes)")
    max_received_bytes_per_rank: Number = Field(description="the most one new rank receives (bytes)")
    move_time_seconds: float = Field(description="predicted time of the move: its slowest new rank's (s)")
    runs_on: list[str] = Field(default_factory=list, description="the targets that run this layout as it is "
                               "(knowledge/targets.yaml); --target keeps to one")


class OldCluster(Result):
    """The old plan's cluster and layout, and what of it is lost."""

    num_gpus: int
    num_nodes: int
    layout: dict[str, Any] = Field(description="the old manifest's layout section")
    lost_ranks: list[int] = Field(description="old ranks whose memory is lost (from --lost-nodes and --lost-ranks)")


class ReplanResult(Result):
    """What `replan --json` prints. `chosen`, `moves` are None when nothing fits on the new
    count; `manifest`, `moves_file` are None unless written."""

    plan: str = Field(description="the old manifest")
    model: str
    hardware: str
    workload: str = Field(description="inference or training")
    objective: str = Field(description="what candidates are ranked by")
    margin: float = Field(description="objective tolerance within which the cheapest move wins (fraction)")
    prefer: str = Field(description="what the cheapest move means: moved_bytes, or move_time_seconds "
                                     "(--prefer-fast-recovery)")
    checkpoint: str | None = Field(description="the checkpoint read for slices no surviving rank holds")
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
    rollout: Rollout | None = Field(description="serving: the order that starts the chosen layout's replicas and "
                                                "drains the old ones; None for training, when nothing fits, or past "
                                                "the replicas a rollout is planned for (rollout_not_planned)")
    rollout_not_planned: str | None = Field(None, description="serving: why no rollout was planned (more replicas, old "
                                                              "and new, than ROLLOUT_MAX_REPLICAS); None: planned")


# ----- lost ranks --------------------------------------------------------------------------------


def lost_old_ranks(old: DeploymentManifest, gpus_per_node: int, *, lost_nodes: Iterable[int] = (),
                   lost_ranks: Iterable[int] = ()) -> frozenset[int]:
    """The old ranks named lost, each node as its ranks; refused unless in range and some survive."""
    num_gpus = old.hardware.num_gpus
    num_nodes = -(-num_gpus // gpus_per_node)
    out: set[int] = set()
    for n in lost_nodes:
        if not 0 <= n < num_nodes:
            raise ShardplanError(f"node {n} is not a node of the old plan (nodes 0-{num_nodes - 1})",
                                 field="--lost-nodes", hint=f"name nodes 0-{num_nodes - 1}")
        out.update(range(n * gpus_per_node, min((n + 1) * gpus_per_node, num_gpus)))
    for r in lost_ranks:
        if not 0 <= r < num_gpus:
            raise ShardplanError(f"rank {r} is not a rank of the old plan (ranks 0-{num_gpus - 1})",
                                 field="--lost-ranks", hint=f"name ranks 0-{num_gpus - 1}")
        out.add(r)
    if len(out) == num_gpus:
        raise ShardplanError(f"all {num_gpus} ranks of the old plan are named lost: nothing is left to move from",
                             field="--lost-nodes", hint="plan afresh with `shardplan recommend`, or load the "
                             "checkpoint with `shardplan checkpoint`")
    return frozenset(out)


def _unrecoverable(pieces: list[Unrecoverable]) -> UnrecoverableError:
    names = sorted({(p.state, p.tensor) for p in pieces})
    weights = [n for s, n in names if s == "weights"]
    optimizer = [n for s, n in names if s == "optimizer"]

    def listed(xs: list[str]) -> str:
        return ", ".join(xs[:3]) + (f" and {len(xs) - 3} more" if len(xs) > 3 else "")

    if weights:
        return UnrecoverableError(f"every old rank holding {len(weights)} weight tensor(s) is lost and no checkpoint "
                                  f"was given: {listed(weights)}", field="--from-checkpoint",
                                  hint="pass --from-checkpoint DIR (the model's safetensors checkpoint)")
    return UnrecoverableError(f"every old rank holding the optimizer states of {len(optimizer)} tensor(s) is lost and "
                              f"a safetensors checkpoint holds weights only: {listed(optimizer)}",
                              field="--from-checkpoint", hint="resume from the trainer's own checkpoint "
                              "(--from-checkpoint gives weights only)")


def load_checkpoint(spec: ModelSpec, path: Path) -> dict[str, StoredTensor]:
    """The I/O edge of --from-checkpoint: the checkpoint's headers, checked against the model."""
    folder, stored, _ = read_checkpoint(path)
    return check_tensors(spec, stored, expected_dtype(spec, None), str(folder))


def node_size(old: DeploymentManifest, new: DeploymentManifest) -> int:
    """GPUs per physical node: a plan on part of one node records only the GPUs it uses."""
    return max(old.placement.gpus_per_node, new.placement.gpus_per_node)


# ----- the old plan's inputs ---------------------------------------------------------------------


def _default_objective(m: DeploymentManifest) -> Objective:
    if m.objective is not None:
        return Objective(m.objective)
    return Objective.STEP_TIME if m.workload.kind == "training" else Objective.THROUGHPUT


# ----- the command -----------------------------------------------------------------------------


def replan(old: DeploymentManifest, *, source: str, hw: HardwareProfile, num_gpus: int, margin: float,
           top_k: int, objective: str | None = None, manifest_path: Path | None = None,
           moves_path: Path | None = None, progress: Progress | None = None, lost_nodes: Iterable[int] = (),
           lost_ranks: Iterable[int] = (), checkpoint: Path | None = None,
           prefer_fast_recovery: bool = False, min_capacity: float | None = None,
           target: str | None = None, workers: int = 0) -> ReplanResult:
    """What `shardplan replan --json` prints; writes the chosen manifest and its move list when
    paths are given. Raises ShardplanError (exit 2) for bad input, UnrecoverableError (exit 3)
    when slices only lost ranks held have no checkpoint to come from; `chosen` is None when
    nothing fits on the new count (the CLI exits 3). `progress(done, total)` is passed to the
    search, then called once per candidate costed. `checkpoint`: a safetensors checkpoint
    folder (headers only are read). `min_capacity`: serving only, the share of the old plan's
    rate the rollout keeps (None: the highest any order keeps); `rollout.keeps_floor` is false
    when no order keeps it (the CLI exits 3). `target`: only layouts it runs (and verify checks),
    for a plan made with its engine or stack (tasks/_targets.py). `workers`: the search's worker
    processes (`Space.workers`)."""
    if not 0 <= margin < 1:
        raise ShardplanError(f"margin {margin} is not a fraction in [0, 1)", field="--margin", hint="e.g. 0.05")
    check_min_capacity(old, min_capacity)
    loaded = readback.checked_model(old, source)
    spec = loaded.spec
    check_nameable(spec, source)
    gpn = max(old.placement.gpus_per_node, hw.gpus_per_node)
    lost = lost_old_ranks(old, gpn, lost_nodes=lost_nodes, lost_ranks=lost_ranks)
    stored = load_checkpoint(spec, checkpoint) if checkpoint is not None else None
    links = link_costs(hw)
    prefer = "move_time_seconds" if prefer_fast_recovery else "moved_bytes"
    workload = readback.plan_workload(old)
    # Every variant: the least-moving layout within the margin may be any of them (not each shape's best).
    goal = Goal(objective=Objective(objective) if objective else _default_objective(old), top_k=top_k * 8,
                group_by_shape=False)
    sla = old.sla if goal.objective is Objective.GOODPUT else None
    if sla is not None:  # the new layout keeps the promise the old one was ranked within
        goal = replace(goal, max_ttft_seconds=sla.max_ttft_seconds, max_tpot_seconds=sla.max_tpot_seconds,
                       slo_percentile=sla.percentile, sla_defaulted=sla.defaulted)
    if target is not None:
        check_target(target, spec, hw, workload, plan=source)
    space = Space(rules=search_rules(target, spec, workload), workers=workers)
    if isinstance(workload, InferenceWorkload):
        space = replace(space, quantizations=(workload.quantization,), kv_cache_dtypes=(workload.kv_cache_dtype,))
    res = search(spec, hw, workload, space, goal, num_gpus=num_gpus, progress=progress)
    if not res.top and sla is not None and sla.defaulted:
        # A default SLA is a preference (as recommend takes it): when no layout on the new count meets it,
        # rank by goodput without it, and the new plan records none.
        sla, goal = None, goal.without_sla()
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
        objective=goal.objective.value, margin=margin, prefer=prefer,
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        from_=OldCluster(num_gpus=old.hardware.num_gpus, num_nodes=old.hardware.num_nodes,
                         layout=old.layout.model_dump(mode="json"), lost_ranks=sorted(lost)),
        to_num_gpus=num_gpus, num_evaluated=res.num_evaluated, num_feasible=res.num_feasible,
        rejected=dict(sorted(res.rejected.items(), key=lambda kv: (-kv[1], kv[0]))),
    )
    if not candidates:
        return ReplanResult(**head, candidates=[], chosen=None, manifest=None, moves_file=None, moves=None,
                            rollout=None)
    best = candidates[0].objective_value
    built, rows = [], []
    runs_on = RunsOn(spec)
    for i, e in enumerate(candidates):
        report = banded(estimate(spec, e.hw, e.layout, e.workload), e.hw)  # the manifest records the bands
        m = build_manifest(loaded=loaded, hw=e.hw, layout=e.layout, workload=e.workload, report=report,
                           objective=goal.objective.value,
                           search={"num_evaluated": res.num_evaluated, "num_feasible": res.num_feasible},
                           runs_on=runs_on.of(e.hw, e.layout, e.workload), sla=sla)
        devices = Devices.build(gpus_per_node=node_size(old, m), old_num_gpus=old.hardware.num_gpus,
                                new_num_gpus=m.hardware.num_gpus, lost=lost)
        planned = plan_moves(old, m, spec, devices, hw, stored, source=source)  # MAX_LISTED_RANKS listed
        if planned.missing:  # every layout needs every weight: the first candidate shows it for all
            raise _unrecoverable(planned.missing)
        moves = planned.moves
        summary = move_summary(moves, devices, links, planned.rest, planned.num_listed)
        built.append((m, moves, summary, devices))
        rows.append({
            "rank": i + 1, "plan": explain.plan_dict(e, report), "objective_value": e.objective_value,
            "gap_fraction": (e.objective_value - best) / abs(best) if best else 0.0,
            "within_margin": e.objective_value <= best + margin * abs(best), "figures": e.figures,
            **{k: summary[k] for k in ("moved_bytes", "kept_bytes", "moved_bytes_by_route", "moved_bytes_by_state",
                                       "max_received_bytes_per_rank")},
            "move_time_seconds": summary["time_seconds"], "runs_on": m.runs_on or [],
        })
        if progress is not None:
            progress(i + 1, len(candidates))
    pick = min((c for c in rows if c["within_margin"]), key=lambda c: (c[prefer], c["rank"]))["rank"]
    m, moves, summary, devices = built[pick - 1]
    rollout = not_planned = None
    replicas = old.layout.dp + m.layout.dp
    if old.workload.kind == "inference" and replicas > ROLLOUT_MAX_REPLICAS:
        # A rollout lists every replica and step: past this many it is neither readable nor bounded work.
        not_planned = (f"{old.layout.dp:,} old and {m.layout.dp:,} new replicas: a rollout is planned for up to "
                       f"{ROLLOUT_MAX_REPLICAS:,} replicas in all")
        if min_capacity is not None:
            raise ShardplanError(f"no rollout is planned here ({not_planned})", field="--min-capacity",
                                 hint="leave --min-capacity out, or re-plan for fewer replicas")
    elif old.workload.kind == "inference":
        rollout = plan_rollout(old, m, spec, devices, hw, stored, min_capacity)
        if rollout is None and min_capacity is not None:
            raise ShardplanError(f"{source} predicts no throughput to take a share of", field="--min-capacity",
                                 hint="re-plan it with `shardplan recommend`, or leave --min-capacity out")
    manifest = moves_file = None
    outputs: list[PendingFile] = []  # the manifest and the move list are written all or none
    if manifest_path is not None:
        outputs.append(PendingFile(path=manifest_path, data=dump_manifest(m).encode(), what="-o"))
        manifest = str(manifest_path)
        moves_path = moves_path or manifest_path.with_name(manifest_path.stem + ".moves.json")
    if moves_path is not None:
        text = moves_text(moves_path, old, m, source, moves, summary, links)
        outputs.append(PendingFile(path=moves_path, data=text.encode(), what="--moves"))
        moves_file = str(moves_path)
    write_files_atomic(outputs)
    return ReplanResult(
        **head,
        candidates=[ReplanCandidate(**c, chosen=c["rank"] == pick) for c in rows],
        chosen=pick, manifest=manifest, moves_file=moves_file, moves=MoveSummary.model_validate(summary),
        rollout=rollout, rollout_not_planned=not_planned,
    )


def check_min_capacity(old: DeploymentManifest, min_capacity: float | None) -> None:
    """--min-capacity is a share in (0, 1] and applies to serving plans only."""
    if min_capacity is None:
        return
    if not 0 < min_capacity <= 1:  # also refuses nan
        raise ShardplanError(f"min capacity {min_capacity} is not a share in (0, 1]", field="--min-capacity",
                             hint="a share of the old plan's served rate, e.g. 0.75")
    if old.workload.kind != "inference":
        raise ShardplanError("--min-capacity applies to serving plans (it orders replicas' rollout); this is a "
                             "training plan", field="--min-capacity", hint="leave --min-capacity out for training")


def write_moves(path: Path, old: DeploymentManifest, new: DeploymentManifest, source: str, moves: list[Move],
                summary: dict[str, Any], links: dict[str, Any]) -> None:
    """The move list (`moves_text`), written atomically."""
    write_text_atomic(path, moves_text(path, old, new, source, moves, summary, links))


def moves_text(path: Path, old: DeploymentManifest, new: DeploymentManifest, source: str, moves: list[Move],
               summary: dict[str, Any], links: dict[str, Any]) -> str:
    """The move list as JSON (or YAML for a .yaml/.yml path)."""
    doc = {
        "from_plan": source, "from_num_gpus": old.hardware.num_gpus, "to_num_gpus": new.hardware.num_gpus,
        "gpus_per_node": node_size(old, new),
        "note": "new node n is the old node its ranks' `old_node` names (survivors first, then nodes that join); "
                "route local moves nothing; time_seconds = transfer_bytes / the link's bandwidth + its latency",
        **{k: v for k, v in summary.items() if k != "ranks"},
        "ranks": [{k: r[k] for k in ("rank", "node", "old_node", "received_bytes", "time_seconds")}
                  for r in summary["ranks"]],
        "moves": [mv.as_dict(links) for mv in moves],
    }
    if path.suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=1 << 30)
    else:  # one move per line: the list is long and read by scripts and by eye
        head = json.dumps({k: v for k, v in doc.items() if k != "moves"}, indent=1)
        lines = ",\n  ".join(json.dumps(mv.as_dict(links), separators=(", ", ": ")) for mv in moves)
        text = head[:-2] + ',\n "moves": [\n  ' + lines + "\n ]\n}\n"
    return text


__all__ = ["ROUTES", "Devices", "Move", "MoveSummary", "ReplanCandidate", "ReplanResult", "Rollout",
           "UnrecoverableError", "check_min_capacity", "intersect", "link_costs", "lost_old_ranks", "move_summary",
           "moves_between", "moves_text", "replan", "subtract", "write_moves"]
