"""GGUF weight formats (llama.cpp): which ggml type each tensor is stored in, and its bytes.

A GGUF "quantization type" such as Q4_K_M is a *mixture* (a llama_ftype), not one format: the
quantizer picks a ggml type per tensor by its role and layer (llama.cpp `src/llama-quant.cpp`,
`llama_tensor_get_type_impl`, read at commit 007dbbf3fd17eefe9b47fee45f48f7ba5e62b714). The
rules modelled here, for the mixtures shardplan offers:

- 1-D tensors, norms and the MoE router (`ffn_gate_inp`) stay as converted (f32 norms; the
  router is not quantized); every other 2-D/3-D `.weight` is quantized (`tensor_allows_quantization`).
- output.weight -> Q6_K unless the mixture's base type is Q8_0 (then Q8_0); with tied
  embeddings token_embd is quantized like the output; otherwise token_embd takes the base type.
- attn_v: Q4_K_M/Q5_K_M -> Q6_K where `use_more_bits(i, n)` (the first and last eighth of the
  layers and every third in between); Q3_K_M -> Q5_K for the first two, Q4_K after; Q2_K -> Q4_K
  when n_gqa >= 4 else Q3_K; a Llama 70B (LLM_TYPE_70B) lifts a Q3_K/Q4_K attn_v to Q5_K; an
  8-expert model stores attn_v and attn_k in Q8_0.
- ffn_down: Q4_K_M/Q5_K_M -> Q6_K where use_more_bits; Q3_K_M -> Q5_K below n/16, else Q4_K;
  Q2_K -> Q3_K.
- attn_output: Q3_K_M -> Q4_K, Q2_K -> Q3_K; an 8-expert model -> Q5_K for the K-mixtures below Q5.
- a tensor whose row length is not a multiple of its type's block falls back
  (`tensor_type_fallback`: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, IQ4_XS -> IQ4_NL).

Block sizes and bytes per block: ggml/src/ggml-common.h (block_q4_0 = fp16 d + 16 bytes of
nibbles for 32 weights, ...), the same table `ggml_type_size`/`ggml_blck_size` return.
"""

from __future__ import annotations

from enum import Enum
from functools import lru_cache

from shardplan.cost.params import Component, WeightKind
from shardplan.cost.workload import Quantization
from shardplan.units import GGML_BLOCKS as UNIT_GGML_BLOCKS


class GgmlType(str, Enum):
    F32 = "f32"
    F16 = "f16"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q8_0 = "q8_0"
    Q2_K = "q2_k"
    Q3_K = "q3_k"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    IQ4_NL = "iq4_nl"
    IQ4_XS = "iq4_xs"


# (weights per block, bytes per block): ggml-common.h block structs, kept in units.GGML_BLOCKS
# (the KV cache's q8_0/q4_0 formats read the same table).
GGML_BLOCKS: dict[GgmlType, tuple[int, int]] = {t: UNIT_GGML_BLOCKS[t.value] for t in GgmlType}

_FALLBACK = {
    GgmlType.Q4_K: GgmlType.Q5_0, GgmlType.Q5_K: GgmlType.Q5_1, GgmlType.Q6_K: GgmlType.Q8_0,
    GgmlType.Q2_K: GgmlType.Q4_0, GgmlType.Q3_K: GgmlType.Q4_0, GgmlType.IQ4_XS: GgmlType.IQ4_NL,
}


# The llama_ftype mixtures `llama-quantize` names (lower case) that shardplan models, as
# Quantization members, with the base type of each.
BASE_TYPE: dict[Quantization, GgmlType] = {
    Quantization.Q2_K: GgmlType.Q2_K,
    Quantization.Q3_K_M: GgmlType.Q3_K,
    Quantization.Q4_0: GgmlType.Q4_0,
    Quantization.Q4_K_M: GgmlType.Q4_K,
    Quantization.Q5_K_M: GgmlType.Q5_K,
    Quantization.Q6_K: GgmlType.Q6_K,
    Quantization.Q8_0: GgmlType.Q8_0,
    Quantization.IQ4_XS: GgmlType.IQ4_XS,
}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp: the first and last eighth of the layers and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _role(w: WeightKind) -> str:
    """The llama.cpp tensor category of a shardplan tensor kind."""
    n = w.name
    if w.component is Component.EMBEDDING:
        return "token_embd"
    if w.component is Component.LM_HEAD:
        return "output"
    if n.endswith("v_proj.weight") or n.endswith("kv_b_proj.weight"):
        return "attn_v"
    if n.endswith("k_proj.weight"):
        return "attn_k"
    if n.endswith("q_proj.weight"):
        return "attn_q"
    if n.endswith("o_proj.weight"):
        return "attn_output"
    if n.endswith("down_proj.weight"):
        return "ffn_down"
    return "other"


def quantizable(w: WeightKind) -> bool:
    """`tensor_allows_quantization`: 2-D/3-D weights, not norms, not the MoE router."""
    return (len(w.shape) == 2 and w.name.endswith(".weight") and "norm" not in w.name and "position" not in w.name
            and w.component not in (Component.NORMS, Component.ROUTER, Component.VISION, Component.PROJECTOR))


