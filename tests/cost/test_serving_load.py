"""The continuous-batching model (cost/serving_load.py, step_model.py, traffic.py): what a single
request costs, what conservation requires, and which way the engine's knobs move the figures."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from shardplan.cost import inputs
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost import serving_load
from shardplan.cost.serving_load import (Scheduler, Traffic, percentile, scheduler_for, serve_traffic, simulate,
                                        steady_throughput)
from shardplan.cost.step_model import StepModel
from shardplan.cost.traffic import Sla, best_concurrency, best_rate, latency_floor
from shardplan.cost.workload import ServingLoad
from shardplan.knowledge.load import engine_rules
from shardplan.specs import loading

SPEC = loading.load_model("llama-3.1-8b").spec
H100 = loading.load_hardware("h100-sxm-80gb")
ONE = Layout(tp=1, pp=1, dp=1)


def _wl(engine: str = "vllm", version: str | None = None, **kw):
    base = dict(max_model_len=8192, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
                block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
                input_len=1024, output_len=128, batch_size=None)
    base.update(kw)
    return inputs.inference_workload(engine=engine_rules(engine, version), hw=H100,
                                     model_max_len=SPEC.max_position_embeddings, **base)


def _model(wl):
    return StepModel(SPEC, H100, ONE, wl, wl.max_num_batched_tokens, wl.max_num_seqs)


def test_percentile_is_numpys_linear_interpolation():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_one_request_alone_costs_its_prompt_steps_then_one_decode_step_a_token(engine):
    wl = _wl(engine)
    model = _model(wl)
    kv = serving_memory(SPEC, H100, ONE, wl).kv_capacity_tokens
    r = simulate(model, scheduler_for(wl, kv), Traffic(requests=((3000, 50),)))
    budget = wl.max_num_batched_tokens
    assert budget < 3000 < 2 * budget or budget >= 3000
    ttft, _ = latency_floor(model, wl, 3000)
    assert r.ttft_seconds.p50 == pytest.approx(ttft, rel=1e-9)
    # Every decode step reads the prompt and the tokens so far: between the first and the last.
    first = model.seconds(tokens=1, sampled=1, decoding=1, kv_tokens=3000, prompt_units=0, prompt_step=False)
    last = model.seconds(tokens=1, sampled=1, decoding=1, kv_tokens=3048, prompt_units=0, prompt_step=False)
    assert first <= r.tpot_seconds.p50 <= last
    assert r.num_steps == math.ceil(3000 / budget) + 49
    assert r.e2e_seconds.p50 == pytest.approx(r.ttft_seconds.p50 + 49 * r.tpot_seconds.p50, rel=1e-9)


def test_every_request_completes_and_throughput_is_tokens_over_the_duration():
    wl = _wl()
    reqs = tuple((200 + 37 * i % 900, 20 + 13 * i % 200) for i in range(300))
    r = serve_traffic(SPEC, H100, ONE, wl, Traffic(requests=reqs, request_rate_per_second=20.0, seed=3))
    assert r.num_requests == 300 and r.num_refused == 0
    assert r.output_tokens_per_second * r.duration_seconds == pytest.approx(sum(o for _, o in reqs), rel=1e-9)
    assert r.total_tokens_per_second * r.duration_seconds == pytest.approx(sum(p + o for p, o in reqs), rel=1e-9)
    assert r.ttft_seconds.p50 <= r.ttft_seconds.p90 <= r.ttft_seconds.p99


def test_a_small_cache_preempts_and_recomputes_yet_every_request_finishes():
    wl = _wl()
    reqs = ((2000, 400),) * 64
    tight = simulate(_model(wl), scheduler_for(wl, 20_000), Traffic(requests=reqs))
    roomy = simulate(_model(wl), scheduler_for(wl, 1_000_000), Traffic(requests=reqs))
    assert tight.num_requests == roomy.num_requests == 64
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert tight.peak_running < roomy.peak_running
    assert tight.output_tokens_per_second < roomy.output_tokens_per_second


def test_vllm_v1_admits_nothing_in_a_step_that_preempted():
    """vLLM V1's Scheduler.schedule runs its waiting queue only `if not preempted_reqs`: under a
    cache too small for the load, refusing admissions right after a preemption preempts less (the
    requests just let in would be the next victims) than admitting as V0 does."""
    wl = _wl()
    assert wl.admit_after_preemption is False  # the knowledge file's V1 rule
    reqs = tuple((300 + 41 * i % 700, 150 + 29 * i % 400) for i in range(200))
    v1 = scheduler_for(wl, 40_000)
    admits = replace(v1, admit_after_preemption=True)
    a, b = simulate(_model(wl), v1, Traffic(requests=reqs)), simulate(_model(wl), admits, Traffic(requests=reqs))
    assert a.num_requests == b.num_requests == 200
    assert 0 < a.num_preemptions < b.num_preemptions
    assert a.output_tokens_per_second > b.output_tokens_per_second
    assert _wl(version="0.7.3").admit_after_preemption is True  # V0 schedules prefills after preemptions


def test_a_request_longer_than_the_whole_cache_is_refused_not_looped_on():
    wl = _wl()
    r = simulate(_model(wl), scheduler_for(wl, 1_000), Traffic(requests=((5000, 10), (100, 10))))
    assert r.num_refused == 1 and r.num_requests == 1


def test_raising_max_num_batched_tokens_lowers_ttft_under_load_as_chunked_prefill_implies():
    """vLLM schedules decodes first and fills the rest of the budget with prompt chunks: a larger
    budget finishes a waiting prompt in fewer steps (TTFT down) while each step carries more prompt
    work beside the decodes (TPOT up). The must-show of issue 23. With async scheduling (vLLM's
    default from 0.14) a request also waits for the batch formed while it arrived, a step that a
    larger budget makes longer, so the gain is smaller."""
    reqs = ((6000, 200),) * 300
    traffic = Traffic(requests=reqs, request_rate_per_second=4.0, seed=1)
    for overlap, margin in ((False, 1.2), (None, 1.1)):
        results = {}
        for budget in (1024, 2048, 8192):
            wl = _wl(max_num_batched_tokens=budget, max_model_len=16384, overlap_scheduling=overlap)
            results[budget] = serve_traffic(SPEC, H100, ONE, wl, traffic)
        assert wl.batches_in_flight == (1 if overlap is False else 2)
        assert results[1024].ttft_seconds.p50 > margin * results[2048].ttft_seconds.p50
        assert results[2048].ttft_seconds.p50 > margin * results[8192].ttft_seconds.p50
        assert results[1024].tpot_seconds.mean < results[8192].tpot_seconds.mean


def test_a_capped_clients_next_request_waits_for_the_batches_formed_before_it_was_sent():
    """A capped client sends its next request when the last one's final token arrives, at the end of a
    step; the engine has begun the next step without it. With one batch in flight (vLLM 0.11) the
    request waits for that decode step, then its prompt runs in the step after (beside the 7 other
    requests' decodes); with the next batch formed while a step runs (SGLang's overlap scheduler, vLLM's
    async scheduling), for two decode steps."""
    wl = _wl("vllm", "0.11.0")
    assert wl.batches_in_flight == 1 and _wl("vllm").batches_in_flight == 2 and _wl("sglang").batches_in_flight == 2
    model, sched = _model(wl), scheduler_for(wl, 400_000)
    # Staggered outputs, so that one request ends while the others decode.
    traffic = Traffic(requests=tuple((512, 40 + 7 * i % 41) for i in range(96)), max_concurrency=8)
    sync = simulate(model, sched, traffic)
    ahead = simulate(model, replace(sched, batches_in_flight=2), traffic)
    kv = 7 * 560  # seven requests about halfway through their outputs
    decode = model.seconds(tokens=7, sampled=7, decoding=7, kv_tokens=kv, prompt_units=0, prompt_step=False)
    prompt = model.seconds(tokens=7 + 512, sampled=8, decoding=7, kv_tokens=kv, prompt_units=512 * 513 / 2,
                           prompt_step=True)
    assert sync.ttft_seconds.p50 == pytest.approx(decode + prompt, rel=0.02)
    assert ahead.ttft_seconds.p50 == pytest.approx(2 * decode + prompt, rel=0.02)
    # An idle engine wakes for the request it gets: one at a time, nothing waits.
    alone = Traffic(requests=((512, 40),) * 4, max_concurrency=1)
    assert simulate(model, replace(sched, batches_in_flight=2), alone).ttft_seconds.p50 == pytest.approx(
        simulate(model, sched, alone).ttft_seconds.p50)


def test_requests_an_idle_engine_woke_for_fill_both_batches_it_forms_and_a_preempted_one_stays_seen():
    """Three prompts sent together to an idle engine whose budget holds two: with the next batch formed
    as the first step starts, the third was already there, so its TTFT is the same either way. And a
    request preempted right after the wake is back at the head of the queue, held by the scheduler: it
    is recomputed, not refused (a cache of 1000 tokens for a 1000-token prompt and 5 outputs, with
    admissions after a preemption, as TensorRT-LLM and vLLM V0 allow)."""
    wl = _wl("vllm", "0.11.0")
    model = _model(wl)
    sched = replace(scheduler_for(wl, 400_000), max_num_batched_tokens=1024)
    burst = Traffic(requests=((512, 20),) * 3)
    one, two = (simulate(model, replace(sched, batches_in_flight=b), burst) for b in (1, 2))
    assert two.ttft_seconds == one.ttft_seconds and two.num_steps == one.num_steps
    tight = replace(scheduler_for(wl, 1000), batches_in_flight=2, admit_after_preemption=True)
    r = simulate(model, tight, Traffic(requests=((1000, 5),)))
    assert r.num_preemptions > 0 and r.num_refused == 0 and r.num_requests == 1


def test_an_uncapped_clients_request_is_timed_from_when_it_arrives():
    """Without a concurrency cap nothing holds a request back: its TTFT runs from its arrival, also
    when another request finished in the step it arrived during (the simulation had sent it then)."""
    wl = _wl("vllm", "0.11.0")
    model, sched = _model(wl), scheduler_for(wl, 400_000)
    prompt = model.seconds(tokens=100, sampled=1, decoding=0, kv_tokens=0, prompt_units=100 * 101 / 2, prompt_step=True)
    decode = model.seconds(tokens=1, sampled=1, decoding=1, kv_tokens=100, prompt_units=0, prompt_step=False)
    # The first request's last token comes from the decode step after its prompt; the second arrives halfway through it.
    arrives = prompt + decode / 2
    traffic = Traffic(requests=((100, 2), (100, 2)), request_rate_per_second=1 / arrives, poisson=False)
    r = simulate(model, sched, traffic)
    second = (prompt + decode) + prompt - arrives  # waits for the step's end, then its own prompt step
    assert r.ttft_seconds.mean == pytest.approx((prompt + second) / 2, rel=1e-9)


def test_vllm_and_sglang_form_one_batch_at_a_time_under_pipeline_parallelism():
    wl = _wl("vllm")
    assert scheduler_for(wl, 100_000, pp=1).batches_in_flight == 2
    assert scheduler_for(wl, 100_000, pp=2).batches_in_flight == 1
    assert scheduler_for(_wl("sglang"), 100_000, pp=2).batches_in_flight == 1  # SGLang turns its overlap off too
    assert scheduler_for(_wl("vllm", "0.11.0", overlap_scheduling=True), 100_000, pp=2).batches_in_flight == 1
    assert scheduler_for(_wl("vllm", "0.11.0", overlap_scheduling=True), 100_000).batches_in_flight == 2
    assert scheduler_for(_wl("sglang", overlap_scheduling=False), 100_000).batches_in_flight == 1


def test_sglang_prefill_first_gives_lower_ttft_and_higher_tpot_than_vllm_mixed_steps():
    """The two schedules on the same device and traffic: SGLang runs a waiting prompt before the
    decodes (TTFT down, decodes stall: TPOT up); vLLM folds prompt chunks into decode steps."""
    reqs = ((1500, 300),) * 300
    traffic = Traffic(requests=reqs, request_rate_per_second=10.0, seed=2)
    vllm, sglang = _wl("vllm"), _wl("sglang")
    kv = 400_000
    a = simulate(_model(vllm), scheduler_for(vllm, kv), traffic)
    b = simulate(_model(sglang), replace(scheduler_for(sglang, kv), max_num_batched_tokens=vllm.max_num_batched_tokens),
                 traffic)
    assert b.ttft_seconds.p50 < a.ttft_seconds.p50
    assert b.tpot_seconds.p90 > a.tpot_seconds.p90


def test_sglang_admission_reserve_runs_fewer_requests_at_once_in_a_small_cache():
    sglang = _wl("sglang")
    sched = scheduler_for(sglang, 60_000)
    assert sched.admission is not None and sched.admission[0] == 0.7
    reqs = ((1000, 1000),) * 200
    reserved = simulate(_model(sglang), sched, Traffic(requests=reqs))
    greedy = simulate(_model(sglang), replace(sched, admission=None), Traffic(requests=reqs))
    assert reserved.peak_running < greedy.peak_running
    assert reserved.num_preemptions <= greedy.num_preemptions


def test_prefix_cache_hits_cut_ttft():
    wl = _wl()
    reqs = ((4000, 50),) * 200
    cold = serve_traffic(SPEC, H100, ONE, wl, Traffic(requests=reqs, request_rate_per_second=5.0))
    warm = serve_traffic(SPEC, H100, ONE, wl, Traffic(requests=reqs, request_rate_per_second=5.0,
                                                      prefix_cache_hit_fraction=0.75))
    assert warm.ttft_seconds.p50 < 0.5 * cold.ttft_seconds.p50


def test_a_concurrency_cap_bounds_the_requests_running():
    wl = _wl()
    r = serve_traffic(SPEC, H100, ONE, wl, Traffic(requests=((500, 100),) * 100, max_concurrency=8))
    assert r.peak_running == 8


def test_static_batches_wait_for_the_whole_batch():
    """transformers' generate: the next batch starts only when the longest of this one ends."""
    wl = _wl("transformers")
    sched = Scheduler(schedule="static", max_num_seqs=4, max_num_batched_tokens=100_000, chunked_prefill=False,
                      kv_capacity_tokens=1_000_000)
    reqs = ((100, 10), (100, 200), (100, 10), (100, 10), (100, 10))
    model = _model(wl)
    r = simulate(model, sched, Traffic(requests=reqs))
    # The fifth request's first token comes after the 200-token request of the first batch ends:
    # at least 199 decode steps of one sequence, each no faster than a step alone.
    step = model.seconds(tokens=1, sampled=1, decoding=1, kv_tokens=100, prompt_units=0, prompt_step=False)
    fifth = 5 * r.ttft_seconds.mean - 4 * r.ttft_seconds.p50  # the first four share one prefill step
    assert fifth > 199 * step
    continuous = simulate(model, replace(sched, schedule="mixed"), Traffic(requests=reqs))
    assert continuous.ttft_seconds.p99 < 20 * step  # it joins when a 10-token request leaves


