"""Batch-1 decode of an eager engine against the same engine with CUDA graphs, against published
measurements (tests/data/decode_eager/host_cases.yaml, each case a sourced row of
measurements*.yaml).

The mechanism (cost/time_serving.py): a step takes max(GPU time, host time) plus the engine's
per-step host work. Eager, the host issues every framework op of every layer (counted in each
stack's source: op_counts.md) at the host's per-op cost; with a CUDA graph it issues one replay
and the per-step ops. The per-op cost (9.4 us) and vLLM's and SGLang's step overheads are solved
from the GPT-2 rows of one H200 (calibration: the device time is under 10% of a step there); every
other figure is held out.

What holds today: the CUDA-graph arms of all held-out rows within 15% (the device model), and
SGLang's eager GPT-2 within 15%. The eager arms of the other stacks come out 17-34% fast: their
hosts issue ops 1.3-1.8x slower than the H200 host the per-op cost comes from (older CPUs,
Triton's Python launcher for the MoE), which a single per-op cost per profile cannot follow. They
are bounded below so that they cannot silently get worse.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from conftest import REPO

from shardplan.cost.inputs import inference_workload
from shardplan.cost.layout import Layout
from shardplan.cost.time_serving import serving_time
from shardplan.knowledge.load import engine_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model

CASES = yaml.safe_load((REPO / "tests" / "data" / "decode_eager" / "host_cases.yaml").read_text())["cases"]
TOLERANCE = 0.15
CALIBRATED = 0.01  # the calibration rows reproduce up to the rounding of the figures solved from them
# (case id, arm) -> (bound on |error|, why it is out of the 15% band)
KNOWN_MISSES = {
    ("hf_gemma_2b_a10", "eager"): (0.25, "22% fast: 13.5 us an op on this CI runner's host against 9.4 on the H200's"),
    ("litgpt_open_llama_7b_a100_40gb", "eager"): (0.20, "17% fast: 12.6 us an op on this A100 host (2023)"),
    ("gptfast_llama_7b_a100_80gb", "eager"): (0.37, "34% fast: 15.5 us an op on this A100 host (2023)"),
    ("sglang_granite_moe_h200", "eager"): (0.36, "33% fast: 4 of the 50 ops a layer are Triton launches, whose "
                                                 "Python launcher costs several times a torch op"),
}


def predict_ms(case: dict, eager: bool) -> float:
    model = case["model"]
    loaded = load_model(str(REPO / model) if model.endswith(".yaml") else model)
    hw = cluster(load_hardware(case["hardware"]), gpus=1, nodes=None, gpus_per_node=None)
    wl = inference_workload(
        max_model_len=2048, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=eager,
        input_len=case["input_len"], output_len=case["output_len"], batch_size=1,
        engine=engine_rules(case["engine"]), hw=hw, model_max_len=loaded.spec.max_position_embeddings)
    # counted for this model in this stack: it replaces the engine's counts by part
    stack = {"python_ops_per_layer": case["ops_per_layer"], "python_ops_per_layer_parts": ()}
    if "ops_per_step" in case:  # not one of shardplan's engines: the stack's own figures
        stack |= {"python_ops_per_step": case["ops_per_step"], "step_overhead_seconds": case["step_overhead_us"] * 1e-6}
    t = serving_time(loaded.spec, hw, Layout(), dataclasses.replace(wl, **stack), 1)
    return 1e3 * (t.e2e_latency_seconds if case["measure"] == "e2e" else t.tpot_seconds)


ARMS = [(c, arm) for c in CASES for arm in ("eager", "graphs")]


def _held_out(case: dict, arm: str) -> bool:
    return case["role"] == "held_out" or arm in case.get("held_out_arms", ())


@pytest.mark.parametrize(("case", "arm"), ARMS, ids=[f"{c['id']}-{a}" for c, a in ARMS])
def test_arm_against_its_measurement(case, arm):
    measured = case[f"{arm}_ms"]
    predicted = predict_ms(case, eager=arm == "eager")
    error = predicted / measured - 1
    if not _held_out(case, arm):
        assert abs(error) <= CALIBRATED, f"calibration row off: {predicted:.2f} vs {measured} ms"
        return
    bound, why = KNOWN_MISSES.get((case["id"], arm), (TOLERANCE, ""))
    assert abs(error) <= bound, f"{predicted:.2f} ms predicted vs {measured} ms measured ({error:+.0%}) {why}"
    if (case["id"], arm) in KNOWN_MISSES:
        assert abs(error) > TOLERANCE, "a known miss is now within 15%: take it off KNOWN_MISSES"


def test_at_least_four_held_out_measurements_within_15_percent():
    within = [(c["id"], a) for c, a in ARMS if _held_out(c, a) and (c["id"], a) not in KNOWN_MISSES]
    assert len(within) >= 4, within


def test_eager_is_slower_than_graphs_on_every_case_as_measured():
    """The mechanism's sign and size: eager costs more on every row, and more where the host
    issues more ops per unit of GPU work (small models, MoE)."""
    for c in CASES:
        assert predict_ms(c, eager=True) > predict_ms(c, eager=False), c["id"]
        assert c["eager_ms"] > c["graphs_ms"], c["id"]


def test_enforce_eager_changes_the_cli_prediction(cli):
    base = ("estimate", "llama-3.1-8b", "--hardware", "h100-sxm-80gb", "--gpus", "1", "--batch-size", "1", "--json")
    graphs = cli(*base).json()
    eager = cli(*base, "--enforce-eager").json()
    tpot_g, tpot_e = graphs["time"]["tpot_seconds"], eager["time"]["tpot_seconds"]
    # vLLM 0.21 eager: 31 ops a layer x 32 layers + 48 a step at 9.4 us = 9.8 ms of host time against
    # about 5.5 ms of GPU time: host-bound, 1.5-2x the graph step
    assert 1.4 < tpot_e / tpot_g < 2.2, (tpot_e, tpot_g)
    steps = eager["time"]["breakdown"]["decode_step"], graphs["time"]["breakdown"]["decode_step"]
    assert steps[0]["host"] > 0 and steps[1]["host"] == 0
