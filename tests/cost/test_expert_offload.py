"""llama.cpp's --n-cpu-moe (cost/offload.py, `Layout.offload_expert_layers`): the routed experts of
the first N layers in host memory, run by the CPU; what it moves, what a pass costs, the CLI's
refusals, the search's preference for it over whole layers; and two llama.cpp rules around it:
-ngl counts the output layer, and ggml-cuda's graphs live in the compute buffer."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from shardplan.cost.inputs import inference_workload
from shardplan.cost.layout import Layout, Offload, validate_layout
from shardplan.cost.memory_serving import llamacpp_compute_buffer_phases, serving_memory
from shardplan.cost.offload import (
    expert_offloaded_layers,
    expert_pass_seconds,
    expert_tensor_bytes_per_rank,
    offload_memory,
    touched_experts,
    with_serving_offload,
)
from shardplan.cost.time_serving import pass_time
from shardplan.errors import LayoutError, ShardplanError
from shardplan.knowledge.load import engine_rules
from shardplan.search.serving import fewest_expert_layers, offload_that_fits
from shardplan.search.space import SearchResult
from shardplan.specs.loading import load_hardware, load_model

MOE = load_model("qwen3-30b-a3b").spec  # 48 layers, all MoE, 128 experts, top-8
DENSE = load_model("llama-3.1-8b").spec
HW = load_hardware("rtx-4090-24gb").with_topology(gpus_per_node=1, num_nodes=1)


def _wl(engine: str = "llamacpp", spec=MOE, quantization: str | None = "q4_k_m", max_model_len: int = 4096,
        ubatch: int | None = None):
    return inference_workload(
        engine=engine_rules(engine), hw=HW, model_max_len=spec.max_position_embeddings, max_model_len=max_model_len,
        max_num_seqs=None, max_num_batched_tokens=ubatch, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=None, weight_dtype=None, quantization=quantization, enforce_eager=False, input_len=1024,
        output_len=128, batch_size=1)


def _experts(n: int) -> Layout:
    return Layout(offload_expert_layers=n)


def test_gpu_weights_fall_by_exactly_those_layers_experts_and_the_host_holds_them():
    wl = _wl()
    base = serving_memory(MOE, HW, Layout(), wl).ranks[0]
    off = serving_memory(MOE, HW, _experts(10), wl).ranks[0]
    moved = sum(sum(expert_tensor_bytes_per_rank(MOE, Layout(), wl, i)) for i in range(10))
    assert base.breakdown.weights - off.breakdown.weights == pytest.approx(moved)
    assert off.detail["weights.experts_on_host"] == pytest.approx(-moved)
    assert off.host_bytes == pytest.approx(moved)
    # attention, router and the KV cache stay on the GPU: the KV per token is unchanged
    assert off.breakdown.kv_cache == pytest.approx(base.breakdown.kv_cache)
    # the weights' detail still sums to the weights
    assert sum(v for k, v in off.detail.items() if k.startswith("weights.")) == pytest.approx(off.breakdown.weights)


def test_expert_tensors_take_their_layers_gguf_type():
    """Q4_K_M's ffn_down is Q6_K in the use_more_bits layers (the first eighth), Q4_K after: layer 0's
    experts are larger than layer 10's."""
    wl = _wl()
    assert sum(expert_tensor_bytes_per_rank(MOE, Layout(), wl, 0)) > sum(expert_tensor_bytes_per_rank(MOE, Layout(), wl, 10))


def test_dense_layers_count_but_hold_no_experts():
    ds = load_model("deepseek-v3").spec  # first 3 layers dense
    wl = _wl(spec=ds)
    assert expert_offloaded_layers(ds, _experts(5), wl) == (3, 4)


def test_too_little_host_memory_is_a_reason():
    small = replace(HW, host_memory_bytes_per_node=4 * 2**30)
    sm = serving_memory(MOE, small, _experts(48), _wl())
    assert not sm.fits and "host memory" in sm.reason


def test_touched_experts_is_top_k_for_one_token_and_all_for_many():
    assert touched_experts(128, 8, 1) == pytest.approx(8)
    assert touched_experts(128, 8, 512) == pytest.approx(128, rel=1e-6)


