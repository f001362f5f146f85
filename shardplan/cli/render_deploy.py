"""Tables for `export`, `checkpoint` and `replan`."""

from __future__ import annotations

import sys

from rich.table import Table

from shardplan.cli.render_common import (
    console,
    err_console,
    file_written,
    fmt_bytes,
    fmt_degrees,
    fmt_rate_gb,
    fmt_seconds,
)
from shardplan.tasks.checkpoint import CheckpointResult
from shardplan.tasks.export import ExportResult
from shardplan.tasks.replan import ReplanResult, Rollout


def export_report(result: ExportResult, *, written: bool) -> None:
    """Written: one line per file. Not written: the files' text on stdout, raw (no markup), each
    under a `==> name <==` line when there are several (as `head` prints several files)."""
    files = result.files
    if written:  # a log of what was written: stderr, so stdout stays data
        for f in files:
            err_console.print(f"{result.target}: wrote {f.path} ({f.bytes:,} bytes)", markup=False, highlight=False,
                              soft_wrap=True)
        return
    for i, f in enumerate(files):
        if len(files) > 1:
            sys.stdout.write(("\n" if i else "") + f"==> {f.name} <==\n")
        sys.stdout.write(f.text)
    sys.stdout.flush()


def checkpoint_report(r: CheckpointResult) -> None:
    console.print(
        f"[bold]{r.model}[/bold] checkpoint {r.checkpoint}: {r.num_tensors} tensors ({r.dtype}) in "
        f"{len(r.files)} file(s), {fmt_bytes(r.checkpoint_tensor_bytes)} of tensors; names, shapes and dtypes "
        "match the model", highlight=False)
    # Ranks with the same figures (the data-parallel replicas of one slice, as a rule) share a row, so the
    # table grows with the plan's distinct slices, not its GPUs; each rank's own byte ranges are in --json.
    rows: dict[tuple[str, ...], tuple[list[int], list[int]]] = {}
    for rk in r.ranks:
        shown = (str(rk.num_tensors), str(len(rk.files)), f"{sum(f.num_reads for f in rk.files):,}",
                 f"{sum(f.num_runs for f in rk.files):,}", fmt_bytes(rk.bytes))
        ranks, nodes = rows.setdefault(shown, ([], []))
        ranks.append(rk.rank)
        if rk.node not in nodes:
            nodes.append(rk.node)
    t = Table(title=f"What each rank of {r.plan} reads" + (" (ranks with the same figures share a row)"
                                                            if len(rows) < len(r.ranks) else ""), title_justify="left")
    for c in ("ranks", "nodes", "tensors", "files", "reads", "runs", "bytes each"):
        t.add_column(c, justify="right", no_wrap=True)
    for shown, (ranks, nodes) in rows.items():
        t.add_row(_rank_set(ranks), _rank_set(sorted(nodes)), *shown)
    console.print(t)
    by_bytes: dict[str, list[int]] = {}  # nodes that read as much share an entry too
    for n in r.nodes:
        by_bytes.setdefault(fmt_bytes(n.bytes), []).append(n.node)
    nodes = ", ".join(f"node {_rank_set(ns)} {b}" if len(ns) == 1 else f"nodes {_rank_set(ns)} {b} each"
                      for b, ns in by_bytes.items())
    console.print(f"per node: {nodes}; all ranks {fmt_bytes(r.total_read_bytes)} = {r.replication:.4f} x the "
                  "checkpoint (the plan's replication); byte ranges per file in --json", highlight=False)


def replan_report(r: ReplanResult) -> None:
    f = r.from_
    console.print(
        f"[bold]{r.model}[/bold] on {r.hardware}, {r.workload}: {f.num_gpus} -> {r.to_num_gpus} GPUs, "
        f"objective {r.objective}; {r.num_evaluated:,} layouts evaluated, {r.num_feasible:,} fit", highlight=False)
    if f.lost_ranks:
        console.print(f"lost: old ranks {_ranges(f.lost_ranks)} (never sources)"
                      + (f"; what no survivor holds is read from {r.checkpoint}" if r.checkpoint else ""), highlight=False)
    if r.candidates:
        least = "the soonest back" if r.prefer == "move_time_seconds" else "the least moved"
        t = Table(title=f"Candidates (* chosen: {least} within {r.margin:.0%} of the best; dim: outside)",
                  title_justify="left")
        for c in ("#", "layout", "gap", "moved", "intra-node", "inter-node", "storage", "max/rank", "move time"):
            t.add_column(c, justify="left" if c == "layout" else "right", no_wrap=True)  # the layout stays whole
        for c in r.candidates:
            route = c.moved_bytes_by_route
            t.add_row(f"{c.rank}{'*' if c.chosen else ''}", fmt_degrees(c.plan), f"{100 * c.gap_fraction:.1f}%",
                      fmt_bytes(c.moved_bytes), fmt_bytes(route["intra_node"]), fmt_bytes(route["inter_node"]),
                      fmt_bytes(route["storage"]), fmt_bytes(c.max_received_bytes_per_rank),
                      fmt_seconds(c.move_time_seconds), style=None if c.within_margin else "dim")
        console.print(t)
    mv = r.moves
    if mv is None:
        console.print(f"[red]no layout fits on {r.to_num_gpus} GPUs[/red]")
        return
    states = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mv.moved_bytes_by_state.items()) or "nothing"
    console.print(f"chosen #{r.chosen}: {mv.num_moves:,} slices move ({states}); {fmt_bytes(mv.kept_bytes)} "
                  f"stays on its GPU; predicted move time {fmt_seconds(mv.time_seconds)} (new rank "
                  f"{mv.slowest_rank} is the slowest; per rank: links in parallel, each link's pieces in turn)",
                  highlight=False)
    t = Table(title="Per new rank", title_justify="left")
    for c in ("rank", "node", "old node", "kept", "received", "from other nodes", "from checkpoint", "time",
              "from old ranks"):
        t.add_column(c, justify="left" if c == "from old ranks" else "right", no_wrap=c != "from old ranks")
    for rk in mv.ranks:
        src = rk.sources
        t.add_row(str(rk.rank), str(rk.node), "new" if rk.old_node is None else str(rk.old_node),
                  fmt_bytes(rk.kept_bytes), fmt_bytes(rk.received_bytes), fmt_bytes(rk.received_inter_node_bytes),
                  fmt_bytes(rk.received_storage_bytes), fmt_seconds(rk.time_seconds),
                  ", ".join(map(str, src[:8])) + (f" (+{len(src) - 8})" if len(src) > 8 else ""))
    console.print(t)
    if r.rollout is not None:
        rollout_report(r.rollout)
    elif r.rollout_not_planned:
        console.print(f"rollout: not planned ({r.rollout_not_planned})")


