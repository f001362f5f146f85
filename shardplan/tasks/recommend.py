"""recommend: search, explain, and (optionally) write the winner's manifest. Returns the
typed `RecommendResult` (search/results.py) whose dump `recommend --json` prints; the CLI only
parses options and renders it."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardplan.cost.estimate import plan_report
from shardplan.cost.layout import PipelineSchedule, Recompute
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.errors import ShardplanError
from shardplan.cost.inputs import offload_pair
from shardplan.search import Goal, Objective, SearchResult, Space, search
from shardplan.search import explain
from shardplan.search.serving import THROUGHPUT_REASONS, weights_exceed_memory
from shardplan.search.ahead import in_order
from shardplan.search.results import (BestAtGpuCount, DisaggregatedComparison, EngineFallback, LongRun,
                                      RecommendResult, SearchBudget, Suggestion)
from shardplan.cost.disaggregated import best_disaggregated
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.step_model import StepModel
from shardplan.cost.serving_load import LoadResult
from shardplan.cost.traffic import STEADY_REQUESTS_MAX, Sla, long_run_and_held, most_within_sla
from shardplan.search.space import BUDGET_SPENT, MEMORY_REASONS, Progress
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.loading import LoadedModel
from shardplan.tasks._bands import banded, goal_at_edge, workload_bands
from shardplan.tasks._targets import RunsOn, check_target, engine_label, search_rules
from shardplan.units import DType


PINNABLE = ("tp", "pp", "dp", "cp", "ep", "zero_stage", "hybrid_shard", "sequence_parallel", "recompute",
            "pp_schedule", "virtual_stages", "micro_batch_size", "offload")


def parse_pins(text: str) -> dict[str, Any]:
    """`tp=8,pp=16,dp=128` -> {"tp": 8, ...}: the degrees of a layout to compare with the winner."""
    pins: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip().lower()
        if not sep or key not in PINNABLE:
            raise ShardplanError(f"cannot read {part!r}", field="--compare",
                                 hint="give key=value pairs such as tp=8,pp=16,dp=128; keys: " + ", ".join(PINNABLE))
        try:
            if key in ("hybrid_shard", "sequence_parallel"):
                if raw not in ("true", "false"):
                    raise ValueError(raw)
                pins[key] = raw == "true"
            elif key == "recompute":
                pins[key] = Recompute(raw)
            elif key == "pp_schedule":
                pins[key] = PipelineSchedule(raw)
            elif key == "offload":
                pins[key] = offload_pair(raw)
            else:
                pins[key] = int(raw)
                if pins[key] < 0:
                    raise ValueError(raw)
        except (ValueError, KeyError):
            raise ShardplanError(f"bad value in {part!r}", field="--compare",
                                 hint="degrees are integers; see `shardplan recommend --help` for the others") from None
    return pins


def recommend(
    loaded: LoadedModel,
    hw: HardwareProfile,
    workload: InferenceWorkload | TrainingWorkload,
    space: Space,
    goal: Goal,
    *,
    num_gpus: int | None,
    max_gpus: int | None,
    compare_layout: str | None = None,
    manifest_path: Path | None = None,
    progress: Progress | None = None,
    suggest: bool = True,
    strict_fit: bool = False,
    target: str | None = None,
    compare_disaggregated: bool = True,
    write_disaggregation: bool = False,
    engine_given: bool = True,
) -> RecommendResult:
    """The search with "fits" decided at the edge of the workload's measured error band
    (`knowledge/bands.yaml`): plans that fit only at the prediction (tight) rank after those
    that fit at the edge, or, with `strict_fit`, are rejected where the search decides fit.
    `target`: only plans that target runs (and verify checks); without it each plan says which
    targets run it (`runs_on`) (tasks/_targets.py). `engine_given` False (serving without
    --engine): when the default engine has no plan at all, the answer is the first other engine's
    that has one (`engine_fallback` says which and why), the default's own suggestions kept."""
    spec = loaded.spec
    if target is not None:
        check_target(target, spec, hw, workload)
    if compare_layout:
        parse_pins(compare_layout)  # a bad --compare is bad input before the search, not after it
    space = replace(space, rules=search_rules(target, spec, workload))
    goal = goal_at_edge(goal, workload, hw, strict_fit=strict_fit)
    res = search(spec, hw, workload, space, goal, num_gpus=num_gpus, max_gpus=max_gpus, progress=progress)
    dropped = ""
    if not res.top and goal.objective is Objective.GOODPUT and goal.sla_defaulted and res.sla_floor_seconds:
        # A default SLA is a preference, not the user's limit: when no layout that fits meets it,
        # rank those by goodput without it, and say what the fastest reaches.
        floors = ", ".join(f"p{goal.slo_percentile} {k.upper()} {v * 1e3:,.1f} ms" for k, v in sorted(res.sla_floor_seconds.items()))
        dropped = (f"no layout meets the default SLA (the fastest, one request at a time or at the lightest load: {floors}); ranked by goodput "
                   "without it, at the highest rate each sustains")
        goal = goal.without_sla()
        res = search(spec, hw, workload, space, goal, num_gpus=num_gpus, max_gpus=max_gpus, progress=progress)
    runs_on = RunsOn(spec)
    compare_split = bool(res.top and isinstance(workload, InferenceWorkload) and goal.objective is Objective.GOODPUT
                         and num_gpus and num_gpus > 1 and compare_disaggregated)

    check_long = bool(res.top and isinstance(workload, InferenceWorkload) and goal.objective is Objective.GOODPUT
                      and workload.load is not None and workload.load.max_concurrency is None)

    def part(i: int) -> Any:
        """The i-th top plan's entry with the estimate it was made from (the pick's is its manifest's), then
        the disaggregated comparison of the pick, then its long run."""
        if i < len(res.top):
            return explain.entry_and_report(spec, res.top[i], goal, i + 1, lambda r: banded(r, hw))
        if i == len(res.top) and compare_split:
            return _disaggregated(spec, res.top, workload, goal, num_gpus or 0, hw)
        return _long_run(spec, res.top[0], goal)

    # Under traffic each estimate simulates its plan again: forked workers take some (search/ahead.py). The
    # disaggregated comparison and the long run, the longest parts (each a rate search of its own), go first
    # and run side by side, the ranked plans' estimates after them: a long part started last runs alone.
    parts = list(range(len(res.top), len(res.top) + compare_split + check_long)) + list(range(len(res.top)))
    under_load = isinstance(workload, InferenceWorkload) and workload.load is not None
    by_part = dict(in_order(parts, part, space.workers if under_load else 0))
    done = [by_part[i] for i in sorted(by_part)]
    long_runs = done[-1] if check_long else None
    long_run = None if long_runs is None else long_runs[0]
    top = [t for t, _ in done[:len(res.top)]]
    pick_report = done[0][1] if res.top else None
    top = [t.model_copy(update={"runs_on": runs_on.of(e.hw, e.layout, e.workload)}) for t, e in zip(top, res.top)]
    binding = explain.binding_constraint(top[0], goal) if top else None
    gap = explain.gap(top[0], top[1]) if len(top) > 1 else None
    comparison = None
    if compare_layout:
        pins = parse_pins(compare_layout)
        n = num_gpus
        if "dp" in pins:
            n = pins["dp"] * pins.get("tp", 1) * pins.get("pp", 1) * pins.get("cp", 1)
        pinned = search(spec, hw, workload, replace(space, **pins), replace(goal, top_k=1), num_gpus=n, max_gpus=None if n else max_gpus)
        shown = {k: (v.value if hasattr(v, "value") else [o.value for o in v] if isinstance(v, tuple) else v) for k, v in pins.items()}
        comparison = explain.compare(spec, top[0] if top else None, pinned, goal, shown)
    suggestions = []
    if (not res.top or res.top[0].layout.offload_layers) and suggest:  # nothing fits, or only by offloading
        n = num_gpus or (res.gpu_counts[-1] if res.gpu_counts else hw.num_gpus)

        def run(wl: Any, sp: Space, g: Goal, *, num_gpus: int | None, max_gpus: int | None, first_fit: bool = False) -> SearchResult:
            if _holds_nothing(spec, hw, wl, sp, max_gpus or num_gpus or hw.num_gpus):
                return SearchResult(training=False, goal=g, gpu_counts=[])
            return search(spec, hw, wl, sp, g, num_gpus=num_gpus, max_gpus=max_gpus, first_fit=first_fit)

        # A default SLA is a preference: the single changes that make something fit are judged without it
        # (as the ranking is when nothing meets it), a limit the user gave stays.
        sgoal = _without_default_sla(goal)
        suggestions = _sla_suggestions(res, goal) + explain.suggestions(
            spec, hw, workload, space, sgoal, n, run,
            throughput_short=not res.top and _refused_only_for(res.rejected, THROUGHPUT_REASONS))
        if isinstance(workload, InferenceWorkload) and not res.top and target is None:  # a target fixes the engine
            others = _other_engine_plans(spec, hw, workload, space, sgoal, n)
            # Another engine answers for the default one only where the default holds nothing in memory:
            # a layout that fits but misses the user's limits is the default engine's answer (exit 3).
            if others and not engine_given and _refused_only_for(res.rejected, MEMORY_REASONS):
                return _answered_by(others[0], suggestions, loaded, hw, workload, space, goal, num_gpus=num_gpus,
                                    max_gpus=max_gpus, manifest_path=manifest_path, progress=progress,
                                    strict_fit=strict_fit, compare_layout=compare_layout)
            suggestions += [o.suggestion for o in others]
        if isinstance(workload, TrainingWorkload) and not res.top and target is None:  # a target fixes the stack
            suggestions += _other_stack_suggestions(spec, hw, workload, space, sgoal, n)
    # Sizing part of a node (a workstation's few GPUs): say what one GPU would do by offloading.
    if (suggest and res.top and isinstance(workload, InferenceWorkload) and num_gpus
            and 1 < num_gpus < hw.gpus_per_node and workload.offload_targets and space.allow_offload
            and space.offload is None):
        suggestions += _fewer_gpus_by_offload(spec, hw, workload, space, goal)
    disaggregated = done[len(res.top)] if compare_split else None
    manifest = None
    if manifest_path is not None and res.top:
        from shardplan.plan.manifest import build_manifest, long_run_section, write_manifest  # only a plan written needs them
        from shardplan.plan.schema import DisaggregationSection, PoolSection

        best = res.top[0]
        report = pick_report  # the pick's estimate, banded (profile_bands reads the profile, not its size)
        assert report is not None  # a manifest is written only for a pick
        summary: dict[str, Any] = {"num_candidates": res.num_candidates, "num_evaluated": res.num_evaluated,
                                   "num_costed": res.num_costed, "num_feasible": res.num_feasible}
        if gap is not None:
            summary["runner_up_gap_fraction"] = gap
        m = build_manifest(
            loaded=loaded, hw=best.hw, layout=best.layout, workload=best.workload, report=report,
            objective=goal.objective.value, search=summary, runs_on=top[0].runs_on,
            long_run=None if long_runs is None else long_run_section(*long_runs), sla=_sla_section(goal, workload),
        )
        if write_disaggregation:
            if disaggregated is None:
                raise ShardplanError("no split into prefill and decode pools to write: none meets the SLA on these "
                                     "GPUs, or the comparison did not run (it needs a fixed --gpus count, the goodput "
                                     "objective and a load given as a rate, not --concurrency)",
                                     field="--disaggregated", hint="drop --disaggregated for the aggregated plan")
            d = disaggregated
            m = m.model_copy(update={"disaggregation": DisaggregationSection(
                prefill=PoolSection(tp=d.prefill_tp, replicas=d.prefill_replicas),
                decode=PoolSection(tp=d.decode_tp, replicas=d.decode_replicas),
                request_rate_per_second=d.request_rate_per_second,
                output_tokens_per_second_per_gpu=d.output_tokens_per_second_per_gpu,
                aggregated_output_tokens_per_second_per_gpu=d.aggregated_output_tokens_per_second_per_gpu,
                kv_transfer_bytes_per_request=d.kv_transfer_bytes_per_request,
                kv_transfer_seconds=d.kv_transfer_seconds, link=d.link, winner=d.winner)})
        write_manifest(m, manifest_path)
        manifest = str(manifest_path)
    return RecommendResult(
        model=spec.name,
        hardware=hw.name,
        workload="training" if res.training else "inference",
        objective=goal.objective.value,
        assumptions=(f"SLA: {dropped}; " + assumptions(workload, goal).removeprefix("SLA: none; ")) if dropped
        else assumptions(workload, goal),
        gpu_counts=res.gpu_counts,
        smallest_num_gpus=res.smallest_num_gpus,
        num_candidates=res.num_candidates,
        num_evaluated=res.num_evaluated,
        num_costed=res.num_costed,
        num_feasible=res.num_feasible,
        elapsed_seconds=res.elapsed_seconds,
        search_budget=SearchBudget(  # bounded work: what the search left out when its budget ran out
            max_steps=space.max_search_steps, num_steps=res.num_steps,
            spent=bool(res.rejected.get(BUDGET_SPENT) or res.unsearched_gpu_counts),
            num_layouts_not_searched=res.rejected.get(BUDGET_SPENT, 0),
            gpu_counts_not_searched=res.unsearched_gpu_counts,
        ),
        evaluated_per_second=res.num_evaluated / res.elapsed_seconds if res.elapsed_seconds > 0 else None,
        rejected=dict(sorted(res.rejected.items(), key=lambda kv: (-kv[1], kv[0]))),
        invalid_degree_combinations=dict(sorted(res.invalid.items(), key=lambda kv: (-kv[1], kv[0]))),
        top=top,
        pareto=[explain.pareto_point(e) for e in res.pareto],
        best_per_num_gpus=_best_per_num_gpus(res) if res.training else [],
        binding_constraint=binding,
        runner_up_gap_fraction=gap,
        why=explain.why(top, goal, binding) + _tight_ranked_last(top),
        strict_fit=strict_fit,
        bands=workload_bands(workload, hw),
        compare=comparison,
        suggestions=suggestions,
        manifest=manifest,
        target=target,
        disaggregated=disaggregated,
        long_run=long_run,
    )