def test_decode_reads_the_active_experts_from_host_memory_and_takes_back_their_gpu_time():
    wl = _wl()
    decode = pass_time(MOE, HW, _experts(24), wl, batch=1, q_len=1, kv_len=2048, decode=True)
    base = pass_time(MOE, HW, Layout(), wl, batch=1, q_len=1, kv_len=2048, decode=True)
    active = sum(sum(expert_tensor_bytes_per_rank(MOE, Layout(), wl, i)) for i in range(24)) * 8 / 128
    host = active / (HW.host_memory_bandwidth_bytes_per_second * HW.host_memory_efficiency)
    assert decode.offload < host  # the GPU's count for those experts is taken back
    assert decode.total - base.total == pytest.approx(decode.offload)
    assert decode.total == pytest.approx(sum(getattr(decode, f) for f in (
        "matmul", "attention", "memory", "kernel_overhead", "tensor_parallel", "expert_parallel", "pipeline_p2p",
        "host", "scheduler", "offload")))
    seconds, transfer, bound = expert_pass_seconds(MOE, HW, _experts(24), wl, tokens=1)
    assert transfer == pytest.approx(host) and bound == "host memory" and seconds == pytest.approx(decode.offload)


def test_a_prompt_of_32_tokens_or_more_copies_the_used_experts_per_ubatch():
    wl = _wl(ubatch=512)
    assert wl.offload_batch_on_gpu_min_tokens == 32
    link = HW.host_link.bandwidth_bytes_per_second * HW.host_link.efficiency
    all_experts = offload_memory(MOE, _experts(6), wl).experts_off_gpu_bytes
    seconds, transfer, bound = expert_pass_seconds(MOE, HW, _experts(6), wl, tokens=1024)
    assert bound == "host link" and seconds == transfer
    assert transfer == pytest.approx(2 * all_experts / link, rel=1e-6)  # 2 ubatches, every expert touched
    below, _, where = expert_pass_seconds(MOE, HW, _experts(6), wl, tokens=31)
    assert where == "host memory"


def test_the_compute_buffer_holds_one_copied_expert_tensor():
    """A 512-token ubatch multiplies host experts on the GPU, one copied tensor at a time."""
    wl = _wl()
    phases = llamacpp_compute_buffer_phases(MOE, ubatch_tokens=wl.max_num_batched_tokens, kv_cells=4096,
                                            flash_attention=True, output_on_gpu=True)
    largest = offload_memory(MOE, _experts(4), wl).largest_expert_tensor_bytes
    off = serving_memory(MOE, HW, _experts(4), wl).ranks[0].breakdown.activations
    assert off == pytest.approx(max(max(phases.values()), phases["ffn"] + largest))
    assert serving_memory(MOE, HW, Layout(), wl).ranks[0].breakdown.activations == pytest.approx(max(phases.values()))


@pytest.mark.parametrize("engine", ["vllm", "sglang", "transformers"])
def test_other_engines_are_refused_naming_the_option(engine):
    with pytest.raises(ShardplanError) as e:
        with_serving_offload(MOE, Layout(), _wl(engine, quantization=None), offload_layers=None, cpu_offload_gib=None,
                             n_gpu_layers=None, targets=("cpu",), n_cpu_moe=4)
    assert e.value.field == "--n-cpu-moe" and "llamacpp" in str(e.value.hint)


def test_a_dense_model_and_too_many_layers_are_refused():
    with pytest.raises(ShardplanError, match="dense"):
        with_serving_offload(DENSE, Layout(), _wl(spec=DENSE), offload_layers=None, cpu_offload_gib=None,
                             n_gpu_layers=None, targets=("cpu",), n_cpu_moe=4)
    with pytest.raises(ShardplanError, match="end at layer 48") as e:
        with_serving_offload(MOE, Layout(), _wl(), offload_layers=None, cpu_offload_gib=None, n_gpu_layers=None,
                             targets=("cpu",), n_cpu_moe=49)
    assert "at most 48" in str(e.value.hint)
    with pytest.raises(LayoutError):
        validate_layout(DENSE, _experts(2), 1, training=False)
    assert with_serving_offload(MOE, Layout(), _wl(), offload_layers=None, cpu_offload_gib=None, n_gpu_layers=None,
                                targets=("cpu",), n_cpu_moe=48).offload_expert_layers == 48


def test_cli_refusal_is_one_line_with_exit_2(cli):
    r = cli("estimate", "qwen3-30b-a3b", "--hardware", "rtx-4090-24gb", "--gpus", "1", "--n-cpu-moe", "4")
    assert r.exit_code == 2 and "--n-cpu-moe" in r.stderr and "llamacpp" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_estimate_with_n_cpu_moe_reports_the_offload_part(cli):
    r = cli("estimate", "qwen3-30b-a3b", "--hardware", "rtx-4090-24gb", "--gpus", "1", "--engine", "llamacpp",
            "--quantization", "q4_k_m", "--max-model-len", "4096", "--n-cpu-moe", "12", "--batch-size", "1", "--json")
    assert r.exit_code in (0, 3), r.stderr
    d = json.loads(r.stdout)
    step = d["time"]["breakdown"]["decode_step"]
    assert step["offload"] > 0
    assert step["total"] == pytest.approx(sum(v for k, v in step.items() if k != "total"))


