"""Eager host time by layer kind (time_serving.layer_ops): SGLang's counts by part
(knowledge/engines/sglang.yaml python_ops_per_layer_parts, counted in its source:
docs/research/ops-per-layer.md) add up per layer, and engines with one count keep it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost import inputs
from shardplan.cost.layout import Layout
from shardplan.cost.time_serving import layer_ops
from shardplan.cost.workload import Quantization
from shardplan.knowledge.load import engine_rules
from shardplan.specs import loading

H100 = loading.load_hardware("h100-sxm-80gb")


def _wl(engine: str, version: str, spec, quantization: str | None = None):
    return inputs.inference_workload(
        engine=engine_rules(engine, version), hw=H100, model_max_len=spec.max_position_embeddings, max_model_len=4096,
        max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=None, weight_dtype=None, quantization=quantization, enforce_eager=False, input_len=1024,
        output_len=128, batch_size=None)


def test_sglang_counts_each_layer_by_its_parts():
    llama = loading.load_model("llama-3.1-8b").spec
    qwen3_moe = loading.load_model("qwen3-30b-a3b").spec
    ds = loading.load_model("deepseek-v3").spec
    wl = _wl("sglang", "0.5.6", llama)
    # norms 2 + GQA attention 20 + gated MLP 4; two all-reduces of 3 ops each under tensor parallelism
    assert layer_ops(llama, wl, 0, tp=1) == 26
    assert layer_ops(llama, wl, 0, tp=8) == 32
    # Qwen3 MoE: + per-head q/k norms 8, the MoE block 30 instead of the MLP
    assert layer_ops(qwen3_moe, _wl("sglang", "0.5.6", qwen3_moe), 0, tp=1) == 2 + 20 + 8 + 30
    # DeepSeek-V3 in its FP8 blocks: MLA 39, MoE 30 and one shared expert 4, and 10 more ops for each of
    # MLA's 5 linears and the shared expert's 2; the first 3 layers are dense
    dwl = _wl("sglang", "0.5.6", ds, quantization="fp8")
    assert ds.fp8_weight_block_size == (128, 128)
    assert layer_ops(ds, dwl, 10, tp=8) == 2 + 39 + 30 + 4 + 7 * 10 + 2 * 3
    assert layer_ops(ds, dwl, 0, tp=8) == 2 + 39 + 4 + 7 * 10 + 2 * 3
    # 0.5.3 called kv_b_proj once on the MLA prefill path (0.5.6 twice): 11 fewer ops
    assert layer_ops(ds, _wl("sglang", "0.5.3", ds, quantization="fp8"), 10, tp=8) == 2 + 28 + 30 + 4 + 70 + 6
    # the same weights served in bf16 issue no quantization ops
    assert layer_ops(ds, replace(dwl, quantization=Quantization.NONE), 10, tp=8) == 2 + 39 + 30 + 4 + 6


def test_engines_with_one_count_keep_it_for_every_layer():
    ds = loading.load_model("deepseek-v3").spec
    wl = _wl("vllm", "0.11.0", ds, quantization="fp8")
    assert not wl.python_ops_per_layer_parts
    assert layer_ops(ds, wl, 0, tp=8) == layer_ops(ds, wl, 10, tp=1) == wl.python_ops_per_layer == 26


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
def test_an_eager_sglang_prefill_of_a_moe_model_is_host_bound_at_short_prompts(model):
    """SGLang runs prompt steps without CUDA graphs: a one-token prefill of a MoE/MLA model takes
    its layers' ops at the host's per-op cost, far above the GPU's time. (SGLang PR #12160 measured
    a DeepSeek-V3 one-token prefill at 82.6 ms without a graph, 23.1 ms with one, GPU and tensor
    parallelism not stated; this step, on the MHA prefill path at tp 8 on H100s, is 96 ms, of which
    86 ms are its ops: docs/research/ops-per-layer.md.)"""
    from shardplan.cost.step_model import StepModel

    spec = loading.load_model(model).spec
    tp = 8
    hw = H100.with_topology(gpus_per_node=8)
    wl = _wl("sglang", "0.5.6", spec, quantization="fp8" if spec.fp8_weight_block_size else None)
    layout = Layout(tp=tp)
    step = StepModel(spec, hw, layout, wl, wl.max_num_batched_tokens, wl.max_num_seqs)
    seconds = step.seconds(tokens=1, sampled=1, decoding=0, kv_tokens=0, prompt_units=1, prompt_step=True)
    host = sum(layer_ops(spec, wl, i, tp) for i in range(spec.num_layers)) * hw.python_op_seconds
    graphed = StepModel(spec, hw, layout, replace(wl, graphs_for_prompt_steps=True), wl.max_num_batched_tokens,
                        wl.max_num_seqs).seconds(tokens=1, sampled=1, decoding=0, kv_tokens=0, prompt_units=1,
                                                 prompt_step=True)
    # the ops hide the GPU's work, never the reverse: host <= step <= host + the graphed step
    assert host <= seconds <= host + graphed
    assert seconds > 2 * graphed


@pytest.mark.parametrize(("quant", "expected"), [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, (128, 128)),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, None),  # per-tensor FP8: no blocks
    ({"quant_method": "fp8", "weight_block_size": [True, 128]}, None),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, None),
    ({"quant_method": "fp8", "weight_block_size": "128x128"}, None),
    ({"quant_method": "awq", "weight_block_size": [128, 128]}, None),
    ("fp8", None),
])
def test_only_a_block_quantized_fp8_config_marks_its_weights(quant, expected):
    from shardplan.specs.hf import spec_from_hf_config

    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "quantization_config": quant}
    assert spec_from_hf_config(cfg, "m").fp8_weight_block_size == expected
