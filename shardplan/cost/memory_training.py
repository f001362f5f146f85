"""Training memory per GPU: model states (ZeRO), activations (Korthikanti et al. 2022),
temporaries and runtime overhead, for every pipeline stage.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1, 5.1): with Psi
parameters on a rank, 16-bit weights (2 Psi), 16-bit gradients (2 Psi) and K Psi bytes of
optimizer state, partitioned over the N_d data-parallel ranks by stage:
  stage 0: (2 + 2 + K) Psi     stage 1: (2 + 2) Psi + K Psi / N_d
  stage 2: 2 Psi + (2 + K) Psi / N_d    stage 3: (2 + 2 + K) Psi / N_d
Routed experts shard over their own data-parallel group (dp x cp x tp / (ep x etp)).
"""

from __future__ import annotations

import dataclasses

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from shardplan.cost.breakdown import MemoryBreakdown, RankMemory
from shardplan.cost.finetune import adapter_params, base_format_bytes, is_nf4_base_weight, targeted_modules
from shardplan.cost.layout import Layout, Offload, PipelineSchedule, Recompute, flat_layers, layout_stage_ranges
from shardplan.cost.params import WeightKind, block_weights, chunk_layer_kinds, layer_kinds
from shardplan.cost.weights import StageWeights, numel_per_rank, stage_tensors, stage_weights
from shardplan.cost.workload import Framework, Optimizer, Quantization, TrainingWorkload
from shardplan.knowledge.model_support import hf_norm_readers
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.units import DType, bytes_per_element

FP32_BYTES = 4.0
DROPOUT_MASK_BYTES = 1.0  # Korthikanti et al.: one byte per element
FP8_BYTES = 1.0
# DeepSpeed's estimators size host buffers at 1.5x the offloaded states
# (`additional_buffer_factor` in deepspeed/runtime/zero/stage_1_and_2.py and stage3.py).
DEEPSPEED_HOST_BUFFER_FACTOR = 1.5


ADAM_8BIT_BLOCK = 256  # elements per fp32 absmax constant of a bitsandbytes 8-bit optimizer state