# ----- -ngl counts the output layer ---------------------------------------------------------------


@pytest.mark.parametrize("ngl,offloaded", [(33, 0), (99, 0), (32, 1), (25, 8), (1, 32)])
def test_n_gpu_layers_counts_the_output_layer_as_llama_cpp_does(ngl, offloaded):
    """src/llama-model.cpp: i_gpu_start = max(n_layer + 1 - ngl, 0); the output layer is index n_layer.
    -ngl 32 on a 32-layer model leaves layer 0 on the CPU; the export writes layers + 1 - offloaded."""
    layout = with_serving_offload(DENSE, Layout(), _wl(spec=DENSE), offload_layers=None, cpu_offload_gib=None,
                                  n_gpu_layers=ngl, targets=("cpu",))
    assert layout.offload_layers == offloaded
    if offloaded:
        assert DENSE.num_layers + 1 - offloaded == ngl  # what the exporter writes back


def test_n_gpu_layers_zero_is_refused():
    with pytest.raises(ShardplanError, match="output layer"):
        with_serving_offload(DENSE, Layout(), _wl(spec=DENSE), offload_layers=None, cpu_offload_gib=None,
                             n_gpu_layers=0, targets=("cpu",))


def test_the_embedding_on_the_host_is_counted_once():
    wl = _wl(spec=DENSE)
    layout = Layout(offload_layers=4, offload_params=Offload.CPU)
    mem = offload_memory(DENSE, layout, wl)
    layers = mem.weights_held_bytes - mem.embedding_off_gpu_bytes
    assert mem.host_bytes == pytest.approx(mem.weights_held_bytes)
    assert mem.weights_off_gpu_bytes == pytest.approx(mem.weights_held_bytes)  # llama.cpp keeps the format
    assert layers == pytest.approx(mem.weights_off_gpu_bytes - mem.embedding_off_gpu_bytes)


# ----- CUDA graphs inside the compute buffer ------------------------------------------------------


def test_llama_cpp_counts_no_separate_cuda_graph_pool():
    """ggml-cuda's graphs run over the compute buffer's tensors (knowledge/engines/llamacpp.yaml):
    a profile's cuda_graphs_gib is not added for llama.cpp, and still is for vLLM."""
    assert HW.cuda_graph_bytes > 0
    llama = serving_memory(DENSE, HW, Layout(), _wl(spec=DENSE)).ranks[0].detail
    assert llama["overhead.cuda_graphs"] == 0.0 and llama["outside_budget.cuda_graphs"] == 0.0
    vllm = serving_memory(DENSE, HW, Layout(), _wl("vllm", spec=DENSE, quantization=None)).ranks[0].detail
    assert vllm["overhead.cuda_graphs"] + vllm["outside_budget.cuda_graphs"] == pytest.approx(HW.cuda_graph_bytes)


# ----- the search ----------------------------------------------------------------------------------


def test_the_search_holds_the_fewest_layers_experts_on_the_host_before_whole_layers():
    wl = _wl(quantization="q8_0", max_model_len=8192)  # 32 GB of weights on a 24 GB card
    assert not serving_memory(MOE, HW, Layout(), wl).fits
    res = SearchResult(training=False, goal=None, gpu_counts=[1])
    found = fewest_expert_layers(MOE, HW, Layout(), wl, res)
    assert found is not None
    layout, sm = found
    assert sm.fits and 0 < layout.offload_expert_layers <= MOE.num_layers and layout.offload_layers == 0
    assert not serving_memory(MOE, HW, replace(layout, offload_expert_layers=layout.offload_expert_layers - 1), wl).fits
    assert res.num_costed <= math.ceil(math.log2(MOE.num_layers)) + 1
    chosen, _ = offload_that_fits(MOE, HW, Layout(), wl, SearchResult(training=False, goal=None, gpu_counts=[1]))
    assert chosen == layout  # experts first


def test_the_search_falls_back_to_whole_layers_for_a_dense_model():
    big = load_model("llama-3.1-70b").spec
    wl = _wl(spec=big, max_model_len=4096)
    assert fewest_expert_layers(big, HW, Layout(), wl, SearchResult(training=False, goal=None, gpu_counts=[1])) is None
    found = offload_that_fits(big, HW, Layout(), wl, SearchResult(training=False, goal=None, gpu_counts=[1]))
    assert found is not None and found[0].offload_layers > 0 and found[0].offload_expert_layers == 0
