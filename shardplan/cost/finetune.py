"""Parameter-efficient fine-tuning: LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023).

A LoRA adapter on a linear layer W [out, in] adds B A x with A [r, in] and B [out, r]:
r (in + out) trainable parameters. The base model is frozen:

- its weights stay in their dtype (bf16), or, under QLoRA, its decoder linear layers are
  stored as 4-bit NormalFloat (NF4) in blocks of 64 weights with one absmax constant each
  (bitsandbytes `quantize_4bit`, blocksize 64): 4 + 32/64 = 4.5 bits a weight, or with
  double quantization (the absmax constants quantized to 8 bits in blocks of 256 with one
  fp32 constant each, QLoRA paper Sec. 3) 4 + 8/64 + 32/(64 x 256) = 4.127 bits;
- it has no gradients and no optimizer states; the adapters have both. PEFT keeps adapter
  weights in fp32 under a 16-bit base (`autocast_adapter_dtype=True`, peft/tuners/tuners_utils.py);
- PEFT's `prepare_model_for_kbit_training` (peft/utils/other.py) casts every parameter that
  is not 4-bit (embeddings, norms, lm_head) to fp32; stacks that call it say so in their file;
- bitsandbytes' 4-bit linear dequantizes the whole weight to 16 bits for each matmul
  (`bnb.functional.dequantize_4bit`, then `torch.nn.functional.linear`): a temporary of the
  largest linear, and memory traffic of 0.5 + 2 bytes a weight per pass;
- backward computes activation gradients through the frozen linears (one GEMM, dX = dY W)
  but no weight gradients (the second GEMM of a trained linear), so a linear's input is
  saved only where a trained weight needs it: where an adapter sits on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from shardplan.cost.params import Component, WeightKind, block_weights
from shardplan.specs.model import ModelSpec

NF4_BLOCK = 64  # weights per absmax constant (bitsandbytes quantize_4bit default blocksize)
NF4_DQ_BLOCK = 256  # absmax constants per second-level fp32 constant (double quantization)
ALL_LINEAR = "all-linear"

# The decoder linears LoRA can target, by module name (PEFT matches target_modules on it).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TARGETABLE = (Component.ATTENTION, Component.MLP, Component.SHARED_EXPERTS)


class FineTune(str, Enum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"


class BaseFormat(str, Enum):
    """How the frozen base's decoder linears are stored under QLoRA."""

    NONE = "none"  # the model dtype
    NF4 = "nf4"  # bitsandbytes 4-bit NormalFloat, fp32 absmax per 64 weights
    NF4_DQ = "nf4-dq"  # with double quantization (QLoRA's recipe)


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


def is_lora_target(w: WeightKind, targets: Iterable[str]) -> bool:
    """Whether an adapter sits on this weight: a 2-D decoder linear (attention, dense MLP or a
    shared expert) whose module name is a target, or any of them under `all-linear` (PEFT's
    shorthand: every linear but the output layer). Routed experts are not targeted: since
    transformers 5 they are fused 3-D parameters, not `nn.Linear` modules PEFT wraps; nor are
    routers, embeddings or lm_head."""
    if len(w.shape) != 2 or not w.name.endswith(".weight") or w.component not in _TARGETABLE:
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


def adapter_params_per_layer(spec: ModelSpec, moe_layer: bool, rank: int, targets: Iterable[str]) -> float:
    """Trainable adapter parameters of one decoder layer: r (in + out) per targeted linear, one
    adapter per fused module where the family's modules fuse projections. Under `all-linear`
    PEFT (v0.20, with transformers 5) also wraps the router and the fused 3-D expert weights
    (`ParamWrapper`): rank r x E for each, and gate and up as two such blocks side by side:
    gate_up  A [2 r E, h], B [2 f, 2 r E];  down  A [r E, f], B [h, r E];  router r (h + E)."""
    targets = tuple(targets)
    groups: dict[str, list[int]] = {}
    for w in block_weights(spec, moe_layer):
        if is_lora_target(w, targets):
            out_f, in_f = w.shape
            key = _fused_group(spec, module_name(w))
            g = groups.setdefault(key, [in_f, 0, w.copies])
            g[1] += out_f
    total = float(sum(rank * (i + o) * c for i, o, c in groups.values()))
    if moe_layer and spec.moe is not None and ALL_LINEAR in targets:
        moe, h = spec.moe, spec.hidden_size
        e, f = moe.num_experts, moe.expert_intermediate_size
        up_blocks = 2 if spec.mlp_gated else 1
        total += up_blocks * rank * e * h + up_blocks * f * up_blocks * rank * e  # gate_up
        total += rank * e * (f + h)  # down
        total += rank * (h + e)  # router
    return total


def adapter_params(spec: ModelSpec, layers: Iterable[int], rank: int, targets: Iterable[str]) -> float:
    targets = tuple(targets)
    per = {moe: adapter_params_per_layer(spec, moe, rank, targets) for moe in ((False, True) if spec.moe else (False,))}
    return sum(per[spec.is_moe_layer(i)] for i in layers)


def targeted_modules(spec: ModelSpec, moe_layer: bool, targets: Iterable[str]) -> list[tuple[str, int, int]]:
    """(module, in, out) of every targeted linear of one layer, one entry per copy."""
    targets = tuple(targets)
    out: list[tuple[str, int, int]] = []
    for w in block_weights(spec, moe_layer):
        if is_lora_target(w, targets):
            o, i = w.shape
            out += [(module_name(w), i, o)] * w.copies
    return out


def check_targets(spec: ModelSpec, targets: Iterable[str]) -> list[str]:
    """Targets that name no linear of this model (the caller reports them)."""
    names = {module_name(w) for moe in ((False, True) if spec.moe else (False,)) for w in block_weights(spec, moe)
             if len(w.shape) == 2 and w.component in _TARGETABLE}
    return [t for t in targets if t != ALL_LINEAR and t not in names]