def test_the_best_rate_within_the_sla_meets_it_and_a_faster_one_would_not():
    wl = _wl()
    kv = serving_memory(SPEC, H100, ONE, wl).kv_capacity_tokens
    sla = Sla(max_ttft_seconds=0.5, max_tpot_seconds=0.02, percentile=90)
    model = _model(wl)
    point = best_rate(model, wl, kv, sla, 200)
    assert point is not None and sla.violated(point.result) is None
    from shardplan.cost.traffic import _traffic  # the same requests at 1.5x the rate
    from shardplan.cost.workload import ServingLoad

    over = simulate(model, scheduler_for(wl, kv), _traffic(wl, ServingLoad(), 200, rate=point.request_rate_per_second * 1.5,
                                                           conc=None))
    assert sla.violated(over) is not None


def test_a_run_that_filled_its_slots_spans_its_latencies_after_filling_them():
    """traffic.steady_requests: four latencies' arrivals at the rate, plus the arrivals that fill the
    sequence slots where the run filled them (a queue forms only after)."""
    from shardplan.cost.traffic import STEADY_LATENCIES, STEADY_REQUESTS_MAX, steady_requests

    wl = _wl()
    kv = serving_memory(SPEC, H100, ONE, wl).kv_capacity_tokens
    r = simulate(_model(wl), scheduler_for(wl, kv), Traffic(requests=((1024, 128),) * 40, request_rate_per_second=4.0))
    span = math.ceil(STEADY_LATENCIES * 4.0 * r.e2e_seconds.p50)
    assert steady_requests(4.0, r, r.peak_running + 1) == span  # never full: as before
    assert steady_requests(4.0, r, r.peak_running) == r.peak_running + span  # full: after filling them
    assert steady_requests(4.0, r, 10**9 if r.peak_running >= 10**9 else r.peak_running) <= STEADY_REQUESTS_MAX


