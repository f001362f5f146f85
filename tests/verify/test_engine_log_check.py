"""compare_engine_log: one row per figure both state, tolerances applied, the verdict."""

from __future__ import annotations

import pytest
from conftest import REPO

from shardplan.errors import ShardplanError
from shardplan.specs.engine_log import parse_engine_log, read_engine_log
from shardplan.units import BYTES_PER_GIB
from shardplan.verify.engine_log_check import KV_CAPACITY_TOLERANCE, PredictedServing, compare_engine_log

LOGS = REPO / "shardplan" / "validation" / "corpus" / "engine_logs"
GIB = BYTES_PER_GIB


def predicted(**over) -> PredictedServing:
    base = dict(memory_capacity_bytes=23.58 * GIB, gpu_memory_utilization=0.9, max_model_len=20000,
                budget_bytes=23.58 * 0.9 * GIB, weights_bytes=14.9888 * GIB, activation_peak_bytes=(17.06 - 14.9888) * GIB,
                non_torch_bytes=0.35 * GIB, cuda_graph_bytes=0.0, kv_cache_bytes=3.81 * GIB, kv_cache_tokens=1952 * 16,
                num_gpu_blocks=1952, max_concurrency=1.56, fits=True, reason=None)
    return PredictedServing(**{**base, **over})


def test_rtx3090_20k_lists_every_term_and_passes_against_its_own_figures():
    log = read_engine_log(LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log")
    check = compare_engine_log(log, predicted(), plan="p.yaml")
    assert [r.term for r in check.terms] == ["total_gpu_memory", "gpu_memory_utilization", "max_model_len", "budget",
                                             "weights", "activations", "non_torch", "kv_cache", "num_gpu_blocks",
                                             "max_concurrency"]
    assert check.status == "ok" and check.verdict.ok and check.verdict.engine_started
    assert all(abs(r.relative_error) < 1e-3 for r in check.terms)


def test_kv_out_of_tolerance_is_a_mismatch():
    log = read_engine_log(LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log")
    check = compare_engine_log(log, predicted(num_gpu_blocks=int(1952 / (1 + 2 * KV_CAPACITY_TOLERANCE))), plan="p")
    (bad,) = [r for r in check.terms if not r.ok]
    assert bad.term == "num_gpu_blocks" and check.status == "mismatch" and "num_gpu_blocks" in check.mismatches[0]


def test_input_that_differs_from_the_plan_is_a_mismatch():
    log = read_engine_log(LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log")
    check = compare_engine_log(log, predicted(max_model_len=29000), plan="p")
    assert [r.term for r in check.terms if not r.ok] == ["max_model_len"]


def test_refusal_against_a_fitting_prediction_is_a_mismatch():
    log = read_engine_log(LOGS / "vllm_v0_rtx3090_llama31_8b_29k.log")
    check = compare_engine_log(log, predicted(max_model_len=29000), plan="p")
    assert not check.verdict.engine_started and not check.verdict.ok and check.status == "mismatch"
    assert check.verdict.log_line == 9
    agree = compare_engine_log(log, predicted(max_model_len=29000, fits=False, reason="no"), plan="p")
    assert agree.verdict.ok


def test_sglang_against_a_vllm_sized_plan_checks_weights_only():
    log = read_engine_log(LOGS / "sglang_l4x4_qwq32b_tp4.log")
    check = compare_engine_log(log, predicted(weights_bytes=15.54 * GIB, kv_cache_bytes=1.0), plan="p")
    checked = [r.term for r in check.terms if r.tolerance is not None]
    assert checked == ["weights"] and check.status == "ok" and not check.verdict.checked
    assert "--engine sglang" in check.notes[0]


def test_sglang_against_an_sglang_sized_plan_checks_its_pool():
    """The 4 x L4 log: 46,611 tokens, K + V 2.84 GiB; load usage 15.54 GiB (weights + overhead)."""
    log = read_engine_log(LOGS / "sglang_l4x4_qwq32b_tp4.log")
    sized = dict(engine="sglang", engine_version="0.4.3", weights_bytes=15.21 * GIB, overhead_bytes=0.33 * GIB,
                 kv_cache_bytes=2.84 * GIB, kv_cache_tokens=46_611)
    check = compare_engine_log(log, predicted(**sized), plan="p")
    rows = {r.term: r for r in check.terms}
    assert rows["kv_cache_tokens"].tolerance == KV_CAPACITY_TOLERANCE and rows["kv_cache_tokens"].ok
    assert rows["weights"].predicted == pytest.approx(15.54 * GIB) and check.verdict.checked
    assert check.status == "ok" and not check.notes
    short = compare_engine_log(log, predicted(**{**sized, "kv_cache_tokens": 40_000}), plan="p")
    assert short.status == "mismatch" and short.mismatches[0].startswith("kv_cache_tokens: +16.5%")


def test_a_log_of_another_version_than_the_plans_is_a_mismatch():
    log = read_engine_log(LOGS / "vllm_v1_a100-80gbx1_qwen2_7b_16k_util050.log")
    assert log.engine_version == "0.10.1.1"
    same = dict(weights_bytes=14.25 * GIB, kv_cache_bytes=24.83 * GIB, kv_cache_tokens=464_848, max_model_len=16384,
                gpu_memory_utilization=0.5, max_concurrency=28.37, budget_bytes=39.6 * GIB)
    ok = compare_engine_log(log, predicted(**same, engine_version="0.10.1"), plan="p")
    assert not any(m.startswith("engine version") for m in ok.mismatches)
    other = compare_engine_log(log, predicted(**same, engine_version="0.21.0"), plan="p")
    assert other.status == "mismatch"
    assert any("--engine-version 0.10.1.1" in m for m in other.mismatches)


def test_a_log_with_nothing_comparable_is_an_error():
    log = parse_engine_log("Input length (10 tokens) exceeds the maximum allowed length (5 tokens).", "x.log")
    with pytest.raises(ShardplanError) as e:
        compare_engine_log(log, predicted(), plan="p")
    assert e.value.one_line().startswith("x.log:")


def test_a_vllm_log_against_an_sglang_sized_plan_checks_only_the_engine_independent_terms():
    log = read_engine_log(LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log")
    check = compare_engine_log(log, predicted(engine="sglang", kv_cache_tokens=10), plan="p")
    checked = {r.term for r in check.terms if r.tolerance is not None}
    assert checked == {"total_gpu_memory", "gpu_memory_utilization", "max_model_len", "weights"}
    assert check.status == "ok" and not check.verdict.checked and "--engine vllm" in check.notes[0]