def optimizer_moment_bytes(optimizer: Optimizer) -> float:
    """Bytes per parameter of the optimizer's moments (no master copy): Adam's m and v in fp32;
    SGD's momentum; 8-bit AdamW's two uint8 moments with an fp32 absmax per block of 256
    (bitsandbytes Optimizer8bit, block-wise quantization)."""
    if optimizer is Optimizer.ADAMW_8BIT:
        return 2.0 * (1.0 + FP32_BYTES / ADAM_8BIT_BLOCK)
    return {Optimizer.ADAMW: 8.0, Optimizer.ADAM: 8.0, Optimizer.SGD: 4.0}[optimizer]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state."""

    weights: float
    gradients: float
    optimizer: float  # K
    grads_partitioned_from_stage: int  # 2 in the ZeRO paper; 3 where stage 1/2 keep full gradients


@lru_cache(maxsize=1024)
def state_bytes(wl: TrainingWorkload, zero_stage: int) -> StateBytes:
    """Bytes per parameter of each state. K (optimizer) holds the moments (Adam: m and v,
    SGD: momentum, fp32) and an fp32 master copy of the weights where one exists apart from
    them: always with 16-bit weights; with fp32 weights only under ZeRO-1/2, whose optimizer
    partition is a separate fp32 copy (DeepSpeed's fp32 partition; FSDP2 without resharding
    keeps the sharded parameter beside the gathered one). Under ZeRO-0/3 fp32 weights are
    their own master."""
    w = bytes_per_element(wl.param_dtype)
    master = bytes_per_element(wl.master_dtype)
    # Adam's and SGD's moments in the optimizer's moment dtype (8-bit AdamW's are its own)
    moments = optimizer_moment_bytes(wl.optimizer)
    if wl.optimizer is not Optimizer.ADAMW_8BIT:
        moments *= bytes_per_element(wl.moment_dtype) / FP32_BYTES
    separate_master = wl.param_dtype is not DType.FP32 or zero_stage in (1, 2)
    master_and_moments = moments + (master if separate_master else 0.0)
    if wl.framework is Framework.DEEPSPEED:  # its ZeRO optimizer holds a master partition apart from the weights
        # A gradient partition in the master's dtype joins the optimizer (K + 4 in fp32); under
        # stage 3 the 16-bit gradients are reduce-scattered straight into it, so none are kept
        # apart. bf16 master weights and gradients: 2 + 2 + 2 + 4 = 10 bytes a parameter with
        # bf16 moments (DeepSpeedExamples training/bf16_master_weight/README.md, "Memory Breakdown").
        grads = 0.0 if zero_stage == 3 else w
        return StateBytes(w, grads, master_and_moments + master, grads_partitioned_from_stage=3)
    if wl.framework is Framework.MEGATRON:
        if wl.moment_dtype is not DType.FP32 and wl.param_dtype is DType.BF16 and separate_master:
            # The precision-aware optimizer (Transformer Engine's FusedAdam, store_param_remainders,
            # on by default) keeps the fp32 master as the 16 bits the bf16 weight lacks: an int16
            # remainder (megatron/core/optimizer/distrib_optimizer.py; optimizer_config.py).
            master_and_moments = moments + 2.0
        # Main gradients in fp32 unless the stack reduces them in bf16 (knowledge/stacks/megatron.yaml)
        return StateBytes(w, bytes_per_element(wl.grad_reduce_dtype), master_and_moments, grads_partitioned_from_stage=2)
    if wl.param_dtype is not DType.FP32 and wl.master_dtype is wl.param_dtype and zero_stage not in (1, 2):
        # torch.optim steps the parameters it is given: 16-bit weights in the master's dtype are
        # their own master (pure bf16 training: a model loaded in bf16, no AMP)
        master_and_moments = moments
    return StateBytes(w, w, master_and_moments, grads_partitioned_from_stage=2)


@dataclass(frozen=True)
class ModelStates:
    weights: float
    gradients: float
    optimizer: float
    temporary: float
    host: float
    nvme: float


def model_states_bytes(
    num_params: float,
    largest_layer_params: float,
    shard_degree: float,
    zero_stage: int,
    sb: StateBytes,
    offload_optimizer: Offload,
    offload_params: Offload,
) -> ModelStates:
    """Model-state bytes on one GPU for `num_params` parameters partitioned over
    `shard_degree` ranks. Offloading the optimizer moves its states and the gradients to
    the host (ZeRO-Offload, Ren et al. 2021, Sec. 4); offloading parameters (stage 3) leaves
    only the gathered units on the GPU. Stage 3 gathers the current and the prefetched
    unit: 2 x largest layer in 16-bit (DeepSpeed's `4 * largest_layer_params`)."""
    n = shard_degree
    weights = num_params * sb.weights / (n if zero_stage >= 3 else 1)
    grads = num_params * sb.gradients / (n if zero_stage >= sb.grads_partitioned_from_stage else 1)
    opt = num_params * sb.optimizer / (n if zero_stage >= 1 else 1)
    temp = 2 * largest_layer_params * sb.weights if zero_stage >= 3 else 0.0
    host = nvme = 0.0
    if offload_optimizer is not Offload.NONE:
        moved = opt + (num_params * sb.gradients / n if zero_stage >= 1 else grads)
        if offload_optimizer is Offload.CPU:
            host += moved
        else:
            nvme += opt
            host += moved - opt
        opt, grads = 0.0, 0.0
    if offload_params is not Offload.NONE:
        if offload_params is Offload.CPU:
            host += weights
        else:
            nvme += weights
        weights = 0.0
    return ModelStates(weights, grads, opt, temp, host, nvme)


def dropout_kinds(spec: ModelSpec, wl: TrainingWorkload) -> tuple[bool, bool]:
    """(on the attention probabilities, on the residual branches and embeddings) under the
    workload's dropout: the kinds the model's config sets (OPT: attention_dropout 0.0, dropout
    0.1); with dropout asked of a model whose config sets none, both (Korthikanti et al. 2022)."""
    if not wl.dropout:
        return False, False
    if not spec.trains_with_dropout:
        return True, True
    return spec.attention_dropout > 0, spec.hidden_dropout > 0


def activation_bytes_per_layer(
    spec: ModelSpec, layout: Layout, wl: TrainingWorkload, moe_layer: bool, micro_batch_size: int,
    linear_attention: bool = False,
) -> float:
    """`_activation_bytes_per_layer`, cached on the layout's fields it reads."""
    return _activation_bytes_cached(spec, wl, layout.tp, layout.cp, layout.expert_tp, layout.sequence_parallel,
                                    layout.recompute, moe_layer, micro_batch_size, linear_attention)


@lru_cache(maxsize=65536)
def _activation_bytes_cached(
    spec: ModelSpec, wl: TrainingWorkload, tp: int, cp: int, etp: int, sp: bool, recompute: Recompute, moe_layer: bool,
    micro_batch_size: int, linear_attention: bool,
) -> float:
    layout = Layout(tp=tp, cp=cp, etp=etp, sequence_parallel=sp, recompute=recompute)
    return _activation_bytes_per_layer(spec, layout, wl, moe_layer, micro_batch_size, linear_attention)


def _activation_bytes_per_layer(
    spec: ModelSpec, layout: Layout, wl: TrainingWorkload, moe_layer: bool, micro_batch_size: int,
    linear_attention: bool = False,
) -> float:
    """Activations one layer keeps for backward, per micro-batch, on one GPU.

    Generalises Korthikanti et al. 2022, Sec. 4.1 (s b h (34 + 5 a s / h) for GPT with
    dropout, no flash attention), term by term, to GQA/MLA, gated MLPs, MoE, flash
    attention, context parallelism (s -> s / cp), tensor and sequence parallelism (terms
    outside the tensor-parallel region are divided by t only with sequence parallelism),
    and recomputation (selective drops the attention core; full keeps the layer input).
    `linear_attention` picks the layer's LoRA targets (its linears are a Gated DeltaNet's); the
    attention terms themselves are softmax attention's.
    Under context parallelism K and V are s / cp too: ring and all-gather attention keep the
    rank's own K/V and exchange them again in backward (torch's `_templated_ring_attention_
    backward`; TransformerEngine's AttnFuncWithCPAndKVAllGather); `shardplan verify` measures it.
    """
    s = wl.seq_len / layout.cp
    b = micro_batch_size
    h = spec.hidden_size
    t = layout.tp
    a_bytes = bytes_per_element(wl.activation_dtype)
    rep = 1.0 / t if layout.sequence_parallel else 1.0  # share of a "replicated" sbh term
    sbh = s * b * h
    r_bytes = residual_bytes(wl)
    if layout.recompute is Recompute.FULL:
        return r_bytes * sbh * rep
    heads = spec.num_attention_heads
    if (layout.recompute is Recompute.SELECTIVE and wl.selective_policy == "op_level" and spec.mla is None
            and not (moe_layer and spec.moe is not None)):
        return op_level_selective_bytes(spec, layout, wl, micro_batch_size)
    modules = recomputed_modules(wl, layout.recompute)
    moe_here = moe_layer and spec.moe is not None
    # Under fp8 GEMMs a Transformer Engine linear saves its input's fp8 copy (1 byte), not the
    # 16-bit tensor; where another op saves the 16-bit tensor too, both are kept. Under current
    # scaling Megatron makes the linears whose input another op keeps save that input instead
    # (save_original_input): the attention output projection, the shared experts' fc1, and those
    # after a recomputed (discarded) output (knowledge/stacks/megatron.yaml).
    q8 = wl.matmul_dtype is DType.FP8 and wl.fp8_saves_quantized_inputs
    lin = FP8_BYTES if q8 else a_bytes  # a linear's saved input that no other op keeps
    delayed = q8 and megatron_fp8_recipe(modules) == "delayed"
    attention_dropout, hidden_dropout = dropout_kinds(spec, wl)
    mask = DROPOUT_MASK_BYTES * sbh * rep if hidden_dropout else 0.0
    # A linear's input is saved for its weight gradient; a frozen base (LoRA) keeps it only
    # where an adapter sits on that linear (cost/finetune.py).
    kept = _saved_linear_inputs(spec, wl, moe_layer, linear_attention)
    total = spec.num_norms_per_layer * r_bytes * sbh * rep  # norm inputs (the residual stream)
    if wl.norms_fp32 and r_bytes < FP32_BYTES:
        # The norm's fp32 copy of its input, saved for backward (HF RMSNorm: hidden_states.to(
        # torch.float32)); an fp32 residual stream (QLoRA under prepare_model_for_kbit_training)
        # is its own copy, since .to() of a tensor already in that dtype returns the tensor itself.
        total += spec.num_norms_per_layer * FP32_BYTES * sbh * rep
    # Attention: input of the QKV projection (the norm's output), Q, K, V, input of the output
    # projection. MLA's input norm is a module of its own (Megatron's layer spec fuses the other
    # norms into the next linear): "layernorm" recomputation discards its output; under fp8 its
    # two down-projections each keep an fp8 copy.
    if "layernorm" in modules and spec.mla is not None:
        qkv_in = 0.0
    else:
        qkv_in = (lin * (2 if spec.mla is not None else 1)) if q8 else a_bytes
    total += qkv_in * sbh * rep * kept["qkv"]
    core_attn = "core_attn" in modules
    if not q8:
        attn_out = a_bytes
    elif delayed:  # the fp8 copy beside the attention kernel's own 16-bit output (not kept when recomputed)
        attn_out = (a_bytes if wl.flash_attention and not core_attn else 0.0) + FP8_BYTES
    else:
        attn_out = a_bytes
    if spec.mla is not None:
        m = spec.mla
        if "mla_up_proj" in modules:
            # Only the up-projections' inputs are kept (q_compressed, kv_compressed, k_pos_emb):
            # Q, K and V are computed again in backward (MultiLatentAttention qkv_up_checkpoint).
            # The compressed q and kv are sequence-parallel shards; the rotary key is whole.
            total += a_bytes * s * b * (((m.q_lora_rank or 0) + m.kv_lora_rank) * rep + m.qk_rope_head_dim)
        else:
            total += a_bytes * s * b * (heads * m.qk_head_dim / t + (m.kv_lora_rank + m.qk_rope_head_dim))
            total += a_bytes * s * b * heads * (m.qk_nope_head_dim + m.v_head_dim) / t
        total += attn_out * s * b * heads * m.v_head_dim / t
    else:
        d = spec.attention_head_dim
        kv_share = min(t, spec.kv_heads)
        total += a_bytes * s * b * (heads * d / t + 2 * spec.kv_heads * d / kv_share)
        total += attn_out * s * b * heads * d / t
    total += mask  # attention output dropout
    # Attention core: softmax output (+ its dropout mask and output) without flash
    # attention; flash attention keeps only the fp32 log-sum-exp per head and row.
    if not core_attn:
        if wl.flash_attention:
            total += FP32_BYTES * heads * s * b / t
        else:
            scores = heads * s * (wl.seq_len if layout.cp == 1 else s * layout.cp) * b / t
            # The softmax's output (its backward's), and what the product with V saves: the same tensor,
            # a 16-bit copy of an fp32 softmax output, or dropout's output with its 1-byte mask (the
            # copy before it is then not kept). Counted against transformers' layers on CPU:
            # tests/cost/test_layer_activations_torch.py.
            if wl.eager_softmax_fp32:
                total += FP32_BYTES * scores + (0.0 if attention_dropout else a_bytes * scores)
            else:
                total += a_bytes * scores
            if attention_dropout:
                total += (DROPOUT_MASK_BYTES + a_bytes) * scores
    # MLP.
    # gate+up outputs and the activation output; or the input and output of GeLU. ReLU saves its
    # output, which is also the down projection's input: one tensor (transformers' OPT layer on
    # CPU: 2 bytes a token per intermediate unit fewer than GeLU, tests/cost/test_layer_activations_torch.py).
    relu = not spec.mlp_gated and spec.hidden_act == "relu"
    width_factor = 3 if spec.mlp_gated else (1 if relu else 2)
    # An eager gated MLP (act(gate) * up, unfused) keeps act(gate) too: the product saves both its
    # operands, the activation its input. A fused SwiGLU (Megatron's bias_swiglu, Inductor) keeps
    # gate and up and recomputes the activation. Counted against transformers' LlamaMLP on CPU:
    # tests/cost/test_layer_activations_torch.py.
    eager_glu = 1 if spec.mlp_gated and not wl.elementwise_fused else 0
    fc1_out = width_factor - 1 + eager_glu  # widths of the first projections' outputs the activation keeps
    # The down projection's input (the activation's output): ReLU keeps it itself; a linear's copy
    act_out = (a_bytes + (FP8_BYTES if q8 else 0.0)) if relu else lin
    # The MLP's input (the pre-MLP norm's output). An MoE layer's pre-MLP norm is a module of its
    # own in Megatron's layer spec ("layernorm" recomputation discards its output); the router
    # keeps it in 16 bits and, under delayed fp8 scaling, the shared experts' fc1 an fp8 copy
    # unless they are checkpointed. A dense layer's norm is fused into fc1 (its layer spec is
    # built without experts: pre_mlp_layernorm is IdentityOp), which keeps the norm's output,
    # and a checkpointed MLP ("mlp") keeps the residual itself, already counted.
    shared_fc1_copy = (delayed and spec.moe is not None and spec.moe.num_shared_experts > 0
                       and not {"moe", "shared_experts"} & modules)
    if moe_here:
        mlp_in = 0.0 if "layernorm" in modules else a_bytes + (FP8_BYTES if shared_fc1_copy else 0.0)
    elif "mlp" in modules:
        mlp_in = 0.0
    else:
        mlp_in = lin
    total += mlp_in * sbh * rep * kept["mlp"] + mask  # MLP input, output dropout
    if moe_here and "moe" in modules:
        pass  # the MoE layer is checkpointed: it keeps its input only (above)
    elif moe_here:
        moe = spec.moe
        assert moe is not None
        k = moe.num_experts_per_token
        tokens = s * b * rep  # tokens of this rank entering the router
        # Rows this rank's experts run, spread evenly over the experts: each rank's k copies of
        # its tokens go to the experts' owners (all-to-all over ep, balanced on average); under
        # sequence parallelism each rank of an expert-tensor-parallel group holds other tokens,
        # so they are gathered over the etp ranks first (Megatron-core token_dispatcher.py:
        # "num_global_tokens: num_local_tokens*TP*EP", gather_from_sequence_parallel_region).
        # Without sequence parallelism the tp ranks already hold the same tokens.
        rows = tokens * k * (layout.expert_tp if layout.sequence_parallel else 1)
        total += FP32_BYTES * tokens * moe.num_experts  # router logits
        total += lin * rows * h  # permuted (dispatched) tokens, the experts' input
        # the first projections' outputs; the activation's output unless recomputed ("moe_act")
        expert_act = 0.0 if "moe_act" in modules else act_out
        total += rows * (a_bytes * fc1_out + expert_act) * moe.expert_intermediate_size / layout.expert_tp
        # expert outputs, kept by the multiplication with the router probabilities for the
        # probabilities' gradient (Megatron-core moe_utils.unpermute before core 0.13; HF Mixtral's
        # `expert_layer(x) * routing_weights`); measured by `shardplan verify` on a Mixtral proxy
        if wl.moe_expert_outputs_saved:
            total += a_bytes * rows * h
        if moe.num_shared_experts and "shared_experts" not in modules:
            total += (s * b * (a_bytes * fc1_out + act_out) * moe.shared_intermediate_size
                      * moe.num_shared_experts / t)
    elif "mlp" not in modules:
        down_in = act_out if (kept["down"] or relu) else 0.0  # the last is the down projection's input
        total += s * b * (a_bytes * fc1_out + down_in) * spec.intermediate_size / t
    if not wl.trains_base:
        total += lora_saved_bytes(spec, wl, moe_layer, s * b, linear_attention)
    return total


def recomputed_modules(wl: TrainingWorkload, recompute: Recompute) -> frozenset[str]:
    """What a layer recomputes in backward under selective recomputation, as Megatron-Core's
    --recompute-modules names it: the workload's modules under Megatron's (attention_core)
    policy, the attention core alone by default; none without selective recomputation."""
    if recompute is not Recompute.SELECTIVE:
        return frozenset()
    if wl.selective_policy == "attention_core" and wl.recompute_modules:
        return frozenset(wl.recompute_modules)
    return frozenset(("core_attn",))


def megatron_fp8_recipe(recomputed: Iterable[str]) -> str:
    """The fp8 scaling recipe Megatron runs for a plan that recomputes `recomputed`
    (`recomputed_modules`; `export --to megatron` passes it): delayed scaling, or per-tensor
    current scaling where "moe_act" or "layernorm" is recomputed,
    which Megatron-Core refuses under delayed scaling (transformer_config.py, core_v0.14.0: "Delayed
    scaling does not support moe_act and layernorm recompute for fp8")."""
    return "tensorwise" if {"moe_act", "layernorm"} & set(recomputed) else "delayed"


def residual_bytes(wl: TrainingWorkload) -> float:
    """Bytes per element of the residual stream: the activation dtype, or fp32 where the stack
    upcasts a QLoRA base's embedding to fp32 (PEFT prepare_model_for_kbit_training): the
    embedding's output is fp32, and each residual add of a 16-bit attention or MLP output into
    it stays fp32 (PyTorch type promotion), so every layer's input, saved by checkpointing, is too."""
    return FP32_BYTES if wl.base_fp32_non_quantized else bytes_per_element(wl.activation_dtype)


def _saved_linear_inputs(
    spec: ModelSpec, wl: TrainingWorkload, moe_layer: bool, linear_attention: bool = False
) -> dict[str, bool]:
    """Whether the inputs of the QKV projection, of the MLP's first projections and of the down
    projection are saved: always when the base trains; under LoRA only for targeted linears, and
    only without lora_dropout: with it the frozen base linear saves no input (its weight needs no
    gradient) and the adapter's A saves dropout(x), a copy `lora_saved_bytes` counts, not x
    (PEFT tuners/lora/layer.py Linear.forward: lora_B(lora_A(dropout(x))); with lora_dropout 0
    the dropout is nn.Identity and A saves x itself)."""
    if wl.trains_base:
        return {"qkv": True, "mlp": True, "down": True}
    if wl.lora_dropout > 0:
        return {"qkv": False, "mlp": False, "down": False}
    names = {name for name, _, _ in targeted_modules(spec, moe_layer and spec.moe is not None, wl.lora_targets,
                                                     linear_attention)}
    return {"qkv": bool(names & {"q_proj", "k_proj", "v_proj"}), "mlp": bool(names & {"gate_proj", "up_proj"}),
            "down": "down_proj" in names}


def lora_saved_bytes(
    spec: ModelSpec, wl: TrainingWorkload, moe_layer: bool, tokens: float, linear_attention: bool = False
) -> float:
    """What one layer's adapters save for backward (PEFT's LoRA Linear: B(A(dropout(x)))):
    A's output (r a token) for B's weight gradient and, with lora_dropout > 0, the dropped input
    (a copy A's weight gradient needs) and its 1-byte mask. Adapters run outside tensor parallelism."""
    a = bytes_per_element(wl.activation_dtype)
    total = 0.0
    for _, in_f, _ in targeted_modules(spec, moe_layer and spec.moe is not None, wl.lora_targets, linear_attention):
        total += a * tokens * wl.lora_rank
        if wl.lora_dropout > 0:
            total += (a + DROPOUT_MASK_BYTES) * tokens * in_f
    return total


def op_level_selective_bytes(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, micro_batch_size: int) -> float:
    """One dense layer's saved tensors under PyTorch op-level selective checkpointing (torchtitan's
    'op' policy, torch.utils.checkpoint.create_selective_checkpoint_contexts): the checkpoint's
    input, the attention kernel's output and log-sum-exp, and the output of every odd-numbered
    matmul of the layer in forward order (wq, wk, wv, wo, w1, w3, w2: q, v, the gate projection and
    the MLP output are kept; k, the output projection and the up projection are recomputed).
    Everything elementwise is recomputed."""
    s = wl.seq_len / layout.cp
    b = micro_batch_size
    h = spec.hidden_size
    t = layout.tp
    a = bytes_per_element(wl.activation_dtype)
    rep = 1.0 / t if layout.sequence_parallel else 1.0
    d = spec.attention_head_dim
    heads = spec.num_attention_heads
    kv_share = min(t, spec.kv_heads)
    mlp_in = spec.intermediate_size / t
    saved = a * s * b * h * rep  # the checkpoint's input
    saved += a * s * b * heads * d / t  # q (1st matmul)
    saved += a * s * b * spec.kv_heads * d / kv_share  # v (3rd)
    saved += a * s * b * heads * d / t + FP32_BYTES * heads * s * b / t  # attention output and log-sum-exp
    saved += a * s * b * mlp_in  # gate projection (5th)
    saved += a * s * b * h  # MLP output before the tensor-parallel reduction (7th)
    return saved


def in_flight_layer_activations(layout: Layout, stage: int, num_layers_on_stage: int, num_microbatches: int) -> float:
    """Layer-micro-batches of activations stage `stage` holds at its peak.

    1F1B: min(pp - stage, m) micro-batches of its layers (Narayanan et al. 2021, Sec. 2.2.1).
    Interleaved with v chunks: (pp - stage - 1) * 2 + (v - 1) * pp + 1 chunk-micro-batches in
    warm-up (Megatron-LM schedules.py), each of L/(pp v) layers; on stage 0 this is
    Korthikanti's L (1 + (p - 1) / (p v)). GPipe: all m micro-batches.
    """
    pp, v = layout.pp, layout.virtual_stages
    if layout.pp_schedule is PipelineSchedule.GPIPE:
        return num_layers_on_stage * num_microbatches
    if layout.pp_schedule is PipelineSchedule.INTERLEAVED:
        chunks = min((pp - stage - 1) * 2 + (v - 1) * pp + 1, num_microbatches * v)
        return chunks * num_layers_on_stage / v
    return num_layers_on_stage * min(pp - stage, num_microbatches)


def deepspeed_estimator_host_bytes(
    num_params: float,
    largest_layer_params: float,
    zero_stage: int,
    offload_optimizer: bool,
    offload_params: bool,
    gpus_per_node: int,
    num_nodes: int,
    zero_init: bool = True,
) -> float:
    """Host RAM per node as DeepSpeed's estimators print it
    (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`), with
    their 1.5x buffer factor. Stage 1/2 hold the fp32 copy of every GPU's partition on the
    host; stage 3 holds 16-18 bytes per parameter split over nodes."""
    f = DEEPSPEED_HOST_BUFFER_FACTOR
    total_gpus = gpus_per_node * num_nodes
    if zero_stage <= 2:
        if offload_optimizer:
            return num_params * max(4 * total_gpus, 16) * f
        return num_params * 4 * gpus_per_node * f
    per_node = 1.0 / num_nodes
    if offload_optimizer:
        k = 18 if offload_params else 16
        if zero_init:
            return num_params * k * per_node * f
        return num_params * max(4 * gpus_per_node, k * per_node) * f
    if zero_init:
        return largest_layer_params * 4 * gpus_per_node * f
    return num_params * 4 * gpus_per_node * f


@dataclass(frozen=True)
class TrainingMemory:
    ranks: list[RankMemory]
    num_microbatches: int
    host_bytes_per_node: float
    nvme_bytes_per_node: float
    fits: bool
    reason: str | None


def zero_shard_degrees(layout: Layout, gpus_per_node: int) -> tuple[int, int]:
    """Ranks that ZeRO partitions dense and routed-expert states over. Dense weights are
    replicated over dp x cp; hybrid sharding keeps the partition inside a node (rank order
    tp fastest, then cp, then dp)."""
    dense = layout.dp * layout.cp
    if layout.hybrid_shard:
        dense = max(1, min(dense, gpus_per_node // layout.tp))
    expert = max(1, layout.dp * layout.cp * layout.tp // (layout.ep * layout.expert_tp))
    return dense, expert


def activation_bytes_lower_bound(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, num_microbatches: int
) -> float:
    """A lower bound on the binding rank's total in `training_memory`: stage 0's activations at
    their peak, exactly as `training_memory` counts them (the same cached figures: the layers in
    flight, a recomputed layer, the outputs a pipeline holds, and with one stage the loss head;
    not autocast's input copies, which only ZeRO 0 has), plus the runtime overhead.
    ZeRO and offload change neither, so above the GPU's memory no state sharding can fit."""
    L = layout
    act = _stage_activations(
        spec, wl, L.tp, L.cp, L.expert_tp, L.sequence_parallel, L.recompute, L.micro_batch_size, L.pp,
        L.virtual_stages, L.pp_schedule, L.pp_embedding_as_layer, L.pp_loss_as_layer, L.pp_first_stage_layers,
        L.pp_last_stage_layers, max(1, num_microbatches), 0)[0]
    overhead = hw.cuda_context_bytes + hw.non_torch_bytes + (hw.nccl_buffer_bytes if layout.world_size > 1 else 0)
    return act + overhead


def stage_states_bytes(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, stage: int = 0) -> float:
    """GPU bytes of the model states (weights, gradients, optimizer states, temporaries: ZeRO-3
    gather buffers, torchtitan's unsharded stage under a pipeline, autocast's weight copies) of
    one rank of `stage`, exactly as `training_memory` counts them (`_stage_state_parts`)."""
    return sum(stage_states_and_gradients(spec, hw, layout, wl, stage))


def stage_states_and_gradients(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload,
                               stage: int = 0) -> tuple[float, float]:
    """`stage_states_bytes` split into (everything but the gradients, the gradients)."""
    c = _common(hw, layout, wl)
    layers = [i for r in layout_stage_ranges(spec.num_layers, layout)[stage] for i in r]
    states, _ = _stage_state_parts(spec, layout, wl, c, stage, layers)
    return states.weights + states.optimizer + states.temporary, states.gradients


def total_lower_bound(activations_bound: float, states: tuple[float, float], wl: TrainingWorkload,
                      num_microbatches: int) -> float:
    """A lower bound on a rank's total from `activation_bytes_lower_bound` and
    `stage_states_and_gradients`: their sum, less what backward frees before the gradients exist
    where they follow the activations (never more than the smaller of the two)."""
    rest, gradients = states
    overlap = min(gradients, activations_bound) if gradients_follow_activations(wl, num_microbatches) else 0.0
    return activations_bound + rest + gradients - overlap


def vocab_parallel_logits(spec: ModelSpec, wl: TrainingWorkload) -> bool:
    """The logits stay split over tp (a vocabulary-parallel loss); a classification head's few
    outputs are whole on every rank."""
    return wl.loss_vocab_parallel and spec.lm_head


def logits_per_rank(spec: ModelSpec, wl: TrainingWorkload, tokens: float, tp: int) -> float:
    """Logits one tensor-parallel rank holds for `tokens` positions."""
    return tokens * spec.head_outputs / (tp if vocab_parallel_logits(spec, wl) else 1)


def loss_head_bytes(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, micro_batch_size: int) -> tuple[float, float]:
    """(bytes the loss head holds at its peak, its largest single tensor) on the last stage: the
    stack's bytes per logit over micro-batch x local sequence x vocabulary (over tp when the
    logits stay vocab-parallel)."""
    logits = logits_per_rank(spec, wl, wl.seq_len / layout.cp * micro_batch_size, layout.tp)
    per_logit = wl.loss_bytes_per_logit
    if vocab_parallel_logits(spec, wl) and layout.tp > 1 and wl.loss_parallel_bytes_per_logit is not None:
        per_logit = wl.loss_parallel_bytes_per_logit  # the loss-parallel code's own tensors
    if per_logit is None:  # the fp32 logits once
        per_logit = FP32_BYTES if wl.loss_fp32_logits else bytes_per_element(wl.activation_dtype)
    return per_logit * logits, wl.largest_allocation_bytes_per_logit * logits


@dataclass(frozen=True)
class FrozenBase:
    """A LoRA/QLoRA rank's frozen base weights (dense and routed-expert parts, ZeRO-3 sharded
    like trained weights) and the largest linear it dequantizes to 16 bits for a matmul."""

    dense_bytes: float
    expert_bytes: float
    largest_quantized_numel: float
    largest_layer_bytes: float  # one decoder layer as stored (the ZeRO-3 / FSDP gather unit)


def frozen_base(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, stage: int) -> FrozenBase:
    """Bytes per rank of the frozen base of `stage` before ZeRO sharding: decoder nn.Linear weights
    in the base format (NF4 under QLoRA; routed experts and routers are not nn.Linear and stay,
    `is_nf4_base_weight`), everything else in the parameter dtype, or fp32 where the stack upcasts
    the non-quantized parameters (PEFT prepare_model_for_kbit_training)."""
    q_bytes = base_format_bytes(wl.base_format)
    other = FP32_BYTES if (q_bytes is not None and wl.base_fp32_non_quantized) else bytes_per_element(wl.param_dtype)
    dense = expert = largest = 0.0

    def stored(w: WeightKind) -> float:
        return q_bytes if (q_bytes is not None and is_nf4_base_weight(w)) else other

    for w, times in stage_tensors(spec, layout, stage):
        n = numel_per_rank(w, spec, layout) * times
        if w.routed_expert:
            expert += n * stored(w)
        else:
            dense += n * stored(w)
        if q_bytes is not None and is_nf4_base_weight(w):
            largest = max(largest, numel_per_rank(w, spec, layout) / w.copies)
    layers = [i for r in layout_stage_ranges(spec.num_layers, layout)[stage] for i in r]
    per_layer = [sum(numel_per_rank(w, spec, layout) * stored(w) for w in block_weights(spec, moe, linear))
                 for moe, linear in layer_kinds(spec, layers)]
    return FrozenBase(dense, expert, largest, max(per_layer, default=0.0))


def finetune_states(
    spec: ModelSpec, layout: Layout, wl: TrainingWorkload, stage: int, layers: list[int], dense_n: int, expert_n: int
) -> tuple[ModelStates, dict[str, float]]:
    """Model states of one LoRA/QLoRA rank: the frozen base (weights only, no gradients or
    optimizer states) and the adapters in fp32 (PEFT's autocast_adapter_dtype) with fp32
    gradients and the optimizer's moments, partitioned by ZeRO stage like any trained weights.
    Paged optimizer states live in unified memory and are counted on the host."""
    base = frozen_base(spec, layout, wl, stage)
    z3 = layout.zero_stage >= 3
    base_bytes = base.dense_bytes / (dense_n if z3 else 1) + base.expert_bytes / (expert_n if z3 else 1)
    adapters = adapter_params(spec, layers, wl.lora_rank, wl.lora_targets)
    sb = StateBytes(FP32_BYTES, FP32_BYTES, optimizer_moment_bytes(wl.optimizer), grads_partitioned_from_stage=2)
    ad = model_states_bytes(adapters, 0.0, dense_n, layout.zero_stage, sb, layout.offload_optimizer, layout.offload_params)
    host, optimizer = ad.host, ad.optimizer
    if wl.paged_optimizer:
        host, optimizer = host + optimizer, 0.0
    detail = {"weights.frozen_base": base_bytes, "weights.adapters": ad.weights}
    # bitsandbytes dequantizes to the compute dtype (bnb_4bit_compute_dtype: the activations')
    temporary = (bytes_per_element(wl.activation_dtype) * base.largest_quantized_numel
                 if base_format_bytes(wl.base_format) is not None else 0.0)
    if temporary:
        detail["temporary.dequantized_base_weight"] = temporary
    if z3:  # the gathered unit of the frozen base, in its storage format (current and prefetched layer)
        gathered = 2 * base.largest_layer_bytes
        temporary += gathered
        detail["temporary.zero3_gathered_layers"] = gathered
    states = ModelStates(base_bytes + ad.weights, ad.gradients, optimizer, temporary + ad.temporary, host, ad.nvme)
    return states, detail


@dataclass(frozen=True)
class _Common:
    """What every stage of one layout shares in `training_memory`."""

    sb: StateBytes
    num_micro: int
    dense_n: int
    expert_n: int
    overhead_detail: dict[str, float]
    overhead: float


def _common(hw: HardwareProfile, layout: Layout, wl: TrainingWorkload) -> _Common:
    # Under bf16 autocast over fp32 weights, the weights are the master copy: 4-byte weights
    # and gradients, no separate fp32 master.
    sb = state_bytes(dataclasses.replace(wl, param_dtype=DType.FP32) if wl.amp_fp32_master else wl, layout.zero_stage)
    per_step = layout.dp * layout.micro_batch_size
    num_micro = max(1, wl.global_batch_size // per_step)
    dense_n, expert_n = zero_shard_degrees(layout, hw.gpus_per_node)
    overhead_detail = {
        "cuda_context": float(hw.cuda_context_bytes),
        "non_torch": float(hw.non_torch_bytes),
        "nccl_buffers": float(hw.nccl_buffer_bytes) if layout.world_size > 1 else 0.0,
    }
    return _Common(sb, num_micro, dense_n, expert_n, overhead_detail, sum(overhead_detail.values()))


def _stage_states(
    spec: ModelSpec, layout: Layout, wl: TrainingWorkload, c: _Common, stage: int
) -> tuple[StageWeights, ModelStates, ModelStates]:
    """One stage's weights and its (dense, routed-expert) model states, full training."""
    w = stage_weights(spec, layout, stage, quantization=Quantization.NONE, dense_dtype=wl.param_dtype)
    dense = model_states_bytes(
        w.dense_numel, w.largest_layer_numel, c.dense_n, layout.zero_stage, c.sb,
        layout.offload_optimizer, layout.offload_params,
    )
    expert = model_states_bytes(
        w.expert_numel, 0.0, c.expert_n, layout.zero_stage, c.sb, layout.offload_optimizer, layout.offload_params
    )
    return w, dense, expert


def _node_offload_bytes(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, host: list[float], nvme: list[float]
) -> tuple[float, float]:
    """Host RAM and NVMe bytes per node from each stage's rank's offloaded bytes."""
    # Offloaded states of the GPUs of one node (stages spread evenly over nodes).
    gpus_per_node = min(hw.gpus_per_node, layout.world_size)
    mean_host = sum(host) / len(host)
    mean_nvme = sum(nvme) / len(nvme)
    host_total = mean_host * gpus_per_node
    nvme_total = mean_nvme * gpus_per_node
    if wl.framework is Framework.DEEPSPEED and layout.pp == 1 and layout.tp == 1:
        # DeepSpeed's own bookkeeping of host buffers (pure data parallelism, as its estimator assumes).
        w0 = stage_weights(spec, layout, 0, quantization=Quantization.NONE, dense_dtype=wl.param_dtype)
        host_total = deepspeed_estimator_host_bytes(
            w0.numel, w0.largest_layer_numel, layout.zero_stage,
            layout.offload_optimizer is not Offload.NONE, layout.offload_params is not Offload.NONE,
            gpus_per_node, max(1, layout.world_size // gpus_per_node),
        ) - nvme_total
    return host_total, nvme_total


def _stage_state_parts(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, c: _Common, stage: int,
                       layers: list[int]) -> tuple[ModelStates, dict[str, float]]:
    """A stage's model states: ZeRO-partitioned (or LoRA/QLoRA's frozen base and adapters), and
    what the stack adds: FSDP's unsharded stage under a pipeline, autocast's weight copies.
    They depend on the variant (ZeRO, offload), not on the micro-batch or recomputation."""
    w, dense, expert = _stage_states(spec, layout, wl, c, stage)
    detail: dict[str, float] = {}
    if not wl.trains_base:
        dense, detail = finetune_states(spec, layout, wl, stage, layers, c.dense_n, c.expert_n)
        expert = ModelStates(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    temporary = dense.temporary + expert.temporary
    gradients = dense.gradients + expert.gradients
    if wl.trains_base and wl.fsdp_unsharded_under_pp and layout.pp > 1 and layout.zero_stage == 3:
        # FSDP under a pipeline schedule (torchtitan): the stage's parameters stay gathered
        # in 16 bits from the first forward to the last backward, and its gradients
        # accumulate unsharded in fp32 until the last micro-batch's reduce-scatter.
        numel = w.dense_numel + w.expert_numel
        unsharded = bytes_per_element(wl.param_dtype) * numel
        detail["temporary.unsharded_stage_parameters"] = unsharded
        detail["gradients.unsharded_fp32_accumulation"] = FP32_BYTES * numel
        temporary = max(temporary, unsharded)
        gradients += FP32_BYTES * numel
    buckets = zero_reduce_bucket_bytes(layout, wl)
    if buckets:
        detail[ZERO_REDUCE_BUCKETS] = buckets
        temporary += buckets
    if wl.ddp_gradient_buckets and layout.zero_stage == 0 and layout.dp > 1 and gradients:
        # torch's DDP reducer: flat buckets covering every gradient, kept from its construction on
        # (reducer.cpp initialize_buckets), the gradients apart from them (gradient_as_bucket_view False)
        detail[DDP_GRADIENT_BUCKETS] = gradients
        temporary += gradients
    if wl.amp_fp32_master and wl.trains_base:
        # autocast's bf16 copy of each weight, cached for the forward and saved for backward
        copies = 2.0 * (w.dense_numel + w.expert_numel) / (c.dense_n if layout.zero_stage == 3 else 1)
        detail["temporary.autocast_weight_copies"] = copies
        temporary += copies
    return ModelStates(dense.weights + expert.weights, gradients, dense.optimizer + expert.optimizer, temporary,
                       dense.host + expert.host, dense.nvme + expert.nvme), detail


ZERO_REDUCE_BUCKETS = "temporary.zero_reduce_buckets"  # DeepSpeed's contiguous gradient bucket(s)
DDP_GRADIENT_BUCKETS = "temporary.ddp_gradient_buckets"  # torch DDP's reducer buckets


def zero_reduce_bucket_bytes(layout: Layout, wl: TrainingWorkload) -> float:
    """DeepSpeed ZeRO's contiguous gradient bucket on every rank: the whole reduce_bucket_size in the
    optimizer's 16-bit dtype, whatever the model's size, allocated at each backward by ZeRO-1/2 and a
    second one with overlap_comm (stage_1_and_2.py setup_buckets), once at initialisation by ZeRO-3
    (stage3.py); none at stage 0 (DeepSpeed's FP16/BF16 optimizers reduce without it)."""
    if not wl.zero_reduce_bucket_elements or layout.zero_stage == 0:
        return 0.0
    copies = 2 if layout.zero_stage < 3 and wl.overlap_grad_reduce else 1
    return float(copies * wl.zero_reduce_bucket_elements * bytes_per_element(wl.param_dtype))


def optimizer_step_bytes(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, c: _Common, stage: int,
                         layers: list[int]) -> float:
    """What torch's foreach AdamW allocates at once in its step on one rank: the square roots of
    exp_avg_sq for every parameter it steps, one list in their dtype (torch/optim/adamw.py
    _multi_tensor_adamw: torch._foreach_sqrt; measured on CPU, tests/cost/test_optimizer_step.py:
    1.0x the stepped parameters' bytes, 0 for fused=True). The stepped parameters are the rank's
    optimizer partition (ZeRO 1-3) or all its parameters, in the master's dtype (an fp32 master,
    fp32 weights under AMP, or bf16 weights that are their own master); none when the optimizer
    runs on the CPU. Megatron with bf16 main gradients (--grad-reduce-in-bf16) and its fp32
    optimizer copies them into fp32 for the stepped parameters at the step (megatron/core/optimizer/
    optimizer.py _copy_model_grads_to_main_grads: main_param.grad = model_param.main_grad.float();
    distrib_optimizer.py: shard_main_param.grad = shard_model_grad.float(), core_v0.19.0), held until
    the next step's zero_grad; the precision-aware optimizer (bf16 moments here) reads them as they
    are (decoupled_grad)."""
    if layout.offload_optimizer is not Offload.NONE:
        return 0.0
    foreach = wl.optimizer_foreach and wl.optimizer in (Optimizer.ADAMW, Optimizer.ADAM)  # 8-bit AdamW: its own kernel
    grads_copy = (wl.framework is Framework.MEGATRON and wl.grad_reduce_dtype is not DType.FP32
                  and wl.moment_dtype is DType.FP32 and wl.trains_base)
    if not (foreach or grads_copy):
        return 0.0
    z = layout.zero_stage >= 1
    if not wl.trains_base:
        return FP32_BYTES * adapter_params(spec, layers, wl.lora_rank, wl.lora_targets) / (c.dense_n if z else 1)
    w = stage_weights(spec, layout, stage, quantization=Quantization.NONE, dense_dtype=wl.param_dtype)
    numel = w.dense_numel / (c.dense_n if z else 1) + w.expert_numel / (c.expert_n if z else 1)
    return numel * ((bytes_per_element(wl.master_dtype) if foreach else 0.0) + (FP32_BYTES if grads_copy else 0.0))


def _stage_memory(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, c: _Common, stage: int,
) -> RankMemory:
    """One stage's rank in `training_memory`, with its named detail."""
    L = layout
    input_copies = wl.amp_fp32_master and wl.trains_base and L.zero_stage == 0
    act, act_detail, largest, largest_what, layers = _stage_activations(
        spec, wl, L.tp, L.cp, L.expert_tp, L.sequence_parallel, L.recompute, L.micro_batch_size, L.pp,
        L.virtual_stages, L.pp_schedule, L.pp_embedding_as_layer, L.pp_loss_as_layer, L.pp_first_stage_layers,
        L.pp_last_stage_layers, c.num_micro, stage, input_copies)
    stage_layers = list(layers)
    states, states_detail = _stage_state_parts(spec, layout, wl, c, stage, stage_layers)
    credit = 0.0
    if gradients_follow_activations(wl, c.num_micro):
        # Backward frees each layer's activations as it allocates that layer's gradients (none are
        # left from the step before): the rank holds all its activations at the start of backward
        # and all its gradients at the end, beside the first layer's working set, never both whole.
        end = _end_of_backward_activations(spec, layout, wl, stage, act_detail, len(stage_layers), input_copies)
        credit = min(states.gradients, max(0.0, act - end))
        act -= credit
    # Sharded gradients are reduce-scattered on a stream of their own (FSDP1 _post_backward_stream,
    # FSDP2 reduce_scatter_stream), and the caching allocator reuses a freed block only on the stream
    # that allocated it (c10/cuda/CUDACachingAllocator.cpp: a block pool per stream): the activations'
    # blocks stay reserved beside the gradients'.
    apart = credit if layout.zero_stage >= 1 else 0.0
    step = optimizer_step_bytes(spec, layout, wl, c, stage, stage_layers)
    # gradient buckets stay through the step (DeepSpeed's, DDP's); the other temporaries are freed
    freed = states.temporary - sum(states_detail.get(k, 0.0) for k in PERSISTENT_TEMPORARIES)
    if step > act + freed:
        # The step runs after the backward has freed the activations (and ZeRO-3's gathered
        # layers): the rank then holds its states and the step's list, and peaks there when the
        # list is the larger.
        beyond = step - act - freed
        states = dataclasses.replace(states, temporary=states.temporary + beyond)
        what = "optimizer_step_list" if wl.optimizer_foreach else "optimizer_step_fp32_gradients"
        states_detail = {**states_detail, f"temporary.{what}": beyond}
    breakdown = MemoryBreakdown(
        weights=states.weights,
        activations=act,
        gradients=states.gradients,
        optimizer_states=states.optimizer,
        temporary=states.temporary,
        overhead=c.overhead,
    )
    detail = dict(act_detail)
    if credit:
        detail[FREED_BEFORE_GRADIENTS] = credit
    detail.update(states_detail)
    detail.update({f"overhead.{k}": v for k, v in c.overhead_detail.items()})
    return RankMemory(
        stage=stage,
        layers=(layers[0], layers[-1]),
        num_ranks=layout.tp * layout.cp * layout.dp,
        breakdown=breakdown,
        detail=detail,
        host_bytes=states.host,
        nvme_bytes=states.nvme,
        largest_allocation_bytes=largest,
        largest_allocation=largest_what,
        reserved_apart_bytes=apart,
    )


# Temporaries that outlive the backward (gradient buckets), unlike gathered layers and autocast's copies.
PERSISTENT_TEMPORARIES = (ZERO_REDUCE_BUCKETS, DDP_GRADIENT_BUCKETS)


# Activations the backward frees before the gradients that take their place exist (counted once, under
# the gradients): `activations` is the peak less this, and verify, which reads the activations at the
# forward's end, adds it back.
FREED_BEFORE_GRADIENTS = "activations.freed_before_their_gradients"


def gradients_follow_activations(wl: TrainingWorkload, num_microbatches: int) -> bool:
    """A step of one micro-batch under a stack that sets the gradients to None after each step
    (`grads_allocated_in_backward`): backward allocates them as it frees the activations. With
    gradient accumulation or a pipeline they persist from the first micro-batch on. (DDP's buckets
    are apart: `temporary.ddp_gradient_buckets`.)"""
    return wl.grads_allocated_in_backward and num_microbatches == 1 and wl.trains_base


def _end_of_backward_activations(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, stage: int,
                                 act_detail: tuple[tuple[str, float], ...], num_layers: int,
                                 input_copies: bool) -> float:
    """What a stage still holds of its activations when its first layer's backward runs: that layer's
    saved tensors and, under full recomputation, the whole set its re-run forward keeps."""
    per_layer = dict(act_detail)["activations.layers"] / max(1, num_layers)
    if layout.recompute is not Recompute.FULL:
        return per_layer
    kinds = chunk_layer_kinds(spec, layout_stage_ranges(spec.num_layers, layout)[stage])
    return per_layer + _whole_layer_bytes(spec, layout, wl, kinds, input_copies)


def _whole_layer_bytes(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, kinds, input_copies: bool) -> float:  # type: ignore[no-untyped-def]
    """Everything the largest layer kind of a stage saves without recomputation, with the layout's
    parallelism: what full recomputation re-runs one layer at a time (Chen et al. 2016, Sec. 3)."""
    whole = dataclasses.replace(layout, recompute=Recompute.NONE)
    b = layout.micro_batch_size
    return max(activation_bytes_per_layer(spec, whole, wl, moe, b, linear)
               + (autocast_input_copies_per_layer(spec, wl, layout.cp, b, moe, linear) if input_copies else 0.0)
               for (moe, linear) in kinds)


def autocast_input_copies_per_layer(spec: ModelSpec, wl: TrainingWorkload, cp: int, micro_batch_size: int,
                                    moe_layer: bool, linear_attention: bool) -> float:
    """Under autocast over fp32 weights (the Hugging Face Trainer's AMP with fp32 weights at
    compute: one GPU or DDP; FSDP and DeepSpeed compute with bf16 weights), an RMSNorm's output is
    fp32 (its fp32 weight times the bf16 normalized input) and every linear that reads it casts it
    to bf16 itself and saves that copy: q, k and v three where one shared input is counted, gate
    and up two (`model_support.hf_norm_readers`). The bytes one layer saves beyond that shared
    input. Softmax-attention and dense MLP blocks only: MoE routers and experts and
    linear-attention mixers are not counted. Counted against transformers' own LlamaDecoderLayer:
    tests/cost/test_layer_activations_torch.py."""
    attn, mlp = hf_norm_readers(spec)
    kept = _saved_linear_inputs(spec, wl, moe_layer, linear_attention)
    extra = (0 if linear_attention else (attn - 1) * kept["qkv"]) + (0 if moe_layer else (mlp - 1) * kept["mlp"])
    return bytes_per_element(wl.activation_dtype) * wl.seq_len / cp * micro_batch_size * spec.hidden_size * extra


# The detail key of the layer full recomputation re-runs in backward beside the checkpoints
# (verify, which reads activations when a forward ends, leaves it out of its comparison).
RECOMPUTED_LAYER = "activations.recomputed_layer"


@lru_cache(maxsize=4096)
def _activation_layout(tp: int, cp: int, etp: int, sp: bool, recompute: Recompute, b: int, pp: int,
                       virtual_stages: int, schedule: PipelineSchedule, embedding_as_layer: bool,
                       loss_as_layer: bool, first: int | None, last: int | None) -> Layout:
    """The layout of the fields a stage's activations read (one for every stage of a shape)."""
    return Layout(tp=tp, cp=cp, etp=etp, sequence_parallel=sp, recompute=recompute, micro_batch_size=b, pp=pp,
                  virtual_stages=virtual_stages, pp_schedule=schedule, pp_embedding_as_layer=embedding_as_layer,
                  pp_loss_as_layer=loss_as_layer, pp_first_stage_layers=first, pp_last_stage_layers=last)


@lru_cache(maxsize=65536)
def _stage_activations(
    spec: ModelSpec, wl: TrainingWorkload, tp: int, cp: int, etp: int, sp: bool, recompute: Recompute, b: int, pp: int,
    virtual_stages: int, schedule: PipelineSchedule, embedding_as_layer: bool, loss_as_layer: bool, first: int | None,
    last: int | None, num_micro: int, stage: int, input_copies: bool = False,
) -> tuple[float, tuple[tuple[str, float], ...], float, str, tuple[int, ...]]:
    """A stage's activations at its peak with their named parts, the loss head's largest tensor
    and what it is, and the stage's layers: they depend on the shape, not on ZeRO or offload,
    so the many state variants of one shape share them; `input_copies` (autocast over fp32
    weights, which only ZeRO 0 computes with) adds what each linear saves of its own input cast
    (`autocast_input_copies_per_layer`): without it the figure is a lower bound for every variant."""
    layout = _activation_layout(tp, cp, etp, sp, recompute, b, pp, virtual_stages, schedule, embedding_as_layer,
                                loss_as_layer, first, last)
    rep = 1.0 / layout.tp if layout.sequence_parallel else 1.0
    s_local = wl.seq_len / layout.cp
    chunks = layout_stage_ranges(spec.num_layers, layout)[stage]
    layers = flat_layers(chunks)
    kinds = chunk_layer_kinds(spec, chunks)
    per_layer_avg = sum(num * activation_bytes_per_layer(spec, layout, wl, moe, b, linear)
                        for (moe, linear), num in kinds.items()) / len(layers)
    inflight = in_flight_layer_activations(layout, stage, len(layers), num_micro)
    act = per_layer_avg * inflight
    detail = {"activations.layers": act}
    if input_copies and recompute is not Recompute.FULL:
        extra = sum(num * autocast_input_copies_per_layer(spec, wl, cp, b, moe, linear)
                    for (moe, linear), num in kinds.items()) / len(layers) * inflight
        if extra:
            detail["activations.autocast_input_copies"] = extra
            act += extra
    working = 0.0
    if recompute is Recompute.FULL:
        # Full checkpointing keeps each layer's input only; backward re-runs one layer's forward
        # at a time and holds everything that layer saves for its own backward beside the
        # checkpoints (Chen et al. 2016, Sec. 3: the peak is the checkpoints plus one segment's
        # activations; Korthikanti et al. 2022, Sec. 4.3). The largest layer kind of the stage
        # bounds it, with the layout's parallelism, without recomputation.
        working = _whole_layer_bytes(spec, layout, wl, kinds, input_copies)
    inflight_micro = inflight / len(layers)
    if stage == 0 and dropout_kinds(spec, wl)[1]:
        emb = DROPOUT_MASK_BYTES * s_local * b * spec.hidden_size * rep * math.ceil(inflight_micro)
        detail["activations.embedding_dropout"] = emb
        act += emb
    largest, largest_what = 0.0, ""
    if stage == layout.pp - 1:
        # Final norm input, lm_head input, and what the stack's loss keeps of the logits.
        # A frozen lm_head (LoRA) saves no input for a weight gradient.
        head = (2 if wl.trains_base else 1) * residual_bytes(wl) * s_local * b * spec.hidden_size * rep
        logits, largest = loss_head_bytes(spec, layout, wl, b)
        detail["activations.head"] = head
        detail["activations.loss"] = logits
        # The loss head's tensors are freed by their own backward, before the last layer is
        # recomputed: the two peaks come one after the other, not together.
        if working > head + logits:
            detail[RECOMPUTED_LAYER] = working - head - logits
        act += max(head + logits, working)
        working = 0.0
        largest_what = ("the fp32 logits of the loss" if wl.largest_allocation_bytes_per_logit == FP32_BYTES
                        else f"the loss head's largest tensor ({wl.largest_allocation_bytes_per_logit:g} bytes a logit)")
    if working:
        detail[RECOMPUTED_LAYER] = working
        act += working
    if wl.pp_holds_stage_outputs and layout.pp > 1:
        held = pipeline_held_outputs_bytes(spec, layout, wl, stage, inflight_micro * layout.virtual_stages)
        detail["activations.pipeline_outputs"] = held
        act += held
    return act, tuple(detail.items()), largest, largest_what, layers


def pipeline_held_outputs_bytes(spec: ModelSpec, layout: Layout, wl: TrainingWorkload, stage: int,
                                chunks_in_flight: float) -> float:
    """What torch.distributed.pipelining keeps of a stage's outputs: the output of every
    micro-batch (chunk) the stage holds in flight, kept in the stage's fwd_cache until that
    micro-batch's backward, and one more, the previous forward's output the schedule's loop still
    references while the next forward runs (`pp_holds_stage_outputs` in the stack file, with the
    torch source). A stage's output is its last layer's (sequence-sharded under SP); the last
    stage's is the logits: the one in flight, which a stack's loss figure counts as freed (its
    training loop deletes them outside a pipeline), and the previous micro-batch's (under the
    interleaved schedule the hidden-state outputs of the last stage's earlier chunks are not
    counted). Measured with verify's storage tracker on a 2-stage CPU run (tests/verify/test_verify.py)."""
    a = bytes_per_element(wl.activation_dtype)
    b = layout.micro_batch_size
    s_local = wl.seq_len / layout.cp
    if stage < layout.pp - 1:
        rep = 1.0 / layout.tp if layout.sequence_parallel else 1.0
        return (math.ceil(chunks_in_flight) + 1) * a * s_local * b * spec.hidden_size * rep
    logits = logits_per_rank(spec, wl, s_local * b, layout.tp)
    # the fp32-logits-once default (no stack) already counts the logits in flight as its loss figure
    held = 2 if wl.loss_bytes_per_logit is not None else 1
    return held * a * logits  # the model's output, in the activation format


# Relative slack for the float rounding of the per-node mean over at most a few hundred stages.
_MEAN_ROUNDING = 1e-9


def _may_exceed_host(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, c: _Common) -> bool:
    """Whether `training_memory` may find the offloaded states over the node's host RAM or NVMe.
    First a cheap bound: a stage's offloaded bytes grow with its parameters (every term of
    `model_states_bytes` does), so the stage with the most dense and the most expert parameters
    bounds each stage, and so the per-node mean; only when that bound does not clear the
    capacities are the stages summed as `training_memory` sums them."""
    if not (wl.framework is Framework.DEEPSPEED and layout.pp == 1 and layout.tp == 1):
        dense_max, expert_max = _largest_stage_numels(
            spec, layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.virtual_stages, layout.pp_embedding_as_layer,
            layout.pp_loss_as_layer, layout.pp_first_stage_layers, layout.pp_last_stage_layers, wl.param_dtype)
        d = model_states_bytes(dense_max, 0.0, c.dense_n, layout.zero_stage, c.sb, layout.offload_optimizer,
                               layout.offload_params)
        e = model_states_bytes(expert_max, 0.0, c.expert_n, layout.zero_stage, c.sb, layout.offload_optimizer,
                               layout.offload_params)
        per_node = min(hw.gpus_per_node, layout.world_size) * (1 + _MEAN_ROUNDING)
        if ((d.host + e.host) * per_node <= hw.host_memory_bytes_per_node
                and (d.nvme + e.nvme) * per_node <= hw.nvme_capacity_bytes_per_node):
            return False
    states = [_stage_states(spec, layout, wl, c, stage) for stage in range(layout.pp)]
    host, nvme = _node_offload_bytes(spec, hw, layout, wl, [d.host + e.host for _, d, e in states],
                                     [d.nvme + e.nvme for _, d, e in states])
    return host > hw.host_memory_bytes_per_node or nvme > hw.nvme_capacity_bytes_per_node


@lru_cache(maxsize=4096)
def _largest_stage_numels(
    spec: ModelSpec, tp: int, pp: int, ep: int, etp: int, virtual_stages: int, embedding_as_layer: bool,
    loss_as_layer: bool, first: int | None, last: int | None, dense_dtype: DType,
) -> tuple[float, float]:
    """The most dense and the most routed-expert parameters any stage's rank holds."""
    layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp, virtual_stages=virtual_stages, pp_embedding_as_layer=embedding_as_layer,
                    pp_loss_as_layer=loss_as_layer, pp_first_stage_layers=first, pp_last_stage_layers=last)
    stages = [stage_weights(spec, layout, s, quantization=Quantization.NONE, dense_dtype=dense_dtype) for s in range(pp)]
    return max(w.dense_numel for w in stages), max(w.expert_numel for w in stages)


def training_memory(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload) -> TrainingMemory:
    tm = _training_memory(spec, hw, layout, wl, verdict=False)
    assert tm is not None  # without the verdict every stage is costed
    return tm


def training_memory_unless_over_gpu(spec: ModelSpec, hw: HardwareProfile, layout: Layout,
                                    wl: TrainingWorkload) -> TrainingMemory | None:
    """`training_memory`, or None where it would reject the layout for GPU memory alone (no host
    RAM or NVMe reason beside it), decided with the same figures stage by stage and stopping at
    the first stage over the capacity: stage 0 (the most activations in flight) and the last (the
    loss head) first. A layout that fits is costed once (the search's verdict, issue 25). With
    LoRA/QLoRA only layouts that offload nothing are decided early (their host bytes are zero);
    paged optimizer states always take the full model."""
    return _training_memory(spec, hw, layout, wl, verdict=True)


def _training_memory(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload,
                     verdict: bool) -> TrainingMemory | None:
    offloads = (layout.offload_optimizer is not Offload.NONE or layout.offload_params is not Offload.NONE
                or (wl.framework is Framework.DEEPSPEED and layout.pp == 1 and layout.tp == 1))
    if (offloads and not wl.trains_base) or (wl.paged_optimizer and not wl.trains_base):
        verdict = False
    c = _common(hw, layout, wl)
    num_micro = c.num_micro
    cap = hw.memory_capacity_bytes
    last = layout.pp - 1
    order = (0, *((last,) if last else ()), *range(1, last)) if verdict else range(layout.pp)
    by_stage: dict[int, RankMemory] = {}
    for stage in order:
        rank = _stage_memory(spec, hw, layout, wl, c, stage)
        by_stage[stage] = rank
        total = rank.breakdown.total
        if verdict and (total > cap or total + rank.largest_allocation_bytes > cap):
            if offloads:
                if not _may_exceed_host(spec, hw, layout, wl, c):
                    return None
            elif min(hw.host_memory_bytes_per_node, hw.nvme_capacity_bytes_per_node) >= 0:
                return None  # nothing offloaded: zero bytes, over a capacity only if that is negative
            verdict = False  # the host may be over too: the full model names every reason
    ranks = [by_stage[stage] for stage in range(layout.pp)]
    reasons: list[str] = []
    for stage, rank in enumerate(ranks):
        breakdown, largest, largest_what = rank.breakdown, rank.largest_allocation_bytes, rank.largest_allocation
        if breakdown.total > hw.memory_capacity_bytes:
            reasons.append(
                f"stage {stage} needs {breakdown.total / 2**30:.2f} GiB per GPU, over the "
                f"{hw.memory_capacity_bytes / 2**30:.2f} GiB of a {hw.gpu_model}"
            )
        elif breakdown.total + largest > hw.memory_capacity_bytes:
            # The caching allocator holds what the peak allocated and must find a fresh block
            # for the largest tensor (blocks freed earlier are smaller): reserved = allocated + it.
            reasons.append(
                f"stage {stage} allocates {breakdown.total / 2**30:.2f} GiB per GPU but the caching allocator "
                f"also needs a fresh {largest / 2**30:.2f} GiB block for {largest_what}: "
                f"{(breakdown.total + largest) / 2**30:.2f} GiB reserved, over the "
                f"{hw.memory_capacity_bytes / 2**30:.2f} GiB of a {hw.gpu_model}"
            )
    host_total, nvme_total = _node_offload_bytes(spec, hw, layout, wl, [r.host_bytes for r in ranks],
                                                 [r.nvme_bytes for r in ranks])
    if host_total > hw.host_memory_bytes_per_node:
        reasons.append(
            f"offloaded states need {host_total / 2**30:.0f} GiB of host RAM per node, over its "
            f"{hw.host_memory_bytes_per_node / 2**30:.0f} GiB"
        )
    if nvme_total > hw.nvme_capacity_bytes_per_node:
        reasons.append(
            f"offloaded states need {nvme_total / 2**30:.0f} GiB of NVMe per node, over its "
            f"{hw.nvme_capacity_bytes_per_node / 2**30:.0f} GiB"
        )
    return TrainingMemory(
        ranks=ranks,
        num_microbatches=num_micro,
        host_bytes_per_node=host_total,
        nvme_bytes_per_node=nvme_total,
        fits=not reasons,
        reason="; ".join(reasons) or None,
    )
