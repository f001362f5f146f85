"""Serving under load: a discrete-event model of an engine's continuous-batching scheduler.

Requests arrive (a rate, Poisson or evenly spaced, or all at once; at most `max_concurrency`
in flight, as benchmark clients cap them), wait, are admitted by the engine's rules, have their
prompts computed (whole or in chunks of the token budget) and then decode one token a step
until their output is done. The scheduler is the engine version's (knowledge/engines/*.yaml
`schedule`, as Vidur, Agrawal et al. 2024, and Sarathi-Serve, Agrawal et al. 2024, describe
them):

  mixed          every step: one token for each decoding request, then prompt chunks of the
                 running and then the waiting requests until max_num_batched_tokens is used
                 (vLLM V1, V0 with chunked prefill, TensorRT-LLM in-flight batching, llama.cpp).
                 When the KV cache cannot hold a step's tokens, the latest admitted request is
                 preempted: its cache is freed and it is recomputed later (vLLM's recompute).
  prefill_first  a step of prompt tokens alone whenever a waiting request can be admitted, a
                 decode step of every running request otherwise (SGLang, TGI, any engine
                 without chunked prefill).
  static         one batch is admitted, prefilled and decoded to its end before the next
                 (transformers' generate).

Admission: while fewer than max_num_seqs run and the cache holds the prompt's next chunk; with
an admission reserve (SGLang's new_token_ratio, TensorRT-LLM's GUARANTEED_NO_EVICT), only if the
cache also holds ratio x the outputs still to come of it and of every running request.

What a step's batch can hold: the requests the scheduler had when it formed the batch. A busy
engine does not wait for a request in transit, so one sent while a step runs (a capped client's
next request, sent when the last one's final token arrives, at a step's end) misses the batch
formed as that step began. The engine forms a batch when the step before it ends, or, with
`batches_in_flight` 2, when the step before it starts (the next batch is formed and launched while
the GPU runs the current one: SGLang's overlap scheduler, vLLM's async scheduling), so a request
sent during a step waits for that step and the one already formed. An idle engine wakes for the
first request it gets.

A step's time is `StepModel.seconds` of its composition (cost/step_model.py). The client's clock
starts when a request is sent: TTFT ends with the step that samples its first token; TPOT is
(end-to-end - TTFT) / (output - 1), as vLLM's and SGLang's benchmark clients report it.
Prefix-cache hits skip that share of each prompt's first computation (its KV still occupies the
cache). The state is aggregated (counts and sums of the decoding requests, a heap of the
steps at which they finish), so a step costs O(requests admitted or finished in it).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import random
from collections import deque
from dataclasses import dataclass, replace

from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import KvAccount, serving_memory
from shardplan.cost.step_model import IDLE_STEP, StepModel
from shardplan.cost.workload import InferenceWorkload
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec


SCHEDULES = {
    "mixed": "mixed steps: each decoding request's token first, then prompt chunks up to max_num_batched_tokens",
    "prefill_first": "prefill first: a step of prompt tokens whenever a waiting request can be admitted, decode "
                     "steps otherwise",
    "static": "static batches: one batch is prefilled and decoded to its end before the next is admitted",
    "unchunked": "whole prompts first (no chunked prefill): decode steps only when no prompt is scheduled",
}


@dataclass(frozen=True)
class Traffic:
    """What the clients send. `requests`: (prompt tokens, output tokens) per request, in order."""

    requests: tuple[tuple[int, int], ...]
    request_rate_per_second: float = math.inf  # inf: every request is ready at time 0
    poisson: bool = True  # exponential gaps (vLLM's bench --burstiness 1); False: evenly spaced
    max_concurrency: int | None = None  # requests in flight at most (bench --max-concurrency); None: no cap
    prefix_cache_hit_fraction: float = 0.0  # share of each prompt found in the prefix cache
    seed: int = 0
    # A disaggregated decode pool: each request arrives with its first token already sent (by the
    # prefill pool), so the wait for a decode slot counts in its TPOT, as the client sees it.
    first_token_sent: bool = False


@dataclass(frozen=True)
class Scheduler:
    """The engine's limits and rules for one replica (InferenceWorkload fields, the KV capacity)."""

    schedule: str  # "mixed", "prefill_first" or "static"
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    kv_capacity_tokens: int
    admission: tuple[float, float, int, int] | None = None  # (initial ratio, floor factor, decay steps, output clip)
    admit_after_preemption: bool = True  # False: a step that preempted admits no waiting request (vLLM V1)
    # A request holding t tokens takes t + window_charge x min(t, window_tokens) of the capacity
    # (memory_serving.KvAccount: vLLM's sliding-window groups beside its full-attention ones).
    window_tokens: int = 0
    window_charge: float = 0.0
    # When a step's batch is formed: 1, when the step before it ends; 2, when the step before it starts
    # (the batch is formed while that step runs: SGLang's overlap scheduler, vLLM's async scheduling).
    batches_in_flight: int = 1


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class LoadResult:
    num_requests: int
    duration_seconds: float
    request_throughput_per_second: float
    output_tokens_per_second: float
    total_tokens_per_second: float
    ttft_seconds: Percentiles
    tpot_seconds: Percentiles
    e2e_seconds: Percentiles
    num_steps: int
    num_preemptions: int
    num_refused: int  # requests the engine could never hold
    peak_running: int  # requests admitted at once, at most
    # Requests completed per second between the first and the third quartile of completions: the
    # rate the replica keeps up once running, without the ramp at the start and the drain at the end
    steady_request_throughput_per_second: float
    mean_decode_batch: float  # decoding requests per step that had any
    # The gaps between a request's successive tokens over all requests, as the clients' ITL (inter-token
    # latency) figures are; None unless the simulation was asked for them (`simulate(itl=True)`).
    itl_seconds: Percentiles | None = None