def _tight_ranked_last(top: list[Any]) -> str:
    """Why a faster plan may rank below the pick: it fits only at the prediction."""
    tight = [e.rank for e in top if e.fit_at_band_edge is not None and e.fit_at_band_edge.verdict == "tight"]
    if not tight or len(tight) == len(top):
        return ""
    ranks = ", ".join(f"#{r}" for r in tight)
    return (f"; {ranks} fit only at the prediction, not at the error band's edge (tight), so they rank after the "
            "plans that fit at the edge")


_BEST = {
    Objective.THROUGHPUT: "most output tokens/s over all GPUs",
    Objective.LATENCY: "least end-to-end request latency",
    Objective.STEP_TIME: "shortest optimizer step",
}


def assumptions(workload: InferenceWorkload | TrainingWorkload, goal: Goal) -> str:
    """What the answer assumes, in one line: the request or batch shape, what "best" means, the limits."""
    if isinstance(workload, TrainingWorkload):
        shape = f"training {workload.seq_len}-token sequences, {workload.global_batch_size} per step"
        per = "trained"
    else:
        lengths = workload.load.lengths if workload.load is not None else None
        if lengths is not None:
            shape = (f"serving {workload.load.lengths_name} request lengths (mean {lengths.mean_input_tokens:,.0f} prompt, "
                     f"{lengths.mean_output_tokens:,.0f} output tokens)")
        else:
            shape = f"serving {workload.input_len}-token prompts, {workload.output_len} output tokens"
        if workload.engine_version is not None:
            shape += f" on {engine_label(workload)}"
        per = "output"
    if goal.objective is Objective.GOODPUT and isinstance(workload, InferenceWorkload):
        return _sla_assumptions(workload, goal, shape)
    best = _BEST.get(goal.objective, f"least USD per million {per} tokens")
    limits = [f"TTFT <= {goal.max_ttft_seconds * 1e3:g} ms" if goal.max_ttft_seconds is not None else "",
              f"TPOT <= {goal.max_tpot_seconds * 1e3:g} ms" if goal.max_tpot_seconds is not None else "",
              f">= {goal.min_throughput_tokens_per_second:g} output tokens/s over all GPUs"
              if goal.min_throughput_tokens_per_second is not None else ""]
    text = f"{shape}; best = {best}"
    shown = [x for x in limits if x]
    return text + ("; limits: " + ", ".join(shown) if shown else "")


