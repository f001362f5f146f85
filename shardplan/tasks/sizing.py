"""capacity --request-rate: how many GPUs of this kind, in which layout, serve R requests per
second within a latency SLA.

For each replica shape (tp inside a node, pp over nodes, each weight format asked for) that the
engine starts (`serving_memory`), the highest request rate one replica sustains with its p-th
percentile TTFT and TPOT within the limits (`cost.traffic.best_rate`: the engine's continuous
batching simulated under Poisson arrivals of the requests' lengths); replicas = ceil(R / that
rate); GPUs = replicas x tp x pp. The answer is the shape with the fewest GPUs (ties: the most
rate to spare). Replicas serve independently behind a load balancer, so the figures of one
replica at R / replicas are the plan's latencies. Pure: no yaml, rich or typer.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from pydantic import Field

from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.report import PredictionBand
from shardplan.cost.serving_load import LoadResult
from shardplan.cost.step_model import StepModel
from shardplan.cost.traffic import (SEARCH_REQUESTS_MIN, STEADY_REQUESTS_MAX, Sla, latency_floor, load_figures,
                                   long_run_and_held, most_within_sla)
from shardplan.cost.workload import InferenceWorkload, Quantization, ServingLoad
from shardplan.search.results import LongRun
from shardplan.search.space import Space, check_layout, divisors, tp_choices
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.tasks._results import Result
from shardplan.tasks._targets import engine_refuses


PIPELINE_DEPTHS_TRIED = 2  # per tp: the shallowest pipeline that holds the model, and the next
# Long runs (with the search for the rate each holds, where one breaks the SLA) before an answer is given up on:
# each check either settles the answer or adds replicas to one shape, so this bounds the work on any input.
LONG_RUN_CHECKS = 32


class SizingRow(Result):
    """One replica shape: how much rate it carries within the SLA, and how many it takes."""

    tp: int = Field(description="tensor-parallel degree")
    pp: int = Field(description="pipeline stages")
    ep: int = Field(description="expert-parallel degree")
    quantization: str = Field(description="weight format")
    gpus_per_replica: int = Field(description="tp x pp")
    max_request_rate_per_replica: float | None = Field(description="requests/s one replica sustains within the SLA; "
                                                                   "null: none (see reason)")
    replicas: int | None = Field(description="replicas for the asked rate")
    num_gpus: int | None = Field(description="GPUs for the asked rate")
    reason: str | None = Field(description="why the shape cannot serve the rate within the SLA; null when it can")
    long_run_request_rate_per_replica: float | None = Field(
        None, description="where this shape was run at its share of the rate over STEADY_REQUESTS_MAX requests a replica "
                          "(the answer, and shapes that would have taken fewer GPUs) and that broke the SLA: what a "
                          "replica holds over as long a run, which its replicas and GPUs are sized by; null otherwise")


class LatencyAtRate(Result):
    p: int = Field(description="the SLA's percentile")
    ttft_seconds: float = Field(description="TTFT at that percentile, at the asked rate")
    tpot_seconds: float = Field(description="TPOT at that percentile, at the asked rate")
    output_tokens_per_second_per_gpu: float = Field(description="goodput over the plan's GPUs")
    saturated: bool = Field(description="whether requests wait in the engine's queue at the asked rate "
                                        "(which regime's measured band the figures carry)")
    saturation_request_rate: float = Field(
        description="the rate the plan sustains with every request waiting (all replicas); at or above it a longer "
                    "run than the one simulated queues without bound")


class SlaSizing(Result):
    """What `capacity --request-rate` prints (`--json`: this object)."""

    model: str = Field(description="model name")
    hardware: str = Field(description="hardware profile name")
    request_rate: float = Field(description="requests per second to serve")
    max_ttft_seconds: float | None = Field(description="TTFT limit at the percentile; null: none")
    max_tpot_seconds: float | None = Field(description="TPOT limit at the percentile; null: none")
    slo_percentile: int = Field(description="the percentile the limits hold at")
    lengths: str = Field(description="request lengths: fixed input/output or a dataset")
    mean_input_tokens: float = Field(description="mean prompt tokens")
    mean_output_tokens: float = Field(description="mean output tokens")
    rows: list[SizingRow] = Field(description="every replica shape tried, fewest GPUs first")
    best: SizingRow | None = Field(description="the answer: the fewest GPUs; null: no shape meets the SLA")
    at_rate: LatencyAtRate | None = Field(description="the answer's latency and goodput at the asked rate")
    long_run: LongRun | None = Field(None, description="the answer at the asked rate over STEADY_REQUESTS_MAX requests a "
                                                       "replica, where it meets the SLA (a shape whose long run breaks it "
                                                       "is sized again: rows' long_run_request_rate_per_replica)")
    bands: list[PredictionBand] | None = Field(
        None, description="the measured error band of the answer's median TTFT, TPOT and ITL and output tokens/s: "
                          "published benchmark runs of the engine generation in the answer's regime (`shardplan validate`)")

    @property
    def found(self) -> bool:
        return self.best is not None


def _shapes(spec: ModelSpec, hw: HardwareProfile, max_gpus: int) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) of one replica: tp divides the heads inside a node, pp over the nodes."""
    out = []
    gpn = hw.gpus_per_node
    for tp in tp_choices(spec, hw, min(gpn, max_gpus), Space(), Counter()):
        for pp in divisors(max(1, max_gpus // tp)):
            if pp > spec.num_layers or tp * pp > max_gpus or (pp > 1 and tp * pp > gpn and tp != gpn):
                continue
            ep = tp if spec.moe is not None and tp > 1 else 1
            layout = Layout(tp=tp, pp=pp, dp=1, ep=ep)
            if check_layout(spec, layout, tp * pp, False, Counter()):
                out.append((tp, pp, ep))
    return out


def size_for_rate(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, *, rate: float, sla: Sla,
                  formats: tuple[Quantization, ...], max_gpus: int) -> SlaSizing:
    load = wl.load or ServingLoad()
    lengths = load.lengths
    mean_in = wl.input_len if lengths is None else lengths.mean_input_tokens
    mean_out = wl.output_len if lengths is None else lengths.mean_output_tokens
    rows: list[SizingRow] = []
    points: dict[int, tuple[Layout, InferenceWorkload, int]] = {}
    for q in formats:
        wq = replace(wl, quantization=q)
        started: Counter = Counter()  # tp -> pipeline depths at which the replica starts
        for tp, pp, ep in _shapes(spec, hw, max_gpus):
            if started[tp] >= PIPELINE_DEPTHS_TRIED:
                continue  # deeper pipelines than the two shallowest that hold the model only add hops
            layout = Layout(tp=tp, pp=pp, dp=1, ep=ep)
            replica_hw = hw.with_topology(gpus_per_node=hw.gpus_per_node, num_nodes=max(1, math.ceil(tp * pp / hw.gpus_per_node)))
            if engine_refuses(spec, replica_hw, layout, wq):  # a shape the engine cannot run (TGI with pp > 1)
                continue
            sm = serving_memory(spec, replica_hw, layout, wq)
            base = dict(tp=tp, pp=pp, ep=ep, quantization=q.value, gpus_per_replica=tp * pp)
            if not sm.fits:
                rows.append(SizingRow(**base, max_request_rate_per_replica=None, replicas=None, num_gpus=None,
                                      reason=f"does not start: {sm.reason}"))
                continue
            started[tp] += 1
            step = StepModel(spec, replica_hw, layout, wq, wq.max_num_batched_tokens, wq.max_num_seqs)
            ttft, tpot = latency_floor(step, wq, mean_in)
            if (sla.max_ttft_seconds is not None and ttft > sla.max_ttft_seconds) or (
                    sla.max_tpot_seconds is not None and tpot > sla.max_tpot_seconds):
                rows.append(SizingRow(**base, max_request_rate_per_replica=None, replicas=None, num_gpus=None,
                                      reason=f"one request alone takes TTFT {ttft * 1e3:,.0f} ms, TPOT {tpot * 1e3:,.1f} ms"))
                continue
            point, _ = most_within_sla(step, wq, sm.kv_account, sla)
            if point is None:
                rows.append(SizingRow(**base, max_request_rate_per_replica=None, replicas=None, num_gpus=None,
                                      reason=f"p{sla.percentile} latency over the SLA at every rate"))
                continue
            replicas = max(1, math.ceil(rate / point.request_rate_per_second))
            over = replicas * tp * pp > max_gpus
            rows.append(SizingRow(**base, max_request_rate_per_replica=point.request_rate_per_second, replicas=replicas,
                                  num_gpus=replicas * tp * pp,
                                  reason=f"needs {replicas * tp * pp:,} GPUs, more than --max-gpus {max_gpus:,}" if over else None))
            points[len(rows) - 1] = (layout, wq, sm.kv_account)
    # The fewest GPUs whose replicas hold the rate over a long run: a rate judged over the rate search's run can
    # break the SLA over a longer one (traffic.held_over_a_long_run), so the shape with the fewest GPUs is run at
    # its share over STEADY_REQUESTS_MAX requests a replica; where that breaks the SLA it is sized again by what a
    # replica holds over as long a run (never more than the search's rate: it only takes more GPUs), and the shapes
    # are ordered again, until the first is one whose long run holds.
    def order_of() -> list[int]:
        return sorted(range(len(rows)), key=lambda i: (rows[i].reason is not None, rows[i].num_gpus is None,
                                                       rows[i].num_gpus or 0, -(rows[i].max_request_rate_per_replica or 0.0)))

    def replica_hw_of(world: int) -> HardwareProfile:
        return hw.with_topology(gpus_per_node=hw.gpus_per_node, num_nodes=max(1, math.ceil(world / hw.gpus_per_node)))

    runs: dict[int, LoadResult] = {}  # row -> its replica's long run at its share of the rate, where it held
    best_i = None
    for _ in range(LONG_RUN_CHECKS):
        order = order_of()
        if not order or rows[order[0]].reason is not None:
            break
        i = order[0]
        if i in runs:
            best_i = i
            break
        layout, wq, kv = points[i]
        row = rows[i]
        assert row.replicas is not None  # a row without a reason has replicas
        judged = replace(wq, load=replace(load, request_rate_per_second=rate))
        step = StepModel(spec, replica_hw_of(layout.world_size), layout, judged, judged.max_num_batched_tokens,
                         judged.max_num_seqs)
        r, found = long_run_and_held(step, judged, kv, sla, rate / row.replicas)
        if sla.violated(r) is None:
            runs[i] = r
            continue
        if found is None:
            rows[i] = row.model_copy(update={"reason": f"over {STEADY_REQUESTS_MAX:,} requests a replica even half its "
                                                       "share of the rate breaks the SLA"})
            continue
        held = found[0]
        replicas = max(row.replicas + 1, math.ceil(rate / held - 1e-9))
        num_gpus = replicas * row.gpus_per_replica
        rows[i] = row.model_copy(update={
            "replicas": replicas, "num_gpus": num_gpus, "long_run_request_rate_per_replica": held,
            "reason": f"needs {num_gpus:,} GPUs, more than --max-gpus {max_gpus:,}" if num_gpus > max_gpus else None})
    order = order_of()
    at_rate = long_run = None
    if best_i is not None:
        layout, wq, kv = points[best_i]
        b = rows[best_i]
        assert b.replicas is not None  # a row with GPUs has replicas
        plan = replace(layout, dp=b.replicas)
        judged = replace(wq, load=replace(load, request_rate_per_second=rate,
                                          num_requests=max(load.num_requests, SEARCH_REQUESTS_MIN * b.replicas)))
        f = load_figures(spec, replica_hw_of(plan.world_size), plan, judged, kv)
        key = f"p{sla.percentile}"
        at_rate = LatencyAtRate(p=sla.percentile, ttft_seconds=getattr(f.replica.ttft_seconds, key),
                                tpot_seconds=getattr(f.replica.tpot_seconds, key),
                                output_tokens_per_second_per_gpu=f.output_tokens_per_second_per_gpu,
                                saturated=f.saturated, saturation_request_rate=f.saturation_request_rate_per_second)
        long_run = LongRun.of(runs[best_i], sla, rate, b.replicas, STEADY_REQUESTS_MAX)
    return SlaSizing(
        model=spec.name, hardware=hw.name, request_rate=rate, max_ttft_seconds=sla.max_ttft_seconds,
        max_tpot_seconds=sla.max_tpot_seconds, slo_percentile=sla.percentile,
        lengths=load.lengths_name, mean_input_tokens=mean_in, mean_output_tokens=mean_out,
        rows=[rows[i] for i in order], best=rows[best_i] if best_i is not None else None, at_rate=at_rate,
        long_run=long_run,
    )
