"""Tables for `verify` and `calibrate`."""

from __future__ import annotations

from rich.table import Table

from shardplan.cli.render_common import console, err_console, fmt_bytes, fmt_pct, fmt_seconds
from shardplan.tasks.calibrate import CalibrateResult
from shardplan.verify.engine_log_check import EngineLogCheck, TermCheck
from shardplan.verify.offload_compare import OffloadVerifyReport
from shardplan.verify.report import ReshardReport, VerifyReport


_STATUS = {"ok": "[green]ok[/green]", "mismatch": "[red]mismatch[/red]", "oom": "[red]out of memory[/red]"}


def verify_report(r: VerifyReport) -> None:
    """Predicted against measured per rank and memory component, the numerics check, time; for
    a run that ran out of memory, where and what would fit."""
    run = r.run
    mdl = run["model"]
    console.print(f"verify {r.plan}: {_STATUS[r.status]} ({r.backend} on {r.device}, {r.world_size} ranks, "
                  f"{run['scale']} model: hidden {mdl['hidden_size']}, {mdl['num_layers']} layers, "
                  f"{mdl['num_attention_heads']}/{mdl['num_kv_heads']} heads, vocab {mdl['vocab_size']}; {run['dtype']})")
    console.print("work: " + ", ".join(f"{k} {v}" for k, v in run["work"].items()), highlight=False)
    if r.oom is not None:
        _out_of_memory(r)
    _components_table(r)
    _peaks_table(r)
    if r.oom is None:
        _numerics_and_time(r)
    probes = [p for p in r.probes if "error" not in p]
    if probes:
        first = probes[0]
        parts = [f"{first['matmul_dtype']} matmul {max(p['matmul_flops_per_second'] for p in probes) / 1e12:.1f} TFLOP/s",
                 f"memory {max(p['memory_bytes_per_second'] for p in probes) / 1e9:.0f} GB/s"]
        if first.get("all_reduce_bus_bytes_per_second"):
            parts.append(f"all-reduce bus {first['all_reduce_bus_bytes_per_second'] / 1e9:.1f} GB/s")
        console.print(f"hardware probes ({first['device_name']}, best rank): {', '.join(parts)}; "
                      "`shardplan calibrate REPORT` makes a profile of them", highlight=False)
    for note in run["notes"]:
        console.print(f"note: {note}", highlight=False)
    for mm in r.mismatches:
        console.print(f"[red]{'out of memory' if r.oom is not None else 'out of tolerance'}:[/red] {mm}", highlight=False)


def reshard_report(r: ReshardReport) -> None:
    """verify NEW --from OLD: the loss of every step against the unsharded reference, then per
    new rank the bytes it loaded from the checkpoint against the move list."""
    lost = f"; old ranks {', '.join(map(str, r.lost_ranks))} lost" if r.lost_ranks else ""
    console.print(f"verify {r.plan} --from {r.from_plan}: {_STATUS[r.status]} ({r.backend} on {r.device}, "
                  f"{r.run['scale']} model, {r.run['dtype']}; {r.old_layout}, {r.old_world_size} ranks -> "
                  f"{r.new_layout}, {r.new_world_size} ranks{lost})", highlight=False)
    n = r.numerics
    t = Table(title="loss per step vs one unsharded process that never stopped", title_justify="left")
    for col in ("step", "layout", "measured", "reference", "abs error", ""):
        t.add_column(col, justify="left" if col in ("layout", "") else "right")
    for i, ref in enumerate(n.reference):
        measured = n.measured[i] if i < len(n.measured) else None
        err = abs(measured - ref) if measured is not None else None
        ok = n.first_bad_step is None or i < n.first_bad_step
        if i == n.steps_before:
            t.add_section()
        t.add_row(str(i), "old" if i < n.steps_before else "new (resharded)",
                  "-" if measured is None else f"{measured:.7f}", f"{ref:.7f}",
                  "-" if err is None else f"{err:.1e}", "[green]ok[/green]" if ok else "[red]OUT[/red]")
    console.print(t)
    worst = "-" if n.max_relative_error is None else f"{n.max_relative_error:.1e}"
    console.print(f"loss continuation: {'[green]match[/green]' if n.ok else '[red]DIFFER[/red]'}, max relative error "
                  f"{worst} (rtol {n.rtol:g}, atol {n.atol:g})")
    console.print(f"checkpoint: {fmt_bytes(r.checkpoint_bytes)} written by {len(r.saved)} old ranks "
                  f"({', '.join(fmt_bytes(s.written_bytes) for s in r.saved)})", highlight=False)
    b = Table(title="bytes each new rank loaded vs the move list", title_justify="left")
    for col in ("rank", "node", "old GPU", "state", "loaded", "planned", "kept", "from ranks", "from ckpt", "error",
                "", "file read"):
        b.add_column(col, justify="left" if col in ("state", "") else "right", no_wrap=col == "state")
    for rank in r.ranks:
        for i, s in enumerate(rank.states):
            first = i == 0
            b.add_row(str(rank.rank) if first else "", str(rank.node) if first else "",
                      ("-" if rank.old_rank_on_gpu is None else f"rank {rank.old_rank_on_gpu}") if first else "",
                      s.state, fmt_bytes(s.measured_bytes), fmt_bytes(s.planned_bytes), fmt_bytes(s.planned_kept_bytes),
                      fmt_bytes(s.planned_from_ranks_bytes), fmt_bytes(s.planned_from_checkpoint_bytes),
                      fmt_pct(s.relative_error), "[green]ok[/green]" if s.ok else "[red]OUT[/red]",
                      fmt_bytes(rank.file_bytes_read) if first else "")
        b.add_section()
    console.print(b)
    for rank in r.ranks:
        p = rank.plan_scale
        console.print(f"rank {rank.rank} at the plan's scale (replan's move list): keeps {fmt_bytes(p.kept_bytes)}, "
                      f"receives {fmt_bytes(p.from_ranks_bytes)} from surviving ranks, "
                      f"{fmt_bytes(p.from_checkpoint_bytes)} only lost ranks held", highlight=False)
    console.print(f"compared: {r.compared}", highlight=False)
    for note in r.run["notes"]:
        console.print(f"note: {note}", highlight=False)
    w = r.wall_seconds
    console.print(f"time: old run {fmt_seconds(w['old_run'])}, new run {fmt_seconds(w['new_run'])}, total "
                  f"{fmt_seconds(w['total'])} (start-up included)", highlight=False)
    for mm in r.mismatches:
        console.print(f"[red]out of tolerance:[/red] {mm}", highlight=False)