def test_long_outputs_are_judged_over_a_run_that_spans_its_latencies_after_filling_its_slots():
    """Llama 3.1 8B, 4,000/1,000 tokens, one tp 2 replica (206 sequence slots): every run the rate is
    judged by spans four of its latencies, after the arrivals that fill the slots where it filled them.
    Before, 5.81 req/s passed over 701 requests, a rate that queues over 3,000 (p90 TTFT 9.8 s,
    BENCHMARKS.md); the longer runs refuse it. Near what the replica keeps up with a finite run still
    resolves the rate to a few percent (the rate found queues over 3x its run: not asserted)."""
    from shardplan.cost.traffic import sequence_slots, steady_requests

    lay = Layout(tp=2)
    wl = replace(_wl(max_model_len=None, input_len=4000, output_len=1000), load=ServingLoad())
    kv = serving_memory(SPEC, H100, lay, wl).kv_account
    model = StepModel(SPEC, H100, lay, wl, wl.max_num_batched_tokens, wl.max_num_seqs)
    sla = Sla(max_ttft_seconds=1.0, max_tpot_seconds=0.05, percentile=90)
    point = best_rate(model, wl, kv, sla, 600)
    slots = sequence_slots(wl, kv, 5000)
    assert slots == 206
    r = point.result
    assert sla.violated(r) is None
    assert point.num_requests >= steady_requests(point.request_rate_per_second, r, slots)
    assert point.request_rate_per_second < 5.81


