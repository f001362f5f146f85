"""A plan's figures under traffic: the requests a `ServingLoad` describes, split over the plan's
replicas, run through the engine's scheduler (cost/serving_load.py), with the saturation point.

The dp replicas of a plan serve independently and the traffic is spread evenly over them (the
engines' data-parallel front ends and a round-robin load balancer do), so one replica is
simulated at 1/dp of the rate and of the concurrency, and its throughputs are multiplied by dp;
latencies are one replica's. Replicas whose expert group spans them step together: each is
simulated with the others of its group, each under such a share (serving_load.simulate_replica).

Saturation: the highest request rate a replica sustains with a bounded queue is its request
throughput when every request is ready at once (rate inf): beyond it the queue grows without
bound. A rate at or above it is `saturated`; with a concurrency cap the queue is bounded by the
clients, and the plan is saturated when the engine cannot run all of them at once (they wait in
its queue).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import KvAccount
from shardplan.cost.serving_load import (GiveUp, LoadResult, Scheduler, SlaBroken, Traffic, scheduler_for, simulate_replica,
                                        steady_throughput, unit_exponentials)
from shardplan.cost.step_model import StepModel
from shardplan.cost.workload import InferenceWorkload, ServingLoad
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec


@dataclass(frozen=True)
class LoadFigures:
    """One plan under its traffic: one replica's result and the plan's totals."""

    replica: LoadResult
    num_replicas: int
    request_rate_per_replica: float
    concurrency_per_replica: int | None
    saturation_request_rate_per_second: float  # the plan's (all replicas)
    saturated: bool
    request_throughput_per_second: float
    output_tokens_per_second: float
    total_tokens_per_second: float
    output_tokens_per_second_per_gpu: float
    tokens_per_decode_step: float = 1.0


# Sequence-slot refills the saturation run spans (load_figures).
SATURATION_GENERATIONS = 4


def _mean_tokens(wl: InferenceWorkload, load: ServingLoad) -> float:
    """A request's mean prompt and output tokens: what it holds in the cache when it ends."""
    if load.lengths is None:
        return float(wl.input_len + wl.output_len)
    return load.lengths.mean_input_tokens + load.lengths.mean_output_tokens


def requests_for(wl: InferenceWorkload, load: ServingLoad, num: int) -> tuple[tuple[int, int], ...]:
    """(prompt, output) tokens of `num` requests: drawn from the load's lengths, or the workload's."""
    if load.lengths is None:
        return ((wl.input_len, wl.output_len),) * num
    return tuple(load.lengths.sample(num, load.seed))


def load_figures(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, kv: KvAccount | int,
                 *, model: StepModel | None = None, itl: bool = False) -> LoadFigures:
    """The plan of `layout` under `wl.load` (which must be set); with `itl`, its inter-token gaps too."""
    load = wl.load
    if load is None:
        raise ValueError("the workload carries no load")  # a caller's bug
    replicas = max(1, layout.dp)
    num = max(1, math.ceil(load.num_requests / replicas))
    reqs = requests_for(wl, load, num)
    rate = load.request_rate_per_second / replicas  # spread evenly over the replicas (module docstring)
    conc = None if load.max_concurrency is None else max(1, math.ceil(load.max_concurrency / replicas))
    step = model or StepModel(spec, hw, layout, wl, wl.max_num_batched_tokens, wl.max_num_seqs)
    sched = scheduler_for(wl, kv, layout.pp)
    traffic = Traffic(requests=reqs, request_rate_per_second=rate, poisson=load.poisson, max_concurrency=conc,
                      prefix_cache_hit_fraction=load.prefix_cache_hit_fraction, seed=load.seed)
    result = simulate_replica(step, sched, traffic, itl=itl)
    capacity = saturation_rate(step, sched, traffic, sequence_slots(wl, kv, _mean_tokens(wl, load)), result,
                               draw=lambda k: requests_for(wl, load, k))
    saturated = is_saturated(rate, conc, num, result.peak_running, capacity)
    out = result.output_tokens_per_second * replicas
    return LoadFigures(
        replica=result, num_replicas=replicas, request_rate_per_replica=rate, concurrency_per_replica=conc,
        saturation_request_rate_per_second=capacity * replicas, saturated=saturated,
        request_throughput_per_second=result.request_throughput_per_second * replicas,
        output_tokens_per_second=out, total_tokens_per_second=result.total_tokens_per_second * replicas,
        output_tokens_per_second_per_gpu=out / layout.world_size, tokens_per_decode_step=step.tokens_per_decode_step,
    )


