"""Hardware profiles: a GPU, the node it sits in, and the links between GPUs and nodes.

Two layers, so that units are converted exactly once, at load:
- `HardwareProfileFile` mirrors the YAML, with human units in the key names
  (`_gib` = 2**30 bytes, `_gb_per_s` = 1e9 bytes/s, `_tflops` = 1e12 FLOP/s, `_us`);
- `HardwareProfile` is what the cost model uses: SI units only.

A profile `shardplan calibrate` wrote may also carry `measured_cases:`, the runs measured on
this machine that it was calibrated from (the `--cases` schema, `specs/cases.py`): the cost
model ignores them; predictions made with the profile take their error band from them where
they match (tasks/_bands.py). The loader (`specs.loading.load_hardware`) points each case at
the profile's own file and its relative model paths at the profile's folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardplan import units
from shardplan.errors import ShardplanError
from shardplan.specs._base import StrictModel
from shardplan.specs.cases import Case
from shardplan.units import DType

# Upper bounds, orders of magnitude above any GPU or node sold (B200: 180 GiB, 8 TB/s, 4.5 PFLOP/s
# fp8; NVL72: 72 GPUs per NVLink domain), that keep every figure the cost model derives from a
# profile a finite float. A profile past them is refused with the field named.
MAX_CAPACITY_GIB = 2.0**20  # one GPU's memory, a node's host RAM or NVMe (1 PiB)
MAX_BANDWIDTH_GB_PER_S = 1e9
MAX_TFLOPS = 1e9
MAX_MICROSECONDS = 1e9  # latencies and per-kernel costs (1000 s)
MAX_GPUS_PER_NODE = 2**16
# Lower bounds, orders of magnitude below any device (1 MFLOP/s, 1 kB/s, 0.1% of a peak): a rate or
# a share near zero makes a time overflow a float (a step of 1e300 s, squared in the roofline).
MIN_TFLOPS = 1e-6
MIN_BANDWIDTH_GB_PER_S = 1e-6
MIN_FRACTION = 1e-3
MAX_MEASURED_CASES = 100  # a profile's own cases are predicted with every estimate: a few, not a corpus


class LinkKind(str, Enum):
    NVSWITCH = "nvswitch"
    NVLINK = "nvlink"
    PCIE = "pcie"
    XGMI = "xgmi"
    INFINIBAND = "infiniband"
    ROCE = "roce"
    ETHERNET = "ethernet"
    NVLINK_C2C = "nvlink-c2c"


class PeakTflopsFile(StrictModel):
    """Dense (no 2:4 sparsity) peak per dtype, decimal TFLOP/s (TOPS for int8)."""

    fp32: float = Field(..., ge=MIN_TFLOPS, le=MAX_TFLOPS)
    tf32: float | None = Field(None, ge=MIN_TFLOPS, le=MAX_TFLOPS)
    bf16: float | None = Field(None, ge=MIN_TFLOPS, le=MAX_TFLOPS)
    fp16: float = Field(..., ge=MIN_TFLOPS, le=MAX_TFLOPS)
    fp8: float | None = Field(None, ge=MIN_TFLOPS, le=MAX_TFLOPS)
    int8: float | None = Field(None, ge=MIN_TFLOPS, le=MAX_TFLOPS)
    int4: float | None = Field(None, ge=MIN_TFLOPS, le=MAX_TFLOPS)
    fp4: float | None = Field(None, ge=MIN_TFLOPS, le=MAX_TFLOPS)


class GpuFile(StrictModel):
    model: str = Field(..., min_length=1)
    memory_capacity_gib: float = Field(..., ge=2**-20, le=MAX_CAPACITY_GIB, description="total memory as the device reports it, GiB (at least one KiB: a smaller figure rounds to zero bytes)")
    memory_bandwidth_gb_per_s: float = Field(..., ge=MIN_BANDWIDTH_GB_PER_S, le=MAX_BANDWIDTH_GB_PER_S)
    peak_dense_tflops: PeakTflopsFile
    power_limited_compute_fraction: float = Field(
        1.0, ge=MIN_FRACTION, le=1,
        description="the share of the dense peaks the GPU sustains at its board power limit, for a part run below "
                    "its chip's rated power (a capped GPU lowers its clocks under tensor-core load; memory-bound "
                    "work draws less and is not slowed): the peaks above are the chip's, each is scaled by this")
    price_per_gpu_hour_usd: float | None = Field(None, gt=0, le=1e6)
    architecture: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9_-]{0,31}$",
        description="the GPU's architecture as its vendor names it (NVIDIA: volta, turing, ampere, ada, hopper, "
                    "blackwell; AMD: cdna2, cdna3): what an engine's kernels for a checkpoint's format need "
                    "(knowledge/engines/*.yaml checkpoint_formats architectures); null: not stated, and formats "
                    "that need one are planned at the model's dtype")


class LinkFile(StrictModel):
    kind: LinkKind
    bandwidth_gb_per_s: float = Field(..., ge=MIN_BANDWIDTH_GB_PER_S, le=MAX_BANDWIDTH_GB_PER_S, description="per GPU, per direction")
    latency_us: float = Field(..., ge=0, le=MAX_MICROSECONDS)


class HostLinkFile(StrictModel):
    kind: LinkKind = LinkKind.PCIE
    generation: int | None = Field(None, gt=0, le=100)
    lanes: int | None = Field(None, gt=0, le=1024)
    bandwidth_gb_per_s: float = Field(..., ge=MIN_BANDWIDTH_GB_PER_S, le=MAX_BANDWIDTH_GB_PER_S, description="per GPU, per direction")


class NodeFile(StrictModel):
    gpus_per_node: int = Field(..., gt=0, le=MAX_GPUS_PER_NODE)
    intra_node_link: LinkFile
    inter_node_link: LinkFile
    host_link: HostLinkFile
    host_memory_gib: float = Field(..., gt=0, le=MAX_CAPACITY_GIB)
    nvme_capacity_gib: float = Field(..., ge=0, le=MAX_CAPACITY_GIB)
    nvme_bandwidth_gb_per_s: float = Field(..., ge=0, le=MAX_BANDWIDTH_GB_PER_S, description="0: no NVMe")
    host_memory_bandwidth_gb_per_s: float | None = Field(
        None, ge=MIN_BANDWIDTH_GB_PER_S, le=MAX_BANDWIDTH_GB_PER_S,
        description="peak DRAM bandwidth one GPU's process can read from (its socket's channels x transfer rate x 8 "
                    "bytes), GB/s; layers run on the CPU (llama.cpp -ngl) are bound by it; null: unknown")

    @field_validator("nvme_bandwidth_gb_per_s")
    @classmethod
    def _nvme_none_or_real(cls, v: float) -> float:
        if 0 < v < MIN_BANDWIDTH_GB_PER_S:
            raise ValueError(f"must be 0 (no NVMe) or at least {MIN_BANDWIDTH_GB_PER_S:g} GB/s")
        return v


class AttentionKernelFile(StrictModel):
    """Achieved / dense 16-bit peak of one fused attention kernel on this GPU, at long sequences
    (the causal half counted once), forward and backward separately."""

    forward: float = Field(..., ge=MIN_FRACTION, le=1)
    backward: float = Field(..., ge=MIN_FRACTION, le=1)


class EfficiencyFile(StrictModel):
    """Attainable fraction of each peak (0 < x <= 1), and the few shape constants of the time
    model. `shardplan calibrate` (or a hand edit) may replace them; the cost model has no
    other tuning constants."""

    matmul: float = Field(..., ge=MIN_FRACTION, le=1, description="large 16-bit GEMMs: achieved / dense peak")
    matmul_fp8: float | None = Field(
        None, ge=MIN_FRACTION, le=1, description="large fp8/int8 GEMMs: achieved / that dtype's peak; None: same as matmul"
    )
    matmul_half_dim: float = Field(
        64.0,
        gt=0,
        le=2.0**20,
        description="GEMM dimension (rows, columns or depth) at which the attainable share falls to half "
        "(tile and wave quantisation): share = matmul x prod(d / (d + half_dim))",
    )
    attention: float | None = Field(
        None, ge=MIN_FRACTION, le=1, description="fused (flash) attention kernels: achieved / dense peak; None: same as matmul"
    )
    attention_kernels: dict[Literal["fa2", "fa3", "cudnn"], AttentionKernelFile] = Field(
        default_factory=dict,
        description="measured efficiency of each fused attention kernel this GPU runs (fa2: FlashAttention-2 and "
        "PyTorch SDPA's flash backend; fa3: FlashAttention-3; cudnn: cuDNN fused attention, as Transformer Engine "
        "uses it); a training stack's preferred kernel is looked up here, else `attention` applies",
    )
    memory_bandwidth: float = Field(..., ge=MIN_FRACTION, le=1)
    kernel_overhead_us: float = Field(
        4.0, ge=0, le=MAX_MICROSECONDS, description="GPU-side fixed cost per kernel on top of its roofline time (ramp-up, tail), microseconds"
    )
    kernel_launch_us: float = Field(
        8.0,
        ge=0,
        le=MAX_MICROSECONDS,
        description="host time to launch one kernel without CUDA graphs, microseconds; it shows only when the "
        "kernels are shorter than their launches",
    )
    python_op_us: float = Field(
        9.4,
        ge=0,
        le=MAX_MICROSECONDS,
        description="host CPU time of one framework op an eager Python engine issues (interpreter, binding, "
        "dispatcher and the op's kernel launch), microseconds; it shows when an eager engine's ops take longer "
        "to issue than the GPU takes to run them (small decode steps). Default: 9.4, measured from vLLM's "
        "eager-vs-CUDA-graph pair on GPT-2 on an H200 host (DeepSpeed PR #8352)",
    )
    overlap_compute_share: float = Field(
        0.8,
        ge=MIN_FRACTION,
        le=1,
        description="share of compute throughput left while a collective runs alongside it (NCCL kernels "
        "take SMs and HBM bandwidth)",
    )
    intra_node_link: float = Field(..., ge=MIN_FRACTION, le=1)
    inter_node_link: float = Field(..., ge=MIN_FRACTION, le=1)
    host_link: float = Field(..., ge=MIN_FRACTION, le=1)
    nvme: float = Field(..., ge=MIN_FRACTION, le=1)
    host_link_pageable: float | None = Field(
        None, ge=MIN_FRACTION, le=1, description="achieved / peak host-to-device rate of copies from pageable (not pinned) host "
                                      "memory, which the driver stages through a pinned buffer (accelerate's offload "
                                      "hooks); null: unknown, costed at the pinned rate with a note")
    host_memory: float | None = Field(
        None, ge=MIN_FRACTION, le=1, description="achieved / peak host DRAM bandwidth of a CPU matrix-vector product (llama.cpp "
                                      "token generation on the CPU); null: unknown")


class RuntimeFile(StrictModel):
    """Memory per GPU outside the tensors a model allocates. vLLM counts all but the CUDA
    context inside its `gpu_memory_utilization` budget (CUDA graphs since v0.21)."""

    cuda_context_gib: float = Field(..., ge=0, le=MAX_CAPACITY_GIB, description="CUDA context and loaded kernels, present before any tensor")
    non_torch_gib: float = Field(..., ge=0, le=MAX_CAPACITY_GIB, description="library workspaces (cuBLAS, attention backends) outside torch's allocator")
    nccl_buffers_gib: float = Field(..., ge=0, le=MAX_CAPACITY_GIB, description="NCCL communicator buffers, when a process has peers")
    cuda_graphs_gib: float = Field(..., ge=0, le=MAX_CAPACITY_GIB, description="a serving engine's captured CUDA graphs (vLLM without --enforce-eager)")


class HardwareProfileFile(StrictModel):
    name: str = Field(..., min_length=1)
    description: str = ""
    gpu: GpuFile
    node: NodeFile
    efficiency: EfficiencyFile
    runtime: RuntimeFile
    sources: dict[str, str] = Field(default_factory=dict)
    measured_cases: list[Case] = Field(
        default_factory=list, max_length=MAX_MEASURED_CASES,
        description="runs measured on this machine (the `--cases` schema), written by `shardplan calibrate`; "
                    "predictions made with this profile take their error band from them where they match")

    @model_validator(mode="after")
    def _unique_cases(self) -> "HardwareProfileFile":
        ids = [c.id for c in self.measured_cases]
        if len(ids) != len(set(ids)):
            raise ValueError(f"measured_cases: case id {next(i for i in ids if ids.count(i) > 1)!r} appears twice")
        return self


@dataclass(frozen=True)
class Link:
    kind: LinkKind
    bandwidth_bytes_per_second: float  # per GPU, per direction
    latency_seconds: float
    efficiency: float


@dataclass(frozen=True)
class HardwareProfile:
    """A node of identical GPUs, in SI units. `num_nodes` is set by the command line."""

    name: str
    description: str
    gpu_model: str
    memory_capacity_bytes: int
    memory_bandwidth_bytes_per_second: float
    peak_flops: dict[DType, float]
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    host_link: Link
    host_memory_bytes_per_node: int
    nvme_capacity_bytes_per_node: int
    nvme_bandwidth_bytes_per_second_per_node: float
    matmul_efficiency: float
    memory_bandwidth_efficiency: float
    nvme_efficiency: float
    matmul_fp8_efficiency: float
    matmul_half_dim: float
    attention_efficiency: float
    kernel_overhead_seconds: float
    kernel_launch_seconds: float
    python_op_seconds: float
    overlap_compute_share: float
    price_per_gpu_hour_usd: float | None
    cuda_context_bytes: int
    non_torch_bytes: int
    nccl_buffer_bytes: int
    cuda_graph_bytes: int
    num_nodes: int = 1
    sources: dict[str, str] = field(default_factory=dict)
    # kernel -> (forward, backward) achieved / dense 16-bit peak (EfficiencyFile.attention_kernels)
    attention_kernels: tuple[tuple[str, float, float], ...] = ()
    # The runs measured on this machine (HardwareProfileFile.measured_cases); the cost model
    # never reads them, tasks/_bands.py bands predictions with them.
    measured_cases: tuple[Case, ...] = ()
    # Host DRAM (layers run on the CPU, llama.cpp -ngl); None: the profile does not say.
    host_memory_bandwidth_bytes_per_second_or_none: float | None = None
    host_memory_efficiency_or_none: float | None = None
    host_link_pageable_efficiency: float | None = None  # None: unknown (copies costed at the pinned rate)
    gpu_architecture: str | None = None  # GpuFile.architecture (None: not stated)

    @property
    def host_memory_bandwidth_bytes_per_second(self) -> float:
        if self.host_memory_bandwidth_bytes_per_second_or_none is None:
            raise ShardplanError(f"profile '{self.name}' has no node.host_memory_bandwidth_gb_per_s, which layers run "
                                 "on the CPU need", field="node.host_memory_bandwidth_gb_per_s",
                                 hint="add the host's DRAM bandwidth (channels x MT/s x 8 bytes) and "
                                      "efficiency.host_memory to the profile")
        return self.host_memory_bandwidth_bytes_per_second_or_none

    @property
    def host_memory_efficiency(self) -> float:
        if self.host_memory_efficiency_or_none is None:
            raise ShardplanError(f"profile '{self.name}' has no efficiency.host_memory", field="efficiency.host_memory",
                                 hint="add the achieved share of host DRAM bandwidth (a CPU token-generation "
                                      "measurement) to the profile")
        return self.host_memory_efficiency_or_none

    def __hash__(self) -> int:
        # The dict fields make the generated hash impossible; equal profiles share these fields,
        # so hashing them is consistent with the generated __eq__ (cost caches key on profiles).
        return hash((self.name, self.gpu_model, self.memory_capacity_bytes, self.gpus_per_node, self.num_nodes))

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def peak_flops_for(self, dtype: DType) -> float:
        """Dense peak for a matmul dtype; formats a chip lacks fall back to the next wider one
        it has (fp8 on an A100 runs as fp16/bf16, as weight-only quantized kernels do)."""
        order = [dtype, DType.BF16, DType.FP16] if dtype in (DType.FP8, DType.INT8, DType.INT4, DType.FP4) else [dtype]
        if dtype is DType.BF16:
            order.append(DType.FP16)
        for d in order + [DType.FP32]:
            if d in self.peak_flops:
                return self.peak_flops[d]
        raise KeyError(dtype)

    def attention_kernel(self, preferred: tuple[str, ...]) -> tuple[str, float, float] | None:
        """(kernel, forward, backward efficiency) of the first of `preferred` this GPU has a
        measurement for; None: none of them (the profile's `attention` efficiency applies)."""
        table = {k: (k, f, b) for k, f, b in self.attention_kernels}
        return next((table[k] for k in preferred if k in table), None)

    def with_topology(self, *, gpus_per_node: int | None = None, num_nodes: int | None = None) -> "HardwareProfile":
        return replace(
            self,
            gpus_per_node=gpus_per_node if gpus_per_node is not None else self.gpus_per_node,
            num_nodes=num_nodes if num_nodes is not None else self.num_nodes,
        )


def profile_from_file(f: HardwareProfileFile) -> HardwareProfile:
    """Convert the YAML-facing schema to SI units: the one place this happens."""
    derate = f.gpu.power_limited_compute_fraction
    peaks = {DType(k): units.tflops_to_flops(v) * derate for k, v in f.gpu.peak_dense_tflops.model_dump().items() if v}
    eff = f.efficiency

    def link(lf: LinkFile, e: float) -> Link:
        return Link(lf.kind, units.gb_per_s_to_bytes_per_second(lf.bandwidth_gb_per_s), units.us_to_seconds(lf.latency_us), e)

    n = f.node
    return HardwareProfile(
        name=f.name,
        description=f.description,
        gpu_model=f.gpu.model,
        memory_capacity_bytes=units.gib_to_bytes(f.gpu.memory_capacity_gib),
        memory_bandwidth_bytes_per_second=units.gb_per_s_to_bytes_per_second(f.gpu.memory_bandwidth_gb_per_s),
        peak_flops=peaks,
        gpus_per_node=n.gpus_per_node,
        intra_node=link(n.intra_node_link, eff.intra_node_link),
        inter_node=link(n.inter_node_link, eff.inter_node_link),
        host_link=Link(n.host_link.kind, units.gb_per_s_to_bytes_per_second(n.host_link.bandwidth_gb_per_s), 0.0, eff.host_link),
        host_memory_bytes_per_node=units.gib_to_bytes(n.host_memory_gib),
        nvme_capacity_bytes_per_node=units.gib_to_bytes(n.nvme_capacity_gib),
        nvme_bandwidth_bytes_per_second_per_node=units.gb_per_s_to_bytes_per_second(n.nvme_bandwidth_gb_per_s),
        matmul_efficiency=eff.matmul,
        memory_bandwidth_efficiency=eff.memory_bandwidth,
        nvme_efficiency=eff.nvme,
        host_memory_bandwidth_bytes_per_second_or_none=(
            None if n.host_memory_bandwidth_gb_per_s is None
            else units.gb_per_s_to_bytes_per_second(n.host_memory_bandwidth_gb_per_s)),
        host_memory_efficiency_or_none=eff.host_memory,
        host_link_pageable_efficiency=eff.host_link_pageable,
        matmul_fp8_efficiency=eff.matmul_fp8 or eff.matmul,
        matmul_half_dim=eff.matmul_half_dim,
        attention_efficiency=eff.attention or eff.matmul,
        kernel_overhead_seconds=units.us_to_seconds(eff.kernel_overhead_us),
        kernel_launch_seconds=units.us_to_seconds(eff.kernel_launch_us),
        python_op_seconds=units.us_to_seconds(eff.python_op_us),
        overlap_compute_share=eff.overlap_compute_share,
        price_per_gpu_hour_usd=f.gpu.price_per_gpu_hour_usd,
        cuda_context_bytes=units.gib_to_bytes(f.runtime.cuda_context_gib),
        non_torch_bytes=units.gib_to_bytes(f.runtime.non_torch_gib),
        nccl_buffer_bytes=units.gib_to_bytes(f.runtime.nccl_buffers_gib),
        cuda_graph_bytes=units.gib_to_bytes(f.runtime.cuda_graphs_gib),
        sources=dict(f.sources),
        attention_kernels=tuple((k, v.forward, v.backward) for k, v in sorted(eff.attention_kernels.items())),
        measured_cases=tuple(f.measured_cases),
        gpu_architecture=f.gpu.architecture,
    )