def _disaggregated(spec: Any, ranked: list[Any], workload: InferenceWorkload, goal: Goal, num_gpus: int,
                   hw: HardwareProfile) -> DisaggregatedComparison | None:
    """The best split into prefill and decode pools of the pick's GPUs, in the pick's formats and
    traffic, each pool at the most it sustains within its part of the SLA, beside aggregated serving
    at the most it sustains within the SLA: without a rate that is the pick's goodput, which it was
    ranked by; with --request-rate (every plan offered the same load, ranked by latency) it is found
    the same way for each of the ranked plans and the best is taken, so both arrangements are
    compared by the load they carry within the SLA on these GPUs (their headroom). A client
    concurrency is not compared (clients cycling over two pools in a closed loop are not modelled)."""
    top = ranked[0]
    load = workload.load
    if load is None or load.max_concurrency is not None:
        return None
    offered = None if load.open_loop else load.request_rate_per_second
    wl = replace(top.workload, load=replace(load, request_rate_per_second=math.inf), batch_size=None)
    gpn = min(top.hw.gpus_per_node, num_gpus)
    tps = tuple(t for t in (1, 2, 4, 8, 16) if t <= gpn and gpn % t == 0)
    sla = Sla(goal.max_ttft_seconds, goal.max_tpot_seconds, goal.slo_percentile)
    d = best_disaggregated(spec, top.hw, wl, sla, num_gpus, tps)
    if d is None:
        return None
    # Both sides in the same terms: the request rate offered at which the SLA holds, and the output
    # tokens it brings per GPU (a finite run's measured throughput, which the ranking reads, is lower
    # by its ramp and drain: about 9% for Llama 3.1 8B on 8 H100s, and the split has no such run).
    agg_rate, best_agg = top.workload.load.request_rate_per_second, top
    if offered is not None:
        agg_rate = 0.0
        for e in ranked:  # each ranked plan at the most it carries within the SLA
            w = replace(e.workload, load=wl.load, batch_size=None)
            step = StepModel(spec, e.hw, e.layout, w, w.max_num_batched_tokens, w.max_num_seqs)
            point, _ = most_within_sla(step, w, serving_memory(spec, e.hw, e.layout, w).kv_account, sla)
            if point is not None and point.request_rate_per_second * e.layout.dp > agg_rate:
                agg_rate, best_agg = point.request_rate_per_second * e.layout.dp, e
    agg = agg_rate * d.output_tokens_per_second_per_gpu / d.request_rate_per_second  # its mean output over the GPUs
    wins = d.output_tokens_per_second_per_gpu > agg
    ratio = d.output_tokens_per_second_per_gpu / agg if agg else math.inf
    margin = f"{100 * (ratio - 1):.0f}%" if wins else f"{100 * (1 / ratio - 1):.0f}%"
    if offered is not None:
        l = best_agg.layout
        shape = f"tp={l.tp} pp={l.pp} dp={l.dp}" + (f" ep={l.ep}" if l.ep > 1 else "")
        which = "the pick" if best_agg is top else f"{shape}, ranked #{ranked.index(best_agg) + 1}"
        lead = (f"{'disaggregated' if wins else 'aggregated'} has {margin} more headroom: the ranked plans meet the SLA "
                f"at the offered {offered:,.2f} req/s, and within it the split carries up to "
                f"{d.request_rate_per_second:,.2f} req/s, aggregated {agg_rate:,.2f} ({which})")
    else:
        lead = f"{'disaggregated' if wins else 'aggregated'} wins by {margin}"
    if wins:
        why = (f"{lead}: without prompt chunks in the decode steps the decode pool "
               f"keeps p{goal.slo_percentile} TPOT within the limit at larger batches; each prompt's KV "
               f"({d.kv_transfer_bytes_per_request / 2**20:,.0f} MiB) crosses {d.link} in {d.kv_transfer_seconds * 1e3:,.1f} ms")
    else:
        why = (f"{lead}: split into pools of {d.prefill_replicas} x tp{d.prefill_tp} "
               f"prefill and {d.decode_replicas} x tp{d.decode_tp} decode, the lesser pool limits the rate and the other "
               f"idles; the interference the split removes costs less on these GPUs")
    return DisaggregatedComparison(
        prefill_tp=d.prefill_tp, prefill_replicas=d.prefill_replicas, decode_tp=d.decode_tp,
        decode_replicas=d.decode_replicas, request_rate_per_second=d.request_rate_per_second,
        output_tokens_per_second_per_gpu=d.output_tokens_per_second_per_gpu,
        aggregated_output_tokens_per_second_per_gpu=agg, aggregated_request_rate_per_second=agg_rate,
        offered_request_rate_per_second=offered, kv_transfer_bytes_per_request=d.kv_transfer_bytes_per_request,
        kv_transfer_seconds=d.kv_transfer_seconds, link=d.link, winner="disaggregated" if wins else "aggregated", why=why)


