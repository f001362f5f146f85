"""Serving search. A replica is (tp, pp, ep, weight format, KV-cache format); replicas fill the
GPUs (dp = GPUs / (tp x pp)) and change neither a replica's latency nor its per-GPU throughput,
so each replica is costed once: its memory (vLLM's start-up arithmetic, `serving_memory`) and,
for every batch the KV cache holds (powers of two and the largest), TTFT, TPOT and throughput
(`serving_time`). The space is small enough to cost every point. Over the GPU counts of
`--max-gpus` a replica is costed once too, where the few figures the replica count enters
are the same (`_replica_key`)."""

from __future__ import annotations

import math
from collections import Counter
import operator
from dataclasses import fields, replace
from typing import Any, Iterator, NamedTuple

from shardplan.cost import memo as shortcuts
from shardplan.cost.accuracy import kv_holds_at_edge
from shardplan.cost.layout import Layout, Offload
from shardplan.cost.memory_serving import KvAccount, ServingMemory, serving_memory
from shardplan.cost.time_serving import ServingTime, pass_time, serving_time
from shardplan.cost.step_model import StepModel
from shardplan.cost.traffic import (Sla, first_below, latency_floor, load_figures, rate_search,
                                    search_requests)
from shardplan.cost.weights import stage_weights
from shardplan.cost.workload import InferenceWorkload, Quantization, ServingLoad
from shardplan.search.ahead import SKIPPED, in_order
from shardplan.search.targets import serving_refusal
from shardplan.search.space import (
    NO_HOST_BANDWIDTH,
    TIGHT,
    Evaluated,
    Goal,
    Objective,
    SearchResult,
    Space,
    check_layout,
    layout_shape,
    cost_figures,
    divisors,
    memory_reason,
    tp_choices,
)
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec


