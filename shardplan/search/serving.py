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

from shardplan.cost.accuracy import kv_holds_at_edge
from shardplan.cost.layout import Layout, Offload
from shardplan.cost.memory_serving import ServingMemory, serving_memory
from shardplan.cost.time_serving import ServingTime, serving_time
from shardplan.cost.workload import InferenceWorkload, Quantization
from shardplan.search.space import (
    TIGHT,
    Evaluated,
    Goal,
    Objective,
    SearchResult,
    Space,
    check_layout,
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
            eps = [space.ep] if space.ep else ([1, tp] if spec.moe is not None and tp > 1 else [1])
            for ep in eps:
                layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
                if not check_layout(spec, layout, n, False, rejected):
                    continue
                for wlq in formats:
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
        return "throughput under --min-throughput"
    return None


def fewest_offloaded_layers(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload,
                            res: SearchResult) -> tuple[Layout, ServingMemory] | None:
    """The replica with the fewest decoder layers offloaded to host memory that fits (the fastest
    offloaded one: every offloaded layer adds its transfer or host time to each pass); None when the
    engine cannot offload or even every layer off the GPU does not fit. GPU memory falls as layers
    leave, so a bisection over the count finds it in log2(layers) costings."""
    if not wl.offload_targets or layout.pp > 1 or "cpu" not in wl.offload_targets:
        return None
    lo, hi, best = 1, spec.num_layers, None
    while lo <= hi:
        k = (lo + hi) // 2
        trial = replace(layout, offload_layers=k, offload_params=Offload.CPU)
        sm = serving_memory(spec, hw, trial, wl)
        res.num_costed += 1
        res.num_steps += 1
        if sm.fits:
            best, hi = (trial, sm), k - 1
        else:
            lo = k + 1
    return best


class _ReplicaMemory(NamedTuple):
    """What the search reads of a replica's `serving_memory`."""

    fits: bool
    reason: str | None
    kv_capacity_tokens: int
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
        found = _ReplicaMemory(sm.fits, sm.reason, sm.kv_capacity_tokens, sm.max_model_len,
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


def search_serving(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, space: Space, goal: Goal,
                   res: SearchResult, *, offload: bool = False, memo: Memo | None = None) -> None:
    """Cost every replica. `offload`: a second pass, run when nothing fit on the GPUs alone, that
    gives each replica that did not fit the fewest offloaded layers that make it fit; its points
    were counted as rejected by the first pass and are counted again here instead. `memo`: one
    dict for every GPU count of a search: a replica costed at one count is not costed again at
    another where the figures it depends on are the same (`_replica_key`); the counts of what
    was costed stay those of costing it again, so the step budget runs out where it did."""
    ctx = wl.input_len + wl.output_len
    with_batch: dict[tuple[int, int], InferenceWorkload] = {}  # (id of the format's workload, batch) -> workload
    for layout, wlq in _serving_replicas(spec, hw, wl, space, res.invalid if not offload else Counter()):
        sm = _replica_memory(spec, hw, layout, wlq, memo)
        res.num_costed += 1
        res.num_steps += 1
        if offload:
            tight0 = not kv_holds_at_edge(sm.kv_capacity_tokens, sm.max_model_len, goal.kv_capacity_band_fraction)
            if sm.fits and not (tight0 and goal.strict_fit):
                continue  # counted by the first pass
            found = fewest_offloaded_layers(spec, hw, layout, wlq, res)
            if found is None:
                continue  # stays rejected
            n = len(_batch_sizes(wlq, wl.max_num_seqs))
            reason = memory_reason(sm.reason) if not sm.fits else TIGHT
            res.rejected[reason] -= n
            if res.rejected[reason] <= 0:
                del res.rejected[reason]
            res.num_candidates -= n
            res.num_evaluated -= n
            layout, full = found
            sm = _ReplicaMemory(full.fits, full.reason, full.kv_capacity_tokens, full.max_model_len,
                                max(r.breakdown.total for r in full.ranks))
        fit_batch = int(sm.kv_capacity_tokens // ctx)
        tight = not kv_holds_at_edge(sm.kv_capacity_tokens, sm.max_model_len, goal.kv_capacity_band_fraction)
        if not sm.fits or (tight and goal.strict_fit):
            n = len(_batch_sizes(wlq, wl.max_num_seqs))  # the points this replica would have had
            res.num_candidates += n
            res.num_evaluated += n
            res.rejected[memory_reason(sm.reason) if not sm.fits else TIGHT] += n
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
            key = (layout.world_size, layout.tp, layout.pp, layout.ep, layout.offload_layers, _quant_rank(wlq), b)
            wlb = with_batch.get((id(wlq), b))
            if wlb is None:
                wlb = with_batch[(id(wlq), b)] = replace(wlq, batch_size=b)
            res.feasible.append(Evaluated(layout, wlb, hw, serving_objective(goal, figures), key, figures, tight))


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