def tensor_type(w: WeightKind, mixture: Quantization, *, layer: int, num_layers: int, num_experts: int,
                gqa_ratio: int, tied_embeddings: bool, llama_70b: bool) -> GgmlType:
    """The ggml type `llama-quantize` gives tensor kind `w` of decoder layer `layer`."""
    if not quantizable(w):
        return GgmlType.F32 if len(w.shape) == 1 else GgmlType.F16
    base = BASE_TYPE[mixture]
    role = _role(w)
    t = base
    if role == "output" or (role == "token_embd" and tied_embeddings):
        t = GgmlType.Q8_0 if base is GgmlType.Q8_0 else GgmlType.Q6_K
    elif role == "token_embd":
        t = base
    elif role == "attn_v":
        if mixture is Quantization.Q2_K:
            t = GgmlType.Q4_K if gqa_ratio >= 4 else GgmlType.Q3_K
        elif mixture is Quantization.Q3_K_M:
            t = GgmlType.Q5_K if layer < 2 else GgmlType.Q4_K
        elif mixture is Quantization.IQ4_XS and gqa_ratio >= 4:
            t = GgmlType.Q5_K
        elif mixture in (Quantization.Q4_K_M, Quantization.Q5_K_M) and use_more_bits(layer, num_layers):
            t = GgmlType.Q6_K
        if llama_70b and t in (GgmlType.Q3_K, GgmlType.Q4_K):
            t = GgmlType.Q5_K
        if num_experts == 8:
            t = GgmlType.Q8_0
    elif role == "attn_k" and num_experts == 8:
        t = GgmlType.Q8_0
    elif role == "ffn_down":
        if mixture is Quantization.Q2_K:
            t = GgmlType.Q3_K
        elif mixture is Quantization.Q3_K_M:
            t = GgmlType.Q5_K if layer < num_layers // 16 else GgmlType.Q4_K
        elif mixture in (Quantization.Q4_K_M, Quantization.Q5_K_M) and use_more_bits(layer, num_layers):
            t = GgmlType.Q6_K
        elif mixture is Quantization.IQ4_XS and layer < num_layers // 8:
            t = GgmlType.Q5_K  # without an importance matrix
    elif role == "attn_output":
        if num_experts == 8 and mixture in (Quantization.Q2_K, Quantization.Q3_K_M, Quantization.Q4_K_M,
                                             Quantization.IQ4_XS):
            t = GgmlType.Q5_K
        elif num_experts != 8 and mixture is Quantization.Q2_K:
            t = GgmlType.Q3_K
        elif num_experts != 8 and mixture is Quantization.Q3_K_M:
            t = GgmlType.Q4_K
    # ne[0] of a ggml weight is the row length: the input features.
    row = w.shape[-1]
    if row % GGML_BLOCKS[t][0]:
        t = _FALLBACK.get(t, t)
        if row % GGML_BLOCKS[t][0]:
            t = GgmlType.F16
    return t


def bytes_per_element(t: GgmlType) -> float:
    n, b = GGML_BLOCKS[t]
    return b / n


@lru_cache(maxsize=4096)
def mean_bytes_per_element(w: WeightKind, mixture: Quantization, layers: tuple[int, ...], num_layers: int,
                           num_experts: int, gqa_ratio: int, tied_embeddings: bool, llama_70b: bool) -> float:
    """Bytes per element of tensor kind `w` averaged over the decoder layers `layers` that carry
    it (the type of attn_v and ffn_down changes with the layer index)."""
    idx = layers or (0,)
    rules = (num_layers, num_experts, gqa_ratio, tied_embeddings, llama_70b)
    if min(idx) < 0 or max(idx) >= num_layers:  # not layers of the main stack: each on its own
        return sum(_bytes_in_layer(w, mixture, i, *rules) for i in idx) / len(idx)
    by_layer = _bytes_by_layer(w, mixture, *rules)
    return sum(by_layer[i] for i in idx) / len(idx)


def _bytes_in_layer(w: WeightKind, mixture: Quantization, layer: int, num_layers: int, num_experts: int,
                    gqa_ratio: int, tied_embeddings: bool, llama_70b: bool) -> float:
    return bytes_per_element(tensor_type(w, mixture, layer=layer, num_layers=num_layers, num_experts=num_experts,
                                         gqa_ratio=gqa_ratio, tied_embeddings=tied_embeddings, llama_70b=llama_70b))


@lru_cache(maxsize=1024)
def _bytes_by_layer(w: WeightKind, mixture: Quantization, num_layers: int, num_experts: int, gqa_ratio: int,
                    tied_embeddings: bool, llama_70b: bool) -> tuple[float, ...]:
    """`bytes_per_element` of tensor kind `w`'s type in each decoder layer, by index (a model of
    thousands of layers averages it over many layer sets; computed once). Only attn_v's and ffn_down's
    types follow the layer (`tensor_type`); any other kind's is its type in layer 0 throughout."""
    rules = (num_layers, num_experts, gqa_ratio, tied_embeddings, llama_70b)
    if not quantizable(w) or _role(w) not in ("attn_v", "ffn_down"):
        return (_bytes_in_layer(w, mixture, 0, *rules),) * num_layers
    return tuple(_bytes_in_layer(w, mixture, i, *rules) for i in range(num_layers))
