"""What the search varies, what it optimises, and what it returns (shared by serving and training)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import Any, Callable

from shardplan.cost.layout import Layout, Offload, PipelineSchedule, Recompute, validate_layout
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.errors import LayoutError, ShardplanError
from shardplan.search.targets import TargetRules
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.units import DType

SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MILLION = 1e6


class Objective(str, Enum):
    LATENCY = "latency"  # serving: least end-to-end latency of a request
    THROUGHPUT = "throughput"  # serving: most output tokens per second over all GPUs
    COST = "cost"  # least USD per million tokens (output tokens serving, trained tokens training)
    STEP_TIME = "step-time"  # training: shortest optimizer step
    # serving: most output tokens/s per GPU from requests that meet the SLA (continuous batching,
    # cost/traffic.py): at the given rate or concurrency, or at the most load within the SLA
    GOODPUT = "goodput"


SERVING_OBJECTIVES = (Objective.GOODPUT, Objective.LATENCY, Objective.THROUGHPUT, Objective.COST)
# The SLA of the goodput objective when none is given: an interactive chat service (printed as such).
DEFAULT_MAX_TTFT_SECONDS = 1.0
DEFAULT_MAX_TPOT_SECONDS = 0.05
DEFAULT_SLO_PERCENTILE = 90
TRAINING_OBJECTIVES = (Objective.STEP_TIME, Objective.COST)


def check_latency_limits(max_ttft_seconds: float | None, max_tpot_seconds: float | None) -> None:
    """An SLA's limits (None: no limit) must be finite and above 0: a limit of 0 cannot be met, and an
    infinite one is no limit (leave the option out)."""
    for value, option in ((max_ttft_seconds, "--max-ttft-ms"), (max_tpot_seconds, "--max-tpot-ms")):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ShardplanError(f"must be a finite number of ms above 0 (got {value * 1e3:g})", field=option,
                                 hint="give the limit in ms, e.g. 1000, or leave the option out for no limit")


@dataclass(frozen=True)
class Goal:
    objective: Objective
    max_ttft_seconds: float | None = None
    max_tpot_seconds: float | None = None
    min_throughput_tokens_per_second: float | None = None  # all GPUs together
    gpu_hour_price_usd: float | None = None  # None: the profile's price
    top_k: int = 5
    # "Fits" at the edge of the measured error band (cost/accuracy.py; the caller looks the band
    # up): the fraction applied to the reserved peak (training, x (1 + band)) or to the KV
    # capacity (serving, x (1 - band)); None: no band known, the prediction decides. A plan that
    # fits only at the prediction is "tight": ranked after those that fit at the edge, or
    # rejected with `strict_fit`.
    peak_memory_band_fraction: float | None = None
    kv_capacity_band_fraction: float | None = None
    strict_fit: bool = False
    slo_percentile: int = DEFAULT_SLO_PERCENTILE  # the percentile --max-ttft-ms / --max-tpot-ms hold at (goodput)
    sla_defaulted: bool = False  # the limits are the default SLA (said so in the answer)
    # Honest ranking: show the best variant of each parallel shape (False: every variant, --expand),
    # and call plans within this fraction of the first plan's objective ties (the measured error band of
    # the ranked figure; None: only equal values tie); the pick among ties is the first by `secondary_key`.
    group_by_shape: bool = True
    tie_band_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.slo_percentile not in (50, 90, 99):
            raise ShardplanError(f"must be 50, 90 or 99 (got {self.slo_percentile})", field="--slo-percentile",
                                 hint="the percentile of TTFT and TPOT the limits hold at, e.g. 90")
        check_latency_limits(self.max_ttft_seconds, self.max_tpot_seconds)
        limits = (("min_throughput_tokens_per_second", "--min-throughput"), ("gpu_hour_price_usd", "--gpu-hour-price"),
                  ("peak_memory_band_fraction", "bands.yaml"), ("kv_capacity_band_fraction", "bands.yaml"))
        for name, option in limits:
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ShardplanError(f"must be a finite number >= 0 (got {value})", field=option,
                                     hint="leave the option out for no limit")
        if self.min_throughput_tokens_per_second == 0:  # a minimum of nothing: no limit
            object.__setattr__(self, "min_throughput_tokens_per_second", None)

    def without_sla(self) -> "Goal":
        """The same goal with no latency limits (goodput then ranks at the most each plan sustains)."""
        return replace(self, max_ttft_seconds=None, max_tpot_seconds=None, sla_defaulted=False)


@dataclass(frozen=True)
class Space:
    """What the search may vary. A degree given here is pinned (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero_stage: int | None = None
    hybrid_shard: bool | None = None
    sequence_parallel: bool | None = None
    recompute: Recompute | None = None
    pp_schedule: PipelineSchedule | None = None
    virtual_stages: int | None = None
    micro_batch_size: int | None = None
    offload: tuple[Offload, Offload] | None = None  # (optimizer, params)
    allow_cross_node_tp: bool = False
    allow_offload: bool = True
    quantizations: tuple[Quantization, ...] = (Quantization.NONE,)  # serving weight formats
    # Serving: formats tried only when nothing fits in `quantizations` on the GPUs alone (the engine's
    # quantized formats when the user named none); with them, and with offload, the fallback pass.
    fallback_quantizations: tuple[Quantization, ...] = ()
    kv_cache_dtypes: tuple[DType | None, ...] = (None,)  # serving; None = the activation dtype
    max_virtual_stages: int = 8
    max_micro_batch_size: int = 8
    # Steps (a bound or a cost: one per training degree set and branch-and-bound node, one per
    # serving memory or time estimate) one search may take. The largest single GPU count seen
    # (DeepSeek-V3, 32 GPUs) takes ~28,000; --max-gpus up to a million GPUs would take ~600,000.
    # Each GPU count gets an equal share of what is left; when a share is spent, the layouts left
    # in its branch and bound are reported as not searched instead of running for minutes.
    max_search_steps: int = 50_000
    # What the plans must run on (knowledge/targets.yaml): a --target's rules, or a stack's own
    # runtime rules; None: every layout that can exist (search/targets.py).
    rules: TargetRules | None = None
    # How the search runs, not what it finds (as max_search_steps): forked worker processes that
    # simulate serving points ahead of their turn (search/ahead.py); 0: this process alone. Every
    # value gives the same plans, order and counts. The command line sets it (`search_workers()`).
    workers: int = 0


@dataclass(frozen=True)
class Evaluated:
    """One costed layout that fits and meets the limits."""

    layout: Layout
    workload: InferenceWorkload | TrainingWorkload
    hw: HardwareProfile
    objective_value: float  # lower is better (throughput is negated)
    key: tuple[Any, ...]  # deterministic tie-break
    figures: dict[str, float]  # the headline numbers the ranking used
    tight: bool = False  # fits at the prediction, not at the band's edge (Goal.*_band_fraction): ranked last
    tie: bool = False  # within the objective's error band of the first plan (Goal.tie_band_fraction): a tie with it
    variants: int = 1  # plans of this parallel shape the ranking folded into this one (its best)

    @property
    def num_gpus(self) -> int:
        return self.layout.world_size


def layout_shape(layout: Layout) -> tuple[int, ...]:
    """What a layout's GPUs do, the parallel shape the ranking groups plans by: (GPUs, tp, pp, dp, cp,
    ep). Formats, batch, ZeRO stage, recompute, virtual stages and micro-batch are its variants."""
    return (layout.world_size, layout.tp, layout.pp, layout.dp, layout.cp, layout.ep)


@dataclass
class SearchResult:
    training: bool
    goal: Goal
    gpu_counts: list[int]
    num_candidates: int = 0  # layouts in the space that can exist (after the generators)
    num_evaluated: int = 0  # of those, decided by a bound or a full cost
    num_costed: int = 0  # full memory + time evaluations
    rejected: Counter = field(default_factory=Counter)  # reason -> layouts (they sum with num_feasible to num_evaluated)
    invalid: Counter = field(default_factory=Counter)  # reason -> degree combinations that cannot exist (not layouts)
    feasible: list[Evaluated] = field(default_factory=list)  # serving: every point that fits; training: each count's top K
    top: list[Evaluated] = field(default_factory=list)
    pareto: list[Evaluated] = field(default_factory=list)
    num_feasible: int = 0  # costed layouts that fit and meet the limits
    smallest_num_gpus: int | None = None
    elapsed_seconds: float = 0.0
    num_steps: int = 0  # bounds and costs computed (Space.max_search_steps caps them)
    step_limit: int = 0  # where the GPU count being searched must stop: its share of what is left
    unsearched_gpu_counts: list[int] = field(default_factory=list)  # skipped once the budget was spent
    # Serving goodput: the least TTFT and TPOT (at the SLA's percentile) any replica reached with one
    # request at a time, among those no load kept within the SLA: what a relaxed limit must allow.
    sla_floor_seconds: dict[str, float] = field(default_factory=dict)


BUDGET_SPENT = "not searched: the search budget (max_search_steps) was spent"
TIGHT = "tight: fits at the prediction, not at the error band's edge (--strict-fit)"


Progress = Callable[[int, int], None]  # (done, total)


@lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small) | {n // d for d in small}))


def divisors(n: int) -> list[int]:
    return list(_divisors(n))


def gpu_counts(hw: HardwareProfile, *, num_gpus: int | None, max_gpus: int | None) -> list[int]:
    """GPU counts to try: the one given, or with `max_gpus` powers of two inside a node, then
    whole nodes (1, 2, 3, 4, 6, 8, 12, 16, ... nodes) up to the limit."""
    if max_gpus is None:
        return [num_gpus or hw.gpus_per_node]
    gpn = hw.gpus_per_node
    counts = {c for c in (2**k for k in range(0, max_gpus.bit_length())) if c <= min(gpn, max_gpus)}
    if max_gpus <= gpn:
        counts.add(max_gpus)
    nodes = 1
    while nodes * gpn <= max_gpus:
        counts.add(nodes * gpn)
        nodes = nodes + 1 if nodes < 4 else nodes * 3 // 2 if nodes & (nodes - 1) == 0 else nodes * 4 // 3
    if max_gpus % gpn == 0:
        counts.add(max_gpus)
    return sorted(counts)


def topology(hw: HardwareProfile, num_gpus: int) -> HardwareProfile:
    """The cluster of `num_gpus`: part of one node, or whole nodes."""
    if num_gpus <= hw.gpus_per_node:
        return hw.with_topology(gpus_per_node=num_gpus, num_nodes=1)
    if num_gpus % hw.gpus_per_node:
        raise ShardplanError(
            f"{num_gpus} GPUs is not a whole number of {hw.gpus_per_node}-GPU nodes", field="--gpus",
            hint=f"use a multiple of {hw.gpus_per_node}",
        )
    return hw.with_topology(num_nodes=num_gpus // hw.gpus_per_node)


def price_per_gpu_hour(hw: HardwareProfile, goal: Goal) -> float | None:
    return goal.gpu_hour_price_usd if goal.gpu_hour_price_usd is not None else hw.price_per_gpu_hour_usd


def cost_figures(hw: HardwareProfile, goal: Goal, num_gpus: int, tokens_per_second: float) -> dict[str, float | None]:
    """USD per hour of the GPUs and per million tokens at `tokens_per_second` (all GPUs)."""
    price = price_per_gpu_hour(hw, goal)
    if price is None:
        return {"gpu_hour_price_usd": None, "usd_per_hour": None, "usd_per_million_tokens": None}
    per_hour = price * num_gpus
    per_million = per_hour / SECONDS_PER_HOUR / tokens_per_second * TOKENS_PER_MILLION if tokens_per_second > 0 else math.inf
    return {"gpu_hour_price_usd": price, "usd_per_hour": per_hour, "usd_per_million_tokens": per_million}


def tp_choices(spec: ModelSpec, hw: HardwareProfile, num_gpus: int, space: Space, rejected: Counter) -> list[int]:
    out = []
    for tp in ([space.tp] if space.tp else divisors(num_gpus)):
        if num_gpus % tp:
            rejected["tp does not divide the GPU count"] += 1
        elif tp > hw.gpus_per_node and not space.allow_cross_node_tp:
            rejected["tp crosses a node (allow with --allow-cross-node-tp)"] += 1
        elif check_layout(spec, Layout(tp=tp, dp=num_gpus // tp), num_gpus, False, rejected):
            out.append(tp)  # validate_layout's rules: heads, KV heads, MLP width, vocabulary
    return out


def check_layout(spec: ModelSpec, layout: Layout, num_gpus: int, training: bool, rejected: Counter) -> bool:
    try:
        validate_layout(spec, layout, num_gpus, training=training)
    except LayoutError as e:
        rejected[f"cannot exist: {e.field}"] += 1
        return False
    return True


NO_HOST_BANDWIDTH = ("offload not costed: the profile has no node.host_memory_bandwidth_gb_per_s, which layers "
                     "run on the CPU need")
# The rejection reasons that say a layout does not hold in memory (`memory_reason`, the band's edge,
# the offload fallback's); the others say it holds but misses a limit or the top plans.
MEMORY_REASONS = frozenset({"KV cache holds no max_model_len sequence", "offloaded states exceed host RAM",
                            "offloaded states exceed NVMe", "does not fit in GPU memory",
                            "batch larger than the KV cache holds", TIGHT, NO_HOST_BANDWIDTH})


def memory_reason(reason: str | None) -> str:
    r = reason or ""
    if "max seq len" in r:
        return "KV cache holds no max_model_len sequence"
    if "host RAM" in r:
        return "offloaded states exceed host RAM"
    if "NVMe" in r:
        return "offloaded states exceed NVMe"
    return "does not fit in GPU memory"
