"""The typed result of `recommend`: what `recommend --json` prints is
`RecommendResult.model_dump(mode="json")`; the table, the plot and the manifest read the same
model. Entries reuse the estimate's plan, memory, KV-cache and time models (cost/report.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Union

from pydantic import Field

from shardplan.cost.report import (
    FitAtBandEdge,
    Frozen,
    KvCacheReport,
    LoadReport,
    MemoryReport,
    OmitNone,
    PlanReport,
    PredictionBand,
    ServingPlanReport,
    TimeReport,
    TrainingMemoryReport,
)

if TYPE_CHECKING:
    from shardplan.cost.serving_load import LoadResult
    from shardplan.cost.traffic import Sla

AnyPlan = Union[ServingPlanReport, PlanReport]
AnyMemory = Union[TrainingMemoryReport, MemoryReport]


class CostFigures(Frozen):
    gpu_hour_price_usd: float | None = Field(description="USD per GPU-hour; null: no price known")
    usd_per_hour: float | None = Field(description="USD per hour of all the plan's GPUs")
    usd_per_million_tokens: float | None = Field(
        description="USD per million tokens (serving: output tokens; training: trained tokens) over all GPUs")


class RecommendEntry(OmitNone):
    """One ranked plan with its full estimate."""

    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset({"kv_cache", "bands", "fit_at_band_edge", "load"})

    rank: int = Field(description="1 = the pick")
    num_gpus: int = Field(description="GPUs of the plan (count)")
    num_nodes: int = Field(description="nodes of the plan (count)")
    plan: AnyPlan = Field(description="the layout (serving: with formats and batch)")
    objective_value: float = Field(description="what the ranking minimised (throughput: negated tokens/s of the plan)")
    memory: AnyMemory = Field(description="bytes per GPU")
    kv_cache: KvCacheReport | None = Field(default=None, description="serving only")
    time: TimeReport = Field(description="time figures; throughput is the whole plan's (all replicas)")
    cost: CostFigures = Field(description="price of the plan")
    bands: list[PredictionBand] | None = Field(default=None, description="the measured error band of each figure "
                                               "(as `estimate --json`)")
    fit_at_band_edge: FitAtBandEdge | None = Field(default=None, description="fits / tight at the memory band's "
                                                   "edge; tight plans rank after those that fit at the edge")
    runs_on: list[str] = Field(default_factory=list, description="the targets that run this plan as it is "
                               "(knowledge/targets.yaml: their exporters accept it); `--target T` returns only plans T runs")
    load: LoadReport | None = Field(default=None, description="serving under the traffic the plan was judged at "
                                                              "(goodput objective); as `estimate --json`'s load")
    tie: bool = Field(default=False, description="within the ranked figure's measured error band of the first plan: "
                                                 "a tie; the pick is the tie first by the secondary key (fewer GPUs, tp "
                                                 "inside a node, smaller cp, fewer stages, smaller tp, simpler schedule), the others "
                                                 "follow by the ranked figure")
    variants: int = Field(default=1, description="plans of this parallel shape (formats, batch, ZeRO, recompute, "
                                                 "virtual stages) folded into this row, its best; --expand lists them")

    @property
    def throughput_tokens_per_second(self) -> float:
        """Output (serving) or trained (training) tokens per second of the whole plan."""
        t = self.time
        return t.tokens_per_second if hasattr(t, "tokens_per_second") else t.throughput_tokens_per_second  # type: ignore[union-attr]


class ParetoPoint(Frozen):
    num_gpus: int = Field(description="GPUs of the plan (count)")
    tp: int = Field(description="tensor-parallel degree")
    pp: int = Field(description="pipeline stages")
    replicas: int = Field(description="model replicas (dp)")
    ep: int = Field(description="expert-parallel degree")
    quantization: str = Field(description="weight format")
    kv_cache_dtype: str = Field(description="KV-cache format")
    batch_size: int = Field(description="concurrent sequences per replica")
    ttft_seconds: float = Field(description="time to first token, seconds")
    tpot_seconds: float = Field(description="time per output token, seconds")
    e2e_latency_seconds: float = Field(description="one request end to end, seconds (the frontier's first axis)")
    throughput_tokens_per_second_per_gpu: float = Field(
        description="the plan's output tokens/s over its GPUs (the frontier's second axis)")


class BestAtGpuCount(Frozen):
    num_gpus: int = Field(description="GPU count (count)")
    step_seconds: float = Field(description="step time of the best plan there, seconds")
    tokens_per_second_per_gpu: float = Field(description="its trained tokens per second per GPU")
    objective_value: float = Field(description="its objective value")


class BindingConstraint(Frozen):
    constraint: str = Field(description="kv_cache, memory, max_ttft, max_tpot or min_throughput")
    slack_fraction: float = Field(description="slack left, as a fraction of the limit")
    detail: str = Field(description="the figures, in words")


class SearchBudget(Frozen):
    max_steps: int = Field(description="steps the search may take (count)")
    num_steps: int = Field(description="steps taken (count)")
    spent: bool = Field(description="the budget ran out before the space was covered")
    num_layouts_not_searched: int = Field(description="layouts left out (count)")
    gpu_counts_not_searched: list[int] = Field(description="GPU counts left out")


class Difference(Frozen):
    component: str = Field(description="part of the time")
    seconds_a: float = Field(description="the winner's, seconds")
    seconds_b: float = Field(description="the compared plan's, seconds")
    delta_seconds: float = Field(description="b - a, seconds")


class Comparison(OmitNone):
    """The best plan with the degrees the user named, against the winner."""

    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset(
        {"rejected", "invalid_degree_combinations", "plan", "objective_value", "memory", "time", "gap_fraction", "differences"})

    pins: dict[str, Any] = Field(description="the named degrees")
    fits: bool = Field(description="some plan with them fits")
    rejected: dict[str, int] | None = Field(default=None, description="when none fits: layouts by reason")
    invalid_degree_combinations: dict[str, int] | None = Field(default=None, description="when none fits")
    plan: AnyPlan | None = Field(default=None, description="the best such plan")
    objective_value: float | None = Field(default=None, description="its objective value")
    memory: AnyMemory | None = Field(default=None, description="its memory")
    time: TimeReport | None = Field(default=None, description="its time")
    gap_fraction: float | None = Field(default=None, description="how far behind the winner, fraction")
    differences: list[Difference] | None = Field(default=None, description="where the time differs, largest first")


class Suggestion(OmitNone):
    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset({"num_gpus"})

    change: str = Field(description="the option to change")
    detail: str = Field(description="what then fits")
    num_gpus: int | None = Field(default=None, description="--gpus suggestions: the GPU count")


class DisaggregatedComparison(Frozen):
    """The best disaggregated plan on the same GPUs beside the aggregated pick (cost/disaggregated.py)."""

    prefill_tp: int = Field(description="tensor-parallel degree of a prefill replica")
    prefill_replicas: int = Field(description="prefill replicas")
    decode_tp: int = Field(description="tensor-parallel degree of a decode replica")
    decode_replicas: int = Field(description="decode replicas")
    request_rate_per_second: float = Field(
        description="the most requests/s the split carries within the SLA (the lesser pool), as a rate offered")
    output_tokens_per_second_per_gpu: float = Field(description="that rate times the mean output tokens, per GPU")
    aggregated_request_rate_per_second: float = Field(
        description="the most requests/s aggregated serving carries within the SLA, as a rate offered (all replicas): "
                    "the pick's, or with a --request-rate the best of the ranked plans'")
    aggregated_output_tokens_per_second_per_gpu: float = Field(
        description="that rate times the mean output tokens, per GPU (the split's terms; a plan's own goodput, its "
                    "run's measured output, is lower by the run's ramp and drain)")
    offered_request_rate_per_second: float | None = Field(
        None, description="the --request-rate both are judged against; null: none given (each at the most it carries)")
    kv_transfer_bytes_per_request: float = Field(description="a prompt's KV cache sent from prefill to decode, bytes")
    kv_transfer_seconds: float = Field(description="its transfer time over the link, added to TTFT")
    link: str = Field(description="the link between the pools")
    winner: str = Field(description="aggregated or disaggregated")
    why: str = Field(description="the deciding figures, in words")


class ExportSummary(Frozen):
    target: str = Field(description="export target")
    files: list[str] = Field(description="files written")


class EngineFallback(Frozen):
    """The default engine had no plan; the answer is another engine's."""

    asked: str = Field(description="the default engine and version, which has no plan")
    used: str = Field(description="the engine and version the plans are sized for")
    option: str = Field(description="the option that selects it, e.g. --engine llamacpp")
    why: str = Field(description="why the default has no plan and what the other engine does differently")


