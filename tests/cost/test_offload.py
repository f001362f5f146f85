"""Serving with weights off the GPU (cost/offload.py): the memory moved, the time it costs, by
the engine's mechanism, and the search's fewest-layers answer."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from shardplan.cost.inputs import inference_workload
from shardplan.cost.layout import Layout, Offload
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.offload import layer_bytes_per_rank, offload_memory, offload_pass_seconds, offloaded_layers
from shardplan.cost.time_serving import pass_time
from shardplan.knowledge.load import engine_rules
from shardplan.search.serving import fewest_offloaded_layers
from shardplan.search.space import SearchResult
from shardplan.specs.loading import load_hardware, load_model

SPEC = load_model("llama-3.1-8b").spec
HW = load_hardware("rtx-4090-24gb").with_topology(gpus_per_node=1, num_nodes=1)


def _wl(engine: str, quantization: str | None = None, max_model_len: int = 8192):
    return inference_workload(
        engine=engine_rules(engine), hw=HW, model_max_len=SPEC.max_position_embeddings, max_model_len=max_model_len,
        max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=None, weight_dtype=None, quantization=quantization, enforce_eager=False, input_len=1024,
        output_len=128, batch_size=1)


def _off(k: int) -> Layout:
    return Layout(offload_layers=k, offload_params=Offload.CPU)


@pytest.mark.parametrize("engine,first_on_gpu", [("vllm", False), ("transformers", True), ("llamacpp", False)])
def test_which_layers_leave_follows_the_engine(engine, first_on_gpu):
    layers = offloaded_layers(SPEC, _off(5), _wl(engine))
    assert layers == (tuple(range(27, 32)) if first_on_gpu else tuple(range(5)))


@pytest.mark.parametrize("engine", ["vllm", "transformers", "llamacpp"])
def test_gpu_weights_fall_by_the_offloaded_layers_and_the_host_holds_them(engine):
    wl = _wl(engine, "q4_k_m" if engine == "llamacpp" else None)
    base = serving_memory(SPEC, HW, Layout(), wl).ranks[0]
    off = serving_memory(SPEC, HW, _off(10), wl).ranks[0]
    mem = offload_memory(SPEC, _off(10), wl)
    moved = sum(layer_bytes_per_rank(SPEC, Layout(), wl, i) for i in mem.layers)
    assert off.breakdown.weights == pytest.approx(base.breakdown.weights - mem.weights_off_gpu_bytes
                                                  + mem.streamed_buffer_bytes)
    assert mem.weights_off_gpu_bytes >= moved  # + the embedding where llama.cpp keeps it on the host
    assert off.host_bytes >= moved and off.nvme_bytes == 0
    assert off.breakdown.total == pytest.approx(sum(v for k, v in off.breakdown.as_dict().items() if k != "total"))
    weights_detail = sum(v for k, v in off.detail.items() if k.startswith("weights."))
    assert weights_detail == pytest.approx(off.breakdown.weights)


def test_streamed_copy_is_a_layer_for_vllm_and_a_tensor_for_accelerate():
    layer = layer_bytes_per_rank(SPEC, Layout(), _wl("vllm"), 0)
    assert offload_memory(SPEC, _off(4), _wl("vllm")).streamed_buffer_bytes == pytest.approx(layer)
    down = SPEC.hidden_size * SPEC.intermediate_size * 2  # the largest Llama linear, bf16
    assert offload_memory(SPEC, _off(4), _wl("transformers")).streamed_buffer_bytes == pytest.approx(down)


def test_transformers_holds_a_bitsandbytes_plans_offloaded_layers_unquantized():
    int8 = offload_memory(SPEC, _off(4), _wl("transformers", "int8"))
    bf16 = offload_memory(SPEC, _off(4), _wl("transformers"))
    assert int8.host_bytes == pytest.approx(bf16.host_bytes)
    assert int8.weights_off_gpu_bytes < 0.6 * bf16.weights_off_gpu_bytes  # the GPU frees only int8 bytes


def test_stream_time_is_bytes_over_the_host_link():
    wl = _wl("vllm")
    mem = offload_memory(SPEC, _off(6), wl)
    t = offload_pass_seconds(SPEC, HW, _off(6), wl, gpu_seconds=1e-3, tokens=1, kv_bytes_read=0.0, decode=True)
    link = HW.host_link.bandwidth_bytes_per_second * HW.host_link.efficiency
    assert t.seconds == pytest.approx(mem.weights_held_bytes / link) and t.bound == "host link"
    step = pass_time(SPEC, HW, _off(6), wl, batch=1, q_len=1, kv_len=1088, decode=True)
    assert step.offload == pytest.approx(t.seconds)


def test_llama_cpp_decode_reads_host_layers_from_dram_and_prefill_copies_them_per_ubatch():
    wl = _wl("llamacpp", "q4_k_m")
    mem = offload_memory(SPEC, _off(8), wl)
    layers_bytes = mem.weights_held_bytes - mem.embedding_off_gpu_bytes
    decode = offload_pass_seconds(SPEC, HW, _off(8), wl, gpu_seconds=1e-3, tokens=1, kv_bytes_read=0.0, decode=True)
    dram = HW.host_memory_bandwidth_bytes_per_second * HW.host_memory_efficiency
    assert decode.seconds == pytest.approx(layers_bytes / dram) and decode.bound == "host memory"
    prompt = 1500
    prefill = offload_pass_seconds(SPEC, HW, _off(8), wl, gpu_seconds=1e-3, tokens=prompt, kv_bytes_read=0.0,
                                   decode=False)
    link = HW.host_link.bandwidth_bytes_per_second * HW.host_link.efficiency
    assert prefill.seconds == pytest.approx(math.ceil(prompt / wl.max_num_batched_tokens) * layers_bytes / link)


def test_the_search_finds_the_fewest_offloaded_layers_that_fit():
    big = load_model("llama-3.1-70b").spec
    wl = inference_workload(
        engine=engine_rules("vllm"), hw=HW, model_max_len=big.max_position_embeddings, max_model_len=4096,
        max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=None, weight_dtype=None, quantization="int4", enforce_eager=False, input_len=1024,
        output_len=128, batch_size=None)
    assert not serving_memory(big, HW, Layout(), wl).fits
    found = fewest_offloaded_layers(big, HW, Layout(), wl, SearchResult(training=False, goal=None, gpu_counts=[1]))
    assert found is not None
    layout, sm = found
    assert sm.fits and 0 < layout.offload_layers < big.num_layers
    one_less = replace(layout, offload_layers=layout.offload_layers - 1)
    assert not serving_memory(big, HW, one_less, wl).fits


def test_an_engine_without_offload_gets_no_offloaded_layout():
    wl = _wl("sglang")
    assert fewest_offloaded_layers(SPEC, HW, Layout(), wl, SearchResult(training=False, goal=None, gpu_counts=[1])) is None


def test_accelerate_copies_from_pageable_memory_at_the_profiles_pageable_rate():
    """transformers/accelerate copies from pageable tensors; vLLM pins them. With a profile that
    states its pageable efficiency the stream costs that rate; without one the report says the
    copy is costed at the pinned rate."""
    from shardplan.cost.estimate import estimate

    wl = _wl("transformers")
    assert not wl.offload_pinned and _wl("vllm").offload_pinned
    pinned = offload_pass_seconds(SPEC, HW, _off(6), wl, gpu_seconds=0.0, tokens=1, kv_bytes_read=0.0, decode=True)
    slow = replace(HW, host_link_pageable_efficiency=HW.host_link.efficiency / 3)
    pageable = offload_pass_seconds(SPEC, slow, _off(6), wl, gpu_seconds=0.0, tokens=1, kv_bytes_read=0.0, decode=True)
    assert pageable.seconds == pytest.approx(3 * pinned.seconds)
    notes = estimate(SPEC, HW, _off(6), wl).assumptions
    assert any("pageable" in n and "pinned rate" in n for n in notes)
    assert not any("pageable" in n for n in estimate(SPEC, slow, _off(6), wl).assumptions)