def test_the_rate_held_over_a_long_run_meets_the_sla_there_and_a_quarter_step_above_does_not():
    """traffic.held_over_a_long_run: below a rate whose long run breaks the SLA, the highest that a
    run as long meets, in steps of LONG_RUN_STEP resolved to a quarter of one; none where even half
    the rate breaks it (here a TPOT limit just above one request alone's)."""
    from shardplan.cost.traffic import (LONG_RUN_LOWEST, LONG_RUN_STEP, STEADY_REQUESTS_MAX, held_over_a_long_run,
                                        over_a_long_run)

    wl = replace(_wl(), load=ServingLoad())
    kv = serving_memory(SPEC, H100, ONE, wl).kv_account
    model = _model(wl)
    sla = Sla(max_ttft_seconds=1.0, max_tpot_seconds=0.05, percentile=90)
    point = best_rate(model, wl, kv, sla, 600)
    rate = point.request_rate_per_second * 1.1  # a little above what the search finds: its long run breaks the SLA
    assert sla.violated(over_a_long_run(model, wl, kv, rate)) is not None
    held, run = held_over_a_long_run(model, wl, kv, sla, rate)
    r = over_a_long_run(model, wl, kv, held)
    assert r.num_requests == STEADY_REQUESTS_MAX and sla.violated(r) is None
    assert run == r  # the run it returns is that rate's long run, whole
    assert LONG_RUN_LOWEST * rate <= held < rate
    assert sla.violated(over_a_long_run(model, wl, kv, held + LONG_RUN_STEP / 4 * rate)) is not None
    alone = latency_floor(model, wl, 1024)[1]
    tight = Sla(max_ttft_seconds=None, max_tpot_seconds=alone * 1.01, percentile=90)
    assert held_over_a_long_run(model, wl, kv, tight, rate) is None


