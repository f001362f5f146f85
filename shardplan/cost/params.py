"""The weight inventory of a ModelSpec: every stored tensor kind, its shape, and how tensor
parallelism splits it. Parameter counts, per-rank weight memory and the manifest's split
table all derive from this one list, so they cannot disagree.

Split rules follow Megatron-LM (Shoeybi et al. 2019, Sec. 3) as vLLM implements them:
q/k/v and gate/up are column-parallel (output rows divided by tp), o and down are
row-parallel (input columns divided by tp), embedding and lm_head are vocabulary-parallel,
norms and row-parallel biases are replicated. K/V projections divide over KV heads and are
replicated once tp exceeds the number of KV heads (vLLM `QKVParallelLinear`). For MLA,
vLLM keeps q_a/kv_a projections replicated and splits q_b/kv_b by column, o by row.

A linear-attention layer (Qwen3-Next Gated DeltaNet) replaces the attention weights with its
own; a multimodal model's vision tower and projector live with the embedding on the first
pipeline stage and are counted in the total and apart (`ParamCounts.vision`, `.projector`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from shardplan.cost.memo import hash_once
from shardplan.specs.model import ModelSpec, NormType, PositionEmbedding, QKNorm, VisionSpec


class Split(str, Enum):
    COLUMN = "column"  # output dim / tp
    ROW = "row"  # input dim / tp
    KV_COLUMN = "kv_column"  # output dim over KV heads: / min(tp, num_kv_heads)
    VOCAB = "vocab"  # vocabulary rows / tp
    REPLICATED = "replicated"


class Component(str, Enum):
    EMBEDDING = "embedding"
    ATTENTION = "attention"
    MLP = "mlp"
    EXPERTS = "experts"
    SHARED_EXPERTS = "shared_experts"
    ROUTER = "router"
    NORMS = "norms"
    LM_HEAD = "lm_head"
    VISION = "vision"  # the vision tower of a multimodal model
    PROJECTOR = "projector"  # its multimodal projector
    OTHER = "other"  # measured minus analytic parameters of a transformers-derived spec (may be negative)


@hash_once
@dataclass(frozen=True)
class WeightKind:
    """One kind of stored tensor. `copies` > 1 for routed experts (one tensor per expert)."""

    name: str
    component: Component
    shape: tuple[int, ...]
    split: Split
    copies: int = 1
    routed_expert: bool = False

    @property
    def numel_per_copy(self) -> int:
        return math.prod(self.shape)

    @property
    def numel(self) -> int:
        return self.numel_per_copy * self.copies

    def numel_per_tp_rank(self, tp: int, num_kv_heads: int) -> float:
        """Elements of all copies that one tensor-parallel rank stores."""
        if self.split is Split.REPLICATED:
            return float(self.numel)
        if self.split is Split.KV_COLUMN:
            return self.numel / min(tp, num_kv_heads)
        return self.numel / tp


def _norm(name: str, size: int, spec: ModelSpec | VisionSpec, component: Component = Component.NORMS,
          copies: int = 1) -> list[WeightKind]:
    out = [WeightKind(f"{name}.weight", component, (size,), Split.REPLICATED, copies)]
    if spec.norm_type is NormType.LAYERNORM:
        out.append(WeightKind(f"{name}.bias", component, (size,), Split.REPLICATED, copies))
    return out


def _linear(
    name: str,
    component: Component,
    in_features: int,
    out_features: int,
    split: Split,
    bias: bool,
    *,
    copies: int = 1,
    routed: bool = False,
) -> list[WeightKind]:
    out = [WeightKind(f"{name}.weight", component, (out_features, in_features), split, copies, routed)]
    if bias:
        # A row-parallel layer adds its bias once, after the all-reduce: replicated.
        bias_split = Split.REPLICATED if split is Split.ROW else split
        out.append(WeightKind(f"{name}.bias", component, (out_features,), bias_split, copies, routed))
    return out


def _linear_attention(spec: ModelSpec) -> list[WeightKind]:
    """Qwen3NextGatedDeltaNet (transformers models/qwen3_next/modeling_qwen3_next.py):
    in_proj_qkvz (h -> 2 key_dim + 2 value_dim: q, k, v and the gate z), in_proj_ba
    (h -> 2 value heads: beta and alpha), a depthwise conv1d over q, k, v without bias
    (conv_dim x 1 x kernel), dt_bias and A_log per value head, a gated RMSNorm of value_head_dim
    and out_proj (value_dim -> h). Split over heads as vLLM's Qwen3NextGatedDeltaNet does."""
    la = spec.linear_attention
    if la is None:
        raise ValueError(f"{spec.name} has no linear_attention")  # internal: only called for linear layers
    h = spec.hidden_size
    a = Component.ATTENTION
    w = _linear("linear_attn.in_proj_qkvz", a, h, 2 * la.key_dim + 2 * la.value_dim, Split.COLUMN, False)
    w += _linear("linear_attn.in_proj_ba", a, h, 2 * la.num_value_heads, Split.COLUMN, False)
    w.append(WeightKind("linear_attn.conv1d.weight", a, (la.conv_dim, 1, la.conv_kernel_size), Split.COLUMN))
    w.append(WeightKind("linear_attn.dt_bias", a, (la.num_value_heads,), Split.COLUMN))
    w.append(WeightKind("linear_attn.A_log", a, (la.num_value_heads,), Split.COLUMN))
    w.append(WeightKind("linear_attn.norm.weight", a, (la.value_head_dim,), Split.REPLICATED))
    w += _linear("linear_attn.out_proj", a, la.value_dim, h, Split.ROW, False)
    return w