def offload_report(r: OffloadVerifyReport) -> None:
    """verify PLAN --checkpoint DIR: each measured byte count against the plan's, the tokens
    against the whole model's."""
    where = "host RAM" if r.offload_params == "cpu" else "disk"
    layers = f"{r.offloaded_layers[0]}..{r.offloaded_layers[-1]}" if r.offloaded_layers else "none"
    console.print(f"verify {r.plan} --checkpoint {r.checkpoint}: {_STATUS[r.status]} ({r.model}, {r.dtype}; decoder "
                  f"layers {layers} in {where}; {r.device})", highlight=False)
    t = Table(title="offloaded serving: measured vs the plan", title_justify="left")
    for col in ("quantity", "device", "measured", "predicted", "measured B", "predicted B", "error", "tolerance", "",
                "predicted as"):
        t.add_column(col, justify="left" if col in ("quantity", "device", "", "predicted as") else "right",
                     no_wrap=col == "quantity")
    for q in r.quantities:
        t.add_row(q.quantity, q.device, fmt_bytes(q.measured_bytes), fmt_bytes(q.predicted_bytes),
                  f"{q.measured_bytes:,.0f}", f"{q.predicted_bytes:,.0f}", fmt_pct(q.relative_error),
                  f"{q.tolerance:.0%}", "[green]ok[/green]" if q.ok else "[red]OUT[/red]", q.predicted_how)
    console.print(t)
    n = r.numerics
    console.print(f"numerics ({n.check}, {n.prompt_tokens} prompt tokens, {n.new_tokens} generated): "
                  f"{'[green]match[/green]' if n.ok else '[red]DIFFER[/red]'}")
    console.print(f"moved: {r.moved_bytes_total:,.0f} B over {r.forwards} forwards", highlight=False)
    for note in r.notes:
        console.print(f"note: {note}", highlight=False)
    for mm in r.mismatches:
        console.print(f"[red]out of tolerance:[/red] {mm}", highlight=False)