def test_best_concurrency_is_the_largest_that_meets_the_sla():
    wl = _wl()
    kv = serving_memory(SPEC, H100, ONE, wl).kv_capacity_tokens
    sla = Sla(max_ttft_seconds=None, max_tpot_seconds=0.012, percentile=90)
    point = best_concurrency(_model(wl), wl, kv, sla, 256)
    assert point is not None and point.concurrency is not None
    assert point.result.tpot_seconds.p90 <= 0.012
    assert 1 <= point.concurrency < 256


def test_speculative_decoding_yields_leviathans_expected_tokens_per_step():
    from shardplan.cost.speculative import Speculative, SpeculativeMethod
    from shardplan.cost.workload import ServingLoad

    draft = loading.load_model("llama-3.2-1b").spec
    sp = Speculative(method=SpeculativeMethod.DRAFT_MODEL, num_speculative_tokens=4, draft=draft)
    base = _wl()
    reqs = ((500, 300),) * 60
    traffic = Traffic(requests=reqs, max_concurrency=8)
    kv = 400_000
    plain = simulate(_model(base), scheduler_for(base, kv), traffic)
    results = {}
    for a in (0.05, 0.8):
        wl = replace(base, speculative=sp, load=ServingLoad(spec_acceptance_rate=a))
        model = _model(wl)
        assert model.tokens_per_decode_step == pytest.approx((1 - a**5) / (1 - a), rel=1e-12)
        results[a] = simulate(model, scheduler_for(wl, kv), traffic)
    # Accepting 80% of 4 drafted tokens yields 3.36 tokens a step: TPOT falls well below plain
    # decoding despite the draft's four passes and the wider verify step; accepting 5% only adds work.
    assert results[0.8].tpot_seconds.p50 < 0.7 * plain.tpot_seconds.p50
    assert results[0.05].tpot_seconds.p50 > plain.tpot_seconds.p50
    assert all(r.num_requests == 60 for r in (plain, *results.values()))


def test_weighted_percentile_is_the_percentile_of_the_values_repeated():
    from shardplan.cost.serving_load import weighted_percentile

    pairs = [(0.5, 3), (0.1, 1), (0.9, 2), (0.3, 4)]
    flat = sorted(v for v, c in pairs for _ in range(c))
    for q in (0, 10, 37, 50, 90, 99, 100):
        assert weighted_percentile(pairs, q) == pytest.approx(percentile(flat, q), abs=1e-15)