def _serving_replicas(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, space: Space, rejected: Counter) -> Iterator[tuple[Layout, InferenceWorkload]]:
    n = hw.num_gpus
    # One workload per format pair, shared by every layout (built once, hashed once).
    formats = [replace(wl, quantization=q, kv_cache_dtype=kv) for q in space.quantizations for kv in space.kv_cache_dtypes]
    for tp in tp_choices(spec, hw, n, space, rejected):
        for pp in [space.pp] if space.pp else divisors(n // tp):
            if (n // tp) % pp or pp > spec.num_layers:
                rejected["pp does not divide the GPUs left by tp or exceeds the layers"] += 1
                continue
            dp = n // (tp * pp)
            if space.dp and space.dp != dp:
                rejected["dp differs from the pinned --dp"] += 1
                continue
            # Mixture of experts: every expert in each replica (ep 1) or the experts over each replica's
            # tp ranks (ep = tp). Expert groups over k replicas (ep = tp x k, DP attention), which step
            # together, are costed in lockstep (cost/serving_load.py simulate_group) where --ep pins them;
            # searched by default they cost about 20x a replica alone to simulate (DeepSeek-V3 on 8 H200s:
            # 2.3 -> 27 s, docs/research/dp-attention-groups.md), so the search leaves them out.
            eps = [space.ep] if space.ep else ([1, tp] if spec.moe is not None and tp > 1 else [1])
            for ep in eps:
                layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
                if not check_layout(spec, layout, n, False, rejected):
                    continue
                for wlq in formats:
                    refused = serving_refusal(space.rules, spec, hw, layout, wlq)  # the --target's rules
                    if refused is not None:
                        rejected[refused] += 1
                        continue
                    yield layout, wlq


def _batch_sizes(wl: InferenceWorkload, fit_batch: int) -> list[int]:
    if wl.batch_size is not None:
        return [wl.batch_size]
    top = min(fit_batch, wl.max_num_seqs)
    return sorted({b for b in (2**k for k in range(0, top.bit_length())) if b <= top} | ({top} if top >= 1 else set()))


def serving_objective(goal: Goal, figures: dict[str, float]) -> float:
    if goal.objective is Objective.LATENCY:
        return figures["e2e_latency_seconds"]
    if goal.objective is Objective.THROUGHPUT:
        return -figures["throughput_tokens_per_second"]
    return figures["usd_per_million_tokens"]


def _limits_violated(goal: Goal, f: dict[str, float]) -> str | None:
    if goal.max_ttft_seconds is not None and f["ttft_seconds"] > goal.max_ttft_seconds:
        return "TTFT over --max-ttft-ms"
    if goal.max_tpot_seconds is not None and f["tpot_seconds"] > goal.max_tpot_seconds:
        return "TPOT over --max-tpot-ms"
    if goal.min_throughput_tokens_per_second is not None and f["throughput_tokens_per_second"] < goal.min_throughput_tokens_per_second:
        return UNDER_MIN_THROUGHPUT
    return None


def fewest_offloaded_layers(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload,
                            res: SearchResult) -> tuple[Layout, ServingMemory] | None:
    """The replica with the fewest decoder layers offloaded to host memory that fits (the fastest
    offloaded one: every offloaded layer adds its transfer or host time to each pass); None when the
    engine cannot offload or even every layer off the GPU does not fit. GPU memory falls as layers
    leave, so a bisection over the count finds it in log2(layers) costings."""
    if not wl.offload_targets or layout.pp > 1 or "cpu" not in wl.offload_targets:
        return None
    return _fewest_that_fits(spec, hw, wl, res, range(1, spec.num_layers + 1),
                             lambda k: replace(layout, offload_layers=k, offload_params=Offload.CPU))


def _fewest_that_fits(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, res: SearchResult,
                      counts: range, trial_of: Any) -> tuple[Layout, ServingMemory] | None:
    """The least count in `counts` whose layout (`trial_of(count)`) fits, by bisection: its GPU
    memory falls as the count grows, so log2(len(counts)) + 1 costings find it; None if none fits."""
    lo, hi, best = counts.start, counts.stop - 1, None
    while lo <= hi:
        k = (lo + hi) // 2
        trial = trial_of(k)
        sm = serving_memory(spec, hw, trial, wl)
        res.num_costed += 1
        res.num_steps += 1
        if sm.fits:
            best, hi = (trial, sm), k - 1
        else:
            lo = k + 1
    return best


def fewest_expert_layers(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload,
                         res: SearchResult) -> tuple[Layout, ServingMemory] | None:
    """The replica with the fewest layers whose routed experts are held in host memory (llama.cpp
    --n-cpu-moe N) that fits; None for a dense model, an engine that does not run host-held weights
    on the CPU, or when even every layer's experts off the GPU do not fit. Experts are most of an
    MoE model's bytes but a token reads only its top-k of them, and attention and the KV cache stay
    on the GPU, so this comes before offloading whole layers. GPU memory falls as N grows (each
    step moves one more MoE layer's experts, or none past a dense layer), so a bisection over N in
    1..(last MoE layer + 1) finds the fewest in log2(layers) costings."""
    if (spec.moe is None or wl.offload_mode != "host_compute" or "cpu" not in wl.offload_targets
            or layout.pp > 1):
        return None
    last = max(i for i in range(spec.num_layers) if spec.is_moe_layer(i)) + 1
    return _fewest_that_fits(spec, hw, wl, res, range(1, last + 1), lambda n: replace(layout, offload_expert_layers=n))


def offload_that_fits(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload,
                      res: SearchResult) -> tuple[Layout, ServingMemory] | None:
    """The offload fallback for a replica that does not fit on its GPUs: an MoE model's experts in
    host memory first (`fewest_expert_layers`), whole layers only when no number of them fits
    (`fewest_offloaded_layers`). Exact and bounded: each is a bisection over a count whose memory
    falls monotonically, at most log2(layers) + 1 costings each. An engine that runs what it offloads
    on the CPU (llama.cpp) needs the host's DRAM bandwidth to time it: a profile without it gets no
    offloaded plan (counted as such), not an error that ends the search."""
    if not offload_costed(hw, wl):
        return None
    return fewest_expert_layers(spec, hw, layout, wl, res) or fewest_offloaded_layers(spec, hw, layout, wl, res)


def offload_costed(hw: HardwareProfile, wl: InferenceWorkload) -> bool:
    """Whether offloaded layers can be timed on this profile (`offload_that_fits`)."""
    return wl.offload_mode != "host_compute" or hw.host_memory_bandwidth_bytes_per_second_or_none is not None





class _ReplicaMemory(NamedTuple):
    """What the search reads of a replica's `serving_memory`."""

    fits: bool
    reason: str | None
    kv_account: KvAccount  # the cache as running requests draw on it
    max_model_len: int
    peak_bytes: float  # the fullest rank's total


Memo = dict  # replica key (`_replica_key`) -> _ReplicaMemory; (replica key, batch) -> ServingTime


def _replica_key(hw: HardwareProfile, layout: Layout, wl: InferenceWorkload) -> tuple[Any, ...]:
    """What a replica's memory and time depend on, for the memo across GPU counts: everything of
    the layout but the replica count, the workload, the node size, and the few figures the
    replica count enters (cost/memory_serving.py, time_serving.py, offload.py, as `group()`
    places them): NCCL buffers exist with more than one rank; the ranks of a node that share its
    host link and NVMe (tp x dp, at most a node); the pipeline group's ranks per node (its stages
    are tp x dp ranks apart). The node count does not enter: a replica's GPUs are the same GPUs."""
    gpn = hw.gpus_per_node
    replicas = layout.tp * layout.dp
    return (gpn, _all_but_dp(layout), wl, layout.tp * layout.pp * layout.dp > 1, min(replicas, gpn),
            max(1, min(layout.pp, gpn // replicas)) if layout.pp > 1 else 1)


_all_but_dp = operator.attrgetter(*(f.name for f in fields(Layout) if f.name != "dp"))


def _looked_up(memo: Memo | None, key: Any) -> tuple[Any, bool]:
    """(what the memo holds for `key` or None, whether to store there): a workload read back from
    a manifest may hold lists, which cannot be a key; it is then costed every time."""
    if memo is None:
        return None, False
    try:
        return memo.get(key), True
    except TypeError:
        return None, False


def _replica_memory(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload,
                    memo: Memo | None) -> _ReplicaMemory:
    key = _replica_key(hw, layout, wl) if memo is not None else None
    found, store = _looked_up(memo, key)
    if found is None:
        sm = serving_memory(spec, hw, layout, wl)
        found = _ReplicaMemory(sm.fits, sm.reason, sm.kv_account, sm.max_model_len,
                               max(r.breakdown.total for r in sm.ranks))
        if store:
            memo[key] = found  # type: ignore[index]
    return found


def _replica_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, batch: int,
                  memo: Memo | None) -> ServingTime:
    key = (_replica_key(hw, layout, wl), batch) if memo is not None else None
    found, store = _looked_up(memo, key)
    if found is None:
        found = serving_time(spec, hw, layout, wl, batch)
        if store:
            memo[key] = found  # type: ignore[index]
    return found


def _points_rejected(goal: Goal, wlq: InferenceWorkload, wl: InferenceWorkload) -> int:
    """The search points a replica that does not fit stands for: one under the goodput objective (its
    rate is searched), else one a batch size."""
    return 1 if goal.objective is Objective.GOODPUT else len(_batch_sizes(wlq, wl.max_num_seqs))


def search_serving(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, space: Space, goal: Goal,
                   res: SearchResult, *, offload: bool = False, memo: Memo | None = None, bound: bool = True) -> None:
    """Cost every replica. `offload`: a second pass, run when nothing fit on the GPUs alone, that
    gives each replica that did not fit the fewest offloaded layers that make it fit; its points
    were counted as rejected by the first pass and are counted again here instead. `memo`: one
    dict for every GPU count of a search: a replica costed at one count is not costed again at
    another where the figures it depends on are the same (`_replica_key`); the counts of what
    was costed stay those of costing it again, so the step budget runs out where it did. `bound`
    False: no goodput point is left out by its bound (a pass another pass of this count follows,
    whose plans may show a shape this one's bound would have judged out of reach)."""
    ctx = wl.input_len + wl.output_len
    with_batch: dict[tuple[int, int], InferenceWorkload] = {}  # (id of the format's workload, batch) -> workload
    pending: list[tuple[Layout, InferenceWorkload, _ReplicaMemory, bool]] = []  # goodput: costed after the loop
    for layout, wlq in _serving_replicas(spec, hw, wl, space, res.invalid if not offload else Counter()):
        sm = _replica_memory(spec, hw, layout, wlq, memo)
        res.num_costed += 1
        res.num_steps += 1
        if offload:
            tight0 = not kv_holds_at_edge(sm.kv_account.equivalent_tokens(sm.max_model_len), sm.max_model_len,
                                          goal.kv_capacity_band_fraction)
            if sm.fits and not (tight0 and goal.strict_fit):
                continue  # counted by the first pass
            found = offload_that_fits(spec, hw, layout, wlq, res)
            n = _points_rejected(goal, wlq, wl)  # what the first pass counted for it
            reason = memory_reason(sm.reason) if not sm.fits else TIGHT
            if found is None and not offload_costed(hw, wlq):  # say why no offloaded plan was tried
                res.rejected[reason] -= n
                if res.rejected[reason] <= 0:
                    del res.rejected[reason]
                res.rejected[NO_HOST_BANDWIDTH] += n
            if found is None or serving_refusal(space.rules, spec, hw, found[0], wlq) is not None:
                continue  # stays rejected (the target may not offload)
            res.rejected[reason] -= n
            if res.rejected[reason] <= 0:
                del res.rejected[reason]
            res.num_candidates -= n
            res.num_evaluated -= n
            layout, full = found
            sm = _ReplicaMemory(full.fits, full.reason, full.kv_account, full.max_model_len,
                                max(r.breakdown.total for r in full.ranks))
        fit_batch = sm.kv_account.sequences_held(ctx)
        tight = not kv_holds_at_edge(sm.kv_account.equivalent_tokens(sm.max_model_len), sm.max_model_len,
                                     goal.kv_capacity_band_fraction)
        if not sm.fits or (tight and goal.strict_fit):
            n = _points_rejected(goal, wlq, wl)
            res.num_candidates += n
            res.num_evaluated += n
            res.rejected[memory_reason(sm.reason) if not sm.fits else TIGHT] += n
            continue
        if goal.objective is Objective.GOODPUT:
            pending.append((layout, wlq, sm, tight))
            continue
        for b in _batch_sizes(wlq, fit_batch):
            res.num_candidates += 1
            res.num_evaluated += 1
            if b > fit_batch:
                res.rejected["batch larger than the KV cache holds"] += 1
                continue
            st = _replica_time(spec, hw, layout, wlq, b, memo)
            res.num_costed += 1
            res.num_steps += 1
            total = st.throughput_tokens_per_second * layout.dp
            figures = {
                "batch_size": b,
                "ttft_seconds": st.ttft_seconds,
                "tpot_seconds": st.tpot_seconds,
                "e2e_latency_seconds": st.e2e_latency_seconds,
                "throughput_tokens_per_second": total,
                "throughput_tokens_per_second_per_gpu": st.throughput_tokens_per_second_per_gpu,
                "headroom_bytes": float(hw.memory_capacity_bytes) - sm.peak_bytes,
            }
            cost = cost_figures(hw, goal, layout.world_size, total)
            figures["usd_per_million_tokens"] = cost["usd_per_million_tokens"] if cost["usd_per_million_tokens"] is not None else math.nan
            bad = _limits_violated(goal, figures)
            if bad:
                res.rejected[bad] += 1
                continue
            res.num_feasible += 1
            key = (layout.world_size, layout.tp, layout.pp, layout.ep, layout.offload_layers,
                   layout.offload_expert_layers, _quant_rank(wlq), b)
            wlb = with_batch.get((id(wlq), b))
            if wlb is None:
                wlb = with_batch[(id(wlq), b)] = replace(wlq, batch_size=b)
            res.feasible.append(Evaluated(layout, wlb, hw, serving_objective(goal, figures), key, figures, tight))
    _goodput_in_bound_order(spec, hw, pending, goal, res, memo, space.workers, bound)


def _goodput_in_bound_order(spec: ModelSpec, hw: HardwareProfile, pending: list[Any], goal: Goal, res: SearchResult,
                            memo: Memo | None, workers: int = 0, bound: bool = True) -> None:
    """Cost the goodput points of one GPU count, the highest bound first; once the count has a
    plan, a point whose bound (`_goodput_bound`) cannot reach the plans shown (`_top_floor`), and
    whose shape no other variant of it can bring among them (so that each shown shape counts all
    its variants), is left out (counted as such). Exact for what the ranking shows: the bound is
    never below what the simulation finds, and the need only rises as plans are found
    (tests/search/test_goodput_bound.py compares the reference path). A point simulated stops its
    rate search as soon as it cannot reach them either (`traffic.RateSearch`; left out as above).
    Not for the Pareto front, which holds the plans costed in full. `workers` forked processes
    (search/ahead.py) simulate the next points while this one simulates one; each verdict is applied
    at its turn, cut where a search started then would have stopped (`_cut`), so the plans, their
    order and the counts are those of one process."""
    if not pending:
        return
    sla = Sla(goal.max_ttft_seconds, goal.max_tpot_seconds, goal.slo_percentile)
    open_loop = (pending[0][1].load or ServingLoad()).open_loop
    count = pending[0][0].world_size
    keys = [_goodput_memo_key(hw, layout, wlq, goal, sm.kv_account) for layout, wlq, sm, _ in pending]

    floors: dict[tuple[Any, ...], float | None] = {}  # (plans so far, shape, tight) -> _top_floor
    shapes: dict[tuple[int, ...], list[int]] = {}  # shape -> its points
    for i, (layout, _, _, _) in enumerate(pending):
        shapes.setdefault(layout_shape(layout), []).append(i)
    # Point -> the most goodput per GPU it may still show: its bound until it is simulated (or left
    # out), then what it got (-inf where it was rejected). Set below.
    reach: dict[int, float] = {}
    shown: dict[tuple[Any, ...], bool] = {}  # (plans so far, shape) -> whether a plan of it may be shown

    def floor_of(shape: tuple[int, ...], tight: bool) -> float | None:
        key = (len(res.feasible), shape, tight)
        if key not in floors:
            floors[key] = _top_floor(res, goal, count, shape, tight)
        return floors[key]

    def need_of(i: int) -> float | None:
        """The goodput per GPU point i's bound must reach for the search to need its simulation:
        while its shape may be shown (another point of it may still reach the plans shown) every
        variant counts (`Evaluated.variants`), so None; otherwise what it needs itself to reach
        them (`_top_floor`), or None while it could reach them at any value."""
        layout, _, _, tight = pending[i]
        shape = layout_shape(layout)
        need = floor_of(shape, tight)
        if need is not None and goal.group_by_shape:
            for j in shapes[shape]:
                if j != i:
                    if _reaches(reach[j], floor_of(shape, pending[j][3])):
                        return None
            key = (len(res.feasible), shape)
            if key not in shown:  # its variants an earlier pass over this count found (the offload pass)
                shown[key] = any(layout_shape(e.layout) == shape
                                 and _reaches(-e.objective_value, floor_of(shape, e.tight)) for e in res.feasible)
            if shown[key]:
                return None
        return need

    def found_for(i: int, need: float | None = None) -> Verdict:
        layout, wlq, sm, _ = pending[i]
        return _goodput_found(spec, hw, layout, wlq, sm, goal, memo, need)

    def worth(i: int) -> bool:
        """Not a memo hit (a verdict costed at another GPU count): those are not worth a worker."""
        return _looked_up(memo, keys[i])[0] is None

    def remember(i: int, found: Verdict) -> None:
        _, store = _looked_up(memo, keys[i])
        if store and keys[i] not in memo:  # a worker's verdict, kept as this process's own would be
            memo[keys[i]] = found  # type: ignore[index]

    def apply(i: int, found: Verdict) -> None:
        layout, wlq, sm, tight = pending[i]
        before = len(res.feasible)
        _goodput(hw, layout, wlq, sm, goal, res, tight, found)
        reach[i] = -res.feasible[-1].objective_value if len(res.feasible) > before else -math.inf

    if not open_loop:  # at the load's own rate or concurrency: every point, in order
        indices = list(range(len(pending)))
        ahead = workers if sum(1 for i in indices if worth(i)) >= AHEAD_MIN_POINTS else 0
        for i, found in in_order(indices, found_for, ahead, worth=worth):
            remember(i, found)
            apply(i, found)
        return
    # Per GPU of the replica (the dp replicas each carry as much); 5% above the bound, for the step
    # model's interpolation between the points it reads off pass_time.
    bounds = [(BOUND_MARGIN * _goodput_bound(spec, hw, layout, wlq, sla, memo) / (layout.tp * layout.pp), i)
              for i, (layout, wlq, sm, tight) in enumerate(pending)]
    order = sorted(bounds, key=lambda x: (-x[0], x[1]))
    limit = goal.min_throughput_tokens_per_second
    if limit is not None and shortcuts.ENABLED:  # on the reference path the limit rejects what it simulates
        # Over all GPUs: a point whose bound times its GPUs is short of the limit cannot meet it. A bound
        # of 0 (no batch meets the TPOT limit) takes the usual path, which records the SLA's floors
        # (the default SLA's fallback and the looser limits suggested read them).
        def short(bound: float) -> bool:
            return 0 < bound and bound * count < limit

        refused = sum(1 for bound, _ in order if short(bound))
        if refused:
            res.num_candidates += refused
            res.num_evaluated += refused
            res.rejected[BOUNDED_UNDER_MIN_THROUGHPUT] += refused
            order = [(bound, i) for bound, i in order if not short(bound)]

    by_index = {i: bound for bound, i in order}
    reach.update(by_index)
    reach.update({i: -math.inf for i in range(len(pending)) if i not in by_index})  # refused by --min-throughput

    def keep(i: int) -> bool:
        return not bound or _reaches(by_index[i], need_of(i))

    def need_now(i: int) -> float | None:
        """The need a point's rate search may stop at (`need_of`), read when its search starts, here or
        in a worker: the need only rises as the search goes on, so where a search stopped for it then,
        one started at its turn stops no later."""
        return need_of(i) if bound else None

    ahead = workers if sum(1 for _, i in order if worth(i)) >= AHEAD_MIN_POINTS else 0
    for i, found in in_order([i for _, i in order], found_for, ahead, keep, worth, need_now):
        if found is SKIPPED:
            res.num_candidates += 1
            res.num_evaluated += 1
            res.rejected[BOUNDED_OUT] += 1
            continue
        remember(i, found)
        # Where a rate search given this point's need at its turn stops (`_cut`), whenever and with what
        # need its search was run: the plans and counts are those of one process costing each point at
        # its turn.
        layout, need = pending[i][0], need_now(i)
        cut = _cut(found, need, layout)
        if cut is None and found.reason == OUT_OF_REACH:  # cannot be while the need only rises: searched again
            found = found_for(i, need)
            cut = _cut(found, need, layout)
        if cut is None:
            apply(i, found)
            continue
        res.num_costed += 1
        res.num_steps += 1
        res.num_candidates += 1
        res.num_evaluated += 1
        res.rejected[BOUNDED_OUT] += 1
        reach[i] = cut


def _top_floor(res: SearchResult, goal: Goal, count: int, shape: tuple[int, ...], tight: bool) -> float | None:
    """The goodput per GPU that a point of `shape` (`tight`: fits only at the prediction) must
    exceed to be among the plans `search` shows, once this GPU count has a plan (so that each count
    keeps its best); None while any value could. The ranking (`search.honest_top`) puts plans that
    fit at the band's edge before tight ones, shows each parallel shape once (by its best variant)
    unless `goal.group_by_shape` is off, and lists the plans tied with the first ahead of the rest:
    so the floor is the K-th best among the plans ranked ahead of such a point, of K other shapes,
    and no higher than the edge of a tie with the first."""
    feasible = res.feasible
    if not shortcuts.ENABLED or not any(e.num_gpus == count for e in feasible):
        return None  # the reference path (`memo.reference_path()`) simulates every point
    grouped = goal.group_by_shape
    best: dict[Any, float] = {}
    head: tuple[bool, float] | None = None
    for n, e in enumerate(feasible):
        goodput = -e.objective_value
        if head is None or (e.tight, -goodput) < (head[0], -head[1]):
            head = (e.tight, goodput)
        if e.tight > tight:
            continue  # ranked after any plan of this point
        value = math.inf if e.tight < tight else goodput
        s = layout_shape(e.layout)
        if grouped:
            if s == shape:
                continue  # its own shape's other variants do not keep it out of the shown shapes
            if value > best.get(s, -math.inf):
                best[s] = value
        else:
            best[n] = value
    values = sorted(best.values(), reverse=True)
    k = max(1, goal.top_k)  # as `honest_top` shows at least one
    floor = values[k - 1] if len(values) >= k else None
    band = goal.tie_band_fraction or 0.0
    if floor is not None and head is not None and head[0] == tight and band > 0:
        floor = min(floor, head[1] - band * abs(head[1]))  # within the band of the first: a tie, shown
    return floor


def _reaches(value: float, floor: float | None) -> bool:
    """Whether a plan of `value` goodput per GPU may be shown against `floor` (`_top_floor`; None: any may)."""
    return floor is None or value >= floor


BOUNDED_OUT = "cannot reach the top plans: even its bound on goodput is lower"
UNDER_MIN_THROUGHPUT = "throughput under --min-throughput"
BOUNDED_UNDER_MIN_THROUGHPUT = f"{UNDER_MIN_THROUGHPUT} even at its bound on goodput"
THROUGHPUT_REASONS = frozenset({UNDER_MIN_THROUGHPUT, BOUNDED_UNDER_MIN_THROUGHPUT})
AHEAD_MIN_POINTS = 4  # fewer points to simulate at one GPU count than this: no workers (their start costs more)
BOUND_MARGIN = 1.05


def _goodput_bound(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, sla: Sla,
                   memo: Memo | None) -> float:
    """Output tokens/s one replica cannot exceed within the SLA: each step gives each decoding
    request one token, a decode step of b requests takes at least its layers' and logits' time
    without attention (`pass_time` of b one-token rows, attention out), prompts only add steps, and
    within a TPOT limit no step may take longer than the limit. So the bound is b / t(b) at the
    largest b the engine runs (max_num_seqs) whose t(b) meets the limit, or at the graph-capture
    size below it (b / t(b) grows with b, except where steps stop replaying CUDA graphs)."""
    key = ("bound", _goodput_key(hw, layout, wl), sla.max_tpot_seconds)
    found, store = _looked_up(memo, key)
    if found is not None:
        return found

    def t(b: int, sampled: bool = True) -> float:
        p = pass_time(spec, hw, layout, wl, batch=b, q_len=1, kv_len=1, decode=True, logit_tokens=b if sampled else 0)
        return p.total - p.attention

    top = max(1, wl.max_num_seqs)
    limit = sla.max_tpot_seconds
    if limit is not None and t(top) > limit:
        lo, hi = 0, top  # t(lo) <= limit < t(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if t(mid) <= limit else (lo, mid)
        top = lo
    bound = 0.0
    if top >= 1:
        graph_max = wl.graph_max_at(layout.tp)
        sizes = {top} | ({graph_max} if 1 <= graph_max < top else set())
        bound = max(b / t(b) for b in sizes)
        bound = min(bound, _with_decode_attention(bound, _step_model(spec, hw, layout, wl, memo), wl))
        # Every token, prompt or output, passes through the layers in some step, and a step of T
        # tokens takes at least T times the least time a token takes (at the largest step the
        # budget allows): outputs are at most their share of the tokens that rate carries.
        load = wl.load or ServingLoad()
        mean_in = wl.input_len if load.lengths is None else load.lengths.mean_input_tokens
        mean_out = wl.output_len if load.lengths is None else load.lengths.mean_output_tokens
        budget = max(1, wl.max_num_batched_tokens)
        per_token = t(budget, sampled=False) / budget
        share = mean_out / max(1e-9, mean_out + mean_in * (1 - load.prefix_cache_hit_fraction))
        bound = min(bound, share / per_token)
    if store:
        memo[key] = bound  # type: ignore[index]
    return bound


def _with_decode_attention(linear_bound: float, step: StepModel, wl: InferenceWorkload) -> float:
    """The bound with the decode steps' attention: a request of p prompt and o output tokens
    decodes o - 1 tokens after its prefill, in steps that read its p, p + 1, ..., p + o - 2 cached
    tokens (a_kv each) and cost a_seq for it (`StepModel.seconds`), so its outputs take at least
    (o - 1) / linear_bound + a_kv ((o - 1) p + (o - 1)(o - 2) / 2) + a_seq (o - 1) of step time.
    Only for fixed lengths (every request the same; a drawn sample's moments are the sample's) and
    one token a decode step (no speculative width)."""
    load = wl.load or ServingLoad()
    out, prompt = max(1, wl.output_len), wl.input_len
    if load.lengths is not None or step.width > 1 or out < 2 or linear_bound <= 0:
        return math.inf
    decoded = out - 1
    seconds = (decoded / linear_bound + step.kv_seconds_per_token * (decoded * prompt + decoded * (decoded - 1) / 2)
               + step.seconds_per_decoding_seq * decoded)
    return out / seconds


def _step_model(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, memo: Memo | None) -> StepModel:
    """One replica's step model (cost/step_model.py), shared by its bound and its simulation; it
    depends on what its figures under traffic do (`_goodput_key`)."""
    key = ("step", _goodput_key(hw, layout, wl))
    found, store = _looked_up(memo, key)
    if found is None:
        found = StepModel(spec, hw, layout, wl, wl.max_num_batched_tokens, wl.max_num_seqs)
        if store:
            memo[key] = found  # type: ignore[index]
    return found


def _goodput_key(hw: HardwareProfile, layout: Layout, wl: InferenceWorkload) -> tuple[Any, ...]:
    """What one replica's figures under traffic depend on: `_replica_key` without the figures the
    time of a replica that offloads nothing does not read: the node size (its tensor-parallel group
    lies inside a node at every count; how its pipeline stages spread over nodes is k[5]), the host
    link's sharers, NCCL's buffers (which only its memory, memoised apart, reads)."""
    k = _replica_key(hw, layout, wl)
    offloads = bool(layout.offload_layers or layout.offload_expert_layers)
    return ("goodput", k[0] if offloads else None, k[1], k[2], k[4] if offloads else None, k[5])


def _goodput_memo_key(hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, goal: Goal,
                      kv: KvAccount) -> tuple[Any, ...]:
    """What a replica's verdict under traffic depends on: its figures (`_goodput_key`), the KV
    cache its requests draw on (which the memory at this count gives: with more than one rank NCCL's
    buffers take their share, so a one-GPU replica and the same replica beside others hold
    different caches), the SLA, and with a fixed rate or concurrency the replicas it is split over."""
    return (_goodput_key(hw, layout, wl), kv, Sla(goal.max_ttft_seconds, goal.max_tpot_seconds, goal.slo_percentile),
            None if (wl.load or ServingLoad()).open_loop else layout.dp)


def _goodput_found(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, sm: _ReplicaMemory,
                   goal: Goal, memo: Memo | None, need: float | None = None) -> Verdict:
    """What `_goodput` judges a replica by, a pure function of the replica, the load, the SLA and
    `need` (memoised; `Verdict`). `need`: the goodput per GPU below which the search will not show
    it (None: any may be shown); where its rate search finds out before its end that it cannot
    reach that, its reason is OUT_OF_REACH, with the ceilings checked until then."""
    load = wl.load or ServingLoad()
    sla = Sla(goal.max_ttft_seconds, goal.max_tpot_seconds, goal.slo_percentile)
    open_loop = load.open_loop
    key = _goodput_memo_key(hw, layout, wl, goal, sm.kv_account) if memo is not None else None
    found, store = _looked_up(memo, key)
    if found is not None and found.reason == OUT_OF_REACH and _cut(found, need, layout) is None:
        found = None  # stopped at another GPU count, against a higher need than this one's
    if found is None:
        step = _step_model(spec, hw, layout, wl, memo)
        mean_in = wl.input_len if load.lengths is None else load.lengths.mean_input_tokens
        floor_ttft, floor_tpot = latency_floor(step, wl, mean_in)
        if ((sla.max_ttft_seconds is not None and floor_ttft > sla.max_ttft_seconds)
                or (sla.max_tpot_seconds is not None and floor_tpot > sla.max_tpot_seconds)):
            found = Verdict("none within the SLA", None, (floor_ttft, floor_tpot), None)
        elif open_loop:
            n = search_requests(wl, sm.kv_account)
            rs = rate_search(step, wl, sm.kv_account, sla, n, floor_tokens_per_second=_replica_floor(need, layout))
            ceilings = rs.ceilings_tokens_per_second
            if rs.stopped:
                found = Verdict(OUT_OF_REACH, None, None, n, ceilings)
            elif rs.point is None:
                # What the replica reaches one request at a time (a relaxed limit must allow it).
                found = Verdict("none within the SLA", None, (floor_ttft, floor_tpot), n, ceilings)
            else:
                found = Verdict(None, rs.point.request_rate_per_second, rs.point.result, rs.point.num_requests,
                                ceilings)
        else:
            figures = load_figures(spec, hw, layout, wl, sm.kv_account, model=step)
            bad = sla.violated(figures.replica)
            found = Verdict(bad, figures.request_rate_per_replica, figures.replica, None)
        if store:
            memo[key] = found  # type: ignore[index]
    return found


class Verdict(NamedTuple):
    """`_goodput_found`'s verdict on a replica."""

    reason: str | None  # why it fails (OUT_OF_REACH: its rate search stopped below the need), or None
    rate: float | None  # request rate per replica
    result: Any  # its LoadResult, or its latency floors (TTFT, TPOT) where none is within the SLA
    num_requests: int | None  # requests simulated
    ceilings: tuple[float, ...] = ()  # its rate search's, output tokens/s of one replica (`traffic.RateSearch`)


OUT_OF_REACH = "out of reach"


def _replica_floor(need: float | None, layout: Layout) -> float | None:
    """A need in goodput per GPU as one replica's output tokens per second (the plan's per GPU is a
    replica's times dp over the GPUs)."""
    return None if need is None else need * layout.world_size / layout.dp


def _cut(found: Verdict, need: float | None, layout: Layout) -> float | None:
    """Where a rate search given `need` stops (`traffic.first_below`), the same for the search that
    made `found` with a lower need, or none, as far as it went: the most goodput per GPU the point
    could still have reached there; None where it runs to its end."""
    k = first_below(found.ceilings, _replica_floor(need, layout))
    return None if k is None else found.ceilings[k] * layout.dp / layout.world_size


def _goodput(hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, sm: _ReplicaMemory, goal: Goal,
             res: SearchResult, tight: bool, found: Verdict) -> None:
    """One replica under continuous batching (cost/traffic.py): at the load's rate or concurrency,
    split over the dp replicas, or, with neither, at the highest rate it sustains within the SLA.
    One point per replica; its workload carries the load it was judged at, so the plan's estimate
    (and its manifest) shows the same traffic. `found`: its verdict (`_goodput_found`, computed
    here or by a worker, search/ahead.py)."""
    res.num_candidates += 1
    res.num_evaluated += 1
    load = wl.load or ServingLoad()
    sla = Sla(goal.max_ttft_seconds, goal.max_tpot_seconds, goal.slo_percentile)
    replicas = layout.dp
    open_loop = load.open_loop
    res.num_costed += 1
    res.num_steps += 1
    if found[0] is not None:
        res.rejected[found[0] if found[0] != "none within the SLA" else
                     f"{sla.percentile}th-percentile TTFT/TPOT over the SLA even at the lowest load"] += 1
        floors = found[2] if isinstance(found[2], tuple) else None  # (TTFT, TPOT) at the lowest load, if known
        if floors is not None:
            for name, value in zip(("ttft", "tpot"), floors):
                res.sla_floor_seconds[name] = min(value, res.sla_floor_seconds.get(name, math.inf))
        return
    _, rate, r, simulated, _ = found
    pct = {50: "p50", 90: "p90", 99: "p99"}[sla.percentile]
    total = r.output_tokens_per_second * replicas
    figures = {
        "batch_size": r.peak_running,
        "ttft_seconds": getattr(r.ttft_seconds, pct),
        "tpot_seconds": getattr(r.tpot_seconds, pct),
        "e2e_latency_seconds": getattr(r.e2e_seconds, pct),
        "throughput_tokens_per_second": total,
        "throughput_tokens_per_second_per_gpu": total / layout.world_size,
        "request_rate_per_second": r.request_throughput_per_second * replicas,
        "headroom_bytes": float(hw.memory_capacity_bytes) - sm.peak_bytes,
    }
    cost = cost_figures(hw, goal, layout.world_size, total)
    figures["usd_per_million_tokens"] = cost["usd_per_million_tokens"] if cost["usd_per_million_tokens"] is not None else math.nan
    bad = _limits_violated(replace(goal, max_ttft_seconds=None, max_tpot_seconds=None), figures)
    if bad:
        res.rejected[bad] += 1
        return
    res.num_feasible += 1
    # The operating point's own traffic (the same requests per replica, the same seed), so the plan's
    # estimate reproduces the figures it was ranked by.
    judged = load if not open_loop else replace(load, request_rate_per_second=rate * replicas,
                                                 num_requests=simulated * replicas)
    qkey = (layout.world_size, layout.tp, layout.pp, layout.ep, layout.offload_layers, layout.offload_expert_layers,
            _quant_rank(wl))
    if math.isfinite(load.request_rate_per_second) or load.max_concurrency is not None:
        # The offered load is the same for every plan of a GPU count: the least latency wins.
        value = figures["e2e_latency_seconds"]
    else:
        value = -figures["throughput_tokens_per_second_per_gpu"]
    res.feasible.append(Evaluated(layout, replace(wl, load=judged), hw, value, qkey, figures, tight))


def _quant_rank(wl: InferenceWorkload) -> tuple[int, int]:
    """Prefer wider formats on ties: bf16 weights before fp8/int8/int4; auto KV before fp8."""
    order = [Quantization.NONE, Quantization.FP8, Quantization.INT8, Quantization.INT4, Quantization.AWQ, Quantization.GPTQ]
    order += [q for q in Quantization if q not in order]  # nf4 and the GGUF mixtures, as declared
    return order.index(wl.quantization), 0 if wl.kv_cache_dtype is None else 1


def pareto_front(points: list[Evaluated]) -> list[Evaluated]:
    """Serving points no other point beats on both latency and throughput per GPU, by latency."""
    ordered = sorted(points, key=lambda e: (e.figures["e2e_latency_seconds"], -e.figures["throughput_tokens_per_second_per_gpu"], e.key))
    front: list[Evaluated] = []
    best = -math.inf
    for e in ordered:
        if e.figures["throughput_tokens_per_second_per_gpu"] > best:
            front.append(e)
            best = e.figures["throughput_tokens_per_second_per_gpu"]
    return front


def weights_exceed_memory(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, space: Space, gpus: int) -> bool:
    """Whether no serving layout of at most `gpus` GPUs can hold the model's weights: a necessary
    condition of any fit, cheap to check where a search is not (a config of a thousand layers and
    tens of thousands of experts costs seconds a search). The ranks of a layout hold each weight at
    least once between them (tp, pp and ep split it, dp copies it), so some GPU holds at least the
    whole model's weights / `gpus`, in the lightest format the space may pick (its formats and its
    fallback formats); where the space may offload, each node's host memory (and NVMe, for an engine
    that offloads there: `offload_targets`) beside the GPUs holds some too. When this is True,
    `search` over the space finds nothing (an exact skip, tests/search/test_weights_bound.py); it
    judges nothing else (KV cache, activations, overheads)."""
    formats = set(space.quantizations) | set(space.fallback_quantizations)
    lightest_bytes = min(stage_weights(spec, Layout(), 0, quantization=q, dense_dtype=wl.activation_dtype).bytes
                         for q in formats)
    held_bytes = gpus * hw.memory_capacity_bytes
    if space.allow_offload or space.offload is not None:
        nodes = -(-gpus // hw.gpus_per_node)
        held_bytes += nodes * (hw.host_memory_bytes_per_node * ("cpu" in wl.offload_targets)
                               + hw.nvme_capacity_bytes_per_node * ("nvme" in wl.offload_targets))
    return lightest_bytes > held_bytes
