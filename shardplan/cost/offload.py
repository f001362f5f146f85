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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardplan.cost.layout import Layout, Offload
from shardplan.cost.params import block_weights, embedding_weights, layer_kind
from shardplan.cost.weights import bytes_per_weight_element, numel_per_rank
from shardplan.cost.workload import InferenceWorkload, Quantization
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
    kinds = block_weights(spec, *layer_kind(spec, layer))
    return sum(numel_per_rank(w, spec, layout)
               * bytes_per_weight_element(w, q, wl.activation_dtype, spec, (layer,)) for w in kinds)


def largest_tensor_bytes_per_rank(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, layer: int) -> float:
    """The largest single weight (with its quantization constants) of layer `layer` on one rank."""
    kinds = block_weights(spec, *layer_kind(spec, layer))
    return max(numel_per_rank(w, spec, layout) / w.copies
               * bytes_per_weight_element(w, wl.quantization, wl.activation_dtype, spec, (layer,)) for w in kinds)


def embedding_bytes_per_rank(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> float:
    return sum(numel_per_rank(w, spec, layout) * bytes_per_weight_element(w, wl.quantization, wl.activation_dtype, spec)
               for w in embedding_weights(spec) if w.component.value == "embedding")


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


@lru_cache(maxsize=4096)
def offload_memory(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> OffloadMemory:
    layers = offloaded_layers(spec, layout, wl)
    if not layers:
        return OffloadMemory((), 0.0, 0.0, 0.0, 0.0, (), 0.0, 0.0)
    # Offloaded layers the engine holds unquantized (transformers + bitsandbytes) leave the GPU in
    # the plan's format and sit on the host in the model dtype.
    held = None if wl.offload_keeps_quantization else Quantization.NONE
    on_gpu = [layer_bytes_per_rank(spec, layout, wl, i) for i in layers]
    per_layer = on_gpu if held is None else [layer_bytes_per_rank(spec, layout, wl, i, held) for i in layers]
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
    return OffloadMemory(layers, gpu_freed + embedding, embedding, off + embedding, streamed, kv_off,
                         0.0 if disk else off + embedding, off + embedding if disk else 0.0)


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


def offload_pass_seconds(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, *,
                         gpu_seconds: float, tokens: float, kv_bytes_read: float, decode: bool) -> OffloadTime:
    """The offloaded layers' share of one pass of `tokens` tokens whose GPU part takes `gpu_seconds`.
    `kv_bytes_read`: K/V bytes the offloaded layers read in this pass (host_compute decode)."""
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
                         targets: tuple[str, ...] | None) -> Layout:
    """`layout` with the offload a serving command asked for, in the engine's terms: a layer count,
    vLLM's GiB per GPU (the fewest whole layers that hold at least that much, counted in the order
    the engine offloads them), or llama.cpp's layers on the GPU. `targets`: where the engine can
    offload (None: it cannot)."""
    from dataclasses import replace

    from shardplan.errors import ShardplanError

    given = [(n, v) for n, v in (("--offload-layers", offload_layers), ("--cpu-offload-gb", cpu_offload_gib),
                                 ("--n-gpu-layers", n_gpu_layers)) if v is not None]
    if not given:
        return layout
    if len(given) > 1:
        raise ShardplanError(f"{given[0][0]} and {given[1][0]} both say how much to offload", field=given[1][0],
                             hint="give one of them")
    option, value = given[0]
    if value < 0:
        raise ShardplanError(f"must be at least 0, not {value:g}", field=option, hint=f"e.g. {option} 4")
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
        count = max(0, n - int(value))
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
    if count == 0:
        return replace(layout, offload_layers=0, offload_params=Offload.NONE)
    return replace(layout, offload_layers=count, offload_params=where)