@pytest.mark.parametrize("engine,kv,first_token_sent", [
    ("vllm", None, False), ("sglang", None, False),
    ("vllm", 4_000, False),  # a small cache: requests are preempted and recomputed
    ("vllm", None, True),  # a decode pool: each request's first token came from a prefill pool when it was sent
])
def test_inter_token_gaps_add_up_to_each_requests_decode_time(engine, kv, first_token_sent):
    """Each request's gaps run from its first token to its last, so their mean over all gaps is
    sum(e2e - TTFT) / sum(outputs - 1) whatever the interleaving: vLLM's mixed steps, SGLang's
    prompt-only steps that stall every decode (a gap across one is a decode step and a prefill), a
    preempted request's wait for its recompute (one gap, as the client sees it)."""
    wl = _wl(engine)
    reqs = tuple((300 + 71 * i % 1700, 40 + 23 * i % 300) for i in range(120))
    cache = kv if kv is not None else serving_memory(SPEC, H100, ONE, wl).kv_account
    r = simulate(_model(wl), scheduler_for(wl, cache), Traffic(requests=reqs, request_rate_per_second=6.0, seed=5,
                                                               first_token_sent=first_token_sent), itl=True)
    assert r.num_refused == 0 and (r.num_preemptions > 0) == (kv is not None)
    n = len(reqs)
    decode_seconds = n * (r.e2e_seconds.mean - r.ttft_seconds.mean)
    assert r.itl_seconds.mean == pytest.approx(decode_seconds / (sum(o for _, o in reqs) - n), rel=1e-9)
    assert r.itl_seconds.p50 <= r.itl_seconds.p90 <= r.itl_seconds.p99
    step = _model(wl).seconds(tokens=1, sampled=1, decoding=1, kv_tokens=300, prompt_units=0, prompt_step=False)
    assert r.itl_seconds.p50 >= step  # no gap is shorter than a decode step alone
    if engine == "sglang":  # prompt-only steps: a gap across one is much longer than a decode step
        assert r.itl_seconds.p99 > 3 * r.itl_seconds.p50
    # the search's simulations leave them out
    assert serve_traffic(SPEC, H100, ONE, wl, Traffic(requests=reqs[:5])).itl_seconds is None


def test_the_best_rate_is_resolved_finely_when_the_burst_runs_in_one_go():
    """100 identical requests fit the 8B's cache at once, so the burst the bisection starts from
    finishes them together and its "steady" rate is many times what the replica sustains; the
    bisection must start under the token bound instead, or five halvings leave the answer far below
    the SLA's limit (DeepSeek-V3 on 16 H200s: 4.0 req/s found, the limit near 7). Checked against
    the simulation itself: 15% above the rate found, the same run breaks the SLA."""
    from shardplan.cost.traffic import _traffic, token_rate_bound
    from shardplan.cost.workload import ServingLoad

    wl = _wl()
    kv = serving_memory(SPEC, H100, ONE, wl).kv_capacity_tokens
    model = _model(wl)
    sched = scheduler_for(wl, kv)
    burst = simulate(model, sched, _traffic(wl, ServingLoad(), 100, rate=math.inf, conc=None))
    bound = token_rate_bound(model, ServingLoad(), ((wl.input_len, wl.output_len),) * 100)
    assert burst.peak_running == 100 and burst.steady_request_throughput_per_second > 3 * bound  # the trap
    sla = Sla(max_ttft_seconds=None, max_tpot_seconds=0.012, percentile=90)
    point = best_rate(model, wl, kv, sla, 100)
    assert point is not None and sla.violated(point.result) is None
    faster = point.request_rate_per_second * 1.15
    n = point.num_requests
    assert sla.violated(simulate(model, sched, _traffic(wl, ServingLoad(), n, rate=faster, conc=None))) is not None


def test_no_load_runs_faster_than_its_tokens_allow():
    """token_rate_bound: a burst's whole-run request rate (ramp and drain included) stays under it,
    tiny requests too (their first output token comes from the prompt's step: a 1-token output adds
    no position; counting it put the bound 10% under what 8-token prompts ran at)."""
    from shardplan.cost.traffic import _traffic, token_rate_bound
    from shardplan.cost.workload import ServingLoad

    for engine in ("vllm", "sglang"):
        for prompt, out in ((8, 1), (8, 2), (32, 2), (1024, 128)):
            wl = _wl(engine, input_len=prompt, output_len=out)
            kv = serving_memory(SPEC, H100, ONE, wl).kv_capacity_tokens
            model = _model(wl)
            burst = _traffic(wl, ServingLoad(), 5000, rate=math.inf, conc=None)
            r = simulate(model, scheduler_for(wl, kv), burst)
            bound = token_rate_bound(model, ServingLoad(), burst.requests)
            assert r.request_throughput_per_second <= bound, (engine, prompt, out)
        assert r.request_throughput_per_second > 0.3 * bound  # and it is not a vacuous bound


