"""Training step time: compute per pipeline stage, exposed communication, pipeline bubble and
offload traffic, as a breakdown that sums to the step.

Per micro-batch on a stage: forward F (compute.py) and backward B = 2x the forward GEMMs and
elementwise work, 2.5x the flash-attention core (FlashAttention-2 backward runs five GEMMs
to the forward's two; Dao 2023, Sec. 3.1.2), or 2x unfused; plus one more forward of the
layers under full recomputation, or of the attention core under selective recomputation
(Korthikanti et al. 2022, Sec. 5).

    step = m (F + B + TP/EP/CP comm) + bubble + p2p + data-parallel sync + optimizer + offload
    bubble = (pp - 1) / v x (F + B + comm) of the slowest stage   (Narayanan et al. 2021, Sec. 2.2)

What overlaps with compute is an explicit assumption, per collective (`OVERLAP` below):
tensor-parallel all-reduces (or reduce-scatter/all-gather with sequence parallelism) and
expert all-to-alls sit on the critical path (Megatron-LM without TP-comm overlap);
context-parallel ring exchanges hide behind the attention they feed (Liu et al. 2023, ring
attention); pipeline sends are blocking; the data-parallel gradient reduction overlaps the
last micro-batch's backward, all but its final bucket (PyTorch DDP, DeepSpeed
`overlap_comm`, Megatron-Core `--overlap-grad-reduce`) when the workload says so; ZeRO-3/FSDP
all-gathers are prefetched one unit ahead, so a phase costs max(compute, comm) plus the first
unit's gather; offloaded optimizer steps run on the CPU after the backward (ZeRO-Offload,
Ren et al. 2021) with gradients streamed down behind the backward and the updated weights
sent back before the next step; offloaded parameters (ZeRO-Infinity) are prefetched over
PCIe (or from NVMe) behind the compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shardplan.cost.breakdown import SecondsBreakdown
from shardplan.cost.comm import (
    Collective,
    Group,
    Groups,
    collective_seconds,
    group,
    layer_collectives_seconds,
    layout_groups,
    overlapped,
)
from shardplan.cost.compute import (
    FUSED,
    ElementwiseTraffic,
    PassTime,
    Work,
    embedding_forward,
    gemm_time,
    head_forward,
    kernel_overhead_seconds,
    layers_forward,
    memory_seconds,
    recomputed_forward,
)
from shardplan.cost.finetune import adapter_params, base_format_bytes, is_nf4_base_weight, targeted_modules
from shardplan.cost.params import layer_kind, layer_weights
from shardplan.cost.layout import Layout, Offload, Recompute, flat_layers, layout_stage_ranges, stage_layer_ranges
from shardplan.cost.memory_training import (
    FP32_BYTES,
    StateBytes,
    dropout_kinds,
    frozen_base,
    logits_per_rank,
    optimizer_moment_bytes,
    recomputed_modules,
    state_bytes,
    zero_shard_degrees,
)
from shardplan.cost.weights import numel_per_rank, stage_weights
from shardplan.cost.workload import Quantization, TrainingWorkload
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.units import DType, bytes_per_element

FLASH_BACKWARD_FACTOR = 2.5  # FlashAttention-2: 5 GEMMs in backward vs 2 in forward
UNFUSED_BACKWARD_FACTOR = 2.0
# Adam on the host: bytes of fp32 state read and written per parameter (master, m, v, grad).
CPU_ADAM_BYTES_PER_PARAM = 4 * 4 * 2
# Host DRAM streaming rate of a vectorised CPU Adam (DeepSpeed CPUAdam) on a two-socket
# server: an estimate (~half of 8-channel DDR5 x 2 sockets); it matters only with optimizer offload.
CPU_ADAM_BYTES_PER_SECOND = 100e9

OVERLAP = {
    "tensor_parallel": "none: on the critical path (Megatron-LM default, no TP-comm overlap)",
    "expert_all_to_all": "none: dispatch and combine sit between router and experts",
    "context_parallel": "hidden behind the attention core it feeds (ring attention); the excess is exposed",
    "pipeline_p2p": "none: blocking sends between stages",
    "data_parallel": "overlaps the last micro-batch's backward except its final layer (when overlap_grad_reduce)",
    "zero3_gather": "prefetched one unit ahead: max(compute, comm) per pass plus the first unit",
    "offload": "gradients stream to the host behind the backward; the CPU optimizer step and the weights' return are exposed; offloaded parameters are prefetched behind compute",
}


@dataclass(frozen=True)
class TimeBreakdown(SecondsBreakdown):
    """Seconds of one step by cause; `total` is their sum, always."""

    compute: float = 0.0  # GEMMs, attention, elementwise, kernel overheads of all micro-batches
    tensor_parallel: float = 0.0
    expert_parallel: float = 0.0
    context_parallel: float = 0.0
    pipeline_p2p: float = 0.0
    pipeline_bubble: float = 0.0
    data_parallel: float = 0.0
    zero3: float = 0.0
    optimizer: float = 0.0
    offload: float = 0.0


@dataclass(frozen=True)
class StageTime:
    stage: int
    forward: PassTime
    backward: PassTime
    tp_seconds: float  # per micro-batch, forward + backward (+ recompute)
    ep_seconds: float
    cp_seconds: float
    num_layers: int

    @property
    def per_microbatch_seconds(self) -> float:
        return self.forward.seconds + self.backward.seconds + self.tp_seconds + self.ep_seconds + self.cp_seconds


@dataclass(frozen=True)
class TrainingTime:
    step_seconds: float
    breakdown: TimeBreakdown
    tokens_per_second_per_gpu: float
    model_flops_per_step: float  # whole cluster, no recomputation
    hardware_flops_per_step: float  # whole cluster, recomputation included
    mfu: float
    hfu: float
    stages: list[StageTime]


def _backward(fwd: PassTime, flash: bool, attention_slowdown: float = 1.0, weight_grads: bool = True) -> PassTime:
    """The backward of a forward pass; `attention_slowdown` is the kernel's forward efficiency
    over its backward efficiency (FlashAttention-2 on an H100: 0.374 / 0.321). A frozen base
    (`weight_grads` False: LoRA) runs one GEMM per linear (the input gradient), not two."""
    attn_factor = FLASH_BACKWARD_FACTOR * attention_slowdown if flash else UNFUSED_BACKWARD_FACTOR
    g = 2.0 if weight_grads else 1.0
    matmul_flops = fwd.flops - fwd.attention_flops
    return PassTime(
        matmul_seconds=g * fwd.matmul_seconds,
        attention_seconds=attn_factor * fwd.attention_seconds,
        memory_seconds=2 * fwd.memory_seconds,
        kernel_seconds=2 * fwd.kernel_seconds,
        flops=g * matmul_flops + 2 * fwd.attention_flops,
        model_flops=g * (fwd.model_flops - fwd.attention_flops) + 2 * fwd.attention_flops,
        attention_flops=2 * fwd.attention_flops,
    )


def adapters_forward(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, layers: Sequence[int], tokens: float) -> PassTime:
    """Forward of the LoRA adapters on `layers` (PEFT's LoRA Linear): x A^T and (x A^T) B^T as
    thin GEMMs, then the scaled sum into the base output (reads two outputs, writes one); with
    lora_dropout a dropout of the input first. Four kernels, six with dropout."""
    a = bytes_per_element(wl.activation_dtype)
    total = PassTime()
    per_kind: dict[tuple[bool, bool], PassTime] = {}
    for i in layers:
        kind = layer_kind(spec, i)
        if kind not in per_kind:
            t = PassTime()
            for _, in_f, out_f in targeted_modules(spec, kind[0], wl.lora_targets, kind[1]):
                s1, f1 = gemm_time(hw, tokens, wl.lora_rank, in_f, count=1, weight_bytes=FP32_BYTES, act_bytes=a, dtype=wl.activation_dtype)
                s2, f2 = gemm_time(hw, tokens, out_f, wl.lora_rank, count=1, weight_bytes=FP32_BYTES, act_bytes=a, dtype=wl.activation_dtype)
                nbytes = 3 * a * tokens * out_f
                kernels = 4
                if wl.lora_dropout > 0:
                    nbytes += (2 * a + 1) * tokens * in_f
                    kernels += 2
                mem = memory_seconds(hw, nbytes)
                t = t + PassTime(matmul_seconds=s1 + s2, memory_seconds=mem, flops=f1 + f2, model_flops=f1 + f2,
                                 kernels=kernels, kernel_seconds=kernel_overhead_seconds(hw, kernels, s1 + s2 + mem, False))
            per_kind[kind] = t
        total = total + per_kind[kind]
    return total


def dequantize_pass(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, layers: Sequence[int]) -> PassTime:
    """QLoRA: every 4-bit base linear (`is_nf4_base_weight`: routed experts and routers stay 16-bit
    or fp32) is dequantized to the compute dtype before each matmul that uses it (bitsandbytes
    dequantize_4bit): reads the 4-bit weight and its constants, writes 16 bits; one kernel each.
    Once per pass (forward, input-gradient backward, recomputed forward)."""
    q = base_format_bytes(wl.base_format)
    if q is None:
        return PassTime()
    a = bytes_per_element(wl.activation_dtype)
    numel = kernels = 0.0
    for i in layers:
        for w in layer_weights(spec, i):
            if is_nf4_base_weight(w):
                numel += numel_per_rank(w, spec, layout)
                kernels += w.copies
    mem = memory_seconds(hw, numel * (q + a))
    return PassTime(memory_seconds=mem, kernels=kernels, kernel_seconds=kernel_overhead_seconds(hw, int(kernels), mem, False))


def _compute_shape(layout: Layout) -> Layout:
    """The fields a stage's compute and per-micro-batch communication depend on; dp, ZeRO and
    offload do not enter, so stage times are cached on this (the search costs many
    state-sharding variants of one shape)."""
    return _shape_of(layout.tp, layout.cp, layout.ep, layout.expert_tp, layout.sequence_parallel, layout.recompute, layout.micro_batch_size)


@lru_cache(maxsize=4096)
def _shape_of(tp: int, cp: int, ep: int, etp: int, sp: bool, recompute: Recompute, mbs: int) -> Layout:
    return Layout(tp=tp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp, recompute=recompute, micro_batch_size=mbs)


def _time_kind(spec: ModelSpec, i: int) -> tuple[bool, bool, bool]:
    """What a layer's time depends on: MoE, sliding window, linear attention (its own weights)."""
    return spec.is_moe_layer(i), spec.is_sliding_layer(i), spec.is_linear_attention_layer(i)


@lru_cache(maxsize=8192)
def _canonical_layers(spec: ModelSpec, chunks: tuple[range, ...]) -> tuple[int, ...]:
    """The stage's layers with each replaced by the first layer of its kind (`_time_kind`)."""
    reps = _kind_representatives(spec)
    return tuple(sorted(reps[_time_kind(spec, i)] for r in chunks for i in r))


@lru_cache(maxsize=256)
def _kind_representatives(spec: ModelSpec) -> dict[tuple[bool, bool, bool], int]:
    kinds: dict[tuple[bool, bool, bool], int] = {}
    for i in range(spec.num_layers):
        kinds.setdefault(_time_kind(spec, i), i)
    return kinds


def layers_seconds_lower_bound(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, layers: Sequence[int] | None = None
) -> float:
    """Per-micro-batch seconds (forward, backward, recompute, TP/EP/CP communication) of
    `layers` (None: all of them) without the embedding and head: the sum of each layer's own
    time. A stage's per-micro-batch time is at least this for its layers (the search's bound)."""
    return _layers_seconds(spec, hw, wl, layout.tp, layout.cp, layout.ep, layout.expert_tp, layout.sequence_parallel,
                           layout.recompute, layout.micro_batch_size, None if layers is None else tuple(layers))


def shape_layers_seconds(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, tp: int, cp: int, ep: int,
                         etp: int, sp: bool, recompute: Recompute, mbs: int) -> float:
    """`layers_seconds_lower_bound` of all the layers, on the fields it reads (no Layout built:
    the training search bounds thousands of degree sets with it)."""
    return _layers_seconds(spec, hw, wl, tp, cp, ep, etp, sp, recompute, mbs, None)


@lru_cache(maxsize=65536)
def _layers_seconds(
    spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, tp: int, cp: int, ep: int, etp: int, sp: bool,
    recompute: Recompute, mbs: int, layers: tuple[int, ...] | None,
) -> float:
    """`layers_seconds_lower_bound` on the fields it reads (a plain tuple key: the search asks
    for the same shapes thousands of times)."""
    counts = _all_kind_counts(spec) if layers is None else _kind_counts(spec, layers)
    return _sum_by_kind(_per_kind_seconds(spec, hw, wl, tp, cp, ep, etp, sp, recompute, mbs), counts)


def _sum_by_kind(per_kind: dict[tuple[bool, bool, bool], float], counts: dict[tuple[bool, bool, bool], int]) -> float:
    """Seconds of the layers counted by kind, each kind's own time times its count, in the counts' order."""
    return sum(per_kind[kind] * n for kind, n in counts.items())


@lru_cache(maxsize=16384)
def _per_kind_seconds(
    spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, tp: int, cp: int, ep: int, etp: int, sp: bool,
    recompute: Recompute, mbs: int,
) -> dict[tuple[bool, bool, bool], float]:
    """Each layer kind's per-micro-batch seconds for one shape, on a plain tuple key; the groups
    are those `_groups` places for it."""
    gpn = hw.gpus_per_node
    return _kind_seconds(spec, hw, _shape_of(tp, cp, ep, etp, sp, recompute, mbs), wl,
                         group(tp, 1, gpn), group(cp, tp, gpn), group(ep, etp, gpn))


@lru_cache(maxsize=256)
def _all_kind_counts(spec: ModelSpec) -> dict[tuple[bool, bool, bool], int]:
    return _kind_counts(spec, tuple(range(spec.num_layers)))


@lru_cache(maxsize=4096)
def _kind_counts(spec: ModelSpec, layers: tuple[int, ...]) -> dict[tuple[bool, bool, bool], int]:
    counts: dict[tuple[bool, bool, bool], int] = {}
    for i in layers:
        kind = _time_kind(spec, i)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@lru_cache(maxsize=16384)
def _kind_seconds(
    spec: ModelSpec, hw: HardwareProfile, shape: Layout, wl: TrainingWorkload, tp: Group, cp: Group, ep: Group
) -> dict[tuple[bool, bool, bool], float]:
    return {
        kind: _cached_stage_time(spec, hw, shape, wl, tp, cp, ep, (i,), False, False).per_microbatch_seconds
        for kind, i in _kind_representatives(spec).items()
    }


def step_seconds_lower_bound(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, num_microbatches: int
) -> float:
    """A lower bound on `training_time(...).step_seconds`: (m + (pp - 1) / v) micro-batch times
    of the slowest stage, which is at least stage 0's layers and at least the mean stage's; every
    other term of the step is non-negative. dp, ZeRO and offload do not change it, so one bound
    serves all their variants; with v = the most virtual stages allowed it bounds every v."""
    stage0 = flat_layers(layout_stage_ranges(spec.num_layers, layout)[0])
    fields = (spec, hw, wl, layout.tp, layout.cp, layout.ep, layout.expert_tp, layout.sequence_parallel,
              layout.recompute, layout.micro_batch_size)
    # Stage 0's layers are summed here, not cached: each (pp, virtual stages) has its own, so a
    # cache keyed on them would rarely be hit; the sum is `_layers_seconds`'s, term for term.
    stage0_seconds = _sum_by_kind(_per_kind_seconds(*fields), _kind_counts(spec, stage0))
    per_mb = max(stage0_seconds, _layers_seconds(*fields, None) / layout.pp)
    return (num_microbatches + (layout.pp - 1) / layout.virtual_stages) * per_mb


def _pipeline(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, groups: Groups, m: int
) -> tuple[list[StageTime], StageTime, float, float]:
    """Every stage's time, the slowest, the bubble and the p2p seconds of a step. dp, ZeRO and
    offload do not enter: the search's bound on a shape (`pipeline_seconds`) and the step of each
    of its state variants (`training_time`) share one computation."""
    stages, slowest, bubble, p2p = _pipeline_of(
        spec, hw, wl, _compute_shape(layout), layout.pp, layout.virtual_stages, layout.pp_embedding_as_layer,
        layout.pp_loss_as_layer, layout.pp_first_stage_layers, layout.pp_last_stage_layers,
        groups.tp, groups.cp, groups.ep, groups.pp, m)
    return list(stages), slowest, bubble, p2p


@lru_cache(maxsize=16384)
def _pipeline_of(
    spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, shape: Layout, pp: int, v: int, embedding_as_layer: bool,
    loss_as_layer: bool, first_stage_layers: int | None, last_stage_layers: int | None, tp: Group, cp: Group, ep: Group,
    pp_group: Group, m: int,
) -> tuple[tuple[StageTime, ...], StageTime, float, float]:
    """`_pipeline` on the fields it reads (`shape`: `_compute_shape`)."""
    # Stages of the same make-up (their layers' kinds, first or last or neither) take the same
    # time: their cached computation (`_cached_stage_time`) is looked up once per make-up, not per stage.
    ranges = stage_layer_ranges(spec.num_layers, pp, v, embedding_as_layer, loss_as_layer, first_stage_layers,
                                last_stage_layers)
    made: dict[tuple[Any, ...], StageTime] = {}
    stages = []
    last = pp - 1
    for s in range(pp):
        key = (_canonical_layers(spec, ranges[s]), s == 0, s == last)
        st = made.get(key)
        if st is None:
            st = made[key] = _cached_stage_time(spec, hw, shape, wl, tp, cp, ep, *key)
        stages.append(StageTime(s, st.forward, st.backward, st.tp_seconds, st.ep_seconds, st.cp_seconds, st.num_layers))
    slowest = max(stages, key=lambda st: st.per_microbatch_seconds)
    bubble = (pp - 1) / v * slowest.per_microbatch_seconds
    p2p = 0.0
    if pp > 1:
        a = bytes_per_element(wl.activation_dtype)
        act = shape.micro_batch_size * wl.seq_len / shape.cp * spec.hidden_size * a / shape.tp
        p2p = 2 * m * v * collective_seconds(Collective.P2P, act, pp_group, hw)
        if wl.pp_p2p_overlap and v > 1:  # batched sends beside the next chunk's compute
            busy = m * (slowest.forward.seconds + slowest.backward.seconds)
            p2p = overlapped(busy, p2p, hw) - busy
    return tuple(stages), slowest, bubble, p2p


def pipeline_seconds(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, num_microbatches: int) -> float:
    """The part of the step that dp, ZeRO and offload do not change: m micro-batches of the
    slowest stage with their TP/EP/CP communication, the bubble and the p2p sends. The rest of
    the step (data-parallel sync, ZeRO-3 gathers, optimizer, offload) is non-negative, so this
    is a tighter lower bound than `step_seconds_lower_bound`, at the cost of every stage."""
    _, slowest, bubble, p2p = _pipeline(spec, hw, layout, wl, _groups(layout, hw), num_microbatches)
    return num_microbatches * slowest.per_microbatch_seconds + bubble + p2p


def _groups(layout: Layout, hw: HardwareProfile) -> Groups:
    dense_n, expert_n = zero_shard_degrees(layout, hw.gpus_per_node)
    return _layout_groups(
        layout.tp, layout.cp, layout.dp, layout.pp, layout.ep, layout.expert_tp, dense_n, expert_n, hw.gpus_per_node
    )


_layout_groups = lru_cache(maxsize=65536)(layout_groups)


@lru_cache(maxsize=65536)
def _cached_stage_time(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, tp: Group, cp: Group, ep: Group,
    layers: tuple[int, ...], first: bool, last: bool,
) -> StageTime:
    s_local = wl.seq_len / layout.cp
    b = layout.micro_batch_size
    kernel = attention_kernel(hw, wl)
    work = _training_work(hw, wl, layout.cp, b, dropout_kinds(spec, wl))
    layer_fwd = layers_forward(spec, hw, layout, work, layers)
    attn_fwd = PassTime(attention_seconds=layer_fwd.attention_seconds, attention_flops=layer_fwd.attention_flops)
    fwd = layer_fwd
    if first:
        fwd = fwd + embedding_forward(spec, hw, work)
    loss_fwd = loss_bwd = PassTime()
    if last:
        fwd = fwd + head_forward(spec, hw, layout, work, work.tokens)
        # The loss head's traffic has its own backward count, not twice the forward's.
        logits = logits_per_rank(spec, wl, work.tokens, layout.tp)
        loss_fwd = PassTime(memory_seconds=memory_seconds(hw, logits * wl.loss_forward_bytes_per_logit))
        loss_bwd = PassTime(memory_seconds=memory_seconds(hw, logits * wl.loss_backward_bytes_per_logit))
    bwd = _backward(fwd, wl.flash_attention, kernel[1] / kernel[2] if kernel else 1.0, wl.trains_base) + loss_bwd
    if not wl.trains_base:
        # The adapters train (their backward is twice their forward); a quantized base is
        # dequantized again for the input-gradient GEMMs. Both rerun in a recomputed forward.
        adapters = adapters_forward(spec, hw, wl, layers, work.tokens)
        dequant = dequantize_pass(spec, hw, layout, wl, layers)
        bwd = bwd + adapters.scaled(2.0) + dequant
        layer_fwd = layer_fwd + adapters + dequant
        fwd = fwd + adapters + dequant
    fwd = fwd + loss_fwd
    n_layers = len(layers)
    modules = recomputed_modules(wl, layout.recompute) if wl.selective_policy == "attention_core" else frozenset()
    again_fwd = PassTime()
    if layout.recompute is Recompute.FULL:
        f = layer_fwd  # the layers' forward again, without counting it as model FLOPs
        bwd = bwd + PassTime(f.matmul_seconds, f.attention_seconds, f.memory_seconds, f.kernel_seconds, f.flops, 0.0,
                             f.attention_flops, f.kernels, 0.0, 0.0)
    elif layout.recompute is Recompute.SELECTIVE and wl.selective_policy == "op_level":
        # PyTorch op-level selective checkpointing: every second matmul and all elementwise
        # work run again in backward; the attention kernel's output is saved.
        bwd = bwd + PassTime(matmul_seconds=layer_fwd.dropped_matmul_seconds, memory_seconds=layer_fwd.memory_seconds,
                             kernel_seconds=layer_fwd.kernel_seconds, flops=layer_fwd.dropped_matmul_flops,
                             kernels=layer_fwd.kernels)
    elif layout.recompute is Recompute.SELECTIVE:
        if "core_attn" in modules:
            bwd = bwd + PassTime(attention_seconds=attn_fwd.attention_seconds, flops=attn_fwd.attention_flops)
        others = tuple(sorted(modules - {"core_attn"}))
        if others:
            again_fwd = recomputed_forward(spec, hw, layout, work, layers, others)
            bwd = bwd + again_fwd

    a = bytes_per_element(wl.activation_dtype)
    # TP all-reduces (or RS + AG with sequence parallelism, the same bytes) and expert
    # all-to-alls, in forward, in backward, and again in a recomputed forward.
    passes = 3 if layout.recompute is Recompute.FULL else 2
    tokens_out = work.tokens / layout.tp if layout.sequence_parallel else work.tokens
    tp_pass, _ = layer_collectives_seconds(spec, hw, layers, tokens=work.tokens, act_bytes=a, tp=tp, ep=ep,
                                         multirail=wl.collectives_multirail)
    _, ep_pass = layer_collectives_seconds(spec, hw, layers, tokens=tokens_out, act_bytes=a, tp=tp, ep=ep,
                                         multirail=wl.collectives_multirail)
    # A recomputed MoE layer ("moe") dispatches and combines its tokens again.
    tp_seconds, ep_seconds = passes * tp_pass, (3 if "moe" in modules else passes) * ep_pass
    if wl.tp_comm_overlap and tp_pass > 0:
        # Each pass's collectives run beside that pass's GEMMs (twice the forward's in backward).
        gemm = layer_fwd.matmul_seconds
        tp_seconds = sum(overlapped(g, tp_pass, hw) - g for g in (gemm, 2 * gemm, gemm)[:passes])
    if {"mlp", "moe"} & modules and tp_pass > 0:
        # A checkpointed dense MLP or MoE layer runs its tensor-parallel collective again (one of a
        # layer's two, after attention and after the MLP, of the same bytes), beside the
        # recomputed GEMMs where the stack overlaps them.
        again = tuple(i for i in layers if ("moe" if spec.is_moe_layer(i) else "mlp") in modules)
        if again:
            tp_again, _ = layer_collectives_seconds(spec, hw, again, tokens=work.tokens, act_bytes=a, tp=tp, ep=ep,
                                                    multirail=wl.collectives_multirail)
            if wl.tp_comm_overlap:
                g = again_fwd.matmul_seconds
                tp_seconds += overlapped(g, tp_again / 2, hw) - g
            else:
                tp_seconds += tp_again / 2
    # Context parallelism: the ring passes every K/V chunk round once in forward, K/V and
    # their gradients in backward, behind the attention core.
    cp_seconds = 0.0
    if layout.cp > 1:
        kv_chunk = b * s_local * 2 * max(1.0, spec.kv_heads / layout.tp) * spec.attention_head_dim * a
        ring = (layout.cp - 1) * collective_seconds(Collective.P2P, kv_chunk, cp, hw) * n_layers
        cp_seconds = max(0.0, ring - attn_fwd.attention_seconds) + max(0.0, 2 * ring - FLASH_BACKWARD_FACTOR * attn_fwd.attention_seconds)
    return StageTime(-1, fwd, bwd, tp_seconds, ep_seconds, cp_seconds, n_layers)


def attention_kernel(hw: HardwareProfile, wl: TrainingWorkload) -> tuple[str, float, float] | None:
    """(kernel, forward, backward efficiency) of the stack's attention kernel on this GPU; None:
    the profile's `attention` efficiency applies (no kernel named, or none measured here)."""
    if not wl.flash_attention or not wl.attention_kernels:
        return None
    return _measured_kernel(hw, wl.attention_kernels)


@lru_cache(maxsize=256)
def _measured_kernel(hw: HardwareProfile, kernels: tuple[str, ...]) -> tuple[str, float, float] | None:
    return hw.attention_kernel(kernels)


@lru_cache(maxsize=4096)
def _training_work(hw: HardwareProfile, wl: TrainingWorkload, cp: int, b: int, dropouts: tuple[bool, bool]) -> Work:
    """What one training micro-batch's forward processes on one rank (cached: one per shape);
    `dropouts`: (attention, hidden) as `memory_training.dropout_kinds` gives them."""
    attention_dropout, hidden_dropout = dropouts
    s_local = wl.seq_len / cp
    kernel = attention_kernel(hw, wl)
    return Work(
        tokens=b * s_local,
        num_seqs=b,
        q_len=s_local,
        kv_len=wl.seq_len,
        decode=False,
        causal=True,
        flash_attention=wl.flash_attention,
        dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        act_dtype=wl.activation_dtype,
        kv_dtype=wl.activation_dtype,
        cp=cp,
        attention_efficiency=kernel[1] if kernel else None,
        elementwise=elementwise_traffic(wl),
        quantization=Quantization.FP8 if wl.matmul_dtype is DType.FP8 else Quantization.NONE,
        fp8_casts=wl.matmul_dtype is DType.FP8,
        eager_attention_bytes_per_score=wl.eager_attention_bytes_per_score,
    )


KERNEL_NAMES = {"fa2": "FlashAttention-2", "fa3": "FlashAttention-3", "cudnn": "cuDNN fused attention"}


def training_assumptions(hw: HardwareProfile, wl: TrainingWorkload, spec: ModelSpec | None = None) -> list[str]:
    """What the time figures assume of the stack's kernels (and of fine-tuning), one line each, as printed."""
    who = f"{wl.stack}: " if wl.stack else ""
    kernel = attention_kernel(hw, wl)
    if not wl.flash_attention:
        attn = ("attention: eager" + (", its softmax output kept in fp32" if wl.eager_softmax_fp32 else "")
                + " (unfused softmax; the score matrix is written and read)")
    elif kernel:
        attn = (f"attention: {KERNEL_NAMES.get(kernel[0], kernel[0])} at {kernel[1]:.0%} of the 16-bit peak forward, "
                f"{kernel[2]:.0%} backward on {hw.gpu_model} (profile {hw.name})")
    else:
        wanted = f" (none of {', '.join(wl.attention_kernels)} is measured on {hw.name})" if wl.attention_kernels else ""
        attn = f"attention: a fused kernel at the profile's attention efficiency, {hw.attention_efficiency:.0%}{wanted}"
    if wl.elementwise_fused:
        ew = "elementwise ops: fused (one read and one write per norm, RoPE and activation)"
    else:
        ew = (f"elementwise ops: eager, {wl.norm_bytes_per_element:g} bytes per element per norm, "
              f"{wl.rope_bytes_per_element:g} per rotary element, {wl.act_bytes_per_element:g} per activation element")
    lines = [who + attn, who + ew]
    if wl.dropout:
        kinds = dropout_kinds(spec, wl) if spec is not None else (True, True)
        where = " and ".join(n for n, on in zip(("the attention probabilities", "the residual branches"), kinds) if on)
        lines.append(who + f"dropout: on {where or 'nothing the config sets'} (1-byte masks kept for backward, with "
                           "their elementwise passes)")
    if wl.grads_allocated_in_backward:
        lines.append(who + "gradients: set to None after each step, so with one micro-batch a step backward allocates "
                           "them as it frees the activations (the peak holds the two together only beyond that)")
    if wl.zero_reduce_bucket_elements:
        lines.append(who + f"ZeRO 1-3 keep a contiguous gradient bucket of {wl.zero_reduce_bucket_elements:,} elements "
                           "on every rank (reduce_bucket_size; twice at stages 1-2 with overlap_comm)")
    if wl.matmul_dtype is DType.FP8:
        lines.append(who + f"linear GEMMs in fp8 at {hw.matmul_fp8_efficiency:.0%} of the fp8 peak, with their inputs cast "
                           "(attention and the output layer in 16 bits)")
    if not wl.trains_base:
        lines.append(who + finetune_assumption(wl, spec))
    return lines


def finetune_assumption(wl: TrainingWorkload, spec: ModelSpec | None) -> str:
    """One line: what a LoRA/QLoRA plan keeps of the base and what it trains."""
    q = base_format_bytes(wl.base_format)
    if q is None:
        base = f"frozen base in {wl.param_dtype.value}"
    else:
        others = "fp32 (PEFT prepare_model_for_kbit_training)" if wl.base_fp32_non_quantized else wl.param_dtype.value
        base = (f"frozen base: decoder nn.Linear weights in {wl.base_format.value} ({8 * q:.3f} bits a weight), "
                f"dequantized to 16 bits for each matmul; embeddings, norms, lm_head, routed experts and routers "
                f"(not nn.Linear since transformers 5, so bitsandbytes leaves them) in {others}")
    trained = f"rank-{wl.lora_rank} adapters on {','.join(wl.lora_targets)}"
    if spec is not None:
        n = adapter_params(spec, range(spec.num_layers), wl.lora_rank, wl.lora_targets)
        trained += f" ({n / 1e6:,.1f}M trainable parameters)"
    return (f"{wl.finetune.value}: {base}; {trained} in fp32 with fp32 gradients and {wl.optimizer.value} states; "
            "backward computes input gradients only through the base")


def elementwise_traffic(wl: TrainingWorkload) -> ElementwiseTraffic:
    if wl.elementwise_fused:
        return FUSED
    return ElementwiseTraffic(
        norm_bytes_per_element=wl.norm_bytes_per_element, norm_kernels=wl.norm_kernels,
        rope_bytes_per_element=wl.rope_bytes_per_element, rope_kernels=wl.rope_kernels,
        act_bytes_per_element=wl.act_bytes_per_element, act_kernels=wl.act_kernels)


def training_time(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: TrainingWorkload, num_microbatches: int
) -> TrainingTime:
    sb = state_bytes(wl, layout.zero_stage)
    dense_n, expert_n = zero_shard_degrees(layout, hw.gpus_per_node)
    groups = _groups(layout, hw)
    m = num_microbatches
    stages, slowest, bubble, p2p = _pipeline(spec, hw, layout, wl, groups, m)
    compute = m * (slowest.forward.seconds + slowest.backward.seconds)

    # Data-parallel gradient synchronisation and ZeRO traffic, on the slowest stage.
    w = stage_weights(spec, layout, slowest.stage, quantization=Quantization.NONE, dense_dtype=wl.param_dtype)
    wbytes = bytes_per_element(wl.param_dtype)
    grad_bytes = sb.gradients if sb.gradients else wbytes
    dp_sync = zero3 = 0.0
    mr = wl.collectives_multirail
    # (trained elements, bytes ZeRO-3 gathers, group) for the dense and the routed-expert parts.
    trained = ((w.dense_numel, w.dense_numel * wbytes, groups.zero), (w.expert_numel, w.expert_numel * wbytes, groups.expert_dp))
    opt_dense, opt_expert = w.dense_numel, w.expert_numel
    fetched_bytes = w.numel / max(1, dense_n) * wbytes  # what ZeRO-Infinity brings back per pass
    if not wl.trains_base:
        # LoRA: only the fp32 adapters have gradients and optimizer states; ZeRO-3 still gathers
        # the frozen base in its storage format.
        layers = [i for r in layout_stage_ranges(spec.num_layers, layout)[slowest.stage] for i in r]
        adapters = adapter_params(spec, layers, wl.lora_rank, wl.lora_targets)
        base = frozen_base(spec, layout, wl, slowest.stage)
        sb = StateBytes(FP32_BYTES, FP32_BYTES, optimizer_moment_bytes(wl.optimizer), grads_partitioned_from_stage=2)
        grad_bytes = wbytes = FP32_BYTES
        trained = ((adapters, base.dense_bytes + adapters * FP32_BYTES, groups.zero), (0.0, base.expert_bytes, groups.expert_dp))
        opt_dense, opt_expert = adapters, 0.0
        # the frozen base as stored (NF4, 16-bit or fp32), and the fp32 adapters
        fetched_bytes = (base.dense_bytes + adapters * FP32_BYTES) / max(1, dense_n) + base.expert_bytes / max(1, expert_n)
    sync_pairs = tuple((numel, g) for numel, _, g in trained)
    if layout.zero_stage == 3:
        # Every micro-batch gathers the weights for forward and again for backward (and once
        # more for a recomputed forward, which runs in backward after forward released them),
        # and reduce-scatters the gradients.
        gathers_in_backward = 2 if layout.recompute is Recompute.FULL else 1
        gather = scatter = 0.0
        for numel, gathered_bytes, g in trained:
            gather += collective_seconds(Collective.ALL_GATHER, gathered_bytes, g, hw, mr)
            scatter += collective_seconds(Collective.REDUCE_SCATTER, numel * grad_bytes, g, hw, mr)
        units = max(1, slowest.num_layers)
        fwd_c, bwd_c = slowest.forward.seconds, slowest.backward.seconds
        bwd_comm = gathers_in_backward * gather + scatter
        per_mb = overlapped(fwd_c, gather, hw) - fwd_c + overlapped(bwd_c, bwd_comm, hw) - bwd_c
        zero3 = m * (per_mb + (gather + bwd_comm) / units)  # the first unit of each pass waits
    else:
        for numel, g in sync_pairs:
            if layout.zero_stage == 0:
                t = collective_seconds(Collective.ALL_REDUCE, numel * grad_bytes, g, hw, mr)
            else:  # reduce-scatter the gradients, all-gather the updated weights
                t = collective_seconds(Collective.REDUCE_SCATTER, numel * grad_bytes, g, hw, mr) + collective_seconds(
                    Collective.ALL_GATHER, numel * wbytes, g, hw, mr
                )
            dp_sync += t
        if wl.overlap_grad_reduce:
            units = max(1, slowest.num_layers)
            window = slowest.backward.seconds * (units - 1) / units  # all but the final bucket
            dp_sync = overlapped(window, dp_sync * (units - 1) / units, hw) - window + dp_sync / units

    # Optimizer step: fp32 master weights and Adam moments streamed once (read + write).
    shard = dense_n if layout.zero_stage >= 1 else 1
    opt_params = opt_dense / shard + opt_expert / (expert_n if layout.zero_stage >= 1 else 1)
    offload = 0.0
    host = hw.host_link.bandwidth_bytes_per_second * hw.host_link.efficiency
    mb_compute = slowest.forward.seconds + slowest.backward.seconds
    if layout.offload_optimizer is Offload.NONE:
        optimizer = opt_params * (sb.optimizer + grad_bytes + wbytes) * 2 / (
            hw.memory_bandwidth_bytes_per_second * hw.memory_bandwidth_efficiency
        )
    else:
        # ZeRO-Offload (Ren et al. 2021, Sec. 4.2): gradients stream to the host during the
        # last backward, the CPU runs Adam, updated 16-bit weights come back before the next step.
        optimizer = opt_params * CPU_ADAM_BYTES_PER_PARAM / CPU_ADAM_BYTES_PER_SECOND
        grads_down = opt_params * grad_bytes / host
        offload = overlapped(slowest.backward.seconds, grads_down, hw) - slowest.backward.seconds
        offload += opt_params * wbytes / host
        if layout.offload_optimizer is Offload.NVME:
            nvme = hw.nvme_bandwidth_bytes_per_second_per_node * hw.nvme_efficiency / max(1, min(hw.gpus_per_node, layout.world_size))
            offload += 2 * opt_params * sb.optimizer / nvme  # states read and written back
    if layout.offload_params is not Offload.NONE:
        # ZeRO-Infinity: every micro-batch fetches the rank's parameters for forward and again
        # for backward, prefetched behind the compute of the unit before.
        fetch = 2 * fetched_bytes / host
        if layout.offload_params is Offload.NVME:
            nvme = hw.nvme_bandwidth_bytes_per_second_per_node * hw.nvme_efficiency / max(1, min(hw.gpus_per_node, layout.world_size))
            fetch = max(fetch, 2 * fetched_bytes / nvme)
        offload += m * (overlapped(mb_compute, fetch, hw) - mb_compute)

    breakdown = TimeBreakdown(
        compute=compute,
        tensor_parallel=m * slowest.tp_seconds,
        expert_parallel=m * slowest.ep_seconds,
        context_parallel=m * slowest.cp_seconds,
        pipeline_p2p=p2p,
        pipeline_bubble=bubble,
        data_parallel=dp_sync,
        zero3=zero3,
        optimizer=optimizer,
        offload=offload,
    )
    step = breakdown.total
    tokens = wl.global_batch_size * wl.seq_len
    replicas = layout.dp * layout.cp * layout.tp  # ranks per stage
    model_flops = m * sum(st.forward.model_flops + st.backward.model_flops for st in stages) * replicas
    hw_flops = m * sum(st.forward.flops + st.backward.flops for st in stages) * replicas
    peak = hw.peak_flops_for(wl.activation_dtype) * layout.world_size
    return TrainingTime(
        step_seconds=step,
        breakdown=breakdown,
        tokens_per_second_per_gpu=tokens / step / layout.world_size,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        mfu=model_flops / step / peak,
        hfu=hw_flops / step / peak,
        stages=stages,
    )

