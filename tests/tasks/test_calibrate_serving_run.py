"""`calibrate --serving-run`: a GPU's compute rate fitted to a serving benchmark run (tasks/calibrate.py).
The fit is checked on runs whose "measured" throughput is the model's own at a known compute
rate (it must find that rate again), and refused where the run cannot tell the rate."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from shardplan.errors import InputFileError
from shardplan.specs.cases import ServingLoadCase
from shardplan.specs.loading import load_hardware
from shardplan.tasks.calibrate import (FIT_LOWEST_SHARE, calibrate_profile_from_serving_run, fit_compute_share)
from shardplan.validation.predict import predict_serving_load

# A compute-bound run: 200 prompts of 2,000 tokens at once, 50 tokens out, Llama 3.1 8B on one H100.
PREFILL_RUN = dict(kind="serving_load", id="burst-2k", source="test: the model's own figures at a known compute rate", model="llama-3.1-8b",
                   hardware="h100-sxm-80gb", gpus=1, engine="vllm", engine_version="0.11.0", dataset="random",
                   input_len=2000, output_len=50, num_requests=200, total_input_tokens=400_000,
                   total_output_tokens=10_000)
# Decode at one request at a time: its steps read the weights, whatever the compute rate.
DECODE_RUN = dict(PREFILL_RUN, id="decode-c1", input_len=100, output_len=500, num_requests=20, total_input_tokens=2_000,
                  total_output_tokens=10_000, max_concurrency=1)


def _at_share(run: dict, share: float):
    hw = load_hardware("h100-sxm-80gb")
    case = ServingLoadCase.model_validate(dict(run, measured=dict(median_ttft_ms=1, output_tokens_per_second=1)))
    scaled = dataclasses.replace(hw, peak_flops={k: v * share for k, v in hw.peak_flops.items()})
    return predict_serving_load(case, None, scaled)[0]


def _write(tmp_path, run: dict, output_tok_s: float, **extra) -> object:
    measured = dict(median_ttft_ms=1000.0, median_tpot_ms=40.0, output_tokens_per_second=output_tok_s)
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"cases": [dict(run, measured=measured, **extra)]}))
    return path


def test_the_fit_finds_the_compute_rate_a_run_was_made_at(tmp_path):
    made = _at_share(PREFILL_RUN, 0.6)
    runs = _write(tmp_path, PREFILL_RUN, made.output_tokens_per_second)
    r = calibrate_profile_from_serving_run(runs, tmp_path / "slow-h100.yaml")
    change = r.changes[0]
    assert change.field == "gpu.power_limited_compute_fraction" and change.old == 1.0
    assert change.new == pytest.approx(0.6, abs=0.005)
    out = {f.figure: f for f in r.fit_figures}["output_tokens_per_second"]
    assert out.after == pytest.approx(made.output_tokens_per_second, rel=0.01)
    assert out.before > 1.5 * out.measured  # the full-rate profile was far off
    prof = load_hardware(str(tmp_path / "slow-h100.yaml"))  # loads as written, with the fraction applied
    base = load_hardware("h100-sxm-80gb")
    assert prof.peak_flops[next(iter(base.peak_flops))] == pytest.approx(
        0.6 * base.peak_flops[next(iter(base.peak_flops))], rel=0.01)
    assert prof.memory_bandwidth_bytes_per_second == base.memory_bandwidth_bytes_per_second
    assert r.measured_case is None and any("in-sample" in n for n in r.notes)


def test_a_profile_already_below_its_peaks_is_fitted_from_its_own_fraction(tmp_path):
    """The 94 GB H100 profile runs at 0.8 of its peaks (a 500 W board): the fitted fraction is of
    the chip's peaks, so a run made at 0.8 x 0.5 of them gives 0.4."""
    run = dict(PREFILL_RUN, hardware="h100-sxm-94gb-hbm2e")
    hw = load_hardware("h100-sxm-94gb-hbm2e")
    case = ServingLoadCase.model_validate(dict(run, measured=dict(median_ttft_ms=1, output_tokens_per_second=1)))
    made = predict_serving_load(case, None, dataclasses.replace(hw, peak_flops={k: v * 0.5 for k, v in hw.peak_flops.items()}))[0]
    r = calibrate_profile_from_serving_run(_write(tmp_path, run, made.output_tokens_per_second), tmp_path / "p.yaml")
    assert r.changes[0].old == pytest.approx(0.8) and r.changes[0].new == pytest.approx(0.4, abs=0.004)


def test_a_run_faster_than_the_full_peaks_keeps_the_fraction_at_one(tmp_path):
    full = _at_share(PREFILL_RUN, 1.0).output_tokens_per_second
    r = calibrate_profile_from_serving_run(_write(tmp_path, PREFILL_RUN, 1.3 * full), tmp_path / "p.yaml")
    assert r.changes[0].new == 1.0
    assert any("30% faster than predicted at the chip's full peaks" in n for n in r.notes)


@pytest.mark.parametrize("what", ["decode-bound", "too slow", "two runs", "unknown id"])
def test_runs_that_cannot_measure_the_rate_are_refused_and_nothing_is_written(tmp_path, what):
    out = tmp_path / "p.yaml"
    if what == "decode-bound":
        runs, match = _write(tmp_path, DECODE_RUN, 100.0), "bound by memory bandwidth"
    elif what == "too slow":
        slowest = _at_share(PREFILL_RUN, FIT_LOWEST_SHARE).output_tokens_per_second
        runs, match = _write(tmp_path, PREFILL_RUN, 0.5 * slowest), "slower than 5%"
    else:
        runs = tmp_path / "runs.yaml"
        m = dict(median_ttft_ms=1.0, output_tokens_per_second=1.0)
        runs.write_text(yaml.safe_dump({"cases": [dict(PREFILL_RUN, measured=m), dict(DECODE_RUN, measured=m)]}))
        match = "2 serving_load cases" if what == "two runs" else "no serving_load case with id 'nope'"
    with pytest.raises(InputFileError, match=match) as e:
        calibrate_profile_from_serving_run(runs, out, case_id="nope" if what == "unknown id" else None)
    assert e.value.source == str(runs) and not out.exists()


def test_the_bisection_alone():
    """fit_compute_share on a known monotone throughput: the share that gives the measured one."""
    def tput(s: float) -> float:
        return 1000 * s / (1 + s)  # saturating: half the rate gives 1.5x less at s = 1
    share, note = fit_compute_share(tput, tput(0.37), 1.0)
    assert share == pytest.approx(0.37, abs=1e-3) and note is None
    with pytest.raises(ValueError, match="memory bandwidth"):
        fit_compute_share(lambda s: 100 + s, 100.5, 1.0)
    share, note = fit_compute_share(tput, 2 * tput(1.0), 1.25)
    assert share == 1.25 and "80% faster" in note  # 1000 against tput(1.25) = 556
