"""A host's compute rate fitted to one of its published serving runs predicts its other runs
(`calibrate --serving-run`, tasks/calibrate.py; BENCHMARKS.md "A host's compute rate from one of
its runs"). GPUStack's one-H100 pages measure prompt-bound bursts at about half the rate the
shipped H100 profile (and NVIDIA's measured kernels, docs/research/step-times-vs-aiconfigurator.md)
predict, on vLLM and SGLang alike, while their decode at a few requests matches: a GPU whose
compute runs below its peaks and whose memory does not. One run of each page is fitted; the
page's other runs, other lengths, the other engine and ShareGPT, are held out and must then be
within the issue's tolerances (median TPOT 20%, output throughput 15%; median TTFT 20% where
listed). The runs in MISSES miss for a stated mechanism and are asserted to still miss."""

from __future__ import annotations

import pytest
import yaml

import serving_load_cases as S

from shardplan.specs.loading import load_hardware
from shardplan.tasks.calibrate import calibrate_profile_from_serving_run
from shardplan.validation.predict import predict_serving_load

TPOT, OUTPUT, TTFT = 0.20, 0.15, 0.20
FRONTEND = ("vLLM 0.11.0's burst of short prompts reaches the engine late, as a block (its chat template parsed "
            "per request: docs/research/ttft-overheads.md section 8)")
HOSTS = {
    # fitted run: (held out with TTFT too, held out on TPOT and throughput only, misses with their reason)
    "gpustack-qwen3-14b-h100-vllm-09": (
        ["gpustack-qwen3-14b-h100-sglang-01", "gpustack-qwen3-14b-h100-sglang-03", "gpustack-qwen3-14b-h100-vllm-07",
         "gpustack-qwen3-14b-h100-vllm-08", "gpustack-qwen3-14b-h100-sglang-12", "gpustack-qwen3-14b-h100-sglang-13"],
        ["gpustack-qwen3-14b-h100-vllm-00"],
        {"gpustack-qwen3-14b-h100-vllm-10": FRONTEND,
         "gpustack-qwen3-14b-h100-sglang-11": "32k-token prompts on SGLang: TPOT 21% fast (its decodes between "
                                              "prompt chunks, at the edge of the band)",
         "gpustack-qwen3-14b-h100-sglang-14": "1,000 prompts of 128 tokens, 4 out: TPOT 39% slow, a burst of "
                                              "requests that end at once"}),
    "gpustack-gpt-oss-120b-h100-vllm-10": (
        ["gpustack-gpt-oss-120b-h100-vllm-13", "gpustack-gpt-oss-120b-h100-vllm-14", "gpustack-gpt-oss-120b-h100-vllm-15",
         "gpustack-gpt-oss-120b-h100-vllm-17"],
        ["gpustack-gpt-oss-120b-h100-vllm-00", "gpustack-gpt-oss-120b-h100-vllm-03", "gpustack-gpt-oss-120b-h100-vllm-04",
         "gpustack-gpt-oss-120b-h100-vllm-06", "gpustack-gpt-oss-120b-h100-vllm-07"],
        {"gpustack-gpt-oss-120b-h100-vllm-08": "32k-token prompts: TPOT 50% slow (sliding-window decode among "
                                               "32k-token prompt chunks)",
         "gpustack-gpt-oss-120b-h100-vllm-09": "4k-token prompts: TPOT 33% slow, as run 08",
         "gpustack-gpt-oss-120b-h100-vllm-11": "1,000 prompts of 128 tokens: output 39% high, " + FRONTEND,
         "gpustack-gpt-oss-120b-h100-vllm-12": "4 in flight: output 20% high, its MXFP4 experts at the roofline "
                                               "(tests/golden/test_serving_load_published.py NOT_YET)",
         "gpustack-gpt-oss-120b-h100-vllm-16": "2 GPUs, 1,000 prompts of 128 tokens: output 34% high, " + FRONTEND,
         "gpustack-gpt-oss-120b-h100-sglang-01": "SGLang 0.5.3rc0: a 140 s median TTFT, far slower than the "
                                                 "vLLM runs on the same page"}),
}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """Each page's profile, fitted to its one run through the command's own code."""
    cases = {c.id: c for c in S.cases()}
    out = {}
    for fitted in HOSTS:
        folder = tmp_path_factory.mktemp(fitted)
        run = cases[fitted].model_dump(mode="json", exclude_none=True)
        run["model"] = str(S.CORPUS_DIR / run["model"])
        (folder / "run.yaml").write_text(yaml.safe_dump({"cases": [run]}))
        result = calibrate_profile_from_serving_run(folder / "run.yaml", folder / "host.yaml")
        out[fitted] = (result, load_hardware(str(folder / "host.yaml")))
    return cases, out


def _errors(case, hw):
    return S.errors(case, predict_serving_load(case, S.CORPUS_DIR, hw)[0])


def _ok(e: dict, ttft: bool) -> bool:
    return abs(e["median_tpot"]) <= TPOT and abs(e["output_throughput"]) <= OUTPUT and (not ttft or abs(e["median_ttft"]) <= TTFT)


@pytest.mark.parametrize("fitted", list(HOSTS))
def test_the_fitted_run_is_matched_and_the_fraction_is_a_slow_gpu(calibrated, fitted):
    result, _ = calibrated[1][fitted]
    (change,) = result.changes
    assert 0.2 < change.new < 0.7  # prompt-bound bursts measured at 0.46-0.59 of the full-rate prediction
    out = {f.figure: f for f in result.fit_figures}["output_tokens_per_second"]
    assert out.after == pytest.approx(out.measured, rel=0.01)


@pytest.mark.parametrize("run,fitted,ttft", [(r, f, True) for f, (a, _, _) in HOSTS.items() for r in a]
                         + [(r, f, False) for f, (_, b, _) in HOSTS.items() for r in b])
def test_a_held_out_run_of_the_same_host_is_within_tolerance(calibrated, run, fitted, ttft):
    cases, fits = calibrated
    e = _errors(cases[run], fits[fitted][1])
    assert _ok(e, ttft), (run, e)


@pytest.mark.parametrize("run,fitted", [(r, f) for f, (_, _, m) in HOSTS.items() for r in m])
def test_known_misses_still_miss(calibrated, run, fitted):
    cases, fits = calibrated
    e = _errors(cases[run], fits[fitted][1])
    assert not _ok(e, False), f"{run} is now within tolerance ({e}): move it to the held-out runs"


def test_the_held_out_runs_missed_on_the_shipped_profile(calibrated):
    """What the fit is for: on the bundled H100 profile most of the held-out runs miss."""
    cases, fits = calibrated
    held = [r for a, b, _ in HOSTS.values() for r in a + b]
    missed = [r for r in held if not _ok(S.errors(cases[r], S.predict(cases[r])), False)]
    assert len(missed) >= 0.75 * len(held), missed
