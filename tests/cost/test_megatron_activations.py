"""What Megatron-Core with Transformer Engine keeps for backward, as knowledge/stacks/megatron.yaml
sources it: no routed experts' outputs since core 0.13 (the router probabilities multiply inside the
weighted SwiGLU), fp8 copies of the GEMM inputs under fp8, and fine-grained selective recomputation
(--recompute-modules), each module keeping only its input. Every expected byte count is written
from the model's shapes here, term by term, and compared with the per-layer activation model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost.compute import _block_linear_time, _compute_shape, recomputed_forward
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, Recompute
from shardplan.cost.memory_training import (
    activation_bytes_per_layer,
    dropout_kinds,
    megatron_fp8_recipe,
    recomputed_modules,
)
from shardplan.cost.params import block_weights
from shardplan.cost.time_training import _training_work, layers_seconds_lower_bound
from shardplan.knowledge.load import stack_rules
from shardplan.specs.loading import load_hardware, load_model
from shardplan.units import DType

DSV3 = load_model("deepseek-v3").spec
MIXTRAL = load_model("mixtral-8x7b").spec
LLAMA = load_model("llama-3.1-8b").spec
S = 4096
A = 2  # bf16


def _wl(**kw):
    return training_workload(seq_len=S, global_batch_size=64, optimizer="adamw", framework=None, flash_attention=None,
                             dropout=False, stack=stack_rules("megatron"), **kw)


def _bytes(spec, wl, moe_layer: bool, recompute: Recompute = Recompute.SELECTIVE, tp: int = 1) -> float:
    layout = Layout(tp=tp, ep=8, sequence_parallel=tp > 1, recompute=recompute)
    return activation_bytes_per_layer(spec, layout, wl, moe_layer, 1)


def test_megatron_keeps_no_routed_expert_outputs_since_core_0_13():
    """The only difference from a stack that multiplies the experts' outputs by the router
    probabilities (Megatron-Core before 0.13, transformers' Mixtral) is those outputs: tokens x
    top-k rows of the hidden size."""
    wl = _wl()
    assert wl.moe_expert_outputs_saved is False
    before = replace(wl, moe_expert_outputs_saved=True)
    rows = S * MIXTRAL.moe.num_experts_per_token
    assert _bytes(MIXTRAL, before, True) - _bytes(MIXTRAL, wl, True) == A * rows * MIXTRAL.hidden_size
    assert _bytes(MIXTRAL, before, False) == _bytes(MIXTRAL, wl, False)  # a dense layer has none


def test_fp8_keeps_one_byte_copies_of_the_gemm_inputs_and_both_copies_of_the_attention_output():
    """Llama 3.1 8B under delayed scaling: the QKV, fc1 and fc2 inputs go from 2 bytes to 1; the
    output projection's fp8 copy sits beside the attention kernel's own 16-bit output (1.5x)."""
    bf16, fp8 = _wl(), _wl(matmul_dtype="fp8")
    assert fp8.fp8_saves_quantized_inputs and megatron_fp8_recipe(fp8.recompute_modules) == "delayed"
    h, ffn, q = LLAMA.hidden_size, LLAMA.intermediate_size, LLAMA.num_attention_heads * LLAMA.attention_head_dim
    # keep the attention core's output (no recomputation) so the kernel's 16-bit copy is kept
    saved = (A - 1) * S * h * 2 + (A - 1) * S * ffn - 1 * S * q
    assert _bytes(LLAMA, bf16, False, Recompute.NONE) - _bytes(LLAMA, fp8, False, Recompute.NONE) == saved
    # a stack whose linears keep their 16-bit inputs (torchao's Float8Linear) saves nothing by fp8
    hf_like = replace(fp8, fp8_saves_quantized_inputs=False)
    assert _bytes(LLAMA, hf_like, False, Recompute.NONE) == _bytes(LLAMA, bf16, False, Recompute.NONE)


def test_current_scaling_saves_the_attention_output_once():
    """Recomputing layernorm (or moe_act) needs Megatron's current (tensorwise) scaling, under which
    the output projection keeps the attention output itself (save_original_input)."""
    fp8 = _wl(matmul_dtype="fp8", recompute_modules="core_attn,layernorm")
    assert megatron_fp8_recipe(fp8.recompute_modules) == "tensorwise"
    bf16 = replace(fp8, matmul_dtype=DType.BF16)
    h, ffn = LLAMA.hidden_size, LLAMA.intermediate_size
    assert _bytes(LLAMA, bf16, False) - _bytes(LLAMA, fp8, False) == (A - 1) * S * (2 * h + ffn)


def _modules_diff(spec, moe_layer: bool, module: str) -> float:
    """Bytes one layer saves by recomputing `module` beside the attention core (Megatron's default)."""
    base = _wl(recompute_modules="core_attn")
    more = replace(base, recompute_modules=("core_attn", module))
    return _bytes(spec, base, moe_layer) - _bytes(spec, more, moe_layer)


def test_each_recompute_module_drops_what_megatron_discards():
    m, moe = DSV3.mla, DSV3.moe
    heads, h = DSV3.num_attention_heads, DSV3.hidden_size
    rows = S * moe.num_experts_per_token
    # mla_up_proj: Q and K/V are computed again; the compressed q, kv and the rotary key are kept
    kept_before = heads * m.qk_head_dim + m.kv_lora_rank + m.qk_rope_head_dim + heads * (m.qk_nope_head_dim + m.v_head_dim)
    kept_after = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
    assert _modules_diff(DSV3, True, "mla_up_proj") == A * S * (kept_before - kept_after)
    # under sequence parallelism the compressed q and kv are shards of the sequence, the rotary key whole
    base = _wl(recompute_modules="core_attn")
    more = replace(base, recompute_modules=("core_attn", "mla_up_proj"))
    sp_kept_after = (m.q_lora_rank + m.kv_lora_rank) / 2 + m.qk_rope_head_dim
    sp_kept_before = (heads * m.qk_head_dim + heads * (m.qk_nope_head_dim + m.v_head_dim)) / 2 \
        + m.kv_lora_rank + m.qk_rope_head_dim
    assert _bytes(DSV3, base, True, tp=2) - _bytes(DSV3, more, True, tp=2) == pytest.approx(
        A * S * (sp_kept_before - sp_kept_after))
    # moe_act: the experts' activation output (fc2's input)
    assert _modules_diff(DSV3, True, "moe_act") == A * rows * moe.expert_intermediate_size
    # layernorm: MLA's input norm and the MoE pre-MLP norm are modules of their own; their outputs go
    assert _modules_diff(DSV3, True, "layernorm") == A * S * h * 2
    # ... a dense Llama fuses both into the next linear: nothing to discard
    assert _modules_diff(LLAMA, False, "layernorm") == 0
    # shared_experts: the shared expert's gate, up and activation outputs
    assert _modules_diff(DSV3, True, "shared_experts") == A * S * 3 * moe.shared_intermediate_size
    # moe: the whole MoE layer keeps its input only: router logits, dispatched tokens, the experts'
    # and the shared expert's intermediates go
    whole = 4 * S * moe.num_experts + A * rows * h + A * rows * 3 * moe.expert_intermediate_size \
        + A * S * 3 * moe.shared_intermediate_size
    assert _modules_diff(DSV3, True, "moe") == whole
    # mlp: a dense layer's MLP (DeepSeek-V3's first three) keeps its input only, the residual (its
    # norm is fused into fc1: the layer spec of a dense layer is built without experts)
    assert _modules_diff(DSV3, False, "mlp") == A * S * (3 * DSV3.intermediate_size + h)
    assert _modules_diff(DSV3, True, "mlp") == 0  # not an MoE layer's
    # ... so layernorm frees only MLA's input norm's output there
    assert _modules_diff(DSV3, False, "layernorm") == A * S * h


def test_checkpointed_shared_experts_keep_no_fp8_copy_of_their_input():
    """Under delayed fp8 scaling the shared experts' fc1 keeps an fp8 copy of the pre-MLP norm's
    output beside the router's 16-bit one; checkpointed ("shared_experts" or "moe"), it keeps none."""
    moe, h = DSV3.moe, DSV3.hidden_size
    base = _wl(recompute_modules="core_attn", matmul_dtype="fp8")
    shared = replace(base, recompute_modules=("core_attn", "shared_experts"))
    # gate and up outputs (16-bit), the activation output (fc2's fp8 copy), and fc1's fp8 input copy
    assert _bytes(DSV3, base, True) - _bytes(DSV3, shared, True) == S * (A * 2 + 1) * moe.shared_intermediate_size \
        + S * h * 1


def test_core_attn_is_the_default_and_modules_apply_under_selective_only():
    wl = _wl(recompute_modules="mla_up_proj")
    assert recomputed_modules(wl, Recompute.SELECTIVE) == {"mla_up_proj"}
    assert recomputed_modules(wl, Recompute.NONE) == frozenset()
    assert recomputed_modules(_wl(), Recompute.SELECTIVE) == {"core_attn"}
    # without core_attn, the attention kernel's log-sum-exp stays: fp32 per head and token
    assert _bytes(DSV3, wl, True) - _bytes(DSV3, replace(wl, recompute_modules=("core_attn", "mla_up_proj")), True) \
        == 4 * DSV3.num_attention_heads * S


def test_recomputed_modules_add_their_forward_gemms_to_the_step():
    """mla_up_proj runs q_b_proj and kv_b_proj again in every layer's backward: the layers' time grows
    by those GEMMs at the forward's speed, and by two kernels' overhead each."""
    hw = load_hardware("h100-sxm-80gb")
    base = _wl(recompute_modules="core_attn")
    more = replace(base, recompute_modules=("core_attn", "mla_up_proj"))
    layout = Layout(tp=1, ep=8, recompute=Recompute.SELECTIVE)
    grown = layers_seconds_lower_bound(DSV3, hw, layout, more) - layers_seconds_lower_bound(DSV3, hw, layout, base)
    work = _training_work(hw, base, 1, 1, dropout_kinds(DSV3, base))
    ups = [w for w in block_weights(DSV3, False, False) if w.name in ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")]
    assert len(ups) == 2
    gemms = sum(_block_linear_time(DSV3, hw, _compute_shape(layout, False), w, work)[0] for w in ups)
    expected = DSV3.num_layers * (gemms + 2 * hw.kernel_overhead_seconds)
    assert grown == pytest.approx(expected, rel=1e-9)
    assert recomputed_forward(DSV3, hw, layout, work, (0,), ("mla_up_proj",)).matmul_seconds == pytest.approx(gemms)
