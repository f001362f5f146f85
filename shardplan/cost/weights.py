"""Weight bytes per rank: which tensors a pipeline stage holds and what a tensor-parallel /
expert-parallel rank keeps of each, at the chosen storage format."""

from __future__ import annotations

import math

from dataclasses import dataclass
from functools import lru_cache

from shardplan.cost import gguf
from shardplan.cost.finetune import nf4_bytes_per_weight
from shardplan.cost.layout import Layout, layout_stage_ranges
from shardplan.cost.params import (
    Component,
    WeightKind,
    block_weights,
    chunk_layer_kinds,
    cross_attention_tensors,
    embedding_weights,
    head_weights,
    kinds_by_layer,
    tied_lm_head_copy,
)
from shardplan.cost.workload import Quantization
from shardplan.specs.model import ModelSpec
from shardplan.units import DType, bytes_per_element

# GPTQ/AWQ int4: one fp16 scale and one packed 4-bit zero point per group of 128 input
# elements of each output row (AutoGPTQ/AutoAWQ defaults, group_size=128).
INT4_GROUP_SIZE = 128
INT4_SCALE_BYTES = 2.0
INT4_ZERO_BYTES = 0.5
# W8A8 int8: one fp32 scale per output channel. FP8: one fp32 scale per tensor.
INT8_SCALE_BYTES_PER_ROW = 4.0
FP8_SCALE_BYTES_PER_TENSOR = 4.0

_QUANTIZABLE = {Component.ATTENTION, Component.MLP, Component.EXPERTS, Component.SHARED_EXPERTS}
# MXFP4 (OCP Microscaling Formats v1.0, Sec. 5: a block of 32 FP4 E2M1 elements shares one E8M0
# scale): 4 + 8/32 = 4.25 bits a weight, as gpt-oss's model card states for its MoE weights.
MXFP4_BYTES_PER_ELEMENT = (4 + 8 / 32) / 8
# vLLM's Marlin MoE kernel needs n % 256 == 0 and k % 128 == 0 in each expert GEMM, so it pads the
# expert intermediate size to a multiple of 128 and the hidden size to a multiple of 256
# (vllm/model_executor/layers/quantization/mxfp4.py at 0.11.0, Mxfp4MoEMethod.create_weights).
MARLIN_INTERMEDIATE_MULTIPLE = 128
MARLIN_HIDDEN_MULTIPLE = 256


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def marlin_expert_padding(spec: ModelSpec | None, expert_tp: int = 1) -> float:
    """Stored / shipped elements of each routed expert matrix on vLLM's Marlin path (gate, up and
    down are each intermediate x hidden, padded the same way); 1 without a MoE spec. The padding
    is of each rank's share of the intermediate size (create_weights is given
    intermediate_size_per_partition): gpt-oss-120b's 2,880 is 2,944 on one GPU, 4 x 768 at tp 4."""
    if spec is None or spec.moe is None:
        return 1.0
    i, h = spec.moe.expert_intermediate_size / expert_tp, spec.hidden_size
    return (_round_up(math.ceil(i), MARLIN_INTERMEDIATE_MULTIPLE) * _round_up(h, MARLIN_HIDDEN_MULTIPLE)) / (i * h)


def weight_storage_dtype(quantization: Quantization) -> DType | None:
    if quantization.is_gguf or quantization is Quantization.NF4:
        return DType.INT4 if quantization is Quantization.NF4 else None  # mixed: see gguf.py
    if quantization.is_mxfp4:
        return DType.FP4
    return {
        Quantization.NONE: None,
        Quantization.FP8: DType.FP8,
        Quantization.INT8: DType.INT8,
        Quantization.INT4: DType.INT4,
        Quantization.AWQ: DType.INT4,
        Quantization.GPTQ: DType.INT4,
    }[quantization]


def is_quantized_tensor(w: WeightKind, quantization: Quantization | None = None) -> bool:
    """Block linear weights are quantized; biases, norms, routers, embeddings and lm_head are not.
    MXFP4 (gpt-oss as shipped) holds only the routed experts' weights in 4 bits."""
    linear = w.component in _QUANTIZABLE and len(w.shape) == 2 and w.name.endswith(".weight")
    if quantization is not None and quantization.is_mxfp4:
        return linear and w.routed_expert
    return linear


