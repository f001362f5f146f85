"""The time model's mechanisms: breakdowns that sum, rooflines that bind where they should,
the pipeline bubble, collectives, and the CLI's `time` object."""

from __future__ import annotations

import itertools
import math

import pytest

from shardplan.cost.comm import Collective, Group, collective_seconds, group
from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout, PipelineSchedule, Recompute
from shardplan.cost.time_serving import serving_time
from shardplan.cost.time_training import training_time
from shardplan.cost.weights import stage_weights
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.errors import LayoutError
from shardplan.specs.loading import bundled_names, load_hardware, load_model, model_specs_dir
from shardplan.units import DType


def _finite_parts(d: dict[str, float]) -> None:
    parts = {k: v for k, v in d.items() if k != "total"}
    assert all(math.isfinite(v) and v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(d["total"], rel=1e-12)


@pytest.mark.parametrize("name", bundled_names(model_specs_dir()))
def test_time_breakdowns_sum_for_every_model(name):
    spec = load_model(name).spec
    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=2)
    evaluated = 0
    for tp, pp, ep, zero in itertools.product((1, 8), (1, 2), (1, 8), (1, 3)):
        layout = Layout(tp=tp, pp=pp, dp=16 // (tp * pp), ep=ep, zero_stage=zero, sequence_parallel=tp > 1,
                        recompute=Recompute.SELECTIVE)
        try:
            train = estimate(spec, hw, layout, TrainingWorkload(seq_len=2048, global_batch_size=64)).model_dump(mode="json")
            serve = estimate(spec, hw, Layout(tp=tp, pp=pp, dp=16 // (tp * pp), ep=ep),
                             InferenceWorkload(max_model_len=4096, input_len=512, output_len=64)).model_dump(mode="json")
        except LayoutError:
            continue
        tt = train["time"]
        _finite_parts(tt["breakdown"])
        assert tt["breakdown"]["total"] == pytest.approx(tt["step_seconds"], rel=1e-12)
        assert 0 < tt["mfu"] <= tt["hfu"] < 1
        st = serve["time"]
        _finite_parts(st["breakdown"]["prefill"])
        _finite_parts(st["breakdown"]["decode_step"])
        assert st["ttft_seconds"] == pytest.approx(st["breakdown"]["prefill"]["total"], rel=1e-12)
        evaluated += 1
    assert evaluated >= 2


def _h100(gpus: int = 1):
    return load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=gpus, num_nodes=1)


def test_batch1_decode_reads_the_weights_once():
    spec = load_model("llama-3.1-8b").spec
    hw = _h100()
    layout = Layout()
    t = serving_time(spec, hw, layout, InferenceWorkload(input_len=128, output_len=32), 1)
    weights = stage_weights(spec, layout, 0, quantization=Quantization.NONE, dense_dtype=DType.BF16).bytes
    floor = weights / (hw.memory_bandwidth_bytes_per_second * hw.memory_bandwidth_efficiency)
    assert floor <= t.tpot_seconds <= 1.3 * floor  # memory-bound, plus small per-kernel costs
    # fp8 weights halve the bytes of the linear layers, so decode gets close to 2x faster.
    t8 = serving_time(spec, hw, layout, InferenceWorkload(input_len=128, output_len=32, quantization=Quantization.FP8), 1)
    assert 1.4 < t.tpot_seconds / t8.tpot_seconds < 2.0


def test_prefill_is_compute_bound():
    spec = load_model("llama-3.1-8b").spec
    hw = _h100()
    t = serving_time(spec, hw, Layout(), InferenceWorkload(input_len=4096, output_len=1), 8)
    flops = 2 * 8 * 4096 * 7.5e9  # ~2 x non-embedding params per token, attention on top
    achieved = flops / t.ttft_seconds
    assert 0.5 * hw.matmul_efficiency < achieved / hw.peak_flops_for(DType.BF16) < hw.matmul_efficiency
    assert t.prefill.matmul > 5 * t.prefill.memory


def test_tensor_parallelism_splits_decode_weight_reads():
    spec = load_model("llama-3.1-70b").spec
    wl = InferenceWorkload(input_len=128, output_len=32)
    t1 = serving_time(spec, _h100(2), Layout(tp=2), wl, 1)
    t8 = serving_time(spec, _h100(8), Layout(tp=8), wl, 1)
    assert t1.decode.matmul / t8.decode.matmul == pytest.approx(4, rel=0.1)
    assert t8.decode.tensor_parallel > t1.decode.tensor_parallel > 0


def test_bigger_batches_raise_throughput_until_compute_binds():
    spec = load_model("llama-3.1-8b").spec
    wl = InferenceWorkload(input_len=512, output_len=128)
    tputs = [serving_time(spec, _h100(), Layout(), wl, b).throughput_tokens_per_second for b in (1, 8, 64)]
    assert tputs[0] < tputs[1] < tputs[2]
    assert tputs[1] / tputs[0] > 5  # decode is memory-bound at small batches: nearly free extra rows


def test_pipeline_bubble_is_p_minus_1_over_v_microbatches():
    spec = load_model("llama-3.1-8b").spec
    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=1)
    wl = TrainingWorkload(seq_len=4096, global_batch_size=16)
    one = training_time(spec, hw, Layout(tp=2, pp=4), wl, 16)
    slow = max(one.stages, key=lambda s: s.per_microbatch_seconds)
    assert one.breakdown.pipeline_bubble == pytest.approx(3 * slow.per_microbatch_seconds, rel=1e-12)
    inter = training_time(spec, hw, Layout(tp=2, pp=4, virtual_stages=2, pp_schedule=PipelineSchedule.INTERLEAVED), wl, 16)
    assert inter.breakdown.pipeline_bubble == pytest.approx(one.breakdown.pipeline_bubble / 2, rel=0.05)


