"""What recommend says about a search: the ranked plans with their full estimates, the binding
constraint, the runner-up's gap and its causes, a comparison with a layout the user names, and,
when nothing fits, the smallest changes that make something fit, each found by searching again.
Pure: returns the typed models of search/results.py that `--json` prints and the CLI draws."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

from shardplan.cost.estimate import estimate
from shardplan.cost.report import CostReport, PlanReport, ServingPlanReport, ServingTimeReport, TrainingTimeReport
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.search.results import (
    BindingConstraint,
    Comparison,
    CostFigures,
    Difference,
    ParetoPoint,
    RecommendEntry,
    Suggestion,
)
from shardplan.search.space import Evaluated, Goal, Objective, SearchResult, Space, cost_figures, divisors
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.units import DType, bytes_to_gib

SUGGESTION_MAX_NODES = 64  # "more GPUs" looks this far (whole nodes)
MIN_SUGGESTED_SEQ_LEN_TOKENS = 128  # "shorter sequences" stops halving here


def plan_report(e: Evaluated, report: CostReport) -> PlanReport:
    """The estimate's layout, plus (serving) the replicas, formats and batch the search chose."""
    if not isinstance(e.workload, InferenceWorkload):
        return report.plan
    return ServingPlanReport(
        **dict(report.plan),
        replicas=e.layout.dp,
        quantization=e.workload.quantization.value,
        kv_cache_dtype=(e.workload.kv_cache_dtype.value if e.workload.kv_cache_dtype else "auto"),
        batch_size=e.workload.batch_size,
    )


def plan_dict(e: Evaluated, report: CostReport) -> dict[str, Any]:
    """`plan_report` as its JSON object."""
    return plan_report(e, report).model_dump(mode="json")


def entry(spec: ModelSpec, e: Evaluated, goal: Goal, rank: int,
          banded: Callable[[CostReport], CostReport] | None = None) -> RecommendEntry:
    """One ranked plan: the estimate's memory and time for it, its cost and objective;
    `banded` attaches the measured error bands and the verdict at their edge."""
    return entry_and_report(spec, e, goal, rank, banded)[0]


def entry_and_report(spec: ModelSpec, e: Evaluated, goal: Goal, rank: int,
                     banded: Callable[[CostReport], CostReport] | None = None) -> tuple[RecommendEntry, CostReport]:
    """`entry`, and the estimate it was made from (what the plan's manifest is built from)."""
    report = estimate(spec, e.hw, e.layout, e.workload)
    if banded is not None:
        report = banded(report)
    t = report.time
    tokens_per_second = t.tokens_per_second if isinstance(t, TrainingTimeReport) else t.throughput_tokens_per_second
    if report.load is not None:  # judged under traffic: its cost is that of the goodput
        tokens_per_second = report.load.output_tokens_per_second
    return RecommendEntry(
        rank=rank,
        num_gpus=e.num_gpus,
        num_nodes=e.hw.num_nodes,
        plan=plan_report(e, report),
        objective_value=e.objective_value,
        memory=report.memory,
        kv_cache=report.kv_cache,
        time=t,
        cost=CostFigures(**cost_figures(e.hw, goal, e.num_gpus, tokens_per_second)),
        bands=report.bands,
        fit_at_band_edge=report.fit_at_band_edge,
        load=report.load,
        tie=e.tie,
        variants=e.variants,
    ), report


def pareto_point(e: Evaluated) -> ParetoPoint:
    f = e.figures
    return ParetoPoint(
        num_gpus=e.num_gpus,
        tp=e.layout.tp,
        pp=e.layout.pp,
        replicas=e.layout.dp,
        ep=e.layout.ep,
        quantization=e.workload.quantization.value,  # type: ignore[union-attr]
        kv_cache_dtype=e.workload.kv_cache_dtype.value if e.workload.kv_cache_dtype else "auto",  # type: ignore[union-attr]
        batch_size=int(f["batch_size"]),
        ttft_seconds=f["ttft_seconds"],
        tpot_seconds=f["tpot_seconds"],
        e2e_latency_seconds=f["e2e_latency_seconds"],
        throughput_tokens_per_second_per_gpu=f["throughput_tokens_per_second_per_gpu"],
    )