def _attention(spec: ModelSpec) -> list[WeightKind]:
    h = spec.hidden_size
    a = Component.ATTENTION
    if spec.mla is not None:
        m = spec.mla
        heads = spec.num_attention_heads
        w: list[WeightKind] = []
        if m.q_lora_rank is None:
            w += _linear("self_attn.q_proj", a, h, heads * m.qk_head_dim, Split.COLUMN, False)
        else:
            w += _linear("self_attn.q_a_proj", a, h, m.q_lora_rank, Split.REPLICATED, spec.qkv_bias)
            w += _norm("self_attn.q_a_layernorm", m.q_lora_rank, spec, a)
            w += _linear("self_attn.q_b_proj", a, m.q_lora_rank, heads * m.qk_head_dim, Split.COLUMN, False)
        w += _linear(
            "self_attn.kv_a_proj_with_mqa", a, h, m.kv_lora_rank + m.qk_rope_head_dim, Split.REPLICATED, spec.qkv_bias
        )
        w += _norm("self_attn.kv_a_layernorm", m.kv_lora_rank, spec, a)
        w += _linear(
            "self_attn.kv_b_proj", a, m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), Split.COLUMN, False
        )
        w += _linear("self_attn.o_proj", a, heads * m.v_head_dim, h, Split.ROW, spec.o_bias)
        return w

    d = spec.attention_head_dim
    q_out = spec.num_attention_heads * d
    kv_out = spec.kv_heads * d
    # Qwen3-Next's gated attention: q_proj emits the query and a sigmoid gate of the same size.
    w = _linear("self_attn.q_proj", a, h, q_out * (2 if spec.attention_output_gate else 1), Split.COLUMN, spec.qkv_bias)
    w += _linear("self_attn.k_proj", a, h, kv_out, Split.KV_COLUMN, spec.qkv_bias)
    w += _linear("self_attn.v_proj", a, h, kv_out, Split.KV_COLUMN, spec.qkv_bias)
    w += _linear("self_attn.o_proj", a, q_out, h, Split.ROW, spec.o_bias)
    if spec.qk_norm is QKNorm.PER_HEAD:
        w += _norm("self_attn.q_norm", d, spec, a)
        w += _norm("self_attn.k_norm", d, spec, a)
    elif spec.qk_norm is QKNorm.FULL:
        # Sharded with the heads they normalise.
        w.append(WeightKind("self_attn.q_norm.weight", a, (q_out,), Split.COLUMN))
        w.append(WeightKind("self_attn.k_norm.weight", a, (kv_out,), Split.KV_COLUMN))
    if spec.attention_sinks:
        # gpt-oss (GptOssAttention.sinks): one learned logit per query head, split with the heads.
        w.append(WeightKind("self_attn.sinks", a, (spec.num_attention_heads,), Split.COLUMN))
    return w


