"""Parameter-efficient fine-tuning: LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023).

A LoRA adapter on a linear layer W [out, in] adds B A x with A [r, in] and B [out, r]:
r (in + out) trainable parameters. The base model is frozen:

- its weights stay in their dtype (bf16), or, under QLoRA, its decoder `nn.Linear` layers (not
  the routed experts or routers, `is_nf4_base_weight`) are stored as 4-bit NormalFloat (NF4)
  in blocks of 64 weights with one absmax constant each (bitsandbytes `quantize_4bit`,
  blocksize 64): 4 + 32/64 = 4.5 bits a weight, or with
  double quantization (the absmax constants quantized to 8 bits in blocks of 256 with one
  fp32 constant each, QLoRA paper Sec. 3) 4 + 8/64 + 32/(64 x 256) = 4.127 bits;
- it has no gradients and no optimizer states; the adapters have both. PEFT keeps adapter
  weights in fp32 under a 16-bit base (`autocast_adapter_dtype=True`, peft/tuners/tuners_utils.py);
- PEFT's `prepare_model_for_kbit_training` (peft/utils/other.py) casts every parameter that
  is not 4-bit (embeddings, norms, lm_head, routed experts, routers) to fp32; stacks that call
  it say so in their file;
- bitsandbytes' 4-bit linear dequantizes the whole weight to 16 bits for each matmul
  (`bnb.functional.dequantize_4bit`, then `torch.nn.functional.linear`): a temporary of the
  largest linear, and memory traffic of 0.5 + 2 bytes a weight per pass;
- backward computes activation gradients through the frozen linears (one GEMM, dX = dY W)
  but no weight gradients (the second GEMM of a trained linear), so a linear's input is
  saved only where a trained weight needs it: where an adapter sits on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardplan.cost.params import Component, WeightKind, block_weights, layer_kinds
# What trains and how the base is stored are workload fields: defined beside the workload (which
# the command line imports without the model schema), named here too.
from shardplan.cost.workload import ALL_LINEAR, BaseFormat, FineTune  # noqa: F401 - re-exported
from shardplan.errors import ShardplanError
from shardplan.specs.model import ModelSpec

NF4_BLOCK = 64  # weights per absmax constant (bitsandbytes quantize_4bit default blocksize)
NF4_DQ_BLOCK = 256  # absmax constants per second-level fp32 constant (double quantization)

# The decoder linears LoRA can target, by module name (PEFT matches target_modules on it).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Components whose 2-D weights are `nn.Linear` modules in transformers >= 5. Routed experts are fused
# 3-D parameters (e.g. MixtralExperts.gate_up_proj [E, 2f, h]) and routers custom modules holding a
# bare weight (MixtralTopKRouter, F.linear in forward); the one router-side nn.Linear is Qwen2-MoE's
# and Qwen3-Next's `shared_expert_gate` (h -> 1). transformers models/*/modeling_*.py, v5.
_TORCH_LINEAR = (Component.ATTENTION, Component.MLP, Component.SHARED_EXPERTS)
_TORCH_LINEAR_ROUTER = frozenset({"mlp.shared_expert_gate.weight"})

# Model types whose routed experts and router PEFT wraps (ParamWrapper on the fused 3-D parameters,
# rank r x E): those transformers maps (`_MODEL_TO_CONVERSION_PATTERN`) to a pattern PEFT lists in
# `_MOE_TARGET_MODULE_MAPPING` ("mixtral", "qwen2_moe"); `_convert_peft_config_moe` then turns
# `all-linear`, or a target naming the v4 expert or router modules, into `target_parameters`
# (peft/utils/transformers_weight_conversion.py, peft v0.20.0 with transformers 5). Value: the v4
# names that wrap them. Other MoE families (gpt_oss, granitemoe, llama4, ...) get adapters on their
# nn.Linear modules only. tests/cost/test_finetune.py recomputes this from the installed peft.
_MIXTRAL_EXPERT_NAMES = ("gate", "w1", "w3", "w2")
_QWEN2_MOE_EXPERT_NAMES = ("gate", "gate_proj", "up_proj", "down_proj")
PEFT_EXPERT_WRAPPING: dict[str, tuple[str, ...]] = {
    **{t: _MIXTRAL_EXPERT_NAMES for t in ("minimax", "minimax_m2", "mixtral")},
    **{t: _QWEN2_MOE_EXPERT_NAMES for t in (
        "Dots3NoteTextModel", "UnlimitedOcrTextModel", "afmoe", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
        "deepseek_v32", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "glm4v_moe",
        "glm_moe_dsa", "hunyuan_v1_moe", "longcat_flash", "mellum", "olmoe", "qwen3_moe", "qwen3_next",
        "qwen3_omni_moe", "qwen3_omni_moe_text", "qwen3_omni_moe_thinker", "sarvam_mla", "solar_open")},
}


def nf4_bytes_per_weight(double_quant: bool) -> float:
    """Bytes per weight of bitsandbytes NF4 storage, its quantization constants included."""
    bits = 4.0 + (8.0 / NF4_BLOCK + 32.0 / (NF4_BLOCK * NF4_DQ_BLOCK) if double_quant else 32.0 / NF4_BLOCK)
    return bits / 8.0


def base_format_bytes(fmt: BaseFormat) -> float | None:
    """Bytes per quantized base weight; None: the model dtype."""
    if fmt is BaseFormat.NONE:
        return None
    return nf4_bytes_per_weight(fmt is BaseFormat.NF4_DQ)


def module_name(w: WeightKind) -> str:
    """`self_attn.q_proj.weight` -> `q_proj`."""
    parts = w.name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


def is_torch_linear(w: WeightKind) -> bool:
    """Whether `w` is the weight of a decoder `nn.Linear` in transformers >= 5: attention (softmax,
    MLA or linear), dense MLP and shared-expert projections and the shared-expert gate; not the
    routed experts (fused 3-D parameters), routers, convolutions, embeddings or lm_head."""
    if len(w.shape) != 2 or not w.name.endswith(".weight"):
        return False
    return w.component in _TORCH_LINEAR or w.name in _TORCH_LINEAR_ROUTER


def is_nf4_base_weight(w: WeightKind) -> bool:
    """Whether QLoRA stores `w` in 4 bits: transformers' `replace_with_bnb_linear`
    (integrations/bitsandbytes.py, v5) converts only `type(module) is nn.Linear` (and GPT-2's
    Conv1D) into bnb Linear4bit, lm_head excepted (`get_keys_to_not_convert`). Routed experts and
    routers keep the model dtype, and PEFT's prepare_model_for_kbit_training casts them to fp32
    with the other non-4-bit parameters where the stack calls it."""
    return is_torch_linear(w)


def is_lora_target(w: WeightKind, targets: Iterable[str]) -> bool:
    """Whether an adapter sits on this weight: a decoder nn.Linear whose module name is a target,
    or any of them under `all-linear` (PEFT's shorthand: every linear but the output layer).
    Routed experts and routers are not nn.Linear since transformers 5; PEFT wraps them only for
    the families in PEFT_EXPERT_WRAPPING (`adapter_params_per_layer`)."""
    if not is_torch_linear(w):
        return False
    targets = tuple(targets)
    return ALL_LINEAR in targets or module_name(w) in targets


# Families whose transformers modules fuse projections shardplan lists apart: one adapter then
# spans the fused output (transformers models/gpt2 c_attn, falcon and gpt_neox query_key_value,
# phi3 qkv_proj and gate_up_proj).
FUSED_QKV = frozenset({"gpt2", "falcon", "gpt_neox", "phi3"})
FUSED_GATE_UP = frozenset({"phi3"})


def _fused_group(spec: ModelSpec, name: str) -> str:
    if spec.model_type in FUSED_QKV and name in ("q_proj", "k_proj", "v_proj"):
        return "qkv"
    if spec.model_type in FUSED_GATE_UP and name in ("gate_proj", "up_proj"):
        return "gate_up"
    return name


def _converted_to_experts(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[str, ...]:
    """Module names that PEFT, under `all-linear` on a PEFT_EXPERT_WRAPPING family, moves from
    target_modules to the experts' target_parameters: nn.Linear modules of those names (a
    Qwen2-MoE family's shared expert and dense MLPs) then get no adapter of their own
    (`_convert_peft_config_moe`, peft v0.20.0)."""
    if ALL_LINEAR in targets and spec.moe is not None:
        return PEFT_EXPERT_WRAPPING.get(spec.model_type, ())
    return ()


def adapter_params_per_layer(
    spec: ModelSpec, moe_layer: bool, rank: int, targets: Iterable[str], linear_attention: bool = False
) -> float:
    """Trainable adapter parameters of one decoder layer: r (in + out) per targeted linear, one
    adapter per fused module where the family's modules fuse projections. Under `all-linear`,
    for the families in PEFT_EXPERT_WRAPPING, PEFT (v0.20, with transformers 5) also wraps the
    router and the fused 3-D expert weights (`ParamWrapper`): rank r x E for each, and gate and
    up as two such blocks side by side:
    gate_up  A [2 r E, h], B [2 f, 2 r E];  down  A [r E, f], B [h, r E];  router r (h + E).
    (Plans refuse that case, `refuse_wrapped_experts`; the count stays checked against PEFT.)"""
    targets = tuple(targets)
    groups: dict[str, list[int]] = {}
    skip = _converted_to_experts(spec, targets)
    for w in block_weights(spec, moe_layer, linear_attention):
        if is_lora_target(w, targets) and module_name(w) not in skip:
            out_f, in_f = w.shape
            key = _fused_group(spec, module_name(w))
            g = groups.setdefault(key, [in_f, 0, w.copies])
            g[1] += out_f
    total = float(sum(rank * (i + o) * c for i, o, c in groups.values()))
    if moe_layer and spec.moe is not None and ALL_LINEAR in targets and spec.model_type in PEFT_EXPERT_WRAPPING:
        moe, h = spec.moe, spec.hidden_size
        e, f = moe.num_experts, moe.expert_intermediate_size
        up_blocks = 2 if spec.mlp_gated else 1
        total += up_blocks * rank * e * h + up_blocks * f * up_blocks * rank * e  # gate_up
        total += rank * e * (f + h)  # down
        total += rank * (h + e)  # router
    return total


def adapter_params(spec: ModelSpec, layers: Iterable[int], rank: int, targets: Iterable[str]) -> float:
    """Trainable adapter parameters of `layers`, each counted by its own kind (MoE, linear attention)."""
    targets = tuple(targets)
    return sum(num * adapter_params_per_layer(spec, moe, rank, targets, linear)
               for (moe, linear), num in layer_kinds(spec, layers).items())


def targeted_modules(
    spec: ModelSpec, moe_layer: bool, targets: Iterable[str], linear_attention: bool = False
) -> list[tuple[str, int, int]]:
    """(module, in, out) of every targeted linear of one layer, one entry per copy."""
    targets = tuple(targets)
    out: list[tuple[str, int, int]] = []
    skip = _converted_to_experts(spec, targets)
    for w in block_weights(spec, moe_layer, linear_attention):
        if is_lora_target(w, targets) and module_name(w) not in skip:
            o, i = w.shape
            out += [(module_name(w), i, o)] * w.copies
    return out


def refuse_wrapped_experts(spec: ModelSpec, targets: Iterable[str]) -> None:
    """Refuse targets under which PEFT wraps a PEFT_EXPERT_WRAPPING family's routed experts and
    router: the wrapped experts keep W + B A of every layer for backward and compute the experts'
    weight gradients, which the memory and time models do not hold."""
    names = PEFT_EXPERT_WRAPPING.get(spec.model_type)
    hit = [t for t in targets if t == ALL_LINEAR or (names is not None and t in names)]
    if names is None or spec.moe is None or not hit:
        return
    raise ShardplanError(
        f"under {','.join(hit)} PEFT wraps {spec.name}'s routed experts and router ({spec.model_type}), whose "
        "saved merged weights and expert weight gradients are not modelled", field="--lora-targets",
        hint="name the projections, e.g. --lora-targets q_proj,k_proj,v_proj,o_proj")


def check_targets(spec: ModelSpec, targets: Iterable[str]) -> list[str]:
    """Targets that name no linear of this model (the caller reports them); refuses first the
    targets under which PEFT wraps routed experts (`refuse_wrapped_experts`)."""
    targets = tuple(targets)
    refuse_wrapped_experts(spec, targets)
    names = {module_name(w) for moe, linear in layer_kinds(spec) for w in block_weights(spec, moe, linear)
             if is_torch_linear(w)}
    return [t for t in targets if t != ALL_LINEAR and t not in names]