def describe(plan: PlanReport | dict[str, Any]) -> str:
    """A layout in one line, leaving out what is off."""
    if not isinstance(plan, dict):
        plan = plan.model_dump(mode="json")
    keys = ["tp", "pp", "dp", "cp", "ep", "zero_stage", "virtual_stages", "micro_batch_size"]
    shown = ("tp", "pp", "dp", "micro_batch_size") if "quantization" not in plan else ("tp", "pp", "dp")
    parts = [f"{k}={plan[k]}" for k in keys if k in plan and (plan[k] not in (1, 0) or k in shown)]
    if "zero_stage" in plan and plan["zero_stage"] == 1:
        parts.append("zero_stage=1")
    if plan.get("sequence_parallel"):
        parts.append("sp")
    if plan.get("hybrid_shard"):
        parts.append("hybrid-shard")
    if plan.get("recompute", "none") != "none":
        parts.append(f"recompute={plan['recompute']}")
    off = plan.get("offload", {})
    if off and off.get("layers"):
        parts.append(f"offload={off['layers']} layers to {off['params']}")
    elif off and (off.get("optimizer") != "none" or off.get("params") != "none"):
        parts.append(f"offload={off['optimizer']}/{off['params']}")
    if "quantization" in plan:
        parts.append(f"weights={plan['quantization'] if plan['quantization'] != 'none' else 'bf16'}")
        parts.append(f"kv={plan['kv_cache_dtype']}")
        if plan["batch_size"] is not None:  # a goodput plan runs under continuous batching, not one batch
            parts.append(f"batch={plan['batch_size']}")
    return " ".join(parts)


def binding_constraint(top: RecommendEntry, goal: Goal) -> BindingConstraint:
    """The limit closest to being broken by the winner: memory headroom or a latency/throughput
    limit, as the fraction of slack left."""
    mem, t = top.memory, top.time
    slacks: list[tuple[float, str, str]] = []
    if isinstance(t, ServingTimeReport) and top.load is not None:
        kv = top.kv_cache
        slacks.append((1.0, "kv_cache", f"{top.load.num_preemptions} requests preempted per replica") if not top.load.num_preemptions
                      else (0.0, "kv_cache", f"the KV cache fills: {top.load.num_preemptions} requests preempted and "
                                             f"recomputed per replica ({kv.capacity_tokens if kv else 0:,} tokens)"))
    elif isinstance(t, ServingTimeReport):
        fill = t.batch_size / max(1, t.max_batch_in_kv_cache)
        slacks.append((1 - fill, "kv_cache", f"batch {t.batch_size} uses {100 * fill:.0f}% of the {t.max_batch_in_kv_cache} sequences the KV cache holds"))
    else:
        cap = mem.per_gpu_bytes["total"] + mem.headroom_bytes
        slacks.append((
            mem.headroom_bytes / cap, "memory",
            f"{bytes_to_gib(mem.headroom_bytes):.1f} GiB headroom of {bytes_to_gib(cap):.1f} GiB on stage "
            f"{mem.binding_stage}; largest part {mem.binding_component}",
        ))
    ld = top.load
    if ld is not None:
        p = f"p{goal.slo_percentile}"
        ttft, tpot = getattr(ld.ttft_seconds, p), getattr(ld.tpot_seconds, p)
        if goal.max_ttft_seconds is not None:
            slacks.append((1 - ttft / goal.max_ttft_seconds, "max_ttft", f"{p} TTFT {ttft * 1e3:.1f} ms of {goal.max_ttft_seconds * 1e3:.0f} ms allowed"))
        if goal.max_tpot_seconds is not None:
            slacks.append((1 - tpot / goal.max_tpot_seconds, "max_tpot", f"{p} TPOT {tpot * 1e3:.2f} ms of {goal.max_tpot_seconds * 1e3:.0f} ms allowed"))
    elif isinstance(t, ServingTimeReport):
        if goal.max_ttft_seconds is not None:
            slacks.append((1 - t.ttft_seconds / goal.max_ttft_seconds, "max_ttft", f"TTFT {t.ttft_seconds * 1e3:.1f} ms of {goal.max_ttft_seconds * 1e3:.0f} ms allowed"))
        if goal.max_tpot_seconds is not None:
            slacks.append((1 - t.tpot_seconds / goal.max_tpot_seconds, "max_tpot", f"TPOT {t.tpot_seconds * 1e3:.2f} ms of {goal.max_tpot_seconds * 1e3:.0f} ms allowed"))
    if goal.min_throughput_tokens_per_second is not None:
        have = top.throughput_tokens_per_second
        slacks.append((have / goal.min_throughput_tokens_per_second - 1, "min_throughput", f"{have:,.0f} tokens/s of {goal.min_throughput_tokens_per_second:,.0f} required"))
    slack, name, text = min(slacks)
    return BindingConstraint(constraint=name, slack_fraction=slack, detail=text)