class _KeepsNothing(dict):
    """A composition store that never holds one: every step goes through StepModel.seconds."""

    def get(self, key, default=None):
        return default


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_kept_composition_adds_the_same_terms_as_seconds(engine):
    """`simulate` adds a seen composition's other terms itself (StepModel.fixed_by_composition): the
    same run with every step through `seconds` gives the same result, bit for bit (decode, prompt
    and mixed steps, inside and past the graphs' batch, preemptions). A term added to `seconds`
    fails this until simulate adds it too."""
    wl = _wl(engine)
    kv = serving_memory(SPEC, H100, ONE, wl).kv_account
    for lengths in ((256, 64), (512, 32)), tuple((200 + 37 * (i % 50), 20 + 11 * (i % 17)) for i in range(50)):
        traffic = Traffic(requests=tuple(lengths[i % len(lengths)] for i in range(400)), request_rate_per_second=60.0,
                          seed=3)
        kept, plain = _model(wl), _model(wl)
        plain.fixed_by_composition = _KeepsNothing()
        a = simulate(kept, scheduler_for(wl, kv), traffic, itl=True)
        b = simulate(plain, scheduler_for(wl, kv), traffic, itl=True)
        assert a == b and a.num_steps > 200 and len(kept.fixed_by_composition) > 10


@pytest.mark.parametrize("rate", [math.inf, 0.5, 4.0])
@pytest.mark.parametrize("concurrency", [None, 4, 64])
@pytest.mark.parametrize("peak", [1, 4, 64])
def test_the_verdict_without_the_saturation_rate_is_the_verdict_with_it(rate, concurrency, peak):
    """`saturated_whatever_the_capacity` (validate skips the saturation burst where it decides) is
    `is_saturated` at every saturation rate where it answers, and answers for every burst."""
    from shardplan.cost.traffic import is_saturated, saturated_whatever_the_capacity

    n = 100
    known = saturated_whatever_the_capacity(rate, concurrency, n, peak)
    verdicts = {is_saturated(rate, concurrency, n, peak, capacity) for capacity in (0.1, 1.0, 3.9, 4.0, 1e6)}
    if known is None:
        assert math.isfinite(rate) and verdicts == {True, False}
    else:
        assert verdicts == {known}
    if math.isinf(rate):
        assert known is not None


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tgi"])
@pytest.mark.parametrize("kv_tokens", [6_000, 60_000, 1_000_000])
def test_the_steady_rate_read_before_the_run_ends_is_the_whole_runs(engine, kv_tokens):
    """`steady_throughput` stops a burst once its quartile finishes are known: the same float as the
    whole run's steady throughput, with drawn lengths and fixed ones, a cache that preempts and one
    that holds everything, request counts around the quartiles' edges (1 to 4 requests, where the
    whole run decides) and a request too long for the cache (refusals: the whole run decides)."""
    wl = _wl(engine)
    model = _model(wl)
    sched = scheduler_for(wl, kv_tokens)
    for n in (1, 2, 3, 4, 5, 7, 63, 301):
        for fixed in (True, False):
            reqs = ((1024, 128),) * n if fixed else tuple((64 + 97 * i % 3000, 1 + 53 * i % 400) for i in range(n))
            if n == 63 and not fixed:
                reqs = reqs + ((kv_tokens + 10, 8),)  # longer than the cache holds: refused (64 sent, 63 done)
            burst = Traffic(requests=reqs, request_rate_per_second=math.inf)
            whole = simulate(model, sched, burst).steady_request_throughput_per_second
            assert steady_throughput(model, sched, burst) == whole, (n, fixed)


def test_the_steady_rate_stops_the_run_at_the_third_quartiles_finish():
    """The shortcut is taken: a burst of 400 requests is stopped once 301 have finished (their
    steady throughput is read there), which a run that finished them all would not be."""
    wl = _wl()
    model = _model(wl)
    sched = scheduler_for(wl, 1_000_000)
    reqs = tuple((512 + 31 * i % 700, 16 + 29 * i % 300) for i in range(400))
    finished: list[int] = []
    original = serving_load._Request.__setattr__

    def watch(self, name, value):  # count the requests given a finish time
        if name == "done" and not math.isnan(value):
            finished.append(self.i)
        original(self, name, value)

    burst = Traffic(requests=reqs, request_rate_per_second=math.inf)
    whole = simulate(model, sched, burst).steady_request_throughput_per_second
    finished.clear()
    serving_load._Request.__setattr__ = watch  # type: ignore[method-assign]
    try:
        value = steady_throughput(model, sched, burst)
    finally:
        serving_load._Request.__setattr__ = original  # type: ignore[method-assign]
    assert value == whole
    assert len(finished) == 3 * 400 // 4 + 1