def _mlp(
    spec: ModelSpec, prefix: str, component: Component, width: int, *, copies: int = 1, routed: bool = False
) -> list[WeightKind]:
    h = spec.hidden_size
    bias = spec.mlp_bias
    w: list[WeightKind] = []
    if spec.mlp_gated:
        w += _linear(f"{prefix}.gate_proj", component, h, width, Split.COLUMN, bias, copies=copies, routed=routed)
    w += _linear(f"{prefix}.up_proj", component, h, width, Split.COLUMN, bias, copies=copies, routed=routed)
    w += _linear(f"{prefix}.down_proj", component, width, h, Split.ROW, bias, copies=copies, routed=routed)
    return w


def _moe(spec: ModelSpec) -> list[WeightKind]:
    moe = spec.moe
    if moe is None:
        raise ValueError(f"{spec.name} has no MoE layers")  # internal: only called for MoE layers
    h = spec.hidden_size
    w = _linear("mlp.gate", Component.ROUTER, h, moe.num_experts, Split.REPLICATED, moe.router_linear_bias)
    if moe.router_bias:
        w.append(WeightKind("mlp.gate.e_score_correction_bias", Component.ROUTER, (moe.num_experts,), Split.REPLICATED))
    w += _mlp(spec, "mlp.experts", Component.EXPERTS, moe.expert_intermediate_size, copies=moe.num_experts, routed=True)
    if moe.num_shared_experts:
        w += _mlp(
            spec,
            "mlp.shared_experts",
            Component.SHARED_EXPERTS,
            moe.shared_intermediate_size * moe.num_shared_experts,
        )
    if moe.shared_expert_gate:
        w += _linear("mlp.shared_expert_gate", Component.ROUTER, h, 1, Split.REPLICATED, False)
    return w


@lru_cache(maxsize=256)
def block_weights(spec: ModelSpec, moe_layer: bool, linear_attention: bool = False) -> tuple[WeightKind, ...]:
    """Weights of one transformer block: dense or MoE MLP, softmax or linear attention."""
    w = _linear_attention(spec) if linear_attention else _attention(spec)
    w += _mlp(spec, "mlp", Component.MLP, spec.intermediate_size) if not moe_layer else _moe(spec)
    for i in range(spec.num_norms_per_layer):
        w += _norm(f"norm{i}", spec.hidden_size, spec)
    return tuple(w)


@lru_cache(maxsize=256)
def cross_attention_extra_weights(spec: ModelSpec) -> tuple[WeightKind, ...]:
    """What a cross-attention decoder layer (Mllama, transformers MllamaCrossAttentionDecoderLayer and
    MllamaTextCrossAttention) stores beyond a self-attention block of the same shapes: an RMSNorm of
    head_dim on the queries and one on the keys (q_norm, k_norm, shared by all heads) and the scalar
    tanh gates of its attention and MLP branches (cross_attn_attn_gate, cross_attn_mlp_gate). Its
    q/k/v/o, MLP and two norms are those of `block_weights`; k and v read the projected vision
    states, whose width is the text hidden size."""
    d, a = spec.attention_head_dim, Component.ATTENTION
    return (WeightKind("cross_attn.q_norm.weight", a, (d,), Split.REPLICATED),
            WeightKind("cross_attn.k_norm.weight", a, (d,), Split.REPLICATED),
            WeightKind("cross_attn_attn_gate", a, (1,), Split.REPLICATED),
            WeightKind("cross_attn_mlp_gate", Component.MLP, (1,), Split.REPLICATED))