def _objective_label(goal: Goal) -> str:
    return {
        Objective.LATENCY: "request latency",
        Objective.THROUGHPUT: "throughput",
        Objective.COST: "USD per million tokens",
        Objective.STEP_TIME: "step time",
        Objective.GOODPUT: f"goodput (output tokens/s per GPU within the p{goal.slo_percentile} SLA)",
    }[goal.objective]


def _headline(e: RecommendEntry) -> str:
    t = e.time
    if isinstance(t, TrainingTimeReport):
        return f"step {t.step_seconds:.3g} s, MFU {100 * t.mfu:.1f}%"
    if e.load is not None:
        ld = e.load
        return (f"{ld.request_throughput_per_second:,.2f} req/s, p90 TTFT {ld.ttft_seconds.p90 * 1e3:.0f} ms, p90 TPOT "
                f"{ld.tpot_seconds.p90 * 1e3:.1f} ms, {ld.output_tokens_per_second_per_gpu:,.0f} output tokens/s per GPU")
    return (
        f"TTFT {t.ttft_seconds * 1e3:.0f} ms, TPOT {t.tpot_seconds * 1e3:.1f} ms, "
        f"{t.throughput_tokens_per_second:,.0f} tokens/s"
    )


def differences(a: RecommendEntry, b: RecommendEntry) -> list[Difference]:
    """Where the time of plan `b` differs from plan `a`'s, largest first (seconds, b - a)."""
    ta, tb = a.time, b.time
    if isinstance(ta, TrainingTimeReport) and isinstance(tb, TrainingTimeReport):
        pairs = [(k, ta.breakdown[k], tb.breakdown[k]) for k in ta.breakdown if k != "total"]
    elif a.load is not None and b.load is not None:
        pairs = [(f"p90_{k}", getattr(a.load, k).p90, getattr(b.load, k).p90) for k in ("ttft_seconds", "tpot_seconds", "e2e_seconds")]
    else:
        pairs = [(k, getattr(ta, k), getattr(tb, k)) for k in ("ttft_seconds", "tpot_seconds", "e2e_latency_seconds")]
    out = [Difference(component=k, seconds_a=x, seconds_b=y, delta_seconds=y - x)
           for k, x, y in pairs if not math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)]
    return sorted(out, key=lambda d: -abs(d.delta_seconds))


def gap(a: RecommendEntry, b: RecommendEntry) -> float:
    """How far b's objective is behind a's, as a fraction (0.05 = 5% worse)."""
    va, vb = a.objective_value, b.objective_value
    return (vb - va) / abs(va) if va else 0.0


# `search.secondary_key` in words
PICK_AMONG_TIES = ("the pick is the one with the fewest GPUs, tensor parallelism inside a node, the smallest "
                   "context-parallel group, the fewest pipeline stages, the smallest tensor-parallel group, then the "
                   "simplest schedule")


def why(top: list[RecommendEntry], goal: Goal, binding: BindingConstraint | None) -> str:
    if not top:
        return "no layout fits; see the suggestions"
    w = top[0]
    tied = [e for e in top if e.tie]
    fastest = min(tied, key=lambda e: e.objective_value) if tied else w
    if fastest.objective_value == w.objective_value:
        text = f"{describe(w.plan)} on {w.num_gpus} GPUs ranks first by {_objective_label(goal)} ({_headline(w)})"
    else:
        text = (f"{describe(w.plan)} on {w.num_gpus} GPUs is the pick ({_headline(w)}); the best by "
                f"{_objective_label(goal)} is {describe(fastest.plan)} ({_headline(fastest)}), within the model's "
                "error of it")
    band = goal.tie_band_fraction or 0.0
    if len(tied) > 1 and band <= 0:
        text += f"; {len(tied)} of the plans shown have the same {_objective_label(goal)} (marked =); {PICK_AMONG_TIES}"
    elif len(tied) > 1:
        text += (f"; {len(tied)} of the plans shown tie within ±{100 * band:.1f}% of the best ranked figure, "
                 f"the model's measured error in comparing two layouts (marked =); {PICK_AMONG_TIES}, and the others "
                 "follow by the ranked figure")
    if binding:
        text += f"; binding constraint: {binding.constraint} ({binding.detail})"
    if len(top) > 1:
        r = top[1]
        diffs = differences(w, r)
        g = gap(w, r)
        text += (f"; the runner-up ({describe(r.plan)}) is {100 * g:.2f}% behind" if g >= 0 else
                 f"; the runner-up ({describe(r.plan)}) is {-100 * g:.2f}% ahead on the ranked figure, a tie")
        if diffs:
            d = diffs[0]
            text += f", mostly {d.component.replace('_', ' ')} ({d.delta_seconds * 1e3:+.1f} ms)"
    return text


