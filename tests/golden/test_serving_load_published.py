"""The continuous-batching model against published benchmark_serving runs (shardplan/validation/corpus/
serving_load, sources in docs/research/serving-load-sources.md; per-case errors in BENCHMARKS.md).

Below saturation (at most 16 requests in flight from the client) each run's median TPOT must be
within 20% and its output throughput within 15%: there the figures are the engine's decode steps
and the scheduler's interleaving, which the model costs. The runs listed in NOT_YET miss that
today, each for a stated mechanism the model lacks; they are asserted to still miss, so the list
cannot go stale unnoticed. At saturation (rate inf with up to 1000 requests) eleven runs are held to
the tolerances (SATURATED_WITHIN); over every run, TTFT below saturation included (the servers'
per-request latency before the first token, ~15-110 ms, is not modelled), an aggregate bound holds
the present error so it can only shrink.
"""

from __future__ import annotations

import statistics

import pytest

import serving_load_cases as S

TPOT_TOLERANCE = 0.20
THROUGHPUT_TOLERANCE = 0.15
LOW_CONCURRENCY = 16

NOT_YET = {
    "gpustack-qwen3-8b-h100-latency-sglang-04":
        "Qwen3-8B-FP8 on SGLang: the fp8 path's per-token activation quantization kernels are not costed "
        "(TPOT 15% fast, output 25% high)",
    "gpustack-deepseek-r1-h200-vllm-10":
        "DeepSeek-R1 on vLLM at 4 in flight: small-batch MLA decode and block-scaled fp8 MoE kernels run far "
        "below the roofline (TPOT 39% fast)",
    "sgl-cookbook-gpt-oss-00":
        "gpt-oss-120b: MXFP4 experts are costed at 16 bits, so decode reads twice the bytes (TPOT 84% slow)",
    "gpustack-gpt-oss-120b-h100-vllm-12":
        "gpt-oss-120b on vLLM 0.10.2, one H100, 4 in flight: TPOT 22% fast, output 31% high; its MXFP4 experts "
        "are costed at the roofline of their (Marlin-padded) bytes, which vLLM's Hopper MoE kernels, dequantizing "
        "in the GEMM, do not reach at small batch (not measured)",
    "sgl-cookbook-llama3.1-01":
        "Llama-3.1-70B TP8 on A100 at 16 in flight: output 18% high (decode at batch 16 slower than the roofline)",
}


def _starts(case) -> bool:
    try:
        S.predict(case)
    except S.NotModelled:  # e.g. gpt-oss-120b on one H100: its MXFP4 experts are sized at 16 bits
        return False
    return True


def _judged() -> list:
    return [c for c in S.cases() if c.max_concurrency is not None and c.max_concurrency <= LOW_CONCURRENCY
            and _starts(c)]


CASES = _judged()


def _within(case) -> tuple[bool, dict[str, float]]:
    try:
        r = S.predict(case)
    except S.NotModelled:
        return False, {}
    e = S.errors(case, r)
    ok = abs(e["median_tpot"]) <= TPOT_TOLERANCE and abs(e["output_throughput"]) <= THROUGHPUT_TOLERANCE
    return ok, e


def test_the_judged_set_spans_both_engines_dense_and_moe():
    held = [c for c in CASES if c.id not in NOT_YET]
    assert len(held) >= 10
    assert {c.engine for c in held} == {"vllm", "sglang"}
    assert {S.is_moe(c) for c in held} == {False, True}
    assert set(NOT_YET) <= {c.id for c in CASES}


@pytest.mark.parametrize("case", [c for c in CASES if c.id not in NOT_YET], ids=lambda c: c.id)
def test_below_saturation_tpot_and_output_throughput_match_the_published_run(case):
    ok, e = _within(case)
    assert ok, (case.id, e)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in NOT_YET], ids=lambda c: c.id)
def test_known_misses_still_miss(case):
    ok, e = _within(case)
    assert not ok, f"{case.id} is now within the tolerances ({e}): move it out of NOT_YET"


# Saturated runs (more than 16 in flight, or every request at once) the model predicts within the
# issue's tolerances on the shipped profiles: median TTFT and TPOT within 20%, output throughput within
# 15% (the one marked False: TPOT and throughput only). The rest of the saturated runs miss, most of
# them on two GPUStack hosts whose prompts run at about half the peaks (BENCHMARKS.md, "A host's
# compute rate from one of its runs": test_serving_calibration_published.py holds them on their
# calibrated profile) or in vLLM 0.11's bursts of short prompts (docs/research/ttft-overheads.md).
SATURATED_WITHIN = {
    "gpustack-qwen3-235b-a22b-h100-vllm-06": True, "gpustack-qwen3-235b-a22b-h100-vllm-11": True,
    "gpustack-qwen3-235b-a22b-h100-vllm-12": True, "sgl-cookbook-llama3.1-02": True, "sgl-cookbook-llama3.1-05": True,
    "sgl-cookbook-qwen3-02": True, "sgl-cookbook-qwen3-05": True, "sgl-cookbook-qwen3-08": False,
    "sgl-cookbook-deepseek-r1-02": True, "sgl-cookbook-deepseek-r1-05": True, "sgl-cookbook-deepseek-r1-08": True,
}