def cross_attention_tensors(spec: ModelSpec, layers: Iterable[int]) -> list[tuple[WeightKind, int]]:
    """(tensor kind, how many of `layers` carry it) for the cross-attention layers' extra weights."""
    num = sum(spec.is_cross_attention_layer(i) for i in layers)
    return [(w, num) for w in cross_attention_extra_weights(spec)] if num else []


def layer_weights(spec: ModelSpec, layer_index: int) -> tuple[WeightKind, ...]:
    w = block_weights(spec, *layer_kind(spec, layer_index))
    if spec.is_cross_attention_layer(layer_index):
        w += cross_attention_extra_weights(spec)
    return w


def layer_kind(spec: ModelSpec, layer_index: int) -> tuple[bool, bool]:
    """(MoE layer, linear-attention layer): the two facts `block_weights` needs for a layer's weights."""
    return spec.is_moe_layer(layer_index), spec.is_linear_attention_layer(layer_index)


@lru_cache(maxsize=64)
def kinds_by_layer(spec: ModelSpec) -> tuple[tuple[bool, bool], ...]:
    """`layer_kind` of every layer of the main stack, by index (computed once per spec: sums over
    thousands of layers read it many times a search)."""
    return tuple(layer_kind(spec, i) for i in range(spec.num_layers))


@lru_cache(maxsize=64)
def layer_flags(spec: ModelSpec) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(sliding-window layer, linear-attention layer) of every layer of the main stack, by index."""
    return (tuple(spec.is_sliding_layer(i) for i in range(spec.num_layers)),
            tuple(spec.is_linear_attention_layer(i) for i in range(spec.num_layers)))


def layer_kinds(spec: ModelSpec, layers: Iterable[int] | None = None) -> dict[tuple[bool, bool], int]:
    """(MoE layer, linear-attention layer) -> how many of `layers` (None: the main stack) are of that
    kind. Every per-layer sum over weights goes through this, so layer i's weights follow its type."""
    out: dict[tuple[bool, bool], int] = {}
    for i in range(spec.num_layers) if layers is None else layers:
        key = layer_kind(spec, i)
        out[key] = out.get(key, 0) + 1
    return out


@lru_cache(maxsize=8192)
def chunk_layer_kinds(spec: ModelSpec, chunks: tuple[range, ...]) -> dict[tuple[bool, bool], int]:
    """`layer_kinds` of the layers of `chunks` (a pipeline stage's ranges, `layout_stage_ranges`),
    cached: the search asks for the same stages thousands of times. Shared: do not mutate."""
    return layer_kinds(spec, [i for r in chunks for i in r])