def percentile(sorted_values: list[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted values, as the benchmark clients compute it."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def weighted_percentile(pairs: list[tuple[float, int]], q: float) -> float:
    """`percentile` of the values each repeated by its count, without expanding them: (value,
    count) pairs, any order."""
    if not pairs:
        return math.nan
    ordered = sorted(pairs)
    total = sum(c for _, c in ordered)
    pos = (total - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, total - 1)
    lo_v = hi_v = math.nan
    seen = 0
    for v, c in ordered:
        if seen <= lo < seen + c:
            lo_v = v
        if seen <= hi < seen + c:
            hi_v = v
            break
        seen += c
    return lo_v + (hi_v - lo_v) * (pos - lo)


def _weighted_summary(pairs: list[tuple[float, int]]) -> Percentiles:
    total = sum(c for _, c in pairs)
    if not total:
        return Percentiles(math.nan, math.nan, math.nan, math.nan)
    return Percentiles(sum(v * c for v, c in pairs) / total, weighted_percentile(pairs, 50),
                       weighted_percentile(pairs, 90), weighted_percentile(pairs, 99))


def _summary(values: list[float]) -> Percentiles:
    v = sorted(values)
    if not v:
        return Percentiles(math.nan, math.nan, math.nan, math.nan)
    return Percentiles(sum(v) / len(v), percentile(v, 50), percentile(v, 90), percentile(v, 99))


def arrival_times(traffic: Traffic) -> list[float]:
    n = len(traffic.requests)
    rate = traffic.request_rate_per_second
    if math.isinf(rate):
        return [0.0] * n
    if n == 0:
        return []
    # Each time is the one before plus a gap, summed in order from 0.0 (accumulate adds as `t += gap` does).
    if traffic.poisson:
        # Each gap is expovariate(rate) = -log(1 - u) / rate of the seeded stream's u: the unit
        # draws -log(1 - u) are the same at every rate, so they are drawn once per seed (a search
        # simulates each replica at several rates) and divided by this rate, the same division
        # expovariate does, so the gaps are bit for bit the same. The last draw's gap would follow
        # the last request.
        gaps = map(operator.truediv, unit_exponentials(traffic.seed, n - 1), itertools.repeat(rate))
    else:
        gaps = itertools.repeat(1.0 / rate, n - 1)
    return list(itertools.accumulate(gaps, initial=0.0))


_UNIT_DRAWS: dict[int, tuple[random.Random, list[float]]] = {}  # seed -> (its generator, the draws so far)


def unit_exponentials(seed: int, n: int) -> list[float]:
    """The first `n` of `random.Random(seed)`'s expovariate(1.0) draws (-log(1 - u) / 1.0, which is
    -log(1 - u) exactly). A cache of a pure function: the stream of a seed never changes."""
    rng, draws = _UNIT_DRAWS.get(seed) or _UNIT_DRAWS.setdefault(seed, (random.Random(seed), []))
    while len(draws) < n:
        draws.append(rng.expovariate(1.0))
    return draws[:n]


class _Request:
    __slots__ = ("i", "prompt", "output", "sent", "computed", "target", "generated", "first_token", "decode_from",
                 "generated_at_decode", "done", "epoch", "inside", "last_token")

    def __init__(self, i: int, prompt: int, output: int, sent: float) -> None:
        self.i, self.prompt, self.output, self.sent = i, prompt, output, sent
        self.computed = 0  # tokens whose K/V are in the cache (prefix hits included)
        self.target = prompt  # tokens to compute before the next token is sampled
        self.generated = 0
        self.first_token = math.nan
        self.decode_from = 0  # the decode-step count when it started decoding
        self.generated_at_decode = 0
        self.done = math.nan
        self.epoch = 0  # bumped by each preemption: heap entries of an older epoch are stale
        self.inside = False  # decoding with fewer tokens than the sliding window holds (its window groups grow)
        self.last_token = math.nan  # when the client last got a token from it (kept for the gaps when it was preempted)


class SlaBroken(Exception):
    """Raised by `simulate` with `give_up`: more requests broke a limit than the percentile allows."""


class _SteadyKnown(Exception):
    """Raised by `_run` asked for the steady throughput alone, as soon as it is known (`steady_throughput`)."""

    def __init__(self, value: float) -> None:
        super().__init__(value)
        self.value = value


@dataclass(frozen=True)
class GiveUp:
    """Stop a simulation as soon as its percentile cannot meet a limit: more than `allowed`
    requests with a TTFT over `ttft_seconds` or a TPOT over `tpot_seconds` (None: no limit)."""

    allowed: int
    ttft_seconds: float | None
    tpot_seconds: float | None


def simulate(model: StepModel, sched: Scheduler, traffic: Traffic, give_up: GiveUp | None = None,
             itl: bool = False) -> LoadResult:
    """Run every request of `traffic` through the scheduler; figures as the benchmark clients give
    them. With `give_up`, SlaBroken as soon as the SLA's percentile is certainly broken (a search
    needs the verdict only, and a load past what the replica sustains would queue for long). With
    `itl`, the inter-token gaps too: each decode step gives each of its decoding requests a gap
    from the end of the last step that gave decode tokens (a prompt-only step between them, as
    SGLang runs them, lengthens it) to its own end, or from its last token if it has just begun
    decoding again; a preempted request's recompute ends with a token whose gap holds its wait, as
    the client sees it. A replica whose expert group spans other replicas steps with them:
    `simulate_group`."""
    run = _run(model, sched, traffic, give_up, itl, lockstep=False)
    try:
        next(run)
    except StopIteration as done:
        return _result([done.value])
    raise AssertionError("a replica stepping alone asks for no step times")


def steady_throughput(model: StepModel, sched: Scheduler, traffic: Traffic) -> float:
    """`simulate_replica(model, sched, traffic).steady_request_throughput_per_second`, the same
    float, with the run stopped as soon as that figure is known: it reads only the times at which
    the first and third quarters of the requests had finished (`_result`), and requests finish in
    time order, so where no request can be refused (their count is then known from the start) the
    run stops at the finish that ends the third quarter, unless the two times are equal (the figure
    is then read off the whole run). A burst's last quarter, its drain included, is not simulated.
    A replica stepping in an expert group runs whole (`simulate_group`)."""
    if model.group > 1:
        return simulate_replica(model, sched, traffic).steady_request_throughput_per_second
    run = _run(model, sched, traffic, None, False, lockstep=False, steady=True)
    try:
        next(run)
    except StopIteration as done:
        return _result([done.value]).steady_request_throughput_per_second
    except _SteadyKnown as known:
        return known.value
    raise AssertionError("a replica stepping alone asks for no step times")


def _run(model: StepModel, sched: Scheduler, traffic: Traffic, give_up: GiveUp | None, itl: bool, lockstep: bool,
         steady: bool = False):
    """`simulate`'s scheduler loop as a generator. Alone (`lockstep` False) it computes its own step
    times and yields nothing: it returns its `_Outcome` at once. In a group (`simulate_group`) it
    yields each step's composition, ("step", tokens, sampled, decoding, kv_tokens, prompt_units,
    prompt_step), and is sent the group's step time; with nothing to run it yields ("idle", the next
    request's arrival) and is sent the group's clock. With `steady`, it may instead raise
    _SteadyKnown with the run's steady throughput as soon as that is known (`steady_throughput`)."""
    n = len(traffic.requests)
    broken = 0
    per_step = model.tokens_per_decode_step
    one_per_step = per_step == 1.0
    heappush, heappop = heapq.heappush, heapq.heappop
    arrivals = arrival_times(traffic)
    cap = traffic.max_concurrency or n
    hit = traffic.prefix_cache_hit_fraction
    budget = sched.max_num_batched_tokens
    capacity = sched.kv_capacity_tokens
    reqs: list[_Request] = []
    next_send = 0  # the next request the clients have not sent
    in_flight = 0
    waiting: deque[_Request] = deque()
    running: dict[int, _Request] = {}  # admission order (preemption takes the last)
    prefilling: list[_Request] = []  # admitted, prompt (or recompute) not yet done, in admission order
    prefill_held = 0  # the cached tokens of the requests in `prefilling` (the sum of their `computed`)
    finish_heap: list[tuple[int, int, int]] = []  # (decode step it ends at, epoch, id)
    decoding = 0
    used = 0  # KV tokens held by running requests
    remaining_out = 0.0  # sum of (clipped) outputs still to come of running requests (admission reserve)
    decode_steps = 0  # steps that gave every decoding request a token
    now = 0.0
    steps = preemptions = peak = 0
    decode_batch_sum = 0
    ratio = floor = decay = initial = 0.0
    clip = 0
    if sched.admission is not None:
        ratio, factor, decay_steps, clip = sched.admission
        floor = ratio * factor
        decay = (ratio - floor) / decay_steps
        initial = ratio
    finished = refused = 0
    # The sliding-window groups' share (Scheduler.window_*): `slide` is the sum over running requests of
    # window_charge x min(held, window); `inside` counts the decoding requests still short of the
    # window, whose share grows with each token; `cross_heap` holds the decode step at which each
    # reaches it (then the growth of its last step past the window is taken back).
    charge, window = sched.window_charge, sched.window_tokens
    windowed = charge > 0
    if windowed and sched.admission is not None:
        raise ValueError("a sliding-window cache with an admission reserve is not modelled")
    slide = 0.0
    inside = 0
    step_held = 0.0  # what this step has allocated so far (decode slots, prompt chunks): admissions see the rest
    cross_heap: list[tuple[int, int, int]] = []

    # When a full client last got a slot back: a request that arrived while every slot was taken is
    # sent then; one that arrived with a slot free was sent as it arrived.
    last_free = 0.0
    gaps: list[tuple[float, int]] | None = [] if itl else None  # (inter-token gap, requests that had it)
    joined: dict[int, float] = {}  # requests that (re)started decoding since the last decode step: the time they did
    last_decode_end = 0.0

    def record_gaps(decoders: int, since: float) -> float:
        """A decode step ending now gives each of its `decoders` a token: the ones that joined since
        the last decode step a gap from their first token, the others from that step's end."""
        assert gaps is not None
        for t in joined.values():
            gaps.append((now - t, 1))
        if decoders > len(joined):
            gaps.append((now - since, decoders - len(joined)))
        joined.clear()
        return now
    # What the inner loop reads, read once.
    requests, first_token_sent = traffic.requests, traffic.first_token_sent
    ttft_limit = give_up.ttft_seconds if give_up is not None else None
    tpot_limit = give_up.tpot_seconds if give_up is not None else None
    seconds = model.seconds
    # `seconds` without its call where the step's composition was seen before (one token a decode step):
    # the same terms summed in the same order.
    fixed_of = model.fixed_by_composition if model.width == 1 else {}
    graph_max, graphs_prompt = model.graph_max, model.graphs_for_prompt_steps
    a_kv, a_seq, a_prompt = model.kv_seconds_per_token, model.seconds_per_decoding_seq, model.prompt_seconds_per_unit
    quiet_terms: dict[int, tuple[float, float, float]] = {}  # decoding requests -> model.decode_terms
    mixed, static = sched.schedule == "mixed", sched.schedule == "static"
    admit_after_preemption = sched.admit_after_preemption
    max_seqs, chunked, reserve = sched.max_num_seqs, sched.chunked_prefill, sched.admission is not None
    first_tokens = late = 0  # requests with a first token; requests sent more than the TTFT limit ago

    def send_ready() -> None:
        nonlocal next_send, in_flight, first_tokens
        while next_send < n and in_flight < cap and arrivals[next_send] <= now:
            p, o = requests[next_send]
            r = _Request(next_send, p, max(1, o), max(arrivals[next_send], last_free))
            if first_token_sent and r.output > 1:
                r.generated, r.first_token = 1, r.sent
                r.last_token = r.sent
                first_tokens += 1
            reqs.append(r)
            waiting.append(r)
            next_send += 1
            in_flight += 1

    def out_left(r: _Request) -> float:
        return max(0, min(r.output, clip) - r.generated)

    def preempt_last() -> bool:
        """Free the latest admitted request's cache; it waits at the head of the queue to be recomputed."""
        nonlocal decoding, remaining_out, preemptions, prefill_held
        if not running:
            return False
        _, r = running.popitem()
        if r in prefilling:
            prefilling.remove(r)
            prefill_held -= r.computed
            release(r, r.computed)
        else:
            grown = per_step * (decode_steps - r.decode_from)  # KV tokens its decode steps added
            release(r, r.prompt + r.generated_at_decode - 1 + grown)
            r.generated = min(r.output - 1, r.generated_at_decode + int(grown))
            decoding -= 1
            if gaps is not None:
                # its last token came at its first decode run's start, or at the last decode step's end
                r.last_token = joined.pop(r.i) if r.i in joined else last_decode_end
        remaining_out -= out_left(r)
        r.epoch += 1
        r.computed = 0
        r.target = r.prompt + max(0, r.generated - 1)  # the prompt and the tokens generated so far
        waiting.appendleft(r)
        preemptions += 1
        return True

    def release(r: _Request, held: float) -> None:
        """Give back what `r` holds: its `held` tokens and their share in the sliding-window groups."""
        nonlocal used, slide, inside
        used -= held
        if windowed:
            slide -= charge * min(held, window)
            if r.inside:
                r.inside = False
                inside -= 1

    def sampled_done(r: _Request, t: float) -> None:
        """The step ending at `t` computed the last of `r`'s target: it samples a token."""
        nonlocal decoding, inside, first_tokens
        r.generated += 1
        if r.generated == 1:
            r.first_token = t
            first_tokens += 1
            if ttft_limit is not None and t - r.sent > ttft_limit:
                count_broken()
        r.decode_from, r.generated_at_decode = decode_steps, r.generated
        if r.generated >= r.output:
            finish(r, t)
            return
        decoding += 1
        if gaps is not None:
            if r.generated > 1:  # recomputed after a preemption, or its first token came from a prefill pool
                gaps.append((t - r.last_token, 1))
            joined[r.i] = t
        # Each decode step yields per_step tokens (1, or E with speculative decoding; at 1 the ceiling is the
        # integer itself).
        left = r.output - r.generated if one_per_step else math.ceil((r.output - r.generated) / per_step - 1e-9)
        heappush(finish_heap, (decode_steps + left, r.epoch, r.i))
        if windowed and r.prompt + r.generated - 1 < window:
            r.inside = True
            inside += 1
            short = window - (r.prompt + r.generated - 1)
            heappush(cross_heap, (decode_steps + math.ceil(short / per_step - 1e-9), r.epoch, r.i))

    def count_broken() -> None:
        nonlocal broken
        broken += 1
        if give_up is not None and broken > give_up.allowed:
            raise SlaBroken

    # `steady`: the finishes that end the first and the third quarters of the requests (1-based; 0:
    # not watched, as where a request may be refused) and the time of the first (`steady_throughput`).
    q1_done = q3_done = 0
    q1_time = math.nan

    def finish(r: _Request, t: float) -> None:
        nonlocal finished, in_flight, last_free, q1_time
        r.done = t
        if tpot_limit is not None and r.output > 1 and (t - r.first_token) / (r.output - 1) > tpot_limit:
            count_broken()
        r.generated = r.output
        running.pop(r.i, None)
        # What it holds: its prompt, the tokens up to its first decode step, and what its decode steps
        # added (its reserve was drawn down by the same steps).
        release(r, r.prompt + r.generated_at_decode - 1 + per_step * (decode_steps - r.decode_from))
        finished += 1
        if in_flight == cap:
            last_free = t
        in_flight -= 1
        if finished == q1_done:
            q1_time = t
        elif finished == q3_done and t > q1_time:
            # Every request finishes (none is refused) at or after this one: `_result`'s quartile ends
            # are q1_time and t, and its steady throughput this quotient.
            raise _SteadyKnown((q3_done - q1_done) / (t - q1_time))

    def refuse(r: _Request) -> None:
        """A request the engine can never hold (prompt past the cache or the unchunked budget)."""
        nonlocal finished, in_flight, refused, last_free
        finished += 1
        refused += 1
        if in_flight == cap:
            last_free = now
        in_flight -= 1

    def admit_waiting(left: int, chunks: list[tuple[_Request, int]], formed: float, woke: bool) -> None:
        """Admit waiting requests in order while the budget, the sequence limit and the cache allow,
        each with its first prompt chunk (prefix hits already held). The cache, less what this step
        already allocated (`step_held`), must hold the chunk, its prefix hits and its sliding-window
        share; with an admission reserve, the rest of its prompt and ratio x the outputs still to
        come of it and of every running request."""
        nonlocal used, remaining_out, slide, step_held, prefill_held
        while waiting and left > 0 and len(running) < max_seqs:
            r = waiting[0]
            # Sent after the batch was formed (new requests wait in the order sent, behind the preempted
            # ones, which the scheduler already holds): at that instant only if the engine woke for it.
            if r.epoch == 0 and (r.sent > formed or (r.sent == formed and not woke)):
                break
            # What its first chunk adds to the cache besides the chunk: its prefix-cache hits (none on a recompute).
            start = int(hit * r.prompt) if r.epoch == 0 and r.computed == 0 else 0
            need = r.target - r.computed - start
            c = min(need, left) if chunked else need
            if c > left:
                break
            if reserve:
                out = out_left(r)
                if used + step_held + r.target - r.computed + ratio * (remaining_out + out) > capacity:
                    break
                remaining_out += out
            elif windowed:  # a waiting request holds nothing yet
                if used + slide + step_held + c + start + charge * min(c + start, window) > capacity:
                    break
                slide += charge * min(start, window)
            elif used + step_held + c + start > capacity:
                break
            waiting.popleft()
            running[r.i] = r
            r.computed += start
            used += start
            prefilling.append(r)
            prefill_held += r.computed
            chunks.append((r, c))
            left -= c
            step_held += c + (charge * (min(start + c, window) - min(start, window)) if windowed else 0.0)

    ahead = sched.batches_in_flight > 1
    last_start = 0.0  # when the last step began
    last_woke = False  # whether the engine was idle as it began (it formed that step's batch, and with
    # batches_in_flight 2 the next one, from every request sent by then)
    # Speculative steps add the drafts' passes, and a group's steps are the group's: stepped one by one.
    quiet_ok = model.width == 1 and not lockstep
    # An earlier verdict on the TTFT limit: a request sent more than the limit ago that has no first
    # token yet will break it when it gets one. Requests are sent in order, each no earlier than the
    # one before, so those sent that long ago are the first `late` sent, and at least late - (first
    # tokens so far) of them are still to break it. Counted only where every request is certain to
    # get its first token: none can be refused, as without an admission reserve, with whole tokens a
    # decode step, a cache that holds any request alone and a budget that holds its prompt (or chunks).
    # p + max(1, o) at its largest, summed at C speed where every output is at least one token (then p + o).
    if requests and min(map(operator.itemgetter(1), requests)) >= 1:
        longest = max(map(sum, requests))
    else:
        longest = max((p + max(1, o) for p, o in requests), default=0)
    longest_charge = longest + (charge * min(longest, window) if windowed else 0.0)
    certain = not reserve and per_step == 1.0 and longest_charge <= capacity and (chunked or longest <= budget)
    early = ttft_limit is not None and give_up is not None and certain
    if steady and certain and (3 * n) // 4 > n // 4:
        q1_done, q3_done = n // 4 + 1, (3 * n) // 4 + 1
    allowed = give_up.allowed if give_up is not None else n
    send_ready()
    while finished < n:
        if early:
            while late < next_send and now - reqs[late].sent > ttft_limit:
                late += 1
            if broken + late - first_tokens > allowed:
                raise SlaBroken
        if not running and not waiting:
            if next_send >= n:
                break
            if lockstep:  # the group's clock: its next step's end, or this arrival when every rank is idle
                now = yield ("idle", arrivals[next_send] if in_flight < cap else math.inf)
            else:
                now = max(now, arrivals[next_send])
            send_ready()
            continue
        if decoding and not prefilling and quiet_ok and (
                not waiting or len(running) >= max_seqs or static or (mixed and budget - decoding <= 0)):
            # A quiet stretch: only decode steps until the next arrival, the next finish or a full
            # cache, while no waiting request can be admitted (none waits, every sequence slot is
            # taken, a static batch runs, or decodes fill the token budget; none of these changes
            # before a finish). Each step is the one the loop below would take (same sums, same
            # order), without its per-step scheduling.
            stop = finish_heap[0][0] if finish_heap else decode_steps + 1
            nxt = arrivals[next_send] if next_send < n and in_flight < cap else math.inf
            terms = quiet_terms.get(decoding)
            if terms is None:
                terms = quiet_terms[decoding] = model.decode_terms(decoding)
            fixed, kv_coef, per_seq = terms
            grow = decoding * per_step
            taken = 0
            if windowed:
                while cross_heap and (cross_heap[0][1] != reqs[cross_heap[0][2]].epoch
                                      or not reqs[cross_heap[0][2]].inside):
                    heappop(cross_heap)  # stale: finished or preempted before it reached the window
                if cross_heap:
                    stop = min(stop, cross_heap[0][0])
                slide_grow = charge * inside * per_step
                while (decode_steps + 1 < stop and now < nxt
                       and used + slide + decoding + charge * inside <= capacity):
                    last_start = now
                    now += fixed + kv_coef * used + per_seq
                    if gaps is not None:
                        last_decode_end = record_gaps(decoding, last_decode_end)
                    decode_steps += 1
                    used += grow
                    slide += slide_grow
                    remaining_out -= grow
                    taken += 1
            else:
                while decode_steps + 1 < stop and now < nxt and used + decoding <= capacity:
                    last_start = now
                    now += fixed + kv_coef * used + per_seq
                    if gaps is not None:
                        last_decode_end = record_gaps(decoding, last_decode_end)
                    decode_steps += 1
                    used += grow
                    remaining_out -= grow
                    taken += 1
                    if reserve:
                        ratio = max(ratio - decay, floor)
            if taken:
                last_woke = False  # its steps began with requests running
                steps += taken
                decode_batch_sum += decoding * taken
                peak = max(peak, len(running))
                if next_send < n and arrivals[next_send] <= now:
                    send_ready()
                continue
        chunks: list[tuple[_Request, int]] = []
        prompt_units = 0.0
        tokens = 0
        step_decoding = 0
        # Requests sent from this time on came after the step's batch was formed (module docstring).
        woke = not running
        if woke or not ahead:
            formed, formed_woke = now, woke
        else:
            formed, formed_woke = last_start, last_woke
        if mixed:
            preempted = False
            while decoding and used + slide + decoding + charge * inside > capacity and preempt_last():
                preempted = True
            step_decoding = decoding
            # As the engine allocates them: the decoding requests' slots first, then each chunk in turn.
            step_held = decoding + charge * inside
            left = budget - step_decoding
            for r in prefilling:  # read only: the chunks are applied after the step
                if left <= 0:
                    break
                c = min(r.target - r.computed, left) if chunked else r.target - r.computed
                grown = charge * (min(r.computed + c, window) - min(r.computed, window)) if windowed else 0.0
                if c > left or used + slide + step_held + c + grown > capacity:
                    break
                chunks.append((r, c))
                left -= c
                step_held += c + grown
            if waiting and (admit_after_preemption or not preempted):
                admit_waiting(left, chunks, formed, formed_woke)
        elif static or sched.schedule == "prefill_first":
            static_busy = static and bool(running) and not prefilling
            step_held = 0.0
            if not static_busy:
                left = budget
                for r in list(prefilling):
                    c = min(r.target - r.computed, left) if chunked else r.target - r.computed
                    if left <= 0 or c > left:
                        break
                    chunks.append((r, c))
                    left -= c
                    step_held += c
                admit_waiting(left, chunks, formed, formed_woke)
            if not chunks:
                while decoding and used + slide + decoding + charge * inside > capacity and preempt_last():
                    if reserve:
                        ratio = initial
                step_decoding = decoding
        else:
            raise ValueError(f"unknown schedule {sched.schedule!r}")  # the schema allows three
        if not chunks and not step_decoding:
            # Nothing can run: a prompt chunk the cache cannot hold beside the others. Free the latest
            # admitted; a request alone that still cannot run is one the engine cannot serve.
            if len(running) > 1:
                preempt_last()
            elif running:
                r = running.popitem()[1]
                if r in prefilling:
                    prefilling.remove(r)
                    prefill_held -= r.computed
                release(r, r.computed)
                refuse(r)
            else:
                refuse(waiting.popleft())
            send_ready()
            continue
        # The decodes read every cached token but the prompts' (an exact integer sum, kept as it changes); read
        # before the chunks below add to both.
        kv_read = used - prefill_held if step_decoding else 0
        completing: list[_Request] = []  # the requests whose target this step's chunk completes: each samples a token
        # Each chunk's area is read off what its request held before this step; the step's time reads
        # nothing the chunks change, so they are added here.
        for r, c in chunks:
            p = r.computed
            prompt_units += c * (p + (c + 1) / 2)
            tokens += c
            if p + c >= r.target:
                completing.append(r)
            if windowed:
                slide += charge * (min(p + c, window) - min(p, window))
            r.computed = p + c
            used += c
            prefill_held += c
        tokens += step_decoding
        sampled = step_decoding + len(completing)
        if lockstep:
            dt = yield ("step", tokens, sampled, step_decoding, kv_read, prompt_units, bool(chunks))
        else:
            fixed = fixed_of.get((tokens, sampled, tokens <= graph_max and (not chunks or graphs_prompt)))
            if fixed is None:
                dt = seconds(tokens=tokens, sampled=sampled, decoding=step_decoding, kv_tokens=kv_read,
                             prompt_units=prompt_units, prompt_step=bool(chunks))
            else:
                dt = fixed + a_kv * kv_read + a_seq * step_decoding + a_prompt * prompt_units
        last_start, last_woke = now, woke
        now += dt
        steps += 1
        if len(running) > peak:
            peak = len(running)
        if step_decoding:
            if gaps is not None:
                last_decode_end = record_gaps(step_decoding, last_decode_end)
            decode_steps += 1
            used += step_decoding * per_step
            remaining_out -= step_decoding * per_step
            decode_batch_sum += step_decoding
            if reserve:
                ratio = max(ratio - decay, floor)
            if windowed:
                slide += charge * inside * per_step
                while cross_heap and cross_heap[0][0] <= decode_steps:
                    _, epoch, i = heappop(cross_heap)
                    r = reqs[i]
                    if epoch != r.epoch or not r.inside:
                        continue
                    # It reached the window in this step: its share stops at the window.
                    r.inside = False
                    inside -= 1
                    held = r.prompt + r.generated_at_decode - 1 + per_step * (decode_steps - r.decode_from)
                    slide -= charge * (held - window)
            while finish_heap and finish_heap[0][0] <= decode_steps:
                _, epoch, i = heappop(finish_heap)
                r = reqs[i]
                if epoch != r.epoch:
                    continue
                decoding -= 1
                finish(r, now)
        for r in completing:
            prefilling.remove(r)
            prefill_held -= r.computed
            sampled_done(r, now)
        if next_send < n and arrivals[next_send] <= now:
            send_ready()
    return _Outcome([r for r in reqs if not math.isnan(r.done)], steps, preemptions, refused, peak, decode_batch_sum,
                    decode_steps, gaps)


@dataclass
class _Outcome:
    """What one replica's run leaves: its completed requests and its counts."""

    done: list[_Request]
    steps: int
    preemptions: int
    refused: int
    peak: int
    decode_batch_sum: int
    decode_steps: int
    gaps: list[tuple[float, int]] | None


def _result(outcomes: list[_Outcome]) -> LoadResult:
    """The figures of one replica's run, or of a group's replicas' runs together (their requests
    pooled as one client would see them; steps and decode steps are the group's, which every
    replica takes, and the peak is the ranks' peaks summed)."""
    done = [r for o in outcomes for r in o.done]
    duration = max((r.done for r in done), default=0.0)
    out_tokens = sum(r.output for r in done)
    in_tokens = sum(r.prompt for r in done)
    ttft = [r.first_token - r.sent for r in done]
    tpot = [(r.done - r.first_token) / (r.output - 1) for r in done if r.output > 1]
    e2e = [r.done - r.sent for r in done]
    ends = sorted(r.done for r in done)
    q1, q3 = len(ends) // 4, (3 * len(ends)) // 4
    steady = (q3 - q1) / (ends[q3] - ends[q1]) if q3 > q1 and ends[q3] > ends[q1] else (
        len(done) / duration if duration else 0.0)
    gaps = None if outcomes[0].gaps is None else [g for o in outcomes for g in (o.gaps or [])]
    decode_steps = sum(o.decode_steps for o in outcomes)
    return LoadResult(
        num_requests=len(done),
        steady_request_throughput_per_second=steady,
        duration_seconds=duration,
        request_throughput_per_second=len(done) / duration if duration else 0.0,
        output_tokens_per_second=out_tokens / duration if duration else 0.0,
        total_tokens_per_second=(in_tokens + out_tokens) / duration if duration else 0.0,
        ttft_seconds=_summary(ttft),
        tpot_seconds=_summary(tpot),
        e2e_seconds=_summary(e2e),
        num_steps=max(o.steps for o in outcomes),
        num_preemptions=sum(o.preemptions for o in outcomes),
        num_refused=sum(o.refused for o in outcomes),
        peak_running=sum(o.peak for o in outcomes),
        mean_decode_batch=sum(o.decode_batch_sum for o in outcomes) / decode_steps if decode_steps else 0.0,
        itl_seconds=_weighted_summary(gaps) if gaps is not None else None,
    )


def simulate_replica(model: StepModel, sched: Scheduler, traffic: Traffic, give_up: GiveUp | None = None,
                     itl: bool = False) -> LoadResult:
    """One replica under `traffic`: `simulate`, or, where its expert group spans `model.group`
    replicas, `simulate_group` with each of them under a traffic like it (the same requests from a
    different point of the sample, Poisson arrivals from a different seed: the replicas' batches do
    not line up), its figures per replica (throughputs and counts over the group's divided by the
    group's replicas; latencies are the group's requests'). With `give_up`, each replica's allowance
    is the most the group's pooled percentile leaves out (GiveUp.allowed for k x as many requests is
    at most k x allowed + k - 1)."""
    k = model.group
    if k <= 1:
        return simulate(model, sched, traffic, give_up, itl)
    n = len(traffic.requests)
    traffics = [replace(traffic, requests=traffic.requests[r * n // k:] + traffic.requests[:r * n // k],
                        seed=traffic.seed + r) for r in range(k)]
    pooled = None if give_up is None else replace(give_up, allowed=k * give_up.allowed + k - 1)
    g = simulate_group(model, sched, traffics, pooled, itl)
    return replace(g, num_requests=g.num_requests // k,
                   request_throughput_per_second=g.request_throughput_per_second / k,
                   output_tokens_per_second=g.output_tokens_per_second / k,
                   total_tokens_per_second=g.total_tokens_per_second / k,
                   steady_request_throughput_per_second=g.steady_request_throughput_per_second / k,
                   num_preemptions=g.num_preemptions // k, peak_running=round(g.peak_running / k))


def simulate_group(model: StepModel, sched: Scheduler, traffics: list[Traffic], give_up: GiveUp | None = None,
                   itl: bool = False) -> LoadResult:
    """The replicas of one expert group (their MoE layers span them: DP attention with expert or
    tensor parallelism over the group, vLLM's data parallelism for MoE models, SGLang's
    --enable-dp-attention) under `traffics[i]` each, stepping together: every replica forms its
    own batch with its own scheduler and cache, every step of the group lasts as long as
    `model.group_seconds` says for their batches together (the slowest rank's own work, the
    experts' over the group's tokens), and a replica with nothing to run runs a one-token dummy
    pass while any other steps (vLLM docs, serving/data_parallel_deployment: "Forward passes must
    be aligned ... even when there are fewer requests to be processed than DP ranks"). One
    figure set for the group's requests together. `give_up` holds for each replica's own requests
    against the group's allowance (a replica alone past it puts the group past it)."""
    if model.width != 1:
        raise ValueError("speculative decoding in a stepping group is not modelled")
    runs = [_run(model, sched, t, give_up, itl, lockstep=True) for t in traffics]
    outcomes: list[_Outcome | None] = [None] * len(runs)
    asks: list[tuple | None] = [None] * len(runs)
    for i, run in enumerate(runs):
        try:
            asks[i] = next(run)
        except StopIteration as done:
            outcomes[i] = done.value
    now = 0.0
    while any(a is not None for a in asks):
        live = [a for a in asks if a is not None]
        steps = [a for a in live if a[0] == "step"]
        if steps:  # replicas idle or done run the dummy pass meanwhile
            dt = model.group_seconds(steps + [IDLE_STEP] * (len(runs) - len(steps)))
            now += dt
        else:  # every replica idle (or done): the clock moves to the next arrival
            dt = 0.0
            now = max(now, min(a[1] for a in live))
        for i, run in enumerate(runs):
            a = asks[i]
            if a is None:
                continue
            try:
                asks[i] = run.send(dt if a[0] == "step" else now)
            except StopIteration as done:
                asks[i] = None
                outcomes[i] = done.value
    return _result([o for o in outcomes if o is not None])


def batches_in_flight_at(batches_in_flight: int, pp1_only: bool, pp: int) -> int:
    """The batches an engine keeps in flight for a replica of `pp` stages: one under pipeline
    parallelism where its rules allow more at pp = 1 only (vLLM, SGLang: knowledge/engines/*.yaml)."""
    return 1 if pp > 1 and pp1_only else batches_in_flight


def scheduler_for(wl: InferenceWorkload, kv: KvAccount | int, pp: int = 1) -> Scheduler:
    """The engine's scheduler for a replica of `pp` pipeline stages whose cache is `kv` (an int: that many
    tokens, each costing one)."""
    if not isinstance(kv, KvAccount):
        kv = KvAccount(kv)
    # Without chunked prefill prompts go whole and first (vLLM V0 _schedule_default, SGLang with -1).
    schedule = wl.schedule if wl.chunked_prefill or wl.schedule == "static" else "prefill_first"
    return Scheduler(schedule=schedule, max_num_seqs=wl.max_num_seqs, max_num_batched_tokens=wl.max_num_batched_tokens,
                     chunked_prefill=wl.chunked_prefill, kv_capacity_tokens=kv.capacity_tokens, admission=wl.admission,
                     admit_after_preemption=wl.admit_after_preemption, window_tokens=kv.window_tokens,
                     window_charge=kv.window_charge,
                     batches_in_flight=batches_in_flight_at(wl.batches_in_flight, wl.batches_in_flight_pp1_only, pp))

def serve_traffic(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, traffic: Traffic,
                  kv: KvAccount | int | None = None, itl: bool = False) -> LoadResult:
    """One replica of `layout` serving `traffic` under its engine's scheduler (None: the KV cache
    from the engine's start-up arithmetic, `serving_memory`)."""
    if kv is None:
        kv = serving_memory(spec, hw, layout, wl).kv_account
    model = StepModel(spec, hw, layout, wl, wl.max_num_batched_tokens, wl.max_num_seqs)
    return simulate_replica(model, scheduler_for(wl, kv, layout.pp), traffic, itl=itl)
