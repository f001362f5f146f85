"""Collective communication time: an alpha-beta model per collective, on the link it crosses.

A collective over `n` ranks moving a buffer of `S` bytes costs

    t = hops x alpha + volume_factor x S / B

(Hockney's alpha-beta model; the ring volume factors are Thakur et al. 2005 and NCCL's
`busBw` conventions, docs/PERFORMANCE.md of nccl-tests):

    all-reduce          2 (n-1)/n   ring; latency hops 2 ceil(log2 n) (NCCL's tree)
    reduce-scatter        (n-1)/n   ring, (n-1) hops; S is the full (unsharded) buffer
    all-gather            (n-1)/n   ring, (n-1) hops; S is the full (gathered) buffer
    all-to-all            (n-1)/n   S is what one rank sends, its own share included
    point-to-point        1         one hop

`B` is the bus bandwidth of the group. Inside one node it is the GPU's intra-node link
(NVLink/NVSwitch/PCIe, per direction) times its efficiency. A group that spans nodes is
limited by each rank's own NIC: B = min(intra-node link, per-GPU inter-node link) x
efficiency. That is exact for the common 3-D layouts, where the node's other NICs carry the
other data-parallel groups' traffic at the same moment, and it is what DeepSpeed ZeRO-3
reached in Megatron-LM's Table 2 (Narayanan et al. 2021) for groups that fill whole nodes:
a per-GPU communication time constant in the GPU count and proportional to the parameters,
at about the NIC rate. A training stack whose collectives reach the node's NICs together
(`multirail`: NCCL's one ring per NIC, FSDP2's flat per-layer buffers; measured with
torchtitan's FSDP over 64 A100s) gets r NICs for a group with r ranks in a node.

`overlapped()` is the one rule for communication that runs alongside compute: while the
collective runs, compute keeps only `overlap_compute_share` of its throughput (NCCL's
kernels take SMs and HBM bandwidth), so C seconds of compute and X of communication take
max(X, C + (1 - share) X) when X share < C, else X.

Rank placement follows Megatron-LM and torchtitan: tensor-parallel ranks are adjacent, then
context, then data, then pipeline (`RANK_ORDER`); a group whose faster axes multiply to
`stride` has min(n, gpus_per_node // stride) ranks per node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from enum import Enum
from functools import lru_cache

from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec

RANK_ORDER = ("tp", "cp", "dp", "pp")  # fastest-varying first


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


@dataclass(frozen=True)
class Group:
    """A communicator: `size` ranks, `ranks_per_node` of them in each node it spans."""

    size: int
    ranks_per_node: int

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.size / self.ranks_per_node)


def group(size: int, stride: int, gpus_per_node: int) -> Group:
    """Placement of a group of `size` ranks whose members are `stride` ranks apart."""
    if size <= 1:
        return Group(1, 1)
    per_node = max(1, min(size, gpus_per_node // max(1, stride)))
    return Group(size, per_node)


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_second: float  # bus bandwidth, efficiency applied
    latency_seconds: float


def link_for(g: Group, hw: HardwareProfile, multirail: bool = False) -> Link:
    """The group's bus bandwidth: the intra-node link inside a node; across nodes, each rank's
    own NIC, or with `multirail` the NICs of all the group's ranks in a node (NCCL builds one
    ring per NIC, so a group with r ranks a node moves r NICs' worth: ~370 GB/s bus bandwidth
    over a DGX H100's 8 x 50 GB/s, nccl-tests issues #212 and #309), never more than NVLink."""
    intra = hw.intra_node.bandwidth_bytes_per_second * hw.intra_node.efficiency
    if g.num_nodes <= 1:
        return Link(intra, hw.intra_node.latency_seconds)
    inter = hw.inter_node.bandwidth_bytes_per_second * hw.inter_node.efficiency * (g.ranks_per_node if multirail else 1)
    return Link(min(intra, inter), hw.inter_node.latency_seconds)