_LIMITS = {"start": "the replicas lost before the rollout leave only that",
           "end": "the new layout serves only that",
           "swap": "old replicas must drain before new ones can start on their GPUs"}


def rollout_report(ro: Rollout) -> None:
    """The serving rollout: one row per step, its time and the served share after it."""
    old, new = ro.old_replicas, ro.new_replicas
    kept = sum(1 for x in new if x.status == "kept")
    down = sum(1 for x in old if x.status == "down")
    link = ro.load_link
    already = [f"{kept} kept as they are"] * bool(kept) + [f"{down} down (a lost rank)"] * bool(down)
    console.print(
        f"rollout: {len(old)} old replicas x {ro.old_replica_tokens_per_second:,.0f} tok/s -> {len(new)} new x "
        f"{ro.new_replica_tokens_per_second:,.0f} tok/s" + (f" ({', '.join(already)})" if already else "")
        + f"; a new replica serves once its GPUs have read their weights over {link.kind} at "
        f"{fmt_rate_gb(link.bandwidth_bytes_per_second)} per GPU", highlight=False)
    t = Table(title="Rollout (capacity: served rate after the step, share of the old plan's "
                    f"{ro.full_capacity_tokens_per_second:,.0f} tok/s)", title_justify="left")
    for c in ("step", "at", "action", "replica", "GPUs (node:gpu)", "serves from", "capacity"):
        t.add_column(c, justify="left" if c in ("action", "GPUs (node:gpu)") else "right", no_wrap=True)
    for st in ro.steps:
        action = st.action if not st.after_drains else f"start (after draining old {_ranges(st.after_drains)})"
        t.add_row(str(st.step), fmt_seconds(st.at_seconds) if st.at_seconds else "0 s", action,
                  f"{'old' if st.action == 'drain' else 'new'} {st.replica}", _gpu_ranges(st.gpus),
                  "-" if st.ready_seconds is None else fmt_seconds(st.ready_seconds), f"{st.capacity_share:.1%}")
    console.print(t)
    asked = "none asked" if ro.min_capacity is None else f"asked {ro.min_capacity:.1%}"
    proven = "" if ro.optimal else " (the best found; not proven the highest)"
    console.print(f"capacity never below {ro.min_share:.1%} ({asked}; the highest any order keeps: "
                  f"{ro.max_floor_share:.1%}{proven}); {ro.start_share:.1%} before the first step, "
                  f"{ro.end_share:.1%} at the end; all new replicas serve after {fmt_seconds(ro.duration_seconds)}",
                  highlight=False)
    if not ro.keeps_floor:
        console.print(f"[red]no order keeps --min-capacity {ro.min_capacity:.1%}: the highest is "
                      f"{ro.max_floor_share:.1%} ({_LIMITS[ro.limited_by]}); the order above keeps it[/red]",
                      highlight=False)


def _gpu_ranges(gpus: list[str]) -> str:
    """['0:0', '0:1', '0:2', '1:0'] -> '0:0-2, 1:0'."""
    by_node: dict[str, list[int]] = {}
    for g in gpus:
        node, _, idx = g.partition(":")
        by_node.setdefault(node, []).append(int(idx))
    return ", ".join(f"{node}:{_ranges(sorted(xs)).replace(', ', ',')}" for node, xs in by_node.items())


def _rank_set(xs: list[int]) -> str:
    """A sorted set of ranks (or nodes) in a table cell: [3] -> '3'; [0, 1, 2, 5] -> '0-2, 5'; a stride
    [0, 8, 16, 24] -> '0-24 every 8 (4)'; past a few runs, the count with its ends: '100 of 0-511'."""
    if len(xs) >= 3 and xs[1] - xs[0] > 1 and all(b - a == xs[1] - xs[0] for a, b in zip(xs, xs[1:])):
        return f"{xs[0]}-{xs[-1]} every {xs[1] - xs[0]} ({len(xs)})"
    text = _ranges(xs)
    return text if text.count(",") < 4 else f"{len(xs)} of {xs[0]}-{xs[-1]}"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def replan_files_written(r: ReplanResult) -> None:
    """Where the manifest and move list went: log lines on stderr (with or without --json)."""
    if r.manifest:
        file_written(r.manifest, "manifest")
    if r.moves_file:
        file_written(r.moves_file, "move list")