def _long_run(spec: Any, e: Any, goal: Goal) -> tuple[LongRun, LoadResult, LoadResult | None] | None:
    """The pick at the rate it was judged at over STEADY_REQUESTS_MAX requests a replica
    (traffic.over_a_long_run), unless it was judged over as many; with one replica's run, and
    where it breaks the SLA, the run at the rate that holds (for the manifest)."""
    wl, layout = e.workload, e.layout
    load = wl.load
    if load is None or not math.isfinite(load.request_rate_per_second) or load.max_concurrency is not None:
        return None
    replicas = max(1, layout.dp)
    if math.ceil(load.num_requests / replicas) >= STEADY_REQUESTS_MAX:
        return None  # the plan was judged over as long a run
    step = StepModel(spec, e.hw, layout, wl, wl.max_num_batched_tokens, wl.max_num_seqs)
    kv = serving_memory(spec, e.hw, layout, wl).kv_account
    sla = Sla(goal.max_ttft_seconds, goal.max_tpot_seconds, goal.slo_percentile)
    rate = load.request_rate_per_second / replicas
    r, held = long_run_and_held(step, wl, kv, sla, rate)
    return (LongRun.of(r, sla, load.request_rate_per_second, replicas, STEADY_REQUESTS_MAX, held), r,
            None if held is None else held[1])