def test_recomputation_costs_a_forward_and_counts_only_in_hfu():
    spec = load_model("llama-3.1-8b").spec
    hw = _h100(8)
    wl = TrainingWorkload(seq_len=4096, global_batch_size=64)
    none = training_time(spec, hw, Layout(dp=8), wl, 8)
    full = training_time(spec, hw, Layout(dp=8, recompute=Recompute.FULL), wl, 8)
    assert none.mfu == pytest.approx(none.hfu, rel=1e-9)
    assert full.model_flops_per_step == pytest.approx(none.model_flops_per_step, rel=1e-9)
    assert full.hardware_flops_per_step / full.model_flops_per_step == pytest.approx(4 / 3, rel=0.03)
    assert full.breakdown.compute / none.breakdown.compute == pytest.approx(4 / 3, rel=0.06)


def test_alpha_beta_collectives():
    hw = _h100(8)
    g = group(8, 1, 8)
    assert g == Group(8, 8)
    nbytes = 1e9
    bw = hw.intra_node.bandwidth_bytes_per_second * hw.intra_node.efficiency
    lat = hw.intra_node.latency_seconds
    assert collective_seconds(Collective.ALL_REDUCE, nbytes, g, hw) == pytest.approx(6 * lat + 2 * 7 / 8 * nbytes / bw)
    assert collective_seconds(Collective.ALL_GATHER, nbytes, g, hw) == pytest.approx(7 * lat + 7 / 8 * nbytes / bw)
    # A group of 16 spread one rank per node crosses the network.
    hw2 = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=16)
    g2 = group(16, 8, 8)
    assert g2.num_nodes == 16
    inter = hw2.inter_node.bandwidth_bytes_per_second * hw2.inter_node.efficiency
    assert collective_seconds(Collective.REDUCE_SCATTER, nbytes, g2, hw2) == pytest.approx(
        15 * hw2.inter_node.latency_seconds + 15 / 16 * nbytes / inter
    )
    assert collective_seconds(Collective.ALL_REDUCE, nbytes, Group(1, 1), hw) == 0.0


def test_zero3_traffic_is_exposed_when_compute_is_short():
    spec = load_model("llama-3.1-70b").spec
    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=8)
    wl = TrainingWorkload(seq_len=2048, global_batch_size=64)
    short = training_time(spec, hw, Layout(dp=64, zero_stage=3), wl, 1)
    # Eight times the sequences in one micro-batch: the same gathers, eight times the compute.
    long = training_time(spec, hw, Layout(dp=64, zero_stage=3, micro_batch_size=8), TrainingWorkload(seq_len=2048, global_batch_size=512), 1)
    assert short.breakdown.zero3 / short.step_seconds > long.breakdown.zero3 / long.step_seconds


def test_cli_time_json(cli):
    r = cli("estimate", "llama-3.1-8b", "--hardware", "h100-sxm-80gb", "--gpus", "1", "--input-len", "2048",
            "--output-len", "256", "--batch-size", "16", "--json")
    assert r.exit_code == 0, r.stderr
    t = r.json()["time"]
    assert t["batch_size"] == 16 and t["input_len"] == 2048
    for k in ("ttft_seconds", "tpot_seconds", "throughput_tokens_per_second", "best_batch_size"):
        assert t[k] > 0
    assert t["throughput_tokens_per_second"] == pytest.approx(16 * 256 / t["e2e_latency_seconds"], rel=1e-9)
    longer = cli("estimate", "llama-3.1-8b", "--gpus", "1", "--input-len", "4096", "--batch-size", "16", "--json").json()["time"]
    assert longer["ttft_seconds"] > 1.9 * t["ttft_seconds"]
    tr = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--zero-stage", "1",
             "--seq-len", "4096", "--global-batch-size", "64", "--json")
    assert tr.exit_code == 0, tr.stderr
    tt = tr.json()["time"]
    for k in ("step_seconds", "tokens_per_second_per_gpu", "mfu", "hfu", "breakdown"):
        assert k in tt
    assert tt["tokens_per_second_per_gpu"] == pytest.approx(64 * 4096 / tt["step_seconds"] / 8, rel=1e-9)
    assert 0.2 < tt["mfu"] < 0.8


def test_offload_costs_host_traffic_and_nvme_costs_more():
    spec = load_model("llama-3.1-8b").spec
    hw = _h100(8)
    wl = TrainingWorkload(seq_len=4096, global_batch_size=64)
    base = training_time(spec, hw, Layout(dp=8, zero_stage=2), wl, 8)
    cpu = training_time(spec, hw, Layout(dp=8, zero_stage=2, offload_optimizer="cpu"), wl, 8)
    nvme = training_time(spec, hw, Layout(dp=8, zero_stage=2, offload_optimizer="nvme"), wl, 8)
    assert base.breakdown.offload == 0.0
    host = hw.host_link.bandwidth_bytes_per_second * hw.host_link.efficiency
    # At least the updated 16-bit weights of this rank's 1/8 shard come back over PCIe.
    assert cpu.breakdown.offload >= 8.03e9 / 8 * 2 / host * 0.99
    assert nvme.breakdown.offload > cpu.breakdown.offload
    assert cpu.step_seconds > base.step_seconds