def test_the_saturated_set_spans_both_engines_dense_and_moe():
    by_id = {c.id: c for c in S.cases()}
    held = [by_id[i] for i in SATURATED_WITHIN]
    assert all(not (c.max_concurrency is not None and c.max_concurrency <= LOW_CONCURRENCY) for c in held)
    assert {c.engine for c in held} == {"vllm", "sglang"}
    assert {S.is_moe(c) for c in held} == {False, True}


@pytest.mark.parametrize("run", list(SATURATED_WITHIN))
def test_at_saturation_these_runs_match_the_published_run(run):
    case = next(c for c in S.cases() if c.id == run)
    ok, e = _within(case)
    assert ok and (not SATURATED_WITHIN[run] or abs(e["median_ttft"]) <= TPOT_TOLERANCE), (run, e)


def test_saturation_and_ttft_errors_stay_below_their_present_bounds():
    """Every modelled run, saturation included: the median absolute error of each figure, bounded
    where it stands today so that it can only shrink. Over the 72 runs modelled before vLLM's
    --async-scheduling was read: TTFT 0.36, TPOT 0.19, output throughput 0.14, ITL 0.156. TTFT was
    0.43 before a request sent while a step runs waited for the batch formed without it (a capped
    client's next request arrives as a step ends; SGLang's overlap scheduler forms the next batch
    while a step runs: cost/serving_load.py). TPOT was 0.18 before a step's admissions saw what the
    same step had already allocated (vLLM's allocate_slots and SGLang's PrefillAdder take blocks as
    they go) and gpt-oss's sliding-window groups took their share of the cache (vLLM's hybrid KV
    cache manager); before ShareGPT's lengths were vLLM's first-turn sampling throughput was 0.19;
    before SGLang's eager prefill was costed by the ops of each layer's kind TTFT was 0.53.
    With the nine gpt-oss-120b runs on vLLM 0.10.2 with --async-scheduling (one H100, seven of them
    saturated, where the other gpt-oss runs miss too) the 81 runs stand at TTFT 0.41, TPOT 0.22,
    ITL 0.17, output throughput 0.175. Five DeepSeek-R1 runs on SGLang 0.5.3 (--enable-dp-attention
    without --dp, which SGLang turns off) joined them (86); then SGLang's decode CUDA graphs up to 512
    sequences at tp >= 4 on 60-160 GiB GPUs (from 0.5.3, as its server_args.py sets them; 160 or 256
    before) moved seven SGLang runs: median ITL error over all runs 0.17 -> 0.157 (DeepSeek-R1 on 8 H200s
    +84% -> -11%, Qwen3-235B on 8 H100s +76% -> +9%), but output throughput 0.175 -> 0.215 (72 earlier
    runs and the five: 0.15 -> 0.168), the DeepSeek-R1 bursts now 13-33% high: their host's prompt
    steps run slower than the profile's (BENCHMARKS.md, "A host's compute rate from one of its runs").
    """
    every: dict[str, list[float]] = {"median_ttft": [], "median_tpot": [], "median_itl": [], "output_throughput": []}
    earlier: dict[str, list[float]] = {k: [] for k in every}
    for c in S.cases():
        try:
            e = S.errors(c, S.predict(c))
        except S.NotModelled:
            continue
        for k, v in e.items():
            if v == v:  # NaN: the run has no such figure
                every[k].append(abs(v))
                if c.flags.async_scheduling is None:
                    earlier[k].append(abs(v))
    assert len(earlier["output_throughput"]) >= 77 and len(every["output_throughput"]) >= 86
    assert statistics.median(earlier["median_tpot"]) <= 0.20
    assert statistics.median(earlier["median_ttft"]) <= 0.36
    assert statistics.median(earlier["output_throughput"]) <= 0.17
    # The gaps between tokens: the step times at the batches the runs decode at, less the queueing
    # and the prompt stalls that TPOT also holds. 0.155 when added.
    assert len(earlier["median_itl"]) >= 60 and statistics.median(earlier["median_itl"]) <= 0.14
    assert statistics.median(every["median_ttft"]) <= 0.41
    assert statistics.median(every["median_tpot"]) <= 0.22
    assert statistics.median(every["median_itl"]) <= 0.16
    assert statistics.median(every["output_throughput"]) <= 0.22