def _sla_suggestions(res: SearchResult, goal: Goal) -> list[Suggestion]:
    """Nothing met the SLA: the limits the fastest replica reaches with one request at a time."""
    out = []
    p = goal.slo_percentile
    for name, option, limit in (("ttft", "--max-ttft-ms", goal.max_ttft_seconds), ("tpot", "--max-tpot-ms", goal.max_tpot_seconds)):
        floor = res.sla_floor_seconds.get(name)
        if floor is not None and limit is not None and floor > limit:
            ms = math.ceil(floor * 1e3)
            out.append(Suggestion(change=f"{option} {ms}", detail=f"the lowest p{p} {name.upper()} any layout reaches on "
                                  f"these GPUs is {floor * 1e3:,.1f} ms (asked: {limit * 1e3:g} ms), one request at a "
                                  "time: a limit at it admits only a light load, some headroom above it more"))
    return out


def _sla_assumptions(workload: InferenceWorkload, goal: Goal, shape: str) -> str:
    """The goodput objective's line, the SLA first: the limits, whether they are the defaults, the
    traffic each plan is judged under."""
    p = goal.slo_percentile
    limits = [f"p{p} TTFT <= {goal.max_ttft_seconds * 1e3:g} ms" if goal.max_ttft_seconds is not None else "",
              f"p{p} TPOT <= {goal.max_tpot_seconds * 1e3:g} ms" if goal.max_tpot_seconds is not None else ""]
    sla = ", ".join(x for x in limits if x) or "none"
    if goal.sla_defaulted:
        sla += " (the default SLA of an interactive service; set --max-ttft-ms / --max-tpot-ms)"
    load = workload.load
    lengths = "" if load is None or load.lengths is None else f" with {load.lengths_name} lengths"
    if load is not None and math.isfinite(load.request_rate_per_second):
        traffic = f"{load.request_rate_per_second:g} requests/s{lengths} spread over the replicas; best = least p{p} end-to-end latency"
    elif load is not None and load.max_concurrency is not None:
        traffic = f"{load.max_concurrency} requests in flight{lengths}; best = most output tokens/s per GPU"
    else:
        arrivals = "Poisson" if load is None or load.poisson else "evenly spaced"
        traffic = (f"each plan at the highest request rate{lengths} it sustains within the SLA (continuous batching, "
                   f"{arrivals} arrivals); best = most output tokens/s per GPU (goodput)")
    text = f"SLA: {sla}; {shape}; traffic: {traffic}"
    if goal.min_throughput_tokens_per_second is not None:
        text += f"; limits: >= {goal.min_throughput_tokens_per_second:g} output tokens/s over all GPUs"
    return text