def vision_weights(spec: ModelSpec) -> tuple[WeightKind, ...]:
    """The vision tower (component VISION) and the projector (PROJECTOR) of a multimodal model.

    A ViT block (Dosovitskiy et al. 2021, Sec. 3.1; CLIPEncoderLayer, SiglipEncoderLayer,
    PixtralAttentionLayer, Qwen2VLVisionBlock, Llama4VisionEncoderLayer in transformers) holds
    q, k, v, o of hidden x hidden (heads x head_dim), an MLP (fc1/fc2, or gate/up/down) and two
    norms; the tower adds its patch embedding (a linear map of channels x patch^2 pixels, a conv
    in most implementations), an optional class vector and learned position table, and its outer
    norms. Splits follow vLLM's vision encoders (q/k/v and fc1 by column, o and fc2 by row)."""
    v = spec.vision
    if v is None:
        return ()
    vis, n = Component.VISION, v.num_layers
    h, qd = v.hidden_size, v.num_attention_heads * v.attention_head_dim
    w = _linear("vision.patch_embedding", vis, v.patch_embedding_inputs, h, Split.REPLICATED, v.patch_embedding_bias)
    if v.class_embedding:
        w.append(WeightKind("vision.class_embedding", vis, (h,), Split.REPLICATED))
    if v.num_position_embeddings:
        w.append(WeightKind("vision.position_embedding", vis, (v.num_position_embeddings, h), Split.REPLICATED))
    for i in range(v.num_outer_norms):
        w += _norm(f"vision.outer_norm{i}", h, v, vis)
    for name in ("q_proj", "k_proj", "v_proj"):
        w += _linear(f"vision.layers.attn.{name}", vis, h, qd, Split.COLUMN, v.qkv_bias, copies=n)
    w += _linear("vision.layers.attn.o_proj", vis, qd, h, Split.ROW, v.o_bias, copies=n)
    ups = ("gate_proj", "up_proj") if v.mlp_gated else ("fc1",)
    for name in ups:
        w += _linear(f"vision.layers.mlp.{name}", vis, h, v.intermediate_size, Split.COLUMN, v.mlp_bias, copies=n)
    w += _linear("vision.layers.mlp.down", vis, v.intermediate_size, h, Split.ROW, v.mlp_bias, copies=n)
    for i in range(2):
        w += _norm(f"vision.layers.norm{i}", h, v, vis, copies=n)
    w += [WeightKind(f"vision.{t.name}", vis, t.shape, Split.REPLICATED) for t in v.extra_tensors]
    w += [WeightKind(f"projector.{t.name}", Component.PROJECTOR, t.shape, Split.REPLICATED) for t in v.projector]
    return tuple(w)


@lru_cache(maxsize=256)
def embedding_weights(spec: ModelSpec) -> tuple[WeightKind, ...]:
    """Weights on the first pipeline stage: token (and learned position) embeddings, and a
    multimodal model's vision tower and projector (vLLM runs the encoder on the first stage)."""
    rows = spec.vocab_size + (spec.vision.text_embedding_extra_rows if spec.vision is not None else 0)
    w = [WeightKind("embed_tokens.weight", Component.EMBEDDING, (rows, spec.embedding_width), Split.VOCAB)]
    if spec.embedding_norm:  # BloomModel.word_embeddings_layernorm
        w += _norm("embedding_norm", spec.hidden_size, spec, Component.EMBEDDING)
    if spec.embedding_width != spec.hidden_size:  # OPTDecoder.project_in
        w += _linear("project_in", Component.EMBEDDING, spec.embedding_width, spec.hidden_size, Split.REPLICATED, False)
    if spec.position_embedding is PositionEmbedding.LEARNED:
        w.append(
            WeightKind(
                "embed_positions.weight",
                Component.EMBEDDING,
                (spec.max_position_embeddings + spec.position_embedding_offset, spec.hidden_size),
                Split.REPLICATED,
            )
        )
    w += vision_weights(spec)
    return tuple(w)


@lru_cache(maxsize=256)
def head_weights(spec: ModelSpec) -> tuple[WeightKind, ...]:
    """Weights on the last pipeline stage: final norm and lm_head (absent when tied and
    the embedding lives on the same stage; `tied_head_extra` decides that)."""
    w: list[WeightKind] = []
    if spec.final_norm:
        w += _norm("final_norm", spec.hidden_size, spec)
    if spec.embedding_width != spec.hidden_size:  # OPTDecoder.project_out
        w += _linear("project_out", Component.LM_HEAD, spec.hidden_size, spec.embedding_width, Split.REPLICATED, False)
    if not spec.lm_head:  # transformers *ForSequenceClassification: score = nn.Linear(hidden, num_labels, bias=False)
        w += _linear("score", Component.LM_HEAD, spec.hidden_size, spec.num_labels, Split.REPLICATED, False)
    elif not spec.tie_word_embeddings:
        w += _linear("lm_head", Component.LM_HEAD, spec.embedding_width, spec.vocab_size, Split.VOCAB, spec.lm_head_bias)
    return tuple(w)