@pytest.mark.parametrize("engine,poisson,prompt,output,ttft,tpot", [
    ("vllm", True, 1024, 128, 0.5, 0.02),
    ("vllm", False, 2048, 256, 1.0, 0.03),
    ("sglang", True, 512, 512, 2.0, 0.05),
])
def test_a_rate_search_with_a_floor_stops_at_the_first_ceiling_below_it_and_each_ceiling_bounds_its_runs(
        engine, poisson, prompt, output, ttft, tpot):
    """traffic.rate_search: before each run it checks the most output tokens/s any rate it could still
    pick would report (`output_rate_ceiling`): a run at a rate below that step's upper end, of any of
    the request counts it may take, that refuses nothing reports no more. Given a floor it stops at
    the first such ceiling below it, having run what the search without a floor ran until then
    (`first_below` reads where from the ceilings of a search that went further)."""
    from shardplan.cost.traffic import STEADY_REQUESTS_MAX, _traffic, first_below, output_rate_ceiling, rate_search

    load = ServingLoad(poisson=poisson)
    wl = replace(_wl(engine, input_len=prompt, output_len=output), load=load)
    kv = serving_memory(SPEC, H100, ONE, wl).kv_account
    model = _model(wl)
    sla = Sla(max_ttft_seconds=ttft, max_tpot_seconds=tpot, percentile=90)
    full = rate_search(model, wl, kv, sla, 200)
    assert full.point is not None and not full.stopped
    ceilings = full.ceilings_tokens_per_second
    assert len(ceilings) >= 3 and list(ceilings) == sorted(ceilings, reverse=True)
    assert full.point.result.output_tokens_per_second <= ceilings[-1]
    per_rate = output_rate_ceiling(wl, load, 200)
    sched = scheduler_for(wl, kv)
    for c in ceilings[1:]:
        upper = c / per_rate  # the bisection's upper end when it checked c
        for n in (200, 1000, STEADY_REQUESTS_MAX):
            r = simulate(model, sched, _traffic(wl, load, n, rate=upper * 0.999, conc=None))
            assert r.num_refused == 0 and r.output_tokens_per_second <= c
    for k, c in enumerate(ceilings):
        floor = c * 1.000001
        stopped = rate_search(model, wl, kv, sla, 200, floor_tokens_per_second=floor)
        first = next(j for j, d in enumerate(ceilings) if d < floor)
        assert stopped.stopped and stopped.point is None and first <= k
        assert stopped.ceilings_tokens_per_second == ceilings[:first + 1]
        assert first_below(ceilings, floor) == first
    floor = ceilings[-1] * 0.999999
    assert rate_search(model, wl, kv, sla, 200, floor_tokens_per_second=floor) == full
    assert first_below(ceilings, floor) is None and first_below(ceilings, None) is None


def test_drawn_lengths_have_no_output_rate_ceiling():
    from shardplan.cost.traffic import output_rate_ceiling
    from shardplan.specs.lengths import LengthDistribution

    lengths = LengthDistribution.uniform(input_min_tokens=100, input_max_tokens=200, output_min_tokens=10,
                                         output_max_tokens=300, source="test")
    assert output_rate_ceiling(_wl(), ServingLoad(lengths=lengths), 200) == math.inf
    assert output_rate_ceiling(_wl(), ServingLoad(), 200) < math.inf


@pytest.mark.parametrize("poisson", [True, False])
@pytest.mark.parametrize("n", [0, 1, 2, 600, 6001])
def test_arrival_times_are_the_clients_running_sums_bit_for_bit(poisson, n):
    """vLLM's benchmark client waits expovariate(rate) (or 1 / rate) between sends: each send time is
    the one before plus that gap, from 0. The search reads the unit draws once per seed and divides
    by each rate; the times must be the client's own floats, at any rate."""
    import random

    for rate in (0.37, 3.0, 41.5):
        t, expected, rng = 0.0, [], random.Random(7)
        for _ in range(n):
            expected.append(t)
            t += rng.expovariate(rate) if poisson else 1.0 / rate
        traffic = Traffic(requests=((10, 10),) * n, request_rate_per_second=rate, poisson=poisson, seed=7)
        assert serving_load.arrival_times(traffic) == expected
    assert serving_load.arrival_times(Traffic(requests=((10, 10),) * n)) == [0.0] * n  # every request at once
