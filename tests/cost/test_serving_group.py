"""Replicas whose expert group spans them step together (DP attention + EP; cost/serving_load.py
simulate_group, cost/step_model.py group_seconds): checked against the independent-replica model
where the two must agree (every replica with the same batch), and for the stalls lockstep adds
where they must not (a prompt on one replica delays the others' decodes)."""

from __future__ import annotations

import math

import pytest

from shardplan.cost.inputs import inference_workload
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.serving_load import Traffic, scheduler_for, simulate, simulate_group, simulate_replica
from shardplan.cost.step_model import IDLE_STEP, StepModel
from shardplan.knowledge.load import engine_rules
from shardplan.specs.loading import load_hardware, load_model

SPEC = load_model("qwen3-30b-a3b").spec
HW = load_hardware("h100-sxm-80gb")
WL = inference_workload(engine=engine_rules("vllm", "0.11.0"), hw=HW, model_max_len=SPEC.max_position_embeddings,
                        max_model_len=8192, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
                        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
                        input_len=1024, output_len=128, batch_size=None, checkpoint_format=SPEC.expert_dtype,
                        overlap_scheduling=None)
GROUP = Layout(tp=1, dp=4, ep=4)  # attention data-parallel over 4 replicas, experts split over their 4 GPUs


def _model(layout=GROUP):
    return StepModel(SPEC, HW, layout, WL, WL.max_num_batched_tokens, WL.max_num_seqs)


def _sched(layout=GROUP):
    return scheduler_for(WL, serving_memory(SPEC, HW, layout, WL).kv_account, 1)


def _decode(b: int) -> tuple:
    return ("step", b, b, b, 1000.0 * b, 0.0, False)


PROMPT = ("step", 8192, 0, 0, 0.0, 8192 * 4096.5, True)


def test_a_group_of_equal_batches_is_the_replica_alone():
    """The independent-replica model assumes every replica of the group carries its batch: where they
    do, the group's step is that step."""
    m = _model()
    assert m.group == 4
    for step in (_decode(1), _decode(64), _decode(256), PROMPT):
        _, t, s, d, kv, u, p = step
        alone = m.seconds(tokens=t, sampled=s, decoding=d, kv_tokens=kv, prompt_units=u, prompt_step=p)
        assert m.group_seconds([step] * 4) == pytest.approx(alone, rel=1e-12)


def test_a_prompt_on_one_replica_costs_the_group_its_own_work_and_the_experts_over_every_token():
    m = _model()
    mixed = m.group_seconds([PROMPT] + [_decode(64)] * 3)
    as_if_everywhere = m.group_seconds([PROMPT] * 4)
    decodes_only = m.group_seconds([_decode(64)] * 4)
    # the experts see 8,192 + 192 tokens, not 4 x 8,192; the prompt's own work still holds the others back
    assert decodes_only < mixed < as_if_everywhere
    assert mixed > 5 * decodes_only


def test_an_idle_group_runs_one_token_passes_and_a_lone_request_pays_the_group_dummy_passes():
    m = _model()
    lone = m.alone_seconds(tokens=1, sampled=1, decoding=1, kv_tokens=1000, prompt_units=0, prompt_step=False)
    assert lone == m.group_seconds([_decode(1), IDLE_STEP, IDLE_STEP, IDLE_STEP])
    # the experts of 4 one-token batches cost no less than of one, and the lone replica's own work is its own
    assert lone <= m.seconds(tokens=1, sampled=1, decoding=1, kv_tokens=1000, prompt_units=0, prompt_step=False)


def test_equal_bursts_on_every_replica_are_the_independent_model():
    """Every request at once with equal lengths: each replica forms the same batches at the same
    steps, so the group's figures per replica are the independent simulation's."""
    m, sched = _model(), _sched()
    burst = Traffic(requests=((1000, 100),) * 64)
    alone = simulate(m, sched, burst)
    group = simulate_replica(m, sched, burst)
    assert group.ttft_seconds.p50 == pytest.approx(alone.ttft_seconds.p50, rel=1e-9)
    assert group.tpot_seconds.p50 == pytest.approx(alone.tpot_seconds.p50, rel=1e-9)
    assert group.output_tokens_per_second == pytest.approx(alone.output_tokens_per_second, rel=1e-9)
    assert group.num_requests == alone.num_requests


def test_under_poisson_arrivals_lockstep_stalls_decodes_with_the_other_replicas_prompts():
    m, sched = _model(), _sched()
    traffic = Traffic(requests=((2000, 200),) * 300, request_rate_per_second=3.0, seed=1)
    alone = simulate(m, sched, traffic)
    group = simulate_replica(m, sched, traffic)
    assert group.tpot_seconds.p50 > 1.15 * alone.tpot_seconds.p50
    assert group.num_requests == alone.num_requests == 300
    # the same rate is carried (the run drains at about the same time)
    assert group.request_throughput_per_second == pytest.approx(alone.request_throughput_per_second, rel=0.1)


def test_replicas_without_requests_follow_the_group_and_finish():
    m, sched = _model(), _sched()
    one = Traffic(requests=((500, 50),))
    r = simulate_group(m, sched, [one, Traffic(requests=()), Traffic(requests=()), Traffic(requests=())])
    assert r.num_requests == 1 and not math.isnan(r.tpot_seconds.p50)
    lone = m.alone_seconds(tokens=1, sampled=1, decoding=1, kv_tokens=550, prompt_units=0, prompt_step=False)
    assert r.tpot_seconds.p50 == pytest.approx(lone, rel=0.05)


def test_a_layout_whose_replicas_hold_every_expert_steps_alone():
    assert _model(Layout(tp=1, dp=4, ep=1)).group == 1
    assert _model(Layout(tp=2, dp=2, ep=2)).group == 1