def overlapped(compute_seconds: float, comm_seconds: float, hw: HardwareProfile) -> float:
    """Wall time of `compute_seconds` of work with `comm_seconds` of communication beside it."""
    share = hw.overlap_compute_share
    if comm_seconds * share >= compute_seconds:
        return comm_seconds
    return compute_seconds + (1.0 - share) * comm_seconds


def collective_seconds(kind: Collective, nbytes: float, g: Group, hw: HardwareProfile, multirail: bool = False) -> float:
    """Time of one collective of `nbytes` (see the module docstring for what `nbytes` is)."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = link_for(g, hw, multirail)
    if kind is Collective.ALL_REDUCE:
        factor, hops = 2 * (n - 1) / n, 2 * math.ceil(math.log2(n))
    elif kind is Collective.P2P:
        factor, hops = 1.0, 1
    else:
        factor, hops = (n - 1) / n, n - 1
    return hops * link.latency_seconds + factor * nbytes / link.bandwidth_bytes_per_second


@dataclass(frozen=True)
class Groups:
    """The communicators of a layout, placed on the cluster."""

    tp: Group
    cp: Group
    dp: Group  # dense data parallelism (ZeRO shards over dp x cp: `zero`)
    zero: Group
    ep: Group
    expert_dp: Group
    pp: Group


def layout_groups(tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, zero_degree: int, expert_dp: int, gpus_per_node: int) -> Groups:
    """Groups of a layout in the rank order tp, cp, dp, pp. Expert parallelism folds over
    tp x cp x dp (Megatron-Core), its ranks adjacent after each expert's etp ranks."""
    return Groups(
        tp=group(tp, 1, gpus_per_node),
        cp=group(cp, tp, gpus_per_node),
        dp=group(dp, tp * cp, gpus_per_node),
        zero=group(zero_degree, tp if zero_degree > dp else tp * cp, gpus_per_node),
        ep=group(ep, etp, gpus_per_node),
        expert_dp=group(expert_dp, ep * etp, gpus_per_node),
        pp=group(pp, tp * cp * dp, gpus_per_node),
    )


def layer_collectives_seconds(
    spec: ModelSpec, hw: HardwareProfile, layers: Sequence[int], *, tokens: float, act_bytes: float, tp: Group, ep: Group,
    multirail: bool = False,
) -> tuple[float, float]:
    """(tensor-parallel, expert-parallel) seconds of one pass over `layers`: two all-reduces of
    the layer's activations per layer (one with a parallel residual; Megatron-LM, Shoeybi et al.
    2019, Sec. 3), and a dispatch and a combine all-to-all per MoE layer, each rank sending its
    `tokens` x top-k rows of the hidden size."""
    h = spec.hidden_size
    per_layer = 1 if spec.parallel_residual else 2
    tp_s = per_layer * len(layers) * collective_seconds(Collective.ALL_REDUCE, tokens * h * act_bytes, tp, hw, multirail)
    ep_s = 0.0
    # MoE layers are counted only where they send anything (a search asks for dense models and
    # ep = 1 layouts tens of thousands of times, each over every layer of a stage).
    num_moe = 0
    if spec.moe is not None and ep.size > 1:
        num_moe = _moe_layers_of(spec, layers) if isinstance(layers, tuple) else sum(spec.is_moe_layer(i) for i in layers)
    if num_moe and spec.moe is not None and ep.size > 1:
        sent = tokens * spec.moe.num_experts_per_token * h * act_bytes
        ep_s = 2 * num_moe * collective_seconds(Collective.ALL_TO_ALL, sent, ep, hw, multirail)
    return tp_s, ep_s


@lru_cache(maxsize=8192)
def _moe_layers_of(spec: ModelSpec, layers: tuple[int, ...]) -> int:
    """MoE layers among a stage's `layers`, cached (the training search asks for the same stages
    thousands of times)."""
    return sum(spec.is_moe_layer(i) for i in layers)