def compare(
    spec: ModelSpec, best: RecommendEntry | None, pinned: SearchResult, goal: Goal, pins: dict[str, Any],
) -> Comparison:
    """The best layout with the degrees the user names (e.g. a published layout: its knobs left
    unnamed are searched) against the overall winner: how far behind it is and which parts of
    the time make the difference; or, when nothing with those degrees fits, why."""
    if not pinned.top:
        return Comparison(pins=pins, fits=False,
                          rejected=dict(sorted(pinned.rejected.items(), key=lambda kv: (-kv[1], kv[0]))),
                          invalid_degree_combinations=dict(pinned.invalid))
    mine = entry(spec, pinned.top[0], goal, 0)
    return Comparison(
        pins=pins, fits=True, plan=mine.plan, objective_value=mine.objective_value, memory=mine.memory, time=mine.time,
        gap_fraction=gap(best, mine) if best is not None else None,
        differences=differences(best, mine) if best is not None else None,
    )


# ----- when nothing fits ---------------------------------------------------------------------


def suggestions(
    spec: ModelSpec, hw: HardwareProfile, workload: InferenceWorkload | TrainingWorkload, space: Space, goal: Goal,
    num_gpus: int, run: Any, throughput_short: bool = False,
) -> list[Suggestion]:
    """Smallest single changes that make a layout fit, each checked by searching again with
    `run(workload, space, num_gpus=..., max_gpus=...) -> SearchResult`. `throughput_short`: every
    layout was refused for --min-throughput alone; a shorter context or a smaller batch gives no
    more tokens a second, so they are not searched (a serving search each, seconds of simulation
    for an answer known to be no)."""
    found: list[Suggestion] = []
    quick = replace(goal, top_k=1)
    as_asked = space
    if isinstance(workload, InferenceWorkload):
        # What fits on the GPUs alone: an offloaded plan is what these changes are the alternative to
        # (a shorter context, below, may also fit by offloading: its detail says how).
        space = replace(space, allow_offload=False)

    def fits(res: SearchResult) -> Evaluated | None:
        return res.top[0] if res.top else None

    # More GPUs: whole nodes, the fewest that work.
    gpn = hw.gpus_per_node
    limit = max(num_gpus, gpn) * SUGGESTION_MAX_NODES
    res = run(workload, space, quick, num_gpus=None, max_gpus=limit, first_fit=True)
    if res.smallest_num_gpus is not None and res.smallest_num_gpus > num_gpus:
        n = res.smallest_num_gpus
        speed = speed_note(fits(res)) if isinstance(workload, InferenceWorkload) else ""
        found.append(Suggestion(change=f"--gpus {n}", detail=f"{n} GPUs ({max(1, n // gpn)} node(s) of {gpn}){speed}",
                                num_gpus=n))
    if isinstance(workload, InferenceWorkload):
        allowed = set(space.quantizations)
        for q in (Quantization.FP8, Quantization.INT8, Quantization.INT4):
            if q in allowed:
                continue
            r = run(workload, replace(space, quantizations=tuple(space.quantizations) + (q,)), quick, num_gpus=num_gpus, max_gpus=None)
            if fits(r):
                found.append(Suggestion(change=f"--allow-quantization {q.value}",
                                        detail=f"{q.value} weights fit on {num_gpus} GPU(s){speed_note(fits(r))}"))
                break
        if DType.FP8 not in space.kv_cache_dtypes:
            r = run(workload, replace(space, kv_cache_dtypes=tuple(space.kv_cache_dtypes) + (DType.FP8,)), quick, num_gpus=num_gpus, max_gpus=None)
            if fits(r):
                found.append(Suggestion(change="--kv-cache-dtype fp8", detail="an fp8 KV cache holds twice the tokens"))
        length = _largest_halving_that_fits(
            workload.max_model_len or spec.max_position_embeddings, workload.input_len + workload.output_len,
            lambda n: fits(run(replace(workload, max_model_len=n), as_asked, quick, num_gpus=num_gpus, max_gpus=None)),
        ) if not throughput_short else None
        if length:
            best = fits(run(replace(workload, max_model_len=length), as_asked, quick, num_gpus=num_gpus, max_gpus=None))
            how = ""
            if best is not None and (best.layout.offload_layers or best.workload.quantization is not workload.quantization):
                how = f" with {best.workload.quantization.value} weights" if best.workload.quantization is not workload.quantization else ""
                how += f", {best.layout.offload_layers} layers offloaded" if best.layout.offload_layers else ""
            found.append(Suggestion(change=f"--max-model-len {length}",
                                    detail=f"a {length}-token context fits the KV cache{how}{speed_note(best)}"))
        if workload.batch_size is not None and not throughput_short:
            b = _largest_halving_that_fits(
                workload.batch_size, 1,
                lambda n: fits(run(replace(workload, batch_size=n), space, quick, num_gpus=num_gpus, max_gpus=None)),
            )
            if b:
                found.append(Suggestion(change=f"--batch-size {b}", detail=f"{b} concurrent sequences fit"))
    else:
        if not space.allow_offload and space.offload is None:
            r = run(workload, replace(space, allow_offload=True), quick, num_gpus=num_gpus, max_gpus=None)
            if fits(r):
                found.append(Suggestion(change="--allow-offload", detail="offloading optimizer states (or parameters) to host/NVMe fits"))
        # The shortest halving first, where it holds every layout the longer ones do: with no more
        # memory there (activations only shrink with the sequence), when nothing fits at it nothing
        # fits at any, and the halvings (a search each) are skipped.
        searched: dict[int, Evaluated | None] = {}

        def fits_at(n: int) -> Evaluated | None:  # each length searched once (the shortest may be the answer)
            if n not in searched:
                searched[n] = fits(run(replace(workload, seq_len=n), space, quick, num_gpus=num_gpus, max_gpus=None))
            return searched[n]

        floor = _shortest_halving_with_every_layout(workload.seq_len, num_gpus, space.cp)
        shorter_may_fit = floor is None or fits_at(floor) is not None
        seq = _largest_halving_that_fits(workload.seq_len, MIN_SUGGESTED_SEQ_LEN_TOKENS, fits_at) if shorter_may_fit else None
        if seq:
            found.append(Suggestion(change=f"--seq-len {seq}", detail=f"{seq}-token sequences fit"))
        gbs = _largest_halving_that_fits(
            workload.global_batch_size, 1,
            lambda n: fits(run(replace(workload, global_batch_size=n), space, quick, num_gpus=num_gpus, max_gpus=None)),
        )
        if gbs:
            found.append(Suggestion(change=f"--global-batch-size {gbs}", detail=f"a global batch of {gbs} fits"))
    return found