def sequence_slots(wl: InferenceWorkload, kv: KvAccount | int, mean_tokens: float) -> int:
    """Requests of `mean_tokens` a replica runs at once: its sequence limit, or what its cache holds."""
    held = kv.sequences_held(mean_tokens) if isinstance(kv, KvAccount) else int(kv // max(1.0, mean_tokens))
    return max(1, min(wl.max_num_seqs, held))


def saturation_rate(step: StepModel, sched: Scheduler, traffic: Traffic, slots: int, result: LoadResult | None = None,
                    draw: Callable[[int], tuple[tuple[int, int], ...]] | None = None) -> float:
    """The highest request rate the replica sustains with a bounded queue (module docstring), for
    `traffic`'s requests: the steady throughput of all of them at once, cycled to refill every one
    of `slots` sequence slots SATURATION_GENERATIONS times. A burst the engine runs in one go
    (every request admitted at once, identical lengths finishing together) has no steady stretch to
    read it from: 50 requests of Llama 3.1 8B on an H100 said 985 req/s, 1,000 said 40, this 30.3.
    `result`: `traffic`'s own run, reused where it is already such a burst. `draw(n)`: n requests
    from the traffic's lengths (a dataset's distribution: a small sample cycled is not it); without
    it, `traffic`'s own requests are cycled (a published run's sample)."""
    n = len(traffic.requests)
    n_capacity = min(STEADY_REQUESTS_MAX, max(n, SATURATION_GENERATIONS * slots))
    if (result is not None and n_capacity <= n and math.isinf(traffic.request_rate_per_second)
            and traffic.max_concurrency is None):
        return result.steady_request_throughput_per_second
    if n_capacity <= n:
        reqs = traffic.requests
    else:
        reqs = draw(n_capacity) if draw is not None else tuple(traffic.requests[i % n] for i in range(n_capacity))
    burst = replace(traffic, requests=reqs, request_rate_per_second=math.inf, max_concurrency=None)
    return steady_throughput(step, sched, burst)


def is_saturated(rate: float, concurrency: int | None, num_requests: int, peak_running: int, capacity: float) -> bool:
    """Whether requests wait in the engine's queue (module docstring): a rate at or above the
    replica's saturation rate `capacity` (inf: every request waits for the engine); with a client
    concurrency cap, also when the engine never ran all the clients' requests at once."""
    known = saturated_whatever_the_capacity(rate, concurrency, num_requests, peak_running)
    return known if known is not None else rate >= capacity


def saturated_whatever_the_capacity(rate: float, concurrency: int | None, num_requests: int,
                                    peak_running: int) -> bool | None:
    """`is_saturated`'s verdict where the saturation rate cannot change it, else None (a caller
    that needs only the verdict then skips the burst `saturation_rate` simulates): every request
    sent at once waits for the engine; with a client concurrency cap, an engine that never ran all
    the clients' requests at once is saturated, and clients that send only as requests finish (no
    rate) are not otherwise."""
    if concurrency is not None:
        if peak_running < min(concurrency, num_requests):
            return True
        return False if not math.isfinite(rate) else None
    return True if math.isinf(rate) else None


@dataclass(frozen=True)
class Sla:
    """Latency limits at a percentile of the requests (None: no limit)."""

    max_ttft_seconds: float | None
    max_tpot_seconds: float | None
    percentile: int = 90

    def give_up(self, num_requests: int) -> GiveUp:
        """When a run of `num_requests` is certainly over the limits: more requests over one of
        them than the percentile leaves out (numpy's linear percentile sits above the
        floor(q (n - 1))-th value, so more than n - 1 - that many over it puts it over)."""
        allowed = num_requests - 1 - math.floor(self.percentile / 100 * (num_requests - 1))
        return GiveUp(allowed, self.max_ttft_seconds, self.max_tpot_seconds)

    def violated(self, r: LoadResult) -> str | None:
        """Which limit the result breaks, or None."""
        if r.num_refused:
            return "requests longer than the KV cache holds"
        key = {50: "p50", 90: "p90", 99: "p99"}[self.percentile]
        if self.max_ttft_seconds is not None and getattr(r.ttft_seconds, key) > self.max_ttft_seconds:
            return f"{key} TTFT over --max-ttft-ms"
        if self.max_tpot_seconds is not None and getattr(r.tpot_seconds, key) > self.max_tpot_seconds:
            return f"{key} TPOT over --max-tpot-ms"
        return None


# Requests one search simulation runs per point: enough for a p90 to settle at every concurrency
# (several times the requests in flight), few enough to cost every replica of a search.
SEARCH_REQUESTS_MIN = 64
SEARCH_REQUESTS_PER_SLOT = 3
SEARCH_REQUESTS_MAX = 600
RATE_BISECTIONS = 5
STEADY_LATENCIES = 4  # arrivals spanning this many latencies of a request alone (best_rate)
STEADY_REQUESTS_MAX = 6000


@dataclass(frozen=True)
class OperatingPoint:
    """The most load one replica carries within the SLA, and its figures there."""

    concurrency: int | None  # requests in flight per replica (closed loop), or None (open loop at `rate`)
    request_rate_per_second: float  # the replica's request throughput there
    result: LoadResult
    num_requests: int = 0  # requests the run simulated (an estimate at this rate with as many reproduces it)


def _traffic(wl: InferenceWorkload, load: ServingLoad, num: int, *, rate: float, conc: int | None,
             first_token_sent: bool = False) -> Traffic:
    return Traffic(requests=requests_for(wl, load, num), request_rate_per_second=rate, poisson=load.poisson,
                   max_concurrency=conc, prefix_cache_hit_fraction=load.prefix_cache_hit_fraction, seed=load.seed,
                   first_token_sent=first_token_sent)


def best_concurrency(step: StepModel, wl: InferenceWorkload, kv: KvAccount | int, sla: Sla,
                     most: int) -> OperatingPoint | None:
    """The largest number of requests in flight per replica (at most `most`) whose figures meet
    the SLA, found by bisection (latency grows with the requests in flight); None when even one
    request at a time breaks it."""
    load = wl.load or ServingLoad()
    sched = scheduler_for(wl, kv, step.pp)

    def run(c: int) -> LoadResult:
        n = min(SEARCH_REQUESTS_MAX, max(SEARCH_REQUESTS_MIN, SEARCH_REQUESTS_PER_SLOT * c))
        return simulate_replica(step, sched, _traffic(wl, load, n, rate=math.inf, conc=c))

    lo, hi, best = 1, max(1, most), None
    first = run(lo)
    if sla.violated(first):
        return None
    best = OperatingPoint(lo, first.request_throughput_per_second, first)
    top = run(hi) if hi > lo else first
    if not sla.violated(top):
        return OperatingPoint(hi, top.request_throughput_per_second, top)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = run(mid)
        if sla.violated(r):
            hi = mid
        else:
            lo, best = mid, OperatingPoint(mid, r.request_throughput_per_second, r)
    return best


@dataclass(frozen=True)
class RateSearch:
    """What `rate_search` found: its operating point (None where no rate met the SLA, or where it
    stopped), whether it stopped before its end (below its floor), and the ceiling it checked
    before each of its runs: the most output tokens per second a run at any rate it could still
    pick reports (`output_rate_ceiling`). A search given a floor stops at the first of these below
    it, and its runs until then are those of a search without one, so a caller can tell from a
    search what one with a higher floor would have done (`first_below`)."""

    point: OperatingPoint | None
    stopped: bool
    ceilings_tokens_per_second: tuple[float, ...]


def first_below(ceilings_tokens_per_second: tuple[float, ...], floor_tokens_per_second: float | None) -> int | None:
    """The check at which a rate search given this floor stops (`RateSearch`), from the ceilings of
    one that went at least as far; None where it goes on (no floor: never stops)."""
    if floor_tokens_per_second is None:
        return None
    for k, ceiling in enumerate(ceilings_tokens_per_second):
        if ceiling < floor_tokens_per_second:
            return k
    return None


# Relative slack on the arrival times' floating-point sums (a run's clock adds each gap to the last).
_SUM_SLACK_FRACTION = 1e-9


def output_rate_ceiling(wl: InferenceWorkload, load: ServingLoad, num_requests: int) -> float:
    """Output tokens per second, per request per second of arrivals, that no run `best_rate` may
    judge a point by reports more of (inf where it is not known: drawn lengths). A run of n requests
    of o output tokens each at rate r that meets its SLA refuses none, so its duration runs at least
    to the last arrival: (n - 1) / r evenly spaced, U(n - 1) / r Poisson (U(m): the sum of the
    seed's first m unit exponentials, `arrival_times`), and it reports at most n o r / that. The runs
    take n from `num_requests` to max(`num_requests`, STEADY_REQUESTS_MAX) requests, so the most
    of n / (n - 1) or n / U(n - 1) over them bounds every run. Requests split over an expert group's
    replicas (`simulate_replica`) draw the first replica's arrivals from this seed: the group's
    duration is no shorter."""
    if load.lengths is not None:
        return math.inf
    first = max(2, num_requests)
    last = max(first, STEADY_REQUESTS_MAX)
    most = first / (first - 1) if not load.poisson else _most_requests_per_unit_draw(load.seed, first, last)
    return wl.output_len * most * (1 + _SUM_SLACK_FRACTION)


@functools.lru_cache(maxsize=64)
def _most_requests_per_unit_draw(seed: int, first: int, last: int) -> float:
    """The most of n / U(n - 1) for n in [first, last] (`output_rate_ceiling`)."""
    draws = unit_exponentials(seed, last - 1)
    most, total = 0.0, math.fsum(draws[:first - 2])
    for n in range(first, last + 1):
        total += draws[n - 2]
        if total > 0:
            most = max(most, n / total)
    return most if most > 0 else math.inf


def best_rate(step: StepModel, wl: InferenceWorkload, kv: KvAccount | int, sla: Sla,
              num_requests: int = SEARCH_REQUESTS_MAX, first_token_sent: bool = False) -> OperatingPoint | None:
    """The highest request rate one replica sustains within the SLA (Poisson or even arrivals as
    the load says), by bisection below its saturation rate; None when none does."""
    return rate_search(step, wl, kv, sla, num_requests, first_token_sent).point


def rate_search(step: StepModel, wl: InferenceWorkload, kv: KvAccount | int, sla: Sla,
                num_requests: int = SEARCH_REQUESTS_MAX, first_token_sent: bool = False,
                floor_tokens_per_second: float | None = None) -> RateSearch:
    """`best_rate`, with the ceilings it checked on the way (`RateSearch`). With
    `floor_tokens_per_second`, it stops as soon as every rate its bisection may still pick (it picks
    below its upper end) gives less output than that: a search that shows only points above a floor
    need not resolve one below it."""
    load = wl.load or ServingLoad()
    sched = scheduler_for(wl, kv, step.pp)
    per_rate = output_rate_ceiling(wl, load, num_requests)
    ceilings: list[float] = []

    def below_floor(upper_rate: float) -> bool:
        """Checked before each run: whether no rate up to `upper_rate` gives the floor's output."""
        ceilings.append(upper_rate * per_rate)
        return floor_tokens_per_second is not None and ceilings[-1] < floor_tokens_per_second

    def found(point: OperatingPoint | None, stopped: bool = False) -> RateSearch:
        return RateSearch(point, stopped, tuple(ceilings))

    burst = _traffic(wl, load, num_requests, rate=math.inf, conc=None)
    by_tokens = token_rate_bound(step, load, burst.requests)
    if below_floor(by_tokens):
        return found(None, stopped=True)
    cap = steady_throughput(step, sched, burst)
    if cap <= 0:
        return found(None)
    mean_in = wl.input_len if load.lengths is None else load.lengths.mean_input_tokens
    mean_out = wl.output_len if load.lengths is None else load.lengths.mean_output_tokens
    # A burst the engine runs in one go (every request admitted at once, finishing together) has no
    # steady stretch, and its "steady" rate can be many times what the replica sustains (DeepSeek-V3
    # on 16 H200s: 129 req/s from 600 requests, where the SLA held at 4 and broke at 8): the bisection
    # then resolves the rate to a fraction of it. No load runs faster than its tokens allow.
    lo, hi, best = 0.0, min(cap, by_tokens), None
    # Enough requests for the run to reach its steady state at each rate: Little's law puts
    # rate x latency requests in flight there, so the arrivals must span several latencies (at
    # least the latency of a request alone), or a short run never fills and looks faster.
    ttft, tpot = latency_floor(step, wl, mean_in)
    alone = ttft + max(0.0, mean_out - 1) * tpot
    slots = sequence_slots(wl, kv, _mean_tokens(wl, load))
    for _ in range(RATE_BISECTIONS):
        if below_floor(hi):
            return found(None, stopped=True)
        mid = (lo + hi) / 2
        n = max(num_requests, min(STEADY_REQUESTS_MAX, math.ceil(STEADY_LATENCIES * mid * alone)))
        try:
            r = simulate_replica(step, sched, _traffic(wl, load, n, rate=mid, conc=None,
                                                       first_token_sent=first_token_sent), sla.give_up(n))
            # Under load a request takes longer than alone: if the arrivals did not span several of
            # the latencies the run measured (after filling the sequence slots, where it filled them),
            # the run ended before the queue formed; run it again long enough, until a run does.
            needed = steady_requests(mid, r, slots)
            while needed > n:
                n = needed
                r = simulate_replica(step, sched, _traffic(wl, load, n, rate=mid, conc=None,
                                                           first_token_sent=first_token_sent), sla.give_up(n))
                needed = steady_requests(mid, r, slots)
        except SlaBroken:
            hi = mid
            continue
        if sla.violated(r):
            hi = mid
        else:
            lo, best = mid, OperatingPoint(None, mid, r, n)
    return found(best)


def most_within_sla(step: StepModel, wl: InferenceWorkload, kv: KvAccount, sla: Sla,
                    first_token_sent: bool = False) -> tuple[OperatingPoint | None, int]:
    """(`best_rate` of one replica, the requests it starts from, `search_requests`). What the
    goodput search (`rate_search` itself there), the pools of a disaggregated plan and the
    comparison with them judge a replica by."""
    n = search_requests(wl, kv)
    return best_rate(step, wl, kv, sla, n, first_token_sent=first_token_sent), n


def search_requests(wl: InferenceWorkload, kv: KvAccount) -> int:
    """The requests a replica's rate search starts from: four times the requests of the mean
    length its sequence slots hold, within SEARCH_REQUESTS_MIN..MAX, so that a p90 settles however
    many run at once."""
    slots = sequence_slots(wl, kv, _mean_tokens(wl, wl.load or ServingLoad()))
    return min(SEARCH_REQUESTS_MAX, max(SEARCH_REQUESTS_MIN, 4 * slots))


def over_a_long_run(step: StepModel, wl: InferenceWorkload, kv: KvAccount | int, rate_per_replica: float) -> LoadResult:
    """One replica at `rate_per_replica` over STEADY_REQUESTS_MAX requests of the load's lengths,
    arrivals and seed. Near what a replica keeps up with its running requests approach their steady
    count slowly, so a run as long as the rate search's can meet an SLA that this one does not
    (Llama 3.1 8B on one H100 at 31.3 req/s: p90 TPOT 43 ms over 638 requests, 69 ms over 6,000;
    BENCHMARKS.md)."""
    load = wl.load or ServingLoad()
    traffic = _traffic(wl, load, STEADY_REQUESTS_MAX, rate=rate_per_replica, conc=None)
    return simulate_replica(step, scheduler_for(wl, kv, step.pp), traffic)


# Where a rate breaks the SLA over a long run, the rate that holds over as long a run is looked for below
# it in steps of this fraction of it, then resolved between the last step that broke and the first that
# held by LONG_RUN_BISECTIONS halvings (to a quarter of a step, finer than the rate search resolves a
# rate); below LONG_RUN_LOWEST of it, none is named.
LONG_RUN_STEP = 0.05
LONG_RUN_BISECTIONS = 2
LONG_RUN_LOWEST = 0.5


def held_over_a_long_run(step: StepModel, wl: InferenceWorkload, kv: KvAccount | int, sla: Sla,
                         rate_per_replica: float) -> tuple[float, LoadResult] | None:
    """The highest rate per replica whose run of STEADY_REQUESTS_MAX requests meets `sla`, below
    `rate_per_replica`, whose own long run breaks it, and that run; None if none does above
    LONG_RUN_LOWEST of it.
    A rate judged over a finite run is the highest at which that one sample of arrivals met the
    SLA, and near what a plan keeps up with a p90 over a few hundred requests scatters widely from
    sample to sample (Llama 3.1 70B, tp 4 pp 2 on 8 H100s at 17.84 req/s: p90 TPOT 44-64 ms over
    eight seeds' 600 requests, 58 ms over 24,000; BENCHMARKS.md), so the search's rate sits above
    what a long run holds; this is the rate to plan for. Runs that break the SLA stop as soon as
    they certainly do (`Sla.give_up`)."""
    load = wl.load or ServingLoad()
    sched = scheduler_for(wl, kv, step.pp)

    def held(rate: float) -> LoadResult | None:
        """The run at `rate`, if it meets the SLA."""
        traffic = _traffic(wl, load, STEADY_REQUESTS_MAX, rate=rate, conc=None)
        try:
            r = simulate_replica(step, sched, traffic, sla.give_up(STEADY_REQUESTS_MAX))
        except SlaBroken:
            return None
        return r if sla.violated(r) is None else None

    hi, k = rate_per_replica, 1
    while True:  # down in steps until one holds
        lo = rate_per_replica * (1 - k * LONG_RUN_STEP)
        if lo < LONG_RUN_LOWEST * rate_per_replica - 1e-12:
            return None
        run = held(lo)
        if run is not None:
            break
        hi, k = lo, k + 1
    for _ in range(LONG_RUN_BISECTIONS):
        mid = (lo + hi) / 2
        r = held(mid)
        if r is not None:
            lo, run = mid, r
        else:
            hi = mid
    return lo, run


def long_run_and_held(step: StepModel, wl: InferenceWorkload, kv: KvAccount | int, sla: Sla,
                      rate_per_replica: float) -> tuple[LoadResult, tuple[float, LoadResult] | None]:
    """`over_a_long_run` at `rate_per_replica` and, where that run breaks `sla`,
    `held_over_a_long_run` below it (None where it meets the SLA, or no rate holds)."""
    r = over_a_long_run(step, wl, kv, rate_per_replica)
    return r, (held_over_a_long_run(step, wl, kv, sla, rate_per_replica) if sla.violated(r) else None)


def steady_requests(rate: float, r: LoadResult, slots: int) -> int:
    """Requests a run at `rate` needs to show its steady state: arrivals spanning STEADY_LATENCIES
    of the run's median latency, and, where the run filled every sequence slot (the KV cache or
    max_num_seqs binds), after the `slots` arrivals that fill them: until then every arrival is
    admitted at once, and a queue forms only once they are full. Without that a rate a little above
    what the replica keeps up with met the SLA over the run (Llama 3.1 8B, 4,000/1,000 tokens, tp 2,
    206 slots: 5.81 req/s held a p90 TTFT of 0.77 s over 701 requests, 9.8 s over 930, BENCHMARKS.md)."""
    fill = slots if r.peak_running >= slots else 0
    return min(STEADY_REQUESTS_MAX, fill + math.ceil(STEADY_LATENCIES * rate * r.e2e_seconds.p50))


# Drawn lengths: the bound is read off one sample's mean tokens a request, and the runs draw samples of
# other sizes, whose means differ (ShareGPT's vLLM sampling: within 1% from 1,000 requests up): this slack.
DRAWN_LENGTHS_SLACK = 0.05


def token_rate_bound(step: StepModel, load: ServingLoad, requests: tuple[tuple[int, int], ...]) -> float:
    """Requests per second one replica cannot exceed under any load of these requests: every prompt
    token not found in the prefix cache passes through the layers in some step, and every output
    token but the first, which the prompt's last step samples (speculative decoding verifies at
    least one position a token it yields), and no step takes less than
    `StepModel.least_seconds_per_token` per token it carries. With drawn lengths, less a slack for
    the other samples' means (DRAWN_LENGTHS_SLACK)."""
    if not requests:
        return math.inf
    hit = load.prefix_cache_hit_fraction
    tokens = sum(p * (1 - hit) + max(0, o - 1) for p, o in requests) / len(requests)
    if load.lengths is not None:
        tokens *= 1 - DRAWN_LENGTHS_SLACK
    least = step.least_seconds_per_token()
    return 1.0 / (least * max(1.0, tokens)) if least > 0 else math.inf


def latency_floor(step: StepModel, wl: InferenceWorkload, mean_input_tokens: float) -> tuple[float, float]:
    """(TTFT, TPOT) of a request of the mean prompt length alone on the replica (the others of its
    expert group, if any, idle): no load can do better, and a percentile of many requests is no
    lower, so a replica whose floor breaks the SLA is rejected without simulating it."""
    budget = max(1, wl.max_num_batched_tokens)
    left, done, ttft = mean_input_tokens, 0.0, 0.0
    while left > 0:  # the prompt in chunks of the token budget, each after the ones before it
        c = min(left, budget) if wl.chunked_prefill else left
        ttft += step.alone_seconds(tokens=math.ceil(c), sampled=1 if c == left else 0, decoding=0, kv_tokens=0,
                                   prompt_units=c * (done + (c + 1) / 2), prompt_step=True)
        left -= c
        done += c
    tpot = step.alone_seconds(tokens=1, sampled=1, decoding=1, kv_tokens=mean_input_tokens, prompt_units=0,
                              prompt_step=False)
    return ttft, tpot