def _best_per_num_gpus(res: SearchResult) -> list[BestAtGpuCount]:
    """Training: the best plan found at each GPU count, by the objective, those that fit at the
    error band's edge first, as the ranking does (what `--plot` draws as step time against GPUs)."""
    best: dict[int, Any] = {}
    for e in sorted(res.feasible, key=lambda e: (e.tight, e.objective_value, e.key)):
        best.setdefault(e.num_gpus, e)
    return [
        BestAtGpuCount(num_gpus=n, step_seconds=e.figures["step_seconds"],
                       tokens_per_second_per_gpu=e.figures["tokens_per_second_per_gpu"], objective_value=e.objective_value)
        for n, e in sorted(best.items())
    ]


def _fewer_gpus_by_offload(spec: Any, hw: HardwareProfile, workload: InferenceWorkload, space: Space,
                           goal: Goal) -> list[Any]:
    """The trade the other way: the same model on one GPU, fitting by a smaller format or by
    holding layers in host memory (the search's fallback), with its speed beside the pick's."""
    from shardplan.search.results import Suggestion

    r = search(spec, hw, workload, space, replace(goal, top_k=1), num_gpus=1, max_gpus=None)
    if not r.top:
        return []
    e = r.top[0]
    how = f"{e.workload.quantization.value} weights" if e.workload.quantization is not Quantization.NONE else "as is"
    if e.layout.offload_layers:
        where = "on the CPU" if e.workload.offload_mode == "host_compute" else "in host memory"
        how += f", {e.layout.offload_layers} of {spec.num_layers} layers {where}"
    return [Suggestion(change="--gpus 1", detail=f"one GPU with {how}{explain.speed_note(e)}", num_gpus=1)]