def _out_of_memory(r: VerifyReport) -> None:
    """The allocation that did not fit, its component's prediction, and what would fit."""
    o = r.oom
    assert o is not None
    where = "while building the model" if o.step is None else f"in step {o.step}"
    device = (f"a simulated {fmt_bytes(o.capacity_bytes)} device" if o.simulated else f"a {fmt_bytes(o.capacity_bytes)} device")
    limit = f", torch may allocate {fmt_bytes(o.limit_bytes)}" if o.limit_bytes is not None else ""
    shape = f" {o.shape}" if o.shape is not None else ""
    dtype = f" {o.dtype}" if o.dtype else ""
    size = f" allocating {fmt_bytes(o.allocation_bytes)}" if o.allocation_bytes is not None else ""
    live = f" with {fmt_bytes(o.live_bytes)} live" if o.live_bytes is not None else ""
    console.print(f"rank {o.rank} (stage {o.stage}) ran out of memory {where} on {device}{limit}: "
                  f"{o.op or 'an allocation'}{size}{shape}{dtype}{live}", highlight=False)
    if o.message:
        console.print(f"torch: {o.message}", highlight=False, markup=False)
    predicted = "-" if o.predicted_component_bytes is None else fmt_bytes(o.predicted_component_bytes)
    said = "fits" if o.predicted_fits else "does not fit"
    console.print(f"component: {o.component or 'unknown'}, predicted {predicted}; the rank's predicted total "
                  f"{fmt_bytes(o.predicted_total_bytes)}, reserve {fmt_bytes(o.predicted_reserved_bytes)}: the cost "
                  f"model said it {said}", highlight=False)
    if o.unmeasured_components:
        console.print(f"not measured before the failure: {', '.join(o.unmeasured_components)}", highlight=False)
    if o.suggestion is not None:
        console.print(f"[green]smallest change that fits:[/green] {o.suggestion.change} (predicted "
                      f"{fmt_bytes(o.suggestion.predicted_total_bytes)}, reserve "
                      f"{fmt_bytes(o.suggestion.predicted_reserved_bytes)})", highlight=False)
    else:
        console.print("[red]no change tried fits[/red] (micro-batch halved, recompute full, twice the tp, ZeRO-3)",
                      highlight=False)
    if o.tried:
        t = Table(title="changes tried (the cost model at the device's memory)", title_justify="left")
        for col in ("change", "predicted total", "reserve", "fits"):
            t.add_column(col, justify="right" if col in ("predicted total", "reserve") else "left")
        for c in o.tried:
            t.add_row(c.change, fmt_bytes(c.predicted_total_bytes), fmt_bytes(c.predicted_reserved_bytes),
                      "[green]yes[/green]" if c.fits else "no")
        console.print(t)


def _peaks_table(r: VerifyReport) -> None:
    ranks = [rank for rank in r.ranks if rank.memory_peak is not None]
    if not ranks:
        return
    t = Table(title="peak memory per rank: measured vs the predicted total and reserve (less the runtime's share; "
                    "reported, not checked)", title_justify="left")
    for col in ("rank", "allocated", "predicted", "error", "reserved", "predicted ", "error "):
        t.add_column(col, justify="left" if col == "rank" else "right")
    for rank in ranks:
        p = rank.memory_peak
        assert p is not None
        reserved = "not measured" if p.reserved_peak_bytes is None else fmt_bytes(p.reserved_peak_bytes)
        t.add_row(str(rank.rank), fmt_bytes(p.allocated_peak_bytes), fmt_bytes(p.predicted_allocated_bytes),
                  fmt_pct(p.allocated_relative_error), reserved, fmt_bytes(p.predicted_reserved_bytes),
                  fmt_pct(p.reserved_relative_error))
    console.print(t)


def _components_table(r: VerifyReport) -> None:
    title = ("memory per rank measured before the failure vs the cost model applied to what ran" if r.oom is not None
             else "memory per rank: measured vs the cost model applied to what ran")
    t = Table(title=title, title_justify="left")
    axes = ("pp", "dp", "cp", "tp") if r.world_size > 1 and any(rank.cp for rank in r.ranks) else ("pp", "dp", "tp")
    for col in ("rank", "/".join(axes), "component", "measured", "predicted", "error", "tolerance", ""):
        t.add_column(col, justify="right" if col in ("measured", "predicted", "error", "tolerance") else "left",
                     no_wrap=col == "component")  # the identifier stays whole
    for rank in r.ranks:
        coords = "/".join(str(getattr(rank, a)) for a in axes)
        for i, c in enumerate(rank.components):
            mark = "[green]ok[/green]" if c.ok else "[red]OUT[/red]"
            tol = "-" if c.tolerance is None else f"{c.tolerance:.0%}"
            t.add_row(str(rank.rank) if i == 0 else "", coords if i == 0 else "",
                      c.component, fmt_bytes(c.measured_bytes), fmt_bytes(c.predicted_bytes),
                      fmt_pct(c.relative_error), tol, mark)
        t.add_section()
    console.print(t)


def _numerics_and_time(r: VerifyReport) -> None:
    n = r.numerics
    if not n.get("checked", True):
        console.print(f"numerics: {n['check']}")
    else:
        err = n.get("max_relative_error", n.get("max_abs_error"))
        mark = "[green]match[/green]" if n["ok"] else "[red]DIFFER[/red]"
        console.print(f"numerics ({n['check']}) vs the unsharded reference: {mark}, max error {err:.2e} "
                      f"(tolerance {n['tolerance']:.0e})")
    tm = r.time
    measured = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in tm["measured"].items())
    predicted = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in tm["predicted"].items())
    console.print(f"time: measured {measured}; predicted {predicted}" +
                  ("" if tm["compared"] else f" (not compared: {tm['reason']})"), highlight=False)