class LongRun(Frozen):
    """A plan at a rate over a run of STEADY_REQUESTS_MAX requests a replica (traffic.over_a_long_run):
    near what a plan keeps up with, the running requests approach their steady count slowly, and a
    run as long as the rate search's can meet the SLA where a long one does not (BENCHMARKS.md)."""

    @classmethod
    def of(cls, r: LoadResult, sla: Sla, request_rate: float, replicas: int, num_requests: int,
           held: tuple[float, LoadResult] | None = None) -> LongRun:
        """From one replica's run `r` of `num_requests` requests, judged by `sla`; `held`: the highest
        rate a replica's run as long meets it at, where `r` breaks it, and that run
        (traffic.held_over_a_long_run)."""
        bad = sla.violated(r)
        key = f"p{sla.percentile}"
        held = None if bad is None else held
        return cls(request_rate=request_rate, num_requests=num_requests * replicas, percentile=sla.percentile,
                   ttft_seconds=getattr(r.ttft_seconds, key), tpot_seconds=getattr(r.tpot_seconds, key),
                   within_sla=bad is None, why=bad,
                   held_request_rate=None if held is None else held[0] * replicas,
                   held_ttft_seconds=None if held is None else getattr(held[1].ttft_seconds, key),
                   held_tpot_seconds=None if held is None else getattr(held[1].tpot_seconds, key))

    request_rate: float = Field(description="requests/s, all replicas (the pick's judged rate)")
    num_requests: int = Field(description="requests simulated, all replicas")
    percentile: int = Field(description="the SLA's percentile")
    ttft_seconds: float = Field(description="TTFT at that percentile over the long run")
    tpot_seconds: float = Field(description="TPOT at that percentile over the long run")
    within_sla: bool = Field(description="whether the long run meets the SLA too")
    why: str | None = Field(description="the limit it breaks; null when within")
    held_request_rate: float | None = Field(
        None, description="requests/s, all replicas: the highest rate whose run as long meets the SLA, found below "
        "request_rate in steps of 5% then resolved to a quarter of a step; null when the long run at request_rate meets it, "
        "or none above half of it does")
    held_ttft_seconds: float | None = Field(None, description="TTFT at the percentile over the run at held_request_rate")
    held_tpot_seconds: float | None = Field(None, description="TPOT at the percentile over the run at held_request_rate")