def speed_note(e: Evaluated | None) -> str:
    """': 38 output tokens/s at batch 1, TPOT 26 ms' for a serving point (the trade, stated)."""
    if e is None or "tpot_seconds" not in e.figures:
        return ""
    f = e.figures
    return (f": {f['throughput_tokens_per_second']:,.0f} output tokens/s at batch {int(f['batch_size'])}, "
            f"TPOT {f['tpot_seconds'] * 1e3:,.0f} ms")


def _shortest_halving_with_every_layout(seq_len: int, num_gpus: int, cp: int | None) -> int | None:
    """The shortest of seq_len/2, /4, ... (not below MIN_SUGGESTED_SEQ_LEN_TOKENS) that every
    context-parallel degree splitting the first halving still splits into 2 x cp chunks (the
    search's rule), so that each layout of a halving exists at it too; None when that is the
    first halving itself (checking it first saves nothing)."""
    first = seq_len // 2
    chunks = [2 * c for c in ([cp] if cp else divisors(num_gpus)) if first % (2 * c) == 0]
    shortest, n = None, first
    while n >= MIN_SUGGESTED_SEQ_LEN_TOKENS:
        if all(n % q == 0 for q in chunks):
            shortest = n
        n //= 2
    return shortest if shortest is not None and shortest < first else None


def _largest_halving_that_fits(start: int, floor: int, fits_with: Callable[[int], Any]) -> int | None:
    """The first of start/2, start/4, ... (not below `floor`) for which `fits_with` finds a plan."""
    n = start
    while n // 2 >= floor:
        n //= 2
        if fits_with(n):
            return n
    return None