def tied_lm_head_copy(spec: ModelSpec) -> tuple[WeightKind, ...]:
    """With tied embeddings and more than one pipeline stage, the last stage holds its own
    copy of the embedding matrix as lm_head (Megatron `share_embeddings_and_output_weights`)."""
    if not spec.tie_word_embeddings:
        return ()
    return (WeightKind("lm_head.weight", Component.LM_HEAD, (spec.vocab_size, spec.embedding_width), Split.VOCAB),)


@lru_cache(maxsize=256)
def mtp_weights(spec: ModelSpec) -> tuple[WeightKind, ...]:
    """One DeepSeek-V3 multi-token-prediction module (DeepSeek-V3 report Sec. 2.2): two
    RMSNorms on the inputs, a 2h->h projection, one MoE transformer block and the shared
    head's norm. Its embedding and output head are shared with the main model."""
    h = spec.hidden_size
    w = _norm("enorm", h, spec) + _norm("hnorm", h, spec)
    w += _linear("eh_proj", Component.ATTENTION, 2 * h, h, Split.REPLICATED, False)
    w += list(block_weights(spec, spec.moe is not None))
    w += _norm("shared_head.norm", h, spec)
    return tuple(w)


@dataclass(frozen=True)
class ParamCounts:
    """Stored parameters by component; `total` excludes MTP modules, which are in `mtp`."""

    by_component: dict[str, int]
    total: int
    active_per_token: int
    mtp: int
    per_layer_dense: int
    per_layer_moe: int
    vision: int = 0  # the vision tower, inside `total` (component "vision")
    projector: int = 0  # the multimodal projector, inside `total` (component "projector")

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp


def _sum_by_component(weights: tuple[WeightKind, ...], into: dict[str, int], times: int = 1) -> None:
    for w in weights:
        into[w.component.value] = into.get(w.component.value, 0) + w.numel * times


def count_params(spec: ModelSpec) -> ParamCounts:
    """Exact parameter count: every stored tensor, embeddings, norms, biases and an untied
    lm_head included; tied embeddings once. Active per token = total minus the routed
    experts a token does not visit ((E - k) experts in every MoE layer)."""
    by_component = {c.value: 0 for c in Component}
    _sum_by_component(embedding_weights(spec), by_component)
    kinds = layer_kinds(spec)
    for (moe_layer, linear), num in kinds.items():
        _sum_by_component(block_weights(spec, moe_layer, linear), by_component, num)
    for w, num in cross_attention_tensors(spec, range(spec.num_layers)):
        by_component[w.component.value] += w.numel * num
    _sum_by_component(head_weights(spec), by_component)
    if spec.measured_num_params is not None:
        by_component[Component.OTHER.value] = spec.measured_num_params - sum(by_component.values())
    total = sum(by_component.values())

    num_moe = spec.num_moe_layers
    moe_block = block_weights(spec, True) if num_moe else ()
    inactive = 0
    if spec.moe is not None:
        m = spec.moe
        per_expert = sum(w.numel_per_copy for w in moe_block if w.routed_expert)
        inactive = (m.num_experts - m.num_experts_per_token) * per_expert * num_moe
    mtp = spec.num_mtp_layers * sum(w.numel for w in mtp_weights(spec))
    return ParamCounts(
        by_component={k: v for k, v in by_component.items() if v},
        total=total,
        active_per_token=total - inactive,
        mtp=mtp,
        per_layer_dense=sum(w.numel for w in block_weights(spec, False)) if num_moe < spec.num_layers else 0,
        per_layer_moe=sum(w.numel for w in moe_block),
        vision=by_component[Component.VISION.value],
        projector=by_component[Component.PROJECTOR.value],
    )


def layer_numel(spec: ModelSpec, layer_index: int) -> int:
    """Stored parameters of one block of the main stack."""
    return sum(w.numel for w in layer_weights(spec, layer_index))
