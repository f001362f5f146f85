"""GEMM time as a function of its shape (issue: training per stack), held against XLA's measured
bf16 matmul table for the H100 (tests/data/gemm/h100_bf16_xla.yaml, with its source): the
roofline with the shape share and the per-kernel overhead of the h100-sxm-80gb profile."""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml

from shardplan.cost.compute import gemm_time
from shardplan.specs.loading import load_hardware
from shardplan.units import DType

DATA = yaml.safe_load((Path(__file__).parent.parent / "data" / "gemm" / "h100_bf16_xla.yaml").read_text())
TRAINING_SIZE_FLOPS = 1e10  # a training GEMM's size and up (tokens x hidden x hidden of an 8B model: ~5e11)


def _errors() -> list[tuple[float, float]]:
    hw = load_hardware(DATA["gpu_profile"])
    out = []
    for m, n, k, tflops in DATA["rows"]:
        seconds, flops = gemm_time(hw, m, n, k, count=1, weight_bytes=2, act_bytes=2, dtype=DType.BF16)
        predicted = flops / (seconds + hw.kernel_overhead_seconds) / 1e12
        out.append((flops, predicted / tflops - 1))
    return out


def test_training_size_gemms_within_15_percent():
    big = [e for f, e in _errors() if f >= TRAINING_SIZE_FLOPS]
    assert len(big) >= 15
    assert max(abs(e) for e in big) <= 0.15, big
    assert abs(statistics.median(big)) <= 0.06


def test_small_gemms_are_optimistic_by_a_known_margin():
    """Below ~1e10 FLOPs the measured kernels sit on a floor of ~5-6 us (launch and tail) that the
    profile's 4 us overhead undercounts: the model is optimistic there, by a median of about 21%
    (max 75% at 256 x 512 x 4096, a split-K shape). Serving decode, where such GEMMs live, is
    memory-bound and calibrated separately; this pins the gap so that a change to it shows."""
    small = [e for f, e in _errors() if f < TRAINING_SIZE_FLOPS]
    assert 0.10 <= statistics.median(small) <= 0.30
    assert max(small) <= 0.80