def _fmt_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return fmt_bytes(value)
    if unit in ("tokens", "blocks"):
        return f"{value:,.0f}"
    return f"{value:.3g}" + ("x" if unit == "ratio" else "")


def _term_row(c: TermCheck) -> tuple[str, ...]:
    mark = "[green]ok[/green]" if c.ok else "[red]OUT[/red]"
    tol = "-" if c.tolerance is None else f"{c.tolerance:.0%}"
    return (c.term, _fmt_value(c.measured, c.unit), _fmt_value(c.predicted, c.unit), fmt_pct(c.relative_error), tol,
            mark, str(c.log_line), c.note or "")


def engine_log_check(r: EngineLogCheck) -> None:
    """The engine's start-up figures against the plan's estimate, one row per term."""
    status = "[green]ok[/green]" if r.status == "ok" else "[red]mismatch[/red]"
    console.print(f"verify {r.plan} against {r.log.source}: {status} ({r.log.engine}, format {r.log.generation})",
                  highlight=False)
    t = Table(title="the engine's start-up log vs the cost model", title_justify="left")
    for col in ("term", "measured", "predicted", "error", "tolerance", "", "line", "note"):
        t.add_column(col, justify="right" if col in ("measured", "predicted", "error", "tolerance", "line") else "left",
                     no_wrap=col == "term")
    for c in r.terms:
        t.add_row(*_term_row(c))
    v = r.verdict
    said = "started" if v.engine_started else "refused"
    predicted = "fits" if v.predicted_fits else "does not fit"
    mark = "[green]ok[/green]" if v.ok and v.checked else ("-" if not v.checked else "[red]OUT[/red]")
    t.add_section()
    t.add_row("verdict", said, predicted, "", "", mark, str(v.log_line or ""), v.predicted_reason or "")
    console.print(t)
    for note in r.notes:
        console.print(f"note: {note}", highlight=False)
    for mm in r.mismatches:
        console.print(f"[red]out of tolerance:[/red] {mm}", highlight=False)


def calibrate_report(r: CalibrateResult) -> None:
    if r.measured_by == "engine-log":
        _calibrate_log_table(r)
    elif r.measured_by == "serving-run":
        _calibrate_run_table(r)
    else:
        t = Table(title=f"{r.name}: efficiencies measured (base {r.base})", title_justify="left")
        for c in ("field", "base", "measured", "what", "figure"):
            t.add_column(c, justify="right" if c in ("base", "measured") else "left", no_wrap=c == "field")
        for c in r.changes:
            scale = 1e12 if c.unit == "TFLOP/s" else 1e9
            t.add_row(c.field, f"{c.old:.3f}", f"{c.new:.3f}", c.what,
                      f"{c.measured / scale:.4g} of {c.peak / scale:.4g} {c.unit}")
        console.print(t)
    for note in r.notes:
        console.print(f"note: {note}", highlight=False)
    err_console.print(f"profile written to {r.profile}; use it with --hardware {r.profile}", markup=False,
                      highlight=False, soft_wrap=True)


def _calibrate_run_table(r: CalibrateResult) -> None:
    """The fitted fraction, then the run's figures measured and predicted before and after."""
    for c in r.changes:
        console.print(f"{r.name}: {c.field} {c.old:.4g} -> {c.new:.4g} (base {r.base}; {c.what}: "
                      f"{c.measured:,.0f} measured, {c.peak:,.0f} predicted before)", highlight=False)
    t = Table(title=f"serving run in {r.input_file}", title_justify="left")
    for c in ("figure", "measured", "predicted before", "error", "predicted after", "error "):
        t.add_column(c, justify="left" if c == "figure" else "right")
    for f in r.fit_figures:
        t.add_row(f.figure, f"{f.measured:,.1f}", f"{f.before:,.1f}", f"{f.before / f.measured - 1:+.0%}",
                  f"{f.after:,.1f}", f"{f.after / f.measured - 1:+.0%}")
    console.print(t)


def _calibrate_log_table(r: CalibrateResult) -> None:
    """One row per profile key the engine log set: the base and calibrated GiB, the log line."""
    t = Table(title=f"{r.name}: memory figures from {r.input_file} (base {r.base})", title_justify="left")
    for c in ("field", "base GiB", "calibrated GiB", "line", "log", "rule"):
        t.add_column(c, justify="right" if "GiB" in c or c == "line" else "left", no_wrap=c == "field")
    for c in r.profile_changes:
        t.add_row(c.field, f"{c.old_gib:.4g}", f"{c.new_gib:.4g}", str(c.log_line), c.printed, c.rule)
    console.print(t)