def gguf_bytes_per_element(w: WeightKind, quantization: Quantization, spec: ModelSpec | None,
                           layers: tuple[int, ...] | None = None) -> float:
    """Bytes per element of `w` in a GGUF file of mixture `quantization` (gguf.py), averaged over
    the layers of `layers` (None: every decoder layer) that hold `w` (the type of attn_v and ffn_down
    follows the layer): a MoE model's dense MLP is averaged over its dense layers only, its experts'
    over its MoE layers, so that stages' weights sum to the whole model's."""
    mixture = quantization
    if spec is None:  # no model at hand: the mixture's base type
        return gguf.bytes_per_element(gguf.BASE_TYPE[mixture])
    n = spec.num_layers
    holding = _layers_holding(spec, w)
    if layers is None:
        layers = tuple(sorted(holding)) if holding else tuple(range(n))
    elif holding:
        layers = tuple(i for i in layers if i in holding) or layers
    return gguf.mean_bytes_per_element(
        w, mixture, layers, n,
        spec.moe.num_experts if spec.moe is not None else 1,
        spec.num_attention_heads // max(1, spec.kv_heads), spec.tie_word_embeddings, is_llama_70b(spec))


@lru_cache(maxsize=1024)
def _layers_holding(spec: ModelSpec, w: WeightKind) -> frozenset[int]:
    """The decoder layers whose block holds tensor kind `w` (empty: not a block weight, such as the
    embedding or a cross-attention layer's own tensors)."""
    by_kind = kinds_by_layer(spec)
    kinds = {k for k in set(by_kind) if w in block_weights(spec, *k)}
    return frozenset(i for i, k in enumerate(by_kind) if k in kinds)


def is_llama_70b(spec: ModelSpec) -> bool:
    """llama.cpp's LLM_TYPE_70B: a llama-architecture model of 80 layers (src/llama-model.cpp,
    LLM_ARCH_LLAMA: `case 80: type = ... LLM_TYPE_70B`)."""
    return spec.model_type == "llama" and spec.num_layers == 80


def bytes_per_weight_element(w: WeightKind, quantization: Quantization, dense_dtype: DType,
                             spec: ModelSpec | None = None, layers: tuple[int, ...] | None = None,
                             expert_tp: int = 1) -> float:
    """Average bytes per stored element of tensor kind `w`, scales and zero points included.
    GGUF mixtures quantize the embedding and output too, by llama.cpp's rules (`spec` and
    `layers` select the per-layer types). `expert_tp`: the ranks a routed expert is split over
    (its padding on vLLM's Marlin path is per rank)."""
    if quantization.is_gguf:
        return gguf_bytes_per_element(w, quantization, spec, layers)
    if quantization is Quantization.NONE or not is_quantized_tensor(w, quantization):
        return bytes_per_element(dense_dtype)
    if quantization is Quantization.MXFP4:
        return MXFP4_BYTES_PER_ELEMENT
    if quantization is Quantization.MXFP4_MARLIN:
        return MXFP4_BYTES_PER_ELEMENT * marlin_expert_padding(spec, expert_tp)
    if quantization is Quantization.NF4:
        return nf4_bytes_per_weight(False)
    out_features, in_features = w.shape
    q = weight_storage_dtype(quantization)
    if q is DType.INT4:
        return bytes_per_element(DType.INT4) + (INT4_SCALE_BYTES + INT4_ZERO_BYTES) / INT4_GROUP_SIZE
    if q is DType.INT8:
        return bytes_per_element(DType.INT8) + INT8_SCALE_BYTES_PER_ROW / in_features
    return bytes_per_element(DType.FP8) + FP8_SCALE_BYTES_PER_TENSOR / (out_features * in_features)


def numel_per_rank(w: WeightKind, spec: ModelSpec, layout: Layout) -> float:
    """Elements of `w` (all its copies) on one rank: routed experts over ep x etp, the rest by
    its tensor-parallel split."""
    if w.routed_expert:
        return w.numel / (layout.ep * layout.expert_tp)
    return w.numel_per_tp_rank(layout.tp, spec.kv_heads)


@dataclass(frozen=True)
class StageWeights:
    """What one rank of a pipeline stage stores: elements and bytes by component; the routed
    expert and dense parts apart, since ZeRO shards them over different groups."""

    stage: int
    layers: tuple[int, ...]
    numel_by_component: dict[str, float]
    bytes_by_component: dict[str, float]
    expert_numel: float  # routed-expert elements on this rank
    largest_layer_numel: float  # the largest single block on this rank (ZeRO-3 gather unit)

    @property
    def numel(self) -> float:
        return sum(self.numel_by_component.values())

    @property
    def bytes(self) -> float:
        return sum(self.bytes_by_component.values())

    @property
    def dense_numel(self) -> float:
        return self.numel - self.expert_numel


def stage_tensors(spec: ModelSpec, layout: Layout, stage: int) -> list[tuple[WeightKind, int]]:
    """(tensor kind, how many layers carry it) for one pipeline stage."""
    chunks = layout_stage_ranges(spec.num_layers, layout)[stage]
    out: list[tuple[WeightKind, int]] = []
    if stage == 0:
        out += [(w, 1) for w in embedding_weights(spec)]
    for (moe, linear), num in sorted(chunk_layer_kinds(spec, chunks).items()):
        out += [(w, num) for w in block_weights(spec, moe, linear)]
    out += cross_attention_tensors(spec, (i for r in chunks for i in r))
    if stage == layout.pp - 1:
        out += [(w, 1) for w in head_weights(spec)]
        if layout.pp > 1:
            out += [(w, 1) for w in tied_lm_head_copy(spec)]
    return out


def stage_weights(
    spec: ModelSpec, layout: Layout, stage: int, *, quantization: Quantization, dense_dtype: DType
) -> StageWeights:
    """What one rank of `stage` stores. It depends on tp, ep, etp and the pipeline split only,
    so the result is cached on those (the search costs many layouts that share them)."""
    return _stage_weights_of(spec, layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.virtual_stages,
                             layout.pp_embedding_as_layer, layout.pp_loss_as_layer, layout.pp_first_stage_layers,
                             layout.pp_last_stage_layers, stage, quantization, dense_dtype)


@lru_cache(maxsize=16384)
def _stage_weights_of(
    spec: ModelSpec, tp: int, pp: int, ep: int, etp: int, virtual_stages: int, embedding_as_layer: bool,
    loss_as_layer: bool, first: int | None, last: int | None, stage: int, quantization: Quantization, dense_dtype: DType,
) -> StageWeights:
    """The cache on plain values (hashing a tuple of ints is cheaper than building the layout)."""
    shape = Layout(tp=tp, pp=pp, ep=ep, etp=etp, virtual_stages=virtual_stages, pp_embedding_as_layer=embedding_as_layer,
                   pp_loss_as_layer=loss_as_layer, pp_first_stage_layers=first, pp_last_stage_layers=last)
    return _stage_weights(spec, shape, stage, quantization, dense_dtype)


@lru_cache(maxsize=16384)
def _stage_weights(spec: ModelSpec, layout: Layout, stage: int, quantization: Quantization, dense_dtype: DType) -> StageWeights:
    chunks = layout_stage_ranges(spec.num_layers, layout)[stage]
    layers = tuple(i for r in chunks for i in r)
    numel: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    expert = 0.0
    for w, times in stage_tensors(spec, layout, stage):
        n = numel_per_rank(w, spec, layout) * times
        key = w.component.value
        numel[key] = numel.get(key, 0.0) + n
        nbytes[key] = nbytes.get(key, 0.0) + n * bytes_per_weight_element(w, quantization, dense_dtype, spec, layers,
                                                                          layout.expert_tp)
        if w.routed_expert:
            expert += n
    per_block = [
        sum(numel_per_rank(w, spec, layout) for w in block_weights(spec, moe, linear))
        for moe, linear in chunk_layer_kinds(spec, chunks)
    ]
    return StageWeights(
        stage=stage,
        layers=layers,
        numel_by_component=numel,
        bytes_by_component=nbytes,
        expert_numel=expert,
        largest_layer_numel=max(per_block, default=0.0),
    )
