"""Serving time: time to first token, time per output token, throughput, and the batch that
maximises throughput within the KV cache.

A batch of B sequences of `input_len` prompt tokens is prefilled in one forward (compute-
bound GEMMs over B x input_len rows), then decoded one token per step (each step reads every
local weight and each sequence's K/V once: memory-bound until the batch is large). Per step
and per pass, on every pipeline stage: the layers' roofline time (compute.py), two
tensor-parallel all-reduces per layer (one with a parallel residual) on the critical path,
expert all-to-alls, and the final norm + lm_head over the positions that are sampled.

Pipeline parallel serving keeps pp micro-batches of B/pp sequences in flight (vLLM's
virtual engines): one round gives every sequence a token and takes pp x the slowest
stage's time for B/pp; a lone request (prefill of B = 1) crosses the stages one after the
other (fill and drain).

The host's side of a pass (`host_seconds`): the GPU runs kernels as fast as the host issues
them, so a stage takes max(GPU time, host time). For an engine written in Python, host time
is its framework ops (python_ops_per_layer per decoder layer and python_ops_per_step for the
logits and the sampler, counted in the engine's source: knowledge/engines/*.yaml) at the
host's python_op_us each, the op's kernel launch included; for a C++ runtime it is the
kernels' launches at the profile's kernel_launch_us. A decode step of at most cuda_graph_max_batch sequences
replays the layers from a CUDA graph in one launch, leaving only the per-step ops. That is
why an eager engine's batch-1 decode is slower than the same engine with graphs, while a
large prefill hides its launches entirely.

    TTFT  = prefill of the batch (+ p2p hops between stages)
    TPOT  = decode round at the mean context input_len + output_len / 2
    end-to-end = TTFT + (output_len - 1) x TPOT   (static batching, as gptSessionBenchmark)
    throughput = B x output_len / end-to-end, and per GPU / (tp x pp)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shardplan.cost import memo
from shardplan.cost.breakdown import SecondsBreakdown
from shardplan.cost.comm import Collective, collective_seconds, group, layer_collectives_seconds
from shardplan.cost.compute import PassTime, Work, embedding_forward, head_forward, kinds_forward, layer_kind_groups
from shardplan.cost.layout import Layout, layout_stage_ranges, stage_layer_ranges
from shardplan.cost.memory_serving import kv_bytes_per_token_per_layer_per_rank
from shardplan.cost.offload import offload_memory, offload_pass_seconds
from shardplan.cost.workload import InferenceWorkload, Quantization
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec, QKNorm
from shardplan.units import bytes_per_element

SERVING_OVERLAP = {
    "tensor_parallel": "none: all-reduces sit between the layers' GEMMs",
    "expert_all_to_all": "none",
    "pipeline_p2p": "one hop per stage boundary per pass, not overlapped",
}


@dataclass(frozen=True)
class StepBreakdown(SecondsBreakdown):
    """Seconds of one pass (a prefill or one decode round) by cause; sums to `total`."""

    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0  # elementwise and embedding traffic
    kernel_overhead: float = 0.0
    tensor_parallel: float = 0.0
    expert_parallel: float = 0.0
    pipeline_p2p: float = 0.0
    host: float = 0.0  # host time the GPU waits for: issuing ops beyond the GPU's own time
    scheduler: float = 0.0  # the engine's host work between steps (scheduling, outputs)
    offload: float = 0.0  # weights held off the GPU: their copies, or their layers run on the CPU (cost/offload.py)


# Linear layers of a decoder layer that run as ordinary (non-expert) GEMMs, by part: fused QKV and
# the output projection; MLA's q_a, q_b, kv_a, kv_b and output projections; a gated MLP's fused
# gate/up and down projections (each shared expert too). Routed experts run inside the MoE kernel.
LINEARS_GQA_ATTENTION = 2
LINEARS_MLA_ATTENTION = 5
LINEARS_DENSE_MLP = 2


def layer_ops(spec: ModelSpec, wl: InferenceWorkload, layer_index: int, tp: int) -> float:
    """Framework ops an eager decoder layer issues, from the engine's count by part where it has
    one (`python_ops_per_layer_parts`, knowledge/engines/*.yaml, counted in the engine's source),
    else its one count for every layer (`python_ops_per_layer`)."""
    parts = dict(wl.python_ops_per_layer_parts)
    if not parts:
        return wl.python_ops_per_layer
    mla = spec.mla is not None
    ops = parts.get("norms", 0.0) + parts.get("mla_attention" if mla else "attention", 0.0)
    linears = LINEARS_MLA_ATTENTION if mla else LINEARS_GQA_ATTENTION
    if spec.qk_norm is not QKNorm.NONE and not mla:
        ops += parts.get("qk_norm", 0.0)
    if spec.moe is not None and spec.is_moe_layer(layer_index):
        shared = spec.moe.num_shared_experts
        ops += parts.get("moe", 0.0) + shared * parts.get("dense_mlp", 0.0)
        linears += shared * LINEARS_DENSE_MLP
    else:
        ops += parts.get("dense_mlp", 0.0)
        linears += LINEARS_DENSE_MLP
    if wl.quantization is Quantization.FP8 and fp8_block_quantized(spec):
        ops += linears * parts.get("per_fp8_block_linear", 0.0)
    if tp > 1:
        ops += (1 if spec.parallel_residual else 2) * parts.get("per_all_reduce", 0.0)
    return ops


def fp8_block_quantized(spec: ModelSpec) -> bool:
    """The checkpoint's own FP8 format quantizes in blocks (DeepSeek-V3's and Qwen3's FP8 releases:
    `quantization_config.weight_block_size`), which engines run as activation quantization plus a
    block GEMM per linear."""
    return bool(spec.fp8_weight_block_size)


def host_seconds(hw: HardwareProfile, wl: InferenceWorkload, compute: PassTime, layers: int, last_stage: bool,
                 graphs: bool, layer_ops_total: float | None = None) -> float:
    """Seconds the host takes to issue one pass of one stage. A CUDA graph replays the layers
    in one launch; the logits and the sampler (python_ops_per_step) run eagerly either way.
    `layer_ops_total`: the stage's layers' framework ops (`layer_ops` summed), else
    python_ops_per_layer each."""
    step_ops = wl.python_ops_per_step if last_stage else 0.0
    if graphs:
        return step_ops * hw.python_op_seconds
    if wl.python_ops_per_layer == 0 and not wl.python_ops_per_layer_parts:  # a C++ runtime: the kernels' launches
        return compute.kernels * hw.kernel_launch_seconds + step_ops * hw.python_op_seconds
    ops = wl.python_ops_per_layer * layers if layer_ops_total is None else layer_ops_total
    return (ops + step_ops) * hw.python_op_seconds


def _stage_pass(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work, stage: int, logit_tokens: float,
    wl: InferenceWorkload, graphs: bool, on_host: tuple[int, ...] = ()
) -> tuple[PassTime, float, float, float]:
    """(compute, tensor-parallel seconds, expert-parallel seconds, host seconds the GPU waits
    for) of one pass on one stage; `on_host`: layers the CPU runs instead (llama.cpp -ngl)."""
    chunks = layout_stage_ranges(spec.num_layers, layout)[stage]
    layers = [i for r in chunks for i in r if i not in on_host]
    groups = _stage_groups(spec, chunks, on_host)
    total = kinds_forward(spec, hw, layout, work, groups)
    if stage == 0:
        total = total + embedding_forward(spec, hw, work)
    if stage == layout.pp - 1:
        total = total + head_forward(spec, hw, layout, work, logit_tokens)
    tp, ep = layer_collectives_seconds(
        spec, hw, layers, tokens=work.tokens, act_bytes=bytes_per_element(work.act_dtype),
        tp=group(layout.tp, 1, hw.gpus_per_node), ep=group(layout.ep, layout.expert_tp, hw.gpus_per_node),
    )
    # A layer's ops follow its kind (`layer_ops` reads the layer only through is_moe_layer): one per kind group.
    layer_ops_total = (sum(layer_ops(spec, wl, first, layout.tp) * n for _, first, n in groups)
                       if wl.python_ops_per_layer_parts and not graphs else None)
    host = host_seconds(hw, wl, total, len(layers), stage == layout.pp - 1, graphs, layer_ops_total)
    # The kernels' GPU time hides the host's issuing; their fixed per-kernel cost does not (it
    # follows each launch), nor does the collectives' time (launched like any kernel). This is
    # the form kernel_launch_us was calibrated in (TensorRT-LLM batch-1 TTFT rows).
    return total, tp, ep, max(0.0, host - (total.seconds - total.kernel_seconds))


@lru_cache(maxsize=8192)
def _stage_groups(spec: ModelSpec, chunks: tuple[range, ...], on_host: tuple[int, ...]) -> tuple[Any, ...]:
    """The kinds of a stage's layers (`layers_forward`'s: MoE, sliding window, linear attention)
    with each one's first layer and count, in the order they first appear."""
    return layer_kind_groups(spec, (i for r in chunks for i in r if i not in on_host))


@lru_cache(maxsize=4096)
def _stage_makeups(spec: ModelSpec, pp: int, virtual_stages: int, embedding_as_layer: bool, loss_as_layer: bool,
                   first: int | None, last: int | None, on_host: tuple[int, ...]) -> tuple[tuple[Any, ...], ...]:
    """What `_stage_pass` reads of each stage's layers: their kinds with counts, in the order
    they first appear (the order the forward sums them in); which layers they are does not enter
    (a layer's time follows its kind). The embedding and the head go by the stage's place."""
    stages = stage_layer_ranges(spec.num_layers, pp, virtual_stages, embedding_as_layer, loss_as_layer, first, last)
    return tuple(tuple((kind, n) for kind, _, n in _stage_groups(spec, chunks, on_host)) for chunks in stages)


def pass_time(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, *, batch: float, q_len: float, kv_len: float,
    decode: bool, logit_tokens: float | None = None, graphs: bool | None = None,
    expert_group_tokens: float | None = None
) -> StepBreakdown:
    """One prefill (decode=False) or one decode round (decode=True) of `batch` sequences.
    `logit_tokens`: the positions sampled over the whole pass (None: one a sequence); `graphs`:
    whether the layers replay a CUDA graph (None: the engine's rule for a decode step). The
    continuous-batching model (cost/serving_load.py) sets both for the steps it composes.
    `expert_group_tokens`: the tokens the expert group routes in all, where its replicas carry
    different batches (`Work.expert_group_tokens`; None: this pass's on every replica alike)."""
    pp = layout.pp
    in_flight = batch / pp if pp > 1 and batch >= pp else batch  # sequences per micro-batch
    rounds = pp if pp > 1 and batch >= pp else 1
    work = Work(
        tokens=in_flight * q_len,
        num_seqs=in_flight,
        q_len=q_len,
        kv_len=kv_len,
        decode=decode,
        causal=True,
        flash_attention=True,
        act_dtype=wl.activation_dtype,
        kv_dtype=wl.kv_cache_dtype or wl.activation_dtype,
        quantization=wl.quantization,
        kv_read_per_query_head=wl.kv_read_per_query_head,
        cuda_graphs=True,  # launches are costed per stage and step (host_seconds), not per layer
        expert_group_tokens=expert_group_tokens,
    )
    # Engines capture decode steps up to a batch size, never prefills.
    if graphs is None:
        graphs = decode and not wl.enforce_eager and in_flight <= wl.graph_max_at(layout.tp)
    logits = in_flight if logit_tokens is None else logit_tokens / rounds
    on_host: tuple[int, ...] = ()
    if layout.offload_layers and wl.offload_mode == "host_compute":
        gpu_multiplies = not decode and work.tokens >= wl.offload_batch_on_gpu_min_tokens > 0
        on_host = () if gpu_multiplies else offload_memory(spec, layout, wl).layers
    if memo.ENABLED:
        # Stages of the same make-up (their layers' kinds in order, first or last or neither) take
        # the same time: cost each make-up once (a pass has a few, a deep pipeline up to 80 stages).
        makeups = _stage_makeups(spec, layout.pp, layout.virtual_stages, layout.pp_embedding_as_layer,
                                 layout.pp_loss_as_layer, layout.pp_first_stage_layers, layout.pp_last_stage_layers,
                                 on_host)
        made: dict[tuple[Any, ...], tuple[PassTime, float, float, float]] = {}
        per_stage = []
        for s in range(pp):
            key = (makeups[s], s == 0, s == pp - 1)
            if key not in made:
                made[key] = _stage_pass(spec, hw, layout, work, s, logits, wl, graphs, on_host)
            per_stage.append(made[key])
    else:
        per_stage = [_stage_pass(spec, hw, layout, work, s, logits, wl, graphs, on_host) for s in range(pp)]
    a = bytes_per_element(wl.activation_dtype)
    p2p = 0.0
    if pp > 1:
        pp_group = group(pp, layout.tp * layout.dp, hw.gpus_per_node)
        p2p = collective_seconds(Collective.P2P, work.tokens * spec.hidden_size * a, pp_group, hw)
    if rounds > 1:
        # pp micro-batches in flight: a round is pp x the slowest stage.
        slow = max(per_stage, key=lambda x: x[0].seconds + x[1] + x[2] + x[3])
        c, tp, ep, host = slow
        return StepBreakdown(
            matmul=rounds * c.matmul_seconds,
            attention=rounds * c.attention_seconds,
            memory=rounds * c.memory_seconds,
            kernel_overhead=rounds * c.kernel_seconds,
            tensor_parallel=rounds * tp,
            expert_parallel=rounds * ep,
            pipeline_p2p=rounds * p2p,
            host=rounds * host,
            scheduler=wl.step_overhead_seconds,
        )
    # One micro-batch crosses the stages one after the other.
    off = 0.0
    if layout.offload_layers or layout.offload_expert_layers:  # whole layers (-ngl) or experts (--n-cpu-moe)
        gpu = sum(c.seconds + tp + ep + h for c, tp, ep, h in per_stage)
        mem = offload_memory(spec, layout, wl)
        kv_elt = bytes_per_element(wl.kv_cache_dtype or wl.activation_dtype)
        kv_read = (in_flight * kv_len * len(mem.kv_layers_off_gpu)
                   * kv_bytes_per_token_per_layer_per_rank(spec, layout.tp, kv_elt)) if decode else 0.0
        off = offload_pass_seconds(spec, hw, layout, wl, gpu_seconds=gpu, tokens=work.tokens, kv_bytes_read=kv_read,
                                   decode=decode).seconds
    return StepBreakdown(
        matmul=sum(c.matmul_seconds for c, _, _, _ in per_stage),
        attention=sum(c.attention_seconds for c, _, _, _ in per_stage),
        memory=sum(c.memory_seconds for c, _, _, _ in per_stage),
        kernel_overhead=sum(c.kernel_seconds for c, _, _, _ in per_stage),
        tensor_parallel=sum(tp for _, tp, _, _ in per_stage),
        expert_parallel=sum(ep for _, _, ep, _ in per_stage),
        pipeline_p2p=(pp - 1) * p2p,
        host=sum(h for _, _, _, h in per_stage),
        scheduler=wl.step_overhead_seconds,
        offload=off,
    )


@dataclass(frozen=True)
class ServingTime:
    batch_size: int
    ttft_seconds: float
    tpot_seconds: float
    e2e_latency_seconds: float
    throughput_tokens_per_second: float  # output tokens per second, one replica
    throughput_tokens_per_second_per_gpu: float
    prefill: StepBreakdown
    decode: StepBreakdown


def serving_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, batch: int) -> ServingTime:
    prefill = pass_time(spec, hw, layout, wl, batch=batch, q_len=wl.input_len, kv_len=wl.input_len, decode=False)
    mean_ctx = wl.input_len + wl.output_len / 2
    decode = pass_time(spec, hw, layout, wl, batch=batch, q_len=1, kv_len=mean_ctx, decode=True)
    e2e = prefill.total + max(0, wl.output_len - 1) * decode.total
    tput = batch * wl.output_len / e2e
    return ServingTime(
        batch_size=batch,
        ttft_seconds=prefill.total,
        tpot_seconds=decode.total,
        e2e_latency_seconds=e2e,
        throughput_tokens_per_second=tput,
        throughput_tokens_per_second_per_gpu=tput / (layout.tp * layout.pp),
        prefill=prefill,
        decode=decode,
    )


def best_batch(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, max_batch: int
) -> ServingTime | None:
    """The batch (powers of two up to, and including, `max_batch`) with the highest throughput."""
    if max_batch < 1:
        return None
    candidates = sorted({min(max_batch, 2**k) for k in range(0, max_batch.bit_length() + 1)})
    results = [serving_time(spec, hw, layout, wl, b) for b in candidates]
    return max(results, key=lambda r: (r.throughput_tokens_per_second, -r.batch_size))