@dataclass(frozen=True)
class _OtherEngine:
    """Another engine's best plan where the asked one has none."""

    name: str
    label: str
    workload: InferenceWorkload
    space: Space
    suggestion: Suggestion


def _refused_only_for(rejected: Counter, reasons: frozenset[str]) -> bool:
    """Whether every layout was refused for one of `reasons` (memory: nothing of the engine's fits on
    the GPUs; throughput: only --min-throughput stood in the way)."""
    return bool(rejected) and all(reason in reasons for reason in rejected)


def _holds_nothing(spec: Any, hw: HardwareProfile, workload: InferenceWorkload | TrainingWorkload, space: Space,
                   gpus: int) -> bool:
    """A suggestion's search that is certain to find nothing, and is skipped: a serving model whose
    weights alone exceed what `gpus` GPUs (and, offloading, their nodes) hold in any format the
    space tries (search.serving.weights_exceed_memory)."""
    return isinstance(workload, InferenceWorkload) and weights_exceed_memory(spec, hw, workload, space, gpus)


def _other_engine_plans(spec: Any, hw: HardwareProfile, workload: InferenceWorkload, space: Space, goal: Goal,
                        num_gpus: int) -> list[_OtherEngine]:
    """Engines that run offloaded layers on the CPU with their KV cache (llama.cpp) can serve a
    context the asked engine cannot hold at all: each such engine's best plan, with its speed."""
    from shardplan.cost.inputs import inference_workload
    from shardplan.knowledge.load import engine_rules, known_engines

    out = []
    for name in known_engines():
        rules = engine_rules(name)
        if name == workload.engine or rules.offload is None or not rules.offload.kv_with_layer:
            continue
        try:
            wl = inference_workload(
                engine=rules, hw=hw, model_max_len=spec.max_position_embeddings, max_model_len=workload.max_model_len,
                max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
                kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
                input_len=workload.input_len, output_len=workload.output_len, batch_size=workload.batch_size,
                checkpoint_format=spec.shipped_format, mla=spec.mla is not None,
                sliding_window=spec.num_sliding_layers > 0)
        except ShardplanError:
            continue
        wl = replace(wl, load=workload.load)
        sp = replace(space, quantizations=(wl.quantization,), kv_cache_dtypes=(None,),
                     fallback_quantizations=tuple(Quantization(f) for f in wl.weight_formats))
        if _holds_nothing(spec, hw, wl, sp, num_gpus):
            continue
        try:
            r = search(spec, hw, wl, sp, replace(goal, top_k=1), num_gpus=num_gpus, max_gpus=None)
        except ShardplanError:  # e.g. a profile without the host's DRAM bandwidth
            continue
        if r.top:
            e = r.top[0]
            off = f", {e.layout.offload_layers} of {spec.num_layers} layers on the CPU" if e.layout.offload_layers else ""
            out.append(_OtherEngine(name=name, label=rules.label, workload=wl, space=sp, suggestion=Suggestion(
                change=f"--engine {name}",
                detail=f"{rules.label} fits with {e.workload.quantization.value} weights{off}{explain.speed_note(e)}")))
    return out


