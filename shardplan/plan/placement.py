"""Which slice of which checkpoint tensor each rank of a plan holds.

The tensors are named as a Hugging Face checkpoint of the Llama family names them
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ...,
`model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight` for Mixtral, `model.norm.weight`,
`lm_head.weight`), with their shapes from the weight inventory (`cost.params`), so the
checkpoint plan and the parameter counts cannot disagree. Every layer lists its own kind's
weights (`params.layer_weights`): a Qwen3-Next linear-attention layer holds
`model.layers.{i}.linear_attn.*` (in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm,
out_proj) where a full-attention layer holds `self_attn.*`.

A slice is a box: one [start, stop) per dimension. What a rank holds follows the manifest:
- pipeline: a rank of stage s = rank // (tp x cp x dp) holds the layers of its stage's chunks;
  stage 0 the embedding, the last stage the final norm and lm_head (with tied embeddings and
  pp > 1, its own copy of the embedding matrix, read from `model.embed_tokens.weight`).
- tensor parallelism (`placement.tp_splits`, tp rank = rank % tp): HF linear weights are
  [out, in], so column-parallel splits dim 0 and row-parallel dim 1; vocab splits dim 0;
  kv_column splits dim 0 over min(tp, kv heads) (a KV head is replicated once tp exceeds them).
  The box is one contiguous range: right in size for every tensor, but for Qwen3-Next's
  `linear_attn.conv1d.weight`, whose channels are q, k, v one after the other, vLLM takes each
  rank's heads from all three sections, which one range cannot express.
- experts: ep rank = (rank // etp) % ep holds `placement.experts.expert_ranges[ep rank]`; each
  expert is split over etp (etp rank = rank % etp).
- training, at rest: ZeRO-3/FSDP shards each parameter's tensor-parallel slice along dim 0 over
  its data-parallel group (`torch.chunk` sizes, as FSDP2 does), and ZeRO >= 1 the optimizer
  states the same way; under ZeRO 0 (and 1-2 for the weights) every replica holds the slice.
Parts of a dimension are `torch.chunk` sizes (ceil(n / parts), the last may be short or
empty), which is an even split whenever the degree divides the dimension.

Pure: no torch, yaml or rich.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardplan.cost.layout import Layout
from shardplan.cost.memory_training import state_bytes, zero_shard_degrees
from shardplan.cost.params import (
    Split,
    WeightKind,
    embedding_weights,
    head_weights,
    layer_weights,
    tied_lm_head_copy,
)
from shardplan.cost.weights import bytes_per_weight_element
from shardplan.cost.workload import Framework, Optimizer, Quantization, TrainingWorkload
from shardplan.errors import ShardplanError
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.model import ModelSpec
from shardplan.units import DType

Box = tuple[tuple[int, int], ...]  # one [start, stop) per dimension

# model_type -> Hugging Face naming of the MoE block; every family here names attention,
# dense MLP, norms, embedding and head the Llama way.
_MOE_PREFIX = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp", "qwen3_next": "mlp"}
# Families that name their shared expert `mlp.shared_expert` (one MLP) with a sigmoid gate beside it.
_SHARED_EXPERT_SINGULAR = {"qwen2_moe", "qwen3_next"}
_LLAMA_NAMED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", *_MOE_PREFIX}
_BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_MIXTRAL_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the checkpoint as the plan sees it."""

    name: str  # Hugging Face name
    shape: tuple[int, ...]
    kind: WeightKind  # the inventory entry it comes from (its split, component)
    split_name: str  # key of `placement.tp_splits`
    layer: int | None  # transformer block, None for embedding/head
    expert: int | None  # routed expert index, None otherwise

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def chunk(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of [start, stop) cut into `parts` as torch.chunk does (ceil-sized)."""
    size = -(-(stop - start) // parts)
    lo = min(start + index * size, stop)
    return lo, min(lo + size, stop)


def _unsupported(spec: ModelSpec, why: str, source: str | None = None) -> ShardplanError:
    return ShardplanError(f"cannot name the checkpoint tensors of '{spec.name}': {why}", source=source, field="model",
                          hint="checkpoint and replan know the Llama, Mistral, Mixtral, Qwen2/3(-MoE), Qwen3-Next "
                               "and Gemma naming; for a custom spec with Llama names set architecture.model_type: llama")


def _hf_block_name(spec: ModelSpec, inv: str, layer: int, expert: int | None) -> str:
    base = f"model.layers.{layer}."
    if inv.startswith("norm"):
        index, _, suffix = inv[len("norm"):].partition(".")
        return base + f"{_BLOCK_NORMS[int(index)]}.{suffix}"
    if inv.startswith(("self_attn.", "linear_attn.", "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")) and expert is None:
        return base + inv
    moe = _MOE_PREFIX.get(spec.model_type)
    if moe is None:
        raise _unsupported(spec, f"no Hugging Face name for '{inv}' in a {spec.model_type} model")
    if inv.startswith("mlp.experts.") and expert is not None:
        proj, _, suffix = inv[len("mlp.experts."):].partition(".")
        if spec.model_type == "mixtral":
            proj = _MIXTRAL_EXPERT[proj]
        return base + f"{moe}.experts.{expert}.{proj}.{suffix}"
    if inv.startswith("mlp.gate."):
        return base + f"{moe}.gate.{inv[len('mlp.gate.'):]}"
    if inv.startswith("mlp.shared_experts.") and spec.model_type in _SHARED_EXPERT_SINGULAR:
        return base + "mlp.shared_expert." + inv[len("mlp.shared_experts."):]
    if inv == "mlp.shared_expert_gate.weight" and spec.model_type in _SHARED_EXPERT_SINGULAR:
        return base + inv
    raise _unsupported(spec, f"no Hugging Face name for '{inv}' in a {spec.model_type} model")


def check_nameable(spec: ModelSpec, source: str | None = None) -> None:
    """Refuse, naming the plan, a model whose checkpoint names this module does not know."""
    if spec.mla is not None:
        raise _unsupported(spec, "multi-head latent attention (DeepSeek) is not named here", source)
    if spec.model_type not in _LLAMA_NAMED:
        raise _unsupported(spec, f"model_type '{spec.model_type}'", source)
    if spec.num_norms_per_layer > len(_BLOCK_NORMS) or embedding_weights(spec)[1:]:
        raise _unsupported(spec, "learned position embeddings or more than four norms per block", source)


def model_tensors(spec: ModelSpec) -> list[Tensor]:
    """Every tensor of the model's Hugging Face checkpoint, in checkpoint order (embedding,
    blocks, final norm, lm_head; a tied lm_head is not stored)."""
    check_nameable(spec)
    out = [Tensor("model.embed_tokens.weight", w.shape, w, w.name, None, None) for w in embedding_weights(spec)]
    for layer in range(spec.num_layers):
        for w in layer_weights(spec, layer):  # a linear-attention layer holds linear_attn.*, not self_attn.*
            for e in (range(w.copies) if w.routed_expert else (None,)):
                out.append(Tensor(_hf_block_name(spec, w.name, layer, e), w.shape, w, w.name, layer, e))
    for w in head_weights(spec):
        name = "model.norm." + w.name.split(".", 1)[1] if w.name.startswith("final_norm.") else w.name
        out.append(Tensor(name, w.shape, w, w.name, None, None))
    return out


@dataclass(frozen=True)
class Holding:
    """What one rank holds of one tensor."""

    tensor: Tensor
    box: Box


def _stage_tensors(spec: ModelSpec, m: DeploymentManifest, stage: int, by_layer: dict[int | None, list[Tensor]],
                   ) -> list[Tensor]:
    st = m.placement.stages[stage]
    out: list[Tensor] = []
    if st.embedding:
        out += by_layer[None][:1]
    for first, last in st.layer_ranges:
        for layer in range(first, last + 1):
            out += by_layer[layer]
    if st.lm_head:
        out += by_layer[None][1:]
        if m.layout.pp > 1:  # tied embeddings: the last stage keeps its own copy of the matrix
            out += [Tensor("model.embed_tokens.weight", w.shape, w, w.name, None, None) for w in tied_lm_head_copy(spec)]
    return out


def _tp_box(t: Tensor, split: str, parts: int, index: int, num_kv_heads: int) -> Box:
    box = list(full_box(t.shape))
    s = Split(split)
    if s is Split.REPLICATED:
        return tuple(box)
    if s is Split.KV_COLUMN:
        kv_parts = min(parts, num_kv_heads)
        index, parts = index * kv_parts // parts, kv_parts
    dim = 1 if s is Split.ROW and len(t.shape) > 1 else 0
    box[dim] = chunk(*box[dim], parts, index)
    return tuple(box)


class Holdings:
    """What every rank of a plan holds of one state, computed once per shard make-up.

    Within its stage (local = rank % (tp x cp x dp)) a rank's slices depend only on local % tp,
    on (local // etp) % ep and local % etp (routed experts), and where ZeRO shards the state on
    its index in the shard group, (local // tp) % dense_group or (local // (ep x etp)) %
    expert_group: all of them functions of local % `period`, the least common multiple of those
    moduli. A make-up is (stage, local % period), numbered stage x `width` + residue; its ranks
    are `members(i)`, every `period`-th of the stage, and they hold the same slices (the
    replicas of a data-parallel group, the ranks of a ZeRO group's same index). Make-ups whose
    coordinates agree (`key`) share one list, so a plan of 2^24 replicas costs one list of
    slices, not 2^24."""

    def __init__(self, m: DeploymentManifest, spec: ModelSpec, state: str = "weights") -> None:
        L = m.layout
        self.manifest, self.spec, self.state = m, spec, state
        self.num_ranks = m.hardware.num_gpus
        self.per_stage = L.tp * L.cp * L.dp
        self.num_stages = L.pp
        training = m.workload.kind == "training"
        self.sharded = training and (L.zero_stage >= 3 if state == "weights" else L.zero_stage >= 1)
        layout = Layout(tp=L.tp, pp=L.pp, dp=L.dp, cp=L.cp, ep=L.ep, etp=L.etp, hybrid_shard=L.hybrid_shard)
        self.dense_group, self.expert_group = zero_shard_degrees(layout, m.placement.gpus_per_node)
        self.ranges = m.placement.experts.expert_ranges if m.placement.experts is not None else None
        tensors = model_tensors(spec)
        self._by_layer: dict[int | None, list[Tensor]] = {}
        for t in tensors:
            self._by_layer.setdefault(t.layer, []).append(t)
        self.has_experts = any(t.expert is not None for t in tensors)
        # A ZeRO shard index past every tensor's rows holds nothing of any: such indices are one make-up.
        self._max_rows = max((t.shape[0] for t in tensors if t.shape), default=1)
        moduli = [L.tp]
        if self.has_experts:
            moduli += [L.etp * L.ep]
        if self.sharded:
            moduli += [L.tp * self.dense_group] + ([L.ep * L.etp * self.expert_group] if self.has_experts else [])
        self.period = math.lcm(*moduli)
        self.width = min(self.period, self.per_stage)  # residues that have ranks
        self._lists: dict[tuple[int, ...], list[Holding]] = {}

    @property
    def num_make_ups(self) -> int:
        return self.num_stages * self.width

    def make_up(self, rank: int) -> int:
        stage, local = divmod(rank, self.per_stage)
        return stage * self.width + local % self.period

    def members(self, i: int) -> range:
        """The ranks of make-up i, in order."""
        stage, residue = divmod(i, self.width)
        start = stage * self.per_stage + residue
        return range(start, min((stage + 1) * self.per_stage, self.num_ranks), self.period)

    def key(self, rank: int) -> tuple[int, ...]:
        """The coordinates that decide what `rank` holds (those that do not are 0)."""
        L = self.manifest.layout
        stage, local = divmod(rank, self.per_stage)
        ep_rank = (local // L.etp) % L.ep if self.has_experts else 0
        etp_rank = local % L.etp if self.has_experts else 0
        dense = expert = 0
        if self.sharded:
            dense = min((local // L.tp) % self.dense_group, self._max_rows)
            if self.has_experts:
                expert = min((local // (L.ep * L.etp)) % self.expert_group, self._max_rows)
        return stage, local % L.tp, ep_rank, etp_rank, dense, expert

    def make_up_key(self, i: int) -> tuple[int, ...]:
        return self.key(self.members(i)[0])

    def of_rank(self, rank: int) -> list[Holding]:
        """The slices `rank` holds (one list per make-up: do not change it)."""
        return self.of_key(self.key(rank))

    def of_key(self, key: tuple[int, ...]) -> list[Holding]:
        held = self._lists.get(key)
        if held is None:
            held = self._lists[key] = self._holdings(*key)
        return held

    def _holdings(self, stage: int, tp_rank: int, ep_rank: int, etp_rank: int, dense: int, expert: int,
                  ) -> list[Holding]:
        m, L = self.manifest, self.manifest.layout
        held: list[Holding] = []
        for t in _stage_tensors(self.spec, m, stage, self._by_layer):
            split = m.placement.tp_splits[t.split_name]
            if t.expert is not None:
                if self.ranges is not None and not self.ranges[ep_rank][0] <= t.expert <= self.ranges[ep_rank][1]:
                    continue
                box = _tp_box(t, split, L.etp, etp_rank, m.model.num_kv_heads)
                group, index = self.expert_group, expert
            else:
                box = _tp_box(t, split, L.tp, tp_rank, m.model.num_kv_heads)
                group, index = self.dense_group, dense
            if self.sharded and group > 1:
                box = (chunk(*box[0], group, index), *box[1:])
            if box_numel(box):
                held.append(Holding(t, box))
        return held


def rank_holdings(m: DeploymentManifest, spec: ModelSpec, state: str = "weights") -> list[list[Holding]]:
    """For every rank (list index), the tensor slices it holds at rest. `state`: "weights", or
    "optimizer" (training: the optimizer states of those elements, partitioned by ZeRO >= 1).
    Ranks of one make-up (`Holdings`) share one list."""
    holdings = Holdings(m, spec, state)
    return [holdings.of_rank(rank) for rank in range(m.hardware.num_gpus)]


def bytes_per_element(m: DeploymentManifest, t: Tensor, state: str = "weights") -> float:
    """Bytes of one element of `t` in the plan's format: serving weights as the plan stores them
    (quantized block linear layers with their scales, `cost.weights`), training weights in the
    parameter dtype, optimizer states as `cost.memory_training.state_bytes` counts them."""
    wl = m.workload
    if state == "optimizer":
        training = TrainingWorkload(optimizer=Optimizer(wl.optimizer), framework=Framework(wl.framework),
                                    param_dtype=DType(wl.param_dtype), master_dtype=DType(wl.master_dtype),
                                    moment_dtype=DType(wl.moment_dtype))
        return state_bytes(training, m.layout.zero_stage).optimizer
    if wl.kind == "training":
        return bytes_per_weight_element(t.kind, Quantization.NONE, DType(wl.param_dtype))
    return bytes_per_weight_element(t.kind, Quantization(wl.quantization), DType(wl.activation_dtype))


def states(m: DeploymentManifest) -> tuple[str, ...]:
    """The states a plan keeps per parameter that a re-plan must move."""
    return ("weights", "optimizer") if m.workload.kind == "training" else ("weights",)