class RecommendResult(OmitNone):
    """What `recommend --json` prints."""

    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset({"export", "target", "disaggregated", "engine_fallback",
                                                         "long_run"})

    model: str = Field(description="model name")
    hardware: str = Field(description="hardware profile name")
    workload: str = Field(description="inference or training")
    objective: str = Field(description="what the ranking optimised")
    assumptions: str = Field(description="the workload shape, what 'best' means and the limits, in words")
    gpu_counts: list[int] = Field(description="GPU counts searched")
    smallest_num_gpus: int | None = Field(description="fewest GPUs with a plan that meets the goal")
    num_candidates: int = Field(description="layouts in the space (count)")
    num_evaluated: int = Field(description="layouts decided by a bound or a cost (count)")
    num_costed: int = Field(description="full memory/time evaluations (count)")
    num_feasible: int = Field(description="layouts that fit and meet the limits (count)")
    elapsed_seconds: float = Field(description="search wall time, seconds")
    search_budget: SearchBudget = Field(description="bounded work")
    evaluated_per_second: float | None = Field(description="layouts evaluated per second")
    rejected: dict[str, int] = Field(description="layouts rejected, by reason")
    invalid_degree_combinations: dict[str, int] = Field(description="degree combinations that cannot exist, by reason")
    top: list[RecommendEntry] = Field(description="the best plans, best first")
    pareto: list[ParetoPoint] = Field(description="serving: the latency vs throughput-per-GPU frontier of the plans "
                                                  "costed in full (goodput: a plan whose bound on goodput cannot "
                                                  "reach the plans shown is not simulated, so not on it; `rejected` "
                                                  "counts them)")
    best_per_num_gpus: list[BestAtGpuCount] = Field(description="training: the best plan at each GPU count")
    binding_constraint: BindingConstraint | None = Field(description="the pick's tightest limit")
    runner_up_gap_fraction: float | None = Field(description="how far the runner-up is behind, fraction")
    why: str = Field(description="the choice in words")
    strict_fit: bool = Field(False, description="--strict-fit: plans that fit only at the prediction (tight) were "
                                                "left out, not ranked last")
    bands: list[PredictionBand] = Field(default_factory=list, description="the measured error bands of the "
                                        "workload's predictions; the first is the one fit is decided on")
    compare: Comparison | None = Field(description="--compare: the named layout against the pick")
    suggestions: list[Suggestion] = Field(description="when nothing fits: single changes that make something fit")
    manifest: str | None = Field(description="where the pick's manifest was written")
    export: ExportSummary | None = Field(default=None, description="--export: what was written")
    disaggregated: DisaggregatedComparison | None = Field(
        default=None, description="goodput on a fixed GPU count: the best plan with separate prefill and decode pools, "
                                  "and which of the two wins")
    target: str | None = Field(default=None, description="--target (or the one --export implies): every plan is one "
                                                         "it runs and verify checks")
    engine_fallback: EngineFallback | None = Field(
        default=None, description="serving without --engine: the default engine had no plan, so these plans are "
                                  "another engine's (the first that has one)")
    long_run: LongRun | None = Field(
        default=None, description="serving at a rate (the goodput search's or --request-rate): the pick over a long "
                                  "run at that rate, and whether it still meets the SLA")