def _answered_by(other: _OtherEngine, asked_suggestions: list[Suggestion], loaded: LoadedModel, hw: HardwareProfile,
                 asked: InferenceWorkload, space: Space, goal: Goal, **kw: Any) -> RecommendResult:
    """The answer when the default engine has no plan and `other` has: `other`'s search, with a
    line naming the switch first, and what would make the default engine fit kept as suggestions."""
    res = recommend(loaded, hw, other.workload, other.space, goal, engine_given=True, **kw)
    kv_note = ("it keeps every layer's KV cache on the GPU" if asked.offload_targets
               else "it cannot hold layers or their KV cache in host memory")
    context = asked.max_model_len or loaded.spec.max_position_embeddings
    why = (f"no {engine_label(asked)} layout fits {hw.name} at a {context:,}-token context, with smaller "
           f"weight formats or layers in host memory ({kv_note}); {other.label} keeps offloaded layers' KV cache in "
           "host memory")
    fallback = EngineFallback(asked=engine_label(asked), used=other.label, option=f"--engine {other.name}", why=why)
    line = f"engine: {other.label} ({fallback.option}), not the default {fallback.asked}: {why}"
    kept = [s for s in asked_suggestions if not s.change.startswith("--engine")]
    kept = [s.model_copy(update={"detail": f"with {fallback.asked}: {s.detail}"}) for s in kept]
    return res.model_copy(update={"assumptions": f"{line}; {res.assumptions}", "engine_fallback": fallback,
                                  "suggestions": [*res.suggestions, *kept]})


def _other_stack_suggestions(spec: Any, hw: HardwareProfile, workload: TrainingWorkload, space: Space, goal: Goal,
                             num_gpus: int) -> list[Suggestion]:
    """Nothing the stack runs fits: each other stack's best plan on the same GPUs, searched with that
    stack's own rules and capabilities (e.g. DeepSpeed's ZeRO-Offload where torchtitan offloads only
    FSDP2 shards across ranks), with its step time."""
    from shardplan.cost.inputs import training_workload
    from shardplan.knowledge.load import known_stacks, stack_rules

    out = []
    for name in known_stacks():
        if name == workload.stack:
            continue
        stack = stack_rules(name)
        try:
            wl = training_workload(
                seq_len=workload.seq_len, global_batch_size=workload.global_batch_size,
                optimizer=workload.optimizer.value, framework=None, flash_attention=None, dropout=workload.dropout,
                stack=stack, finetune=workload.finetune.value, lora_rank=workload.lora_rank,
                lora_alpha=workload.lora_alpha, lora_targets=",".join(workload.lora_targets),
                lora_dropout=workload.lora_dropout, qlora_double_quant=workload.base_format.value == "nf4-dq",
                paged_optimizer=workload.paged_optimizer, spec=spec, master_dtype=workload.master_dtype.value,
                moment_dtype=workload.moment_dtype.value)
            r = search(spec, hw, wl, replace(space, rules=search_rules(None, spec, wl)), replace(goal, top_k=1),
                       num_gpus=num_gpus, max_gpus=None)
        except ShardplanError:  # the stack cannot run this fine-tuning method, or another refusal
            continue
        if r.top:
            e = r.top[0]
            shape = explain.describe(plan_report(e.layout, spec.num_layers))
            out.append(Suggestion(change=f"--stack {name}", detail=(
                f"{stack.display_name} runs {shape} on {num_gpus} GPU(s): step {e.figures['step_seconds']:,.2f} s, "
                f"{e.figures['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU")))
    return out


def _sla_section(goal: Goal, workload: InferenceWorkload | TrainingWorkload) -> Any:
    """The manifest's record of the latency limits a serving plan was ranked within (None: none)."""
    if not isinstance(workload, InferenceWorkload) or goal.objective is not Objective.GOODPUT or (
            goal.max_ttft_seconds is None and goal.max_tpot_seconds is None):
        return None
    from shardplan.plan.schema import SlaSection  # only a plan written needs it

    return SlaSection(percentile=goal.slo_percentile, max_ttft_seconds=goal.max_ttft_seconds,
                      max_tpot_seconds=goal.max_tpot_seconds, defaulted=goal.sla_defaulted)


def _without_default_sla(goal: Goal) -> Goal:
    return goal.without_sla() if goal.sla_defaulted else goal


def with_allowed_dtypes(space: Space, allowed: list[str]) -> Space:
    """--allow-quantization fp8,int8,int4: weight formats (and, for fp8, the KV cache) the
    search may use besides the model's own."""
    quants = list(space.quantizations)
    kvs = list(space.kv_cache_dtypes)
    for a in allowed:
        a = a.strip().lower()
        if a not in ("fp8", "int8", "int4"):
            raise ShardplanError(f"unknown format {a!r}", field="--allow-quantization", hint="use a list of fp8, int8, int4")
        q = Quantization(a)
        if q not in quants:
            quants.append(q)
        if a == "fp8" and DType.FP8 not in kvs:
            kvs.append(DType.FP8)
    return replace(space, quantizations=tuple(quants), kv_cache_dtypes=tuple(kvs))


