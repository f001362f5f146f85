"""Serving with weights held off the GPU (`Layout.offload_layers`), by the engine's mechanism
(knowledge/engines/*.yaml `offload_eras`, carried on the workload as `offload_*`):

stream (accelerate's hooks, vLLM --cpu-offload-gb): the offloaded layers' weights live in host
RAM (or on disk) and cross the host link into the GPU on every forward, one layer at a time:

    t_transfer = offloaded bytes / (host link bandwidth x efficiency)      (cpu)
               = offloaded bytes / min(NVMe read, host link) (x efficiency) (disk)
    t_pass     = t_gpu + t_transfer            (no prefetch: copy, then compute)
               = max(t_gpu, t_transfer)        (prefetch overlaps the next copy)

host_compute (llama.cpp -ngl): the offloaded layers run on the CPU where their weights live. A
decode token reads them once from host memory; a prompt batch of at least
`offload_batch_on_gpu_min_tokens` tokens instead copies them to the GPU and multiplies there
(ggml-cuda's op offload), once per physical batch:

    decode  t_host = offloaded bytes (+ their KV) / (host memory bandwidth x efficiency)
    prefill t_copy = ceil(prompt tokens / ubatch) x offloaded bytes / (host link x efficiency)

Either way the transfer, not the GPU, sets the pace once more than a few layers are offloaded:
`OffloadTime.bound` says which.

host_compute, mixture of experts (llama.cpp --n-cpu-moe N, `Layout.offload_expert_layers`): only
the routed experts' tensors of the first N layers stay in host memory (common/arg.cpp at b11312:
`llm_add_n_cpu_ffn_overrides(value, LLM_FFN_EXPS_REGEX, ...)`, which pushes one buffer override
`blk\\.<i>\\.ffn_(up|down|gate|gate_up)_(ch|)exps` -> CPU for i < N; common/common.h). Attention,
the router, the shared experts and the KV cache stay on the GPU. A token needs only its top-k
experts (`touched_experts`), so `expert_pass_seconds`:

    decode   t_host = touched experts' bytes of the N layers / (host memory bandwidth x efficiency)
                      - what the GPU part counted for those experts (they do not run there)
    prefill  t_copy = ceil(prompt tokens / ubatch) x touched experts' bytes / (host link x efficiency)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardplan.cost.layout import Layout, Offload
from shardplan.cost.params import WeightKind, block_weights, embedding_weights, kinds_by_layer, layer_kind
from shardplan.cost.weights import bytes_per_weight_element, numel_per_rank
from shardplan.cost.workload import InferenceWorkload, Quantization
from shardplan.units import DType
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec


def offloaded_layers(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> tuple[int, ...]:
    """The decoder layers whose weights are off the GPU: the last ones when the engine keeps the
    first on the GPU (accelerate), the first ones when it keeps the last (vLLM, llama.cpp)."""
    n = layout.offload_layers
    if n <= 0:
        return ()
    if wl.offload_gpu_layers == "first":
        return tuple(range(spec.num_layers - n, spec.num_layers))
    return tuple(range(n))


def layer_bytes_per_rank(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, layer: int,
                         quantization: Quantization | None = None) -> float:
    """Bytes of decoder layer `layer`'s weights on one tensor-parallel rank, in the plan's format
    (or `quantization`)."""
    q = wl.quantization if quantization is None else quantization
    kind = layer_kind(spec, layer)
    # Layers of one kind weigh the same, except under a GGUF mixture, whose types follow the index.
    return _kind_bytes_per_rank(spec, layout, q, wl.activation_dtype, kind, layer if q.is_gguf else None)


def _layers_bytes_per_rank(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, layers: tuple[int, ...],
                           q: Quantization) -> list[float]:
    """`layer_bytes_per_rank` of each of `layers` in format `q`, in their order: each kind's bytes
    looked up once (a GGUF mixture's types follow the index: each layer then on its own)."""
    if q.is_gguf:
        return [layer_bytes_per_rank(spec, layout, wl, i, q) for i in layers]
    kinds = kinds_by_layer(spec)
    of_kind = {k: _kind_bytes_per_rank(spec, layout, q, wl.activation_dtype, k, None) for k in {kinds[i] for i in layers}}
    return [of_kind[kinds[i]] for i in layers]


@lru_cache(maxsize=16384)
def _kind_bytes_per_rank(spec: ModelSpec, layout: Layout, q: Quantization, dense: DType, kind: tuple[bool, bool],
                         layer: int | None) -> float:
    at = (layer,) if layer is not None else None
    return sum(numel_per_rank(w, spec, layout) * bytes_per_weight_element(w, q, dense, spec, at)
               for w in block_weights(spec, *kind))


def largest_tensor_bytes_per_rank(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, layer: int) -> float:
    """The largest single weight (with its quantization constants) of layer `layer` on one rank."""
    kinds = block_weights(spec, *layer_kind(spec, layer))
    return max(numel_per_rank(w, spec, layout) / w.copies
               * bytes_per_weight_element(w, wl.quantization, wl.activation_dtype, spec, (layer,)) for w in kinds)


def embedding_bytes_per_rank(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> float:
    return sum(numel_per_rank(w, spec, layout) * bytes_per_weight_element(w, wl.quantization, wl.activation_dtype, spec)
               for w in embedding_weights(spec) if w.component.value == "embedding")


def expert_offloaded_layers(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> tuple[int, ...]:
    """The MoE layers whose routed experts alone are in host memory: those among the first
    `offload_expert_layers` (counted by index, dense layers included, as llama.cpp's --n-cpu-moe
    regex per layer index does) that are not already offloaded whole."""
    n = layout.offload_expert_layers
    if n <= 0 or spec.moe is None:
        return ()
    whole = set(offloaded_layers(spec, layout, wl))
    return tuple(i for i in range(min(n, spec.num_layers)) if spec.is_moe_layer(i) and i not in whole)


def routed_expert_kinds(spec: ModelSpec, layer: int) -> tuple[WeightKind, ...]:
    """Layer `layer`'s routed-expert tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps in GGUF
    names: one 3-D tensor each holding every expert); not the router, not the shared experts."""
    return tuple(w for w in block_weights(spec, *layer_kind(spec, layer)) if w.routed_expert)


def expert_tensor_bytes_per_rank(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, layer: int) -> tuple[float, ...]:
    """Bytes of each routed-expert tensor of layer `layer` (all its experts) on one rank, at the
    layer's own GGUF type (gguf.py: ffn_down takes Q6_K in the use_more_bits layers of Q4_K_M)."""
    return tuple(numel_per_rank(w, spec, layout) * bytes_per_weight_element(w, wl.quantization, wl.activation_dtype,
                                                                               spec, (layer,))
                 for w in routed_expert_kinds(spec, layer))


def touched_experts(num_experts: float, experts_per_token: int, tokens: float) -> float:
    """Experts of a layer that `tokens` tokens route to, each picking top-k of E uniformly:
    E (1 - (1 - k/E)^tokens); k for one token (the same balanced-routing form as cost/compute.py)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** tokens)


@dataclass(frozen=True)
class OffloadMemory:
    """What one rank keeps off the GPU and what that frees on it."""

    layers: tuple[int, ...]
    weights_off_gpu_bytes: float  # offloaded layers (+ the embedding where the engine keeps it on the host)
    embedding_off_gpu_bytes: float  # the embedding's share of it
    weights_held_bytes: float  # what those weights take where they are held (unquantized if the engine does so)
    streamed_buffer_bytes: float  # stream: one offloaded layer in flight on the GPU
    kv_layers_off_gpu: tuple[int, ...]  # host_compute: layers whose KV lives in host memory
    host_bytes: float
    nvme_bytes: float
    # --n-cpu-moe: layers whose routed experts alone are in host memory, those tensors' bytes (off
    # the GPU and held on the host, in the plan's format), and the largest of them: a prompt ubatch
    # copies one such tensor at a time into the GPU's compute buffer (`expert_copy_bytes`).
    expert_layers: tuple[int, ...] = ()
    experts_off_gpu_bytes: float = 0.0
    largest_expert_tensor_bytes: float = 0.0


def _expert_memory(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> tuple[tuple[int, ...], float, float]:
    layers = expert_offloaded_layers(spec, layout, wl)
    sizes = [b for i in layers for b in expert_tensor_bytes_per_rank(spec, layout, wl, i)]
    return layers, sum(sizes), max(sizes, default=0.0)


@lru_cache(maxsize=4096)
def offload_memory(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> OffloadMemory:
    layers = offloaded_layers(spec, layout, wl)
    experts, expert_bytes, largest_expert = _expert_memory(spec, layout, wl)
    if not layers:
        return OffloadMemory((), 0.0, 0.0, 0.0, 0.0, (), expert_bytes, 0.0, experts, expert_bytes, largest_expert)
    # Offloaded layers the engine holds unquantized (transformers + bitsandbytes) leave the GPU in
    # the plan's format and sit on the host in the model dtype.
    held = None if wl.offload_keeps_quantization else Quantization.NONE
    on_gpu = _layers_bytes_per_rank(spec, layout, wl, layers, wl.quantization)
    per_layer = on_gpu if held is None else _layers_bytes_per_rank(spec, layout, wl, layers, held)
    gpu_freed = sum(on_gpu)
    off = sum(per_layer)
    embedding = 0.0
    if wl.offload_mode == "host_compute" and wl.offload_embedding_on_host:
        embedding = embedding_bytes_per_rank(spec, layout, wl)
        off += embedding
    streamed = 0.0
    if wl.offload_mode == "stream":
        streamed = max(per_layer) if wl.offload_stream_unit == "layer" else max(
            largest_tensor_bytes_per_rank(spec, layout, wl, i) for i in layers)
    kv_off = layers if wl.offload_mode == "host_compute" and wl.offload_kv_with_layer else ()
    disk = layout.offload_params is Offload.NVME
    # `off` holds the embedding already (added above where the engine keeps it on the host).
    return OffloadMemory(layers, gpu_freed + embedding, embedding, off, streamed, kv_off,
                         (0.0 if disk else off) + expert_bytes, off if disk else 0.0,
                         experts, expert_bytes, largest_expert)


def link_bytes_per_second(hw: HardwareProfile, layout: Layout, pinned: bool = True) -> float:
    """Host -> GPU copy rate: the host link at its efficiency (copies from pageable memory at the
    profile's pageable efficiency, where it has one); from disk, also the node's NVMe read rate,
    shared by the GPUs of the node that read at once."""
    eff = hw.host_link.efficiency
    if not pinned and hw.host_link_pageable_efficiency is not None:
        eff = hw.host_link_pageable_efficiency
    pcie = hw.host_link.bandwidth_bytes_per_second * eff
    if layout.offload_params is Offload.NVME:
        readers = min(layout.tp * layout.dp, hw.gpus_per_node)
        return min(pcie, hw.nvme_bandwidth_bytes_per_second_per_node * hw.nvme_efficiency / readers)
    return pcie


@dataclass(frozen=True)
class OffloadTime:
    """Seconds one pass spends on offloaded weights, and what bounds the pass."""

    seconds: float  # added to the pass (stream without overlap, host compute) or the excess over the GPU (overlap)
    transfer_seconds: float  # the copy or host read by itself
    bound: str  # "gpu", "host link", "host memory", "disk"
    # --n-cpu-moe's share of `seconds`: the experts' host read (or copy) less the GPU time the
    # pass's GPU part counted for experts that do not run on the GPU (`expert_pass_seconds`).
    expert_seconds: float = 0.0


def expert_bytes_touched(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, tokens: float) -> float:
    """Bytes of the host-held experts that `tokens` tokens route to, over every --n-cpu-moe layer
    (top-k of the layer's experts for one token, at each layer's GGUF types)."""
    moe = spec.moe
    if moe is None:
        return 0.0
    touched = touched_experts(moe.num_experts / layout.ep, moe.num_experts_per_token, tokens)
    share = touched / (moe.num_experts / layout.ep)
    return share * sum(sum(expert_tensor_bytes_per_rank(spec, layout, wl, i))
                       for i in expert_offloaded_layers(spec, layout, wl))


def _gpu_expert_seconds(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload,
                        tokens: float, num_layers: int) -> float:
    """What the pass's GPU part (cost/compute.py, which costs every MoE layer's routed experts on the
    GPU at its representative layer) counts for the routed experts of `num_layers` layers: the same
    function on the same inputs, so the deduction is exact."""
    from shardplan.cost.compute import Work, _block_linear_time

    work = Work(tokens=tokens, num_seqs=tokens, q_len=1, kv_len=0, decode=True, act_dtype=wl.activation_dtype,
                kv_dtype=wl.kv_cache_dtype or wl.activation_dtype, quantization=wl.quantization, cuda_graphs=True)
    first_moe = next(i for i in range(spec.num_layers) if spec.is_moe_layer(i))
    # compute.layer_forward costs the matrices only (a 1-D expert bias, gpt-oss's, is elementwise traffic there)
    per_layer = sum(_block_linear_time(spec, hw, layout, w, work)[0] for w in routed_expert_kinds(spec, first_moe)
                    if len(w.shape) == 2)
    return num_layers * per_layer


def expert_pass_seconds(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, *,
                        tokens: float) -> tuple[float, float, str]:
    """(seconds added, transfer seconds, what bounds it) of the --n-cpu-moe experts in one pass of
    `tokens` tokens.

    Where the experts' matrix multiplication (GGML_OP_MUL_MAT_ID) runs is ggml's scheduler's rule:
    an op runs on the backend of its weights, unless a higher-priority backend asks to take it
    (ggml/src/ggml-backend.cpp at b11312, ggml_backend_sched_backend_id_from_cur: `if
    (sched->op_offload && src_backend_id == sched->n_backends - 1 && ggml_backend_buffer_is_host(
    src->buffer))` ... `ggml_backend_offload_op`), and the CUDA device takes it when its batch is
    large enough (ggml/src/ggml-cuda/ggml-cuda.cu ggml_backend_cuda_device_offload_op:
    `get_op_batch_size(op) >= dev_ctx->op_offload_min_batch_size`, 32 unless GGML_OP_OFFLOAD_MIN_BATCH;
    get_op_batch_size of GGML_OP_MUL_MAT_ID is `op->ne[2]`, the tokens). The expert tensors placed
    by --n-cpu-moe are host weights like any other, so the same threshold applies to them, by
    tokens, decode or not. Above it the scheduler copies only the experts the ubatch uses
    (ggml-backend.cpp ggml_backend_sched_compute_splits: 'when offloading MoE weights, we can reduce
    the amount of data copied by copying only the experts that are used'), once per ubatch, and
    the GPU multiplies (its part of the pass already counts that). Below it the CPU reads the
    touched experts from host memory, and the GPU part's count for them is taken back.
    Not modelled: the two backend switches per such layer (a GPU->CPU->GPU hand-over of one
    hidden state each), which add a synchronisation each."""
    layers = expert_offloaded_layers(spec, layout, wl)
    if not layers:
        return 0.0, 0.0, "gpu"
    min_tokens = wl.offload_batch_on_gpu_min_tokens
    if min_tokens > 0 and tokens >= min_tokens:
        ubatch = max(1, wl.max_num_batched_tokens)
        full, rest = divmod(tokens, ubatch)
        nbytes = full * expert_bytes_touched(spec, layout, wl, ubatch) + (
            expert_bytes_touched(spec, layout, wl, rest) if rest else 0.0)
        t = nbytes / link_bytes_per_second(hw, layout)
        return t, t, "host link"
    t = expert_bytes_touched(spec, layout, wl, tokens) / (
        hw.host_memory_bandwidth_bytes_per_second * hw.host_memory_efficiency)
    return t - _gpu_expert_seconds(spec, hw, layout, wl, tokens, len(layers)), t, "host memory"


def offload_pass_seconds(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, *,
                         gpu_seconds: float, tokens: float, kv_bytes_read: float, decode: bool) -> OffloadTime:
    """The offloaded weights' share of one pass of `tokens` tokens whose GPU part takes `gpu_seconds`:
    whole offloaded layers (`layer_pass_seconds`) and --n-cpu-moe experts (`expert_pass_seconds`).
    `kv_bytes_read`: K/V bytes the offloaded layers read in this pass (host_compute decode)."""
    whole = layer_pass_seconds(spec, hw, layout, wl, gpu_seconds=gpu_seconds, tokens=tokens,
                               kv_bytes_read=kv_bytes_read, decode=decode)
    e, e_transfer, e_bound = expert_pass_seconds(spec, hw, layout, wl, tokens=tokens)
    if not e_transfer:
        return whole
    bound = whole.bound if whole.transfer_seconds >= e_transfer else e_bound
    if whole.transfer_seconds + e_transfer <= gpu_seconds:
        bound = "gpu"
    return OffloadTime(whole.seconds + e, whole.transfer_seconds + e_transfer, bound, expert_seconds=e)


def layer_pass_seconds(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, *,
                       gpu_seconds: float, tokens: float, kv_bytes_read: float, decode: bool) -> OffloadTime:
    """The whole offloaded layers' share of one pass (the module docstring's stream and
    host_compute forms)."""
    mem = offload_memory(spec, layout, wl)
    if not mem.layers:
        return OffloadTime(0.0, 0.0, "gpu")
    # The token embedding is a lookup (one row a token), not a pass over its weights.
    weights_off = mem.weights_held_bytes - mem.embedding_off_gpu_bytes
    if wl.offload_mode == "host_compute":
        on_gpu = not decode and tokens >= wl.offload_batch_on_gpu_min_tokens > 0
        if on_gpu:  # the prompt's matrix multiplications run on the GPU, weights copied per ubatch
            batches = max(1, math.ceil(tokens / max(1, wl.max_num_batched_tokens)))
            t = batches * weights_off / link_bytes_per_second(hw, layout)
            return OffloadTime(t, t, "host link" if t > gpu_seconds else "gpu")
        rate = hw.host_memory_bandwidth_bytes_per_second * hw.host_memory_efficiency
        t = (weights_off + kv_bytes_read) / rate
        # A prompt below the op-offload threshold multiplies on the CPU: compute-bound there,
        # but with so few tokens the weight reads dominate (same form as decode).
        return OffloadTime(t, t, "host memory" if t > gpu_seconds else "gpu")
    t = weights_off / link_bytes_per_second(hw, layout, wl.offload_pinned)
    where = "disk" if layout.offload_params is Offload.NVME else "host link"
    if wl.offload_overlap:
        extra = max(0.0, t - gpu_seconds)
        return OffloadTime(extra, t, where if t > gpu_seconds else "gpu")
    return OffloadTime(t, t, where if t > gpu_seconds else "gpu")


def pageable_note(hw: HardwareProfile, layout: Layout, wl: InferenceWorkload) -> str | None:
    """The assumption to print when an engine streams from pageable memory and the profile does
    not say how fast such copies run."""
    if (layout.offload_layers and wl.offload_mode == "stream" and not wl.offload_pinned
            and hw.host_link_pageable_efficiency is None):
        return (f"{wl.engine} copies offloaded weights from pageable host memory; the profile '{hw.name}' has no "
                "efficiency.host_link_pageable, so they are costed at the pinned rate: an optimistic transfer time "
                "(NVIDIA bandwidthTest, pageable vs pinned host-to-device: 10.0 vs 25.7 GB/s on a DGX A100, 3.3 vs "
                "17.3 GB/s on a PCIe A100 host, https://github.com/gengwg/gpu/blob/54e9b29d/nvda_gpu_benchmark.md)")
    return None


def with_serving_offload(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, *, offload_layers: int | None,
                         cpu_offload_gib: float | None, n_gpu_layers: int | None,
                         targets: tuple[str, ...] | None, n_cpu_moe: int | None = None) -> Layout:
    """`layout` with the offload a serving command asked for, in the engine's terms: a layer count,
    vLLM's GiB per GPU (the fewest whole layers that hold at least that much, counted in the order
    the engine offloads them), or llama.cpp's layers on the GPU; and llama.cpp's --n-cpu-moe (the
    routed experts of the first N layers in host memory, `with_expert_offload`). `targets`: where
    the engine can offload (None: it cannot).

    --n-gpu-layers N: llama.cpp counts the output layer as one of n_layer + 1 "layers" and puts the
    last N of them on the GPU (src/llama-model.cpp at b11312, load_tensors: `i_gpu_start =
    std::max(n_layer_all + 1 - n_gpu_layers, 0)`; a layer il < i_gpu_start gets the CPU, and the
    output layer is il = n_layer_all: `dev_output = get_layer_buft_list(n_layer_all)`). So N leaves
    n_layer + 1 - N decoder layers on the CPU (none from N = n_layer + 1 up), the inverse of the
    export's `-ngl = layers + 1 - offloaded`; N = 0 would put the output layer on the CPU too,
    which is not modelled."""
    layout = _with_layer_offload(spec, layout, wl, offload_layers=offload_layers, cpu_offload_gib=cpu_offload_gib,
                                 n_gpu_layers=n_gpu_layers, targets=targets)
    return with_expert_offload(spec, layout, wl, n_cpu_moe)


def with_expert_offload(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, n_cpu_moe: int | None) -> Layout:
    """`layout` with llama.cpp's --n-cpu-moe N: the routed experts of decoder layers 0..N-1 in host
    memory, run by the CPU (common/arg.cpp at b11312). Only an engine that runs host-held weights
    on the CPU can do that (offload mode host_compute: llama.cpp); refused for a dense model and
    for N past the model's last MoE layer."""
    from dataclasses import replace

    from shardplan.errors import ShardplanError

    if n_cpu_moe is None:
        return layout
    if n_cpu_moe < 0:
        raise ShardplanError(f"must be at least 0, not {n_cpu_moe}", field="--n-cpu-moe", hint="e.g. --n-cpu-moe 16")
    if wl.offload_mode != "host_compute" or "cpu" not in wl.offload_targets:
        raise ShardplanError(f"the {wl.engine} engine does not run experts held in host memory on the CPU",
                             field="--n-cpu-moe", hint="use --engine llamacpp, or drop --n-cpu-moe")
    if spec.moe is None:
        raise ShardplanError(f"{spec.name} is a dense model: it has no routed experts to keep in host memory",
                             field="--n-cpu-moe", hint="drop --n-cpu-moe; --n-gpu-layers offloads whole layers")
    last = max(i for i in range(spec.num_layers) if spec.is_moe_layer(i)) + 1
    if n_cpu_moe > last:
        raise ShardplanError(f"{n_cpu_moe} layers, but the model's MoE layers end at layer {last}",
                             field="--n-cpu-moe", hint=f"use at most {last} (all of its experts)")
    return replace(layout, offload_expert_layers=n_cpu_moe)


def _with_layer_offload(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, *, offload_layers: int | None,
                        cpu_offload_gib: float | None, n_gpu_layers: int | None,
                        targets: tuple[str, ...] | None) -> Layout:
    from dataclasses import replace

    from shardplan.errors import ShardplanError

    given = [(n, v) for n, v in (("--offload-layers", offload_layers), ("--cpu-offload-gb", cpu_offload_gib),
                                 ("--n-gpu-layers", n_gpu_layers)) if v is not None]
    if not given:
        if layout.offload_params is not Offload.NONE or layout.offload_optimizer is not Offload.NONE:
            raise ShardplanError("serving offloads whole layers: --offload says where, not how many",
                                 field="--offload", hint="add --offload-layers N (or --cpu-offload-gb / --n-gpu-layers)")
        return layout
    if len(given) > 1:
        raise ShardplanError(f"{given[0][0]} and {given[1][0]} both say how much to offload", field=given[1][0],
                             hint="give one of them")
    option, value = given[0]
    if not math.isfinite(value) or value < 0:
        raise ShardplanError(f"must be a finite number at least 0, not {value:g}", field=option, hint=f"e.g. {option} 4")
    if targets is None:
        raise ShardplanError(f"the {wl.engine} engine has no weight offload modelled", field=option,
                             hint="use --engine llamacpp, transformers or vllm")
    where = layout.offload_params if layout.offload_params is not Offload.NONE else Offload.CPU
    if where.value not in targets:
        raise ShardplanError(f"{wl.engine} offloads to {', '.join(targets)} only, not {where.value}",
                             field="--offload", hint="use --offload all-cpu")
    n = spec.num_layers
    if option == "--offload-layers":
        count = int(value)
    elif option == "--n-gpu-layers":
        if int(value) == 0:
            raise ShardplanError("-ngl 0 keeps the output layer on the CPU too, which shardplan does not model",
                                 field=option, hint="use --n-gpu-layers 1 (every decoder layer on the CPU, the "
                                                    "output layer on the GPU)")
        count = min(n, max(0, n + 1 - int(value)))  # the output layer is the last of the n + 1
    else:
        want = float(value) * 2**30
        trial = replace(layout, offload_layers=n, offload_params=where)
        order = list(offloaded_layers(spec, trial, wl))
        if wl.offload_gpu_layers == "first":
            order.reverse()  # the engine offloads from the end
        count, total = 0, 0.0
        while total < want and count < n:
            total += layer_bytes_per_rank(spec, layout, wl, order[count])
            count += 1
    if count > n:
        raise ShardplanError(f"{count} layers, but the model has {n}", field=option, hint=f"use at most {n}")
    # --offload all-cpu/all-nvme names where the layers go; a serving layout has no optimizer to offload.
    if count == 0:
        return replace(layout, offload_layers=0, offload_params=Offload.NONE, offload_optimizer=Offload.NONE)
    return replace(layout, offload_layers=count, offload_params=where, offload_optimizer=Offload.NONE)
