"""Property tests (hypothesis) over the time model: any valid layout and workload gives finite,
non-negative parts that sum to their totals; more work never takes less time."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout, Recompute
from shardplan.cost.time_serving import serving_time
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import LayoutError
from shardplan.specs.loading import load_hardware, load_model

MODELS = ("llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b", "gemma-2-9b", "deepseek-v3")
HW = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=2)
SPECS = {m: load_model(m).spec for m in MODELS}


def _check(parts: dict[str, float]) -> None:
    body = {k: v for k, v in parts.items() if k != "total"}
    assert all(math.isfinite(v) and v >= 0 for v in body.values()), body
    assert math.isclose(sum(body.values()), parts["total"], rel_tol=1e-9)
    assert parts["total"] > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(MODELS),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 8]),
    zero=st.integers(0, 3),
    recompute=st.sampled_from(list(Recompute)),
    seq_exp=st.integers(9, 13),
    mb=st.sampled_from([1, 2]),
)
def test_training_time_parts_sum(model, tp, pp, ep, zero, recompute, seq_exp, mb):
    layout = Layout(tp=tp, pp=pp, dp=16 // (tp * pp), ep=ep, zero_stage=zero, recompute=recompute,
                    sequence_parallel=tp > 1, micro_batch_size=mb)
    try:
        rep = estimate(SPECS[model], HW, layout, TrainingWorkload(seq_len=2**seq_exp, global_batch_size=64)).model_dump(mode="json")
    except LayoutError:
        return
    _check(rep["time"]["breakdown"])
    assert 0 < rep["time"]["mfu"] <= rep["time"]["hfu"] <= 1


@settings(max_examples=60, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    tp=st.sampled_from([1, 2, 8]),
    batch=st.integers(1, 512),
    isl=st.integers(1, 8192),
    osl=st.integers(1, 2048),
)
def test_serving_time_parts_sum_and_grow_with_work(model, tp, batch, isl, osl):
    spec = SPECS[model]
    layout = Layout(tp=tp)
    hw = HW.with_topology(gpus_per_node=8, num_nodes=1)
    wl = InferenceWorkload(input_len=isl, output_len=osl)
    try:
        t = serving_time(spec, hw, layout, wl, batch)
    except LayoutError:
        return
    _check(t.prefill.as_dict())
    _check(t.decode.as_dict())
    more = serving_time(spec, hw, layout, InferenceWorkload(input_len=isl * 2, output_len=osl), batch)
    assert more.ttft_seconds >= t.ttft_seconds
    assert more.tpot_seconds >= t.tpot_seconds
    bigger = serving_time(spec, hw, layout, wl, batch + 1)
    assert bigger.tpot_seconds >= t.tpot_seconds
