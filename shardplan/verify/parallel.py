"""The plan's layout applied with PyTorch's own parallel APIs, in torchtitan's order: pipeline
split -> tensor parallelism (DTensor `parallelize_module`, per the manifest's `tp_splits`)
-> activation checkpointing -> materialise and initialise shard by shard -> FSDP2
(`fully_shard`, resharding after forward for ZeRO-3 only). The device mesh has the
manifest's axes, the data-parallel one split torchtitan-style into replicate x shard
(HSDP: shard inside a node, replicate across).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy

from shardplan.cost.layout import Layout, Offload, Recompute, layout_stage_ranges
from shardplan.verify import measure
from shardplan.verify.model import Decoder, RMSNorm, rope_cache

INIT_STD = 0.02
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


@dataclass(frozen=True)
class Coords:
    """This rank's place in the mesh (rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i)."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


def coords(rank: int, layout: Layout) -> Coords:
    tp_i = rank % layout.tp
    rest = rank // (layout.tp * layout.cp)
    return Coords(pp=rest // layout.dp, dp=rest % layout.dp, tp=tp_i, cp=rank // layout.tp % layout.cp)


def dp_split(layout: Layout, gpus_per_node: int, training: bool) -> tuple[int, int]:
    """(replicate, shard) sizes of the data-parallel axis: ZeRO >= 1 shards over dp (HSDP: the
    dp ranks of one node); ZeRO-0 and serving replicas replicate."""
    if not training or layout.zero_stage == 0 or layout.dp == 1:
        return layout.dp, 1
    shard = layout.dp
    if layout.hybrid_shard:
        shard = max(1, min(layout.dp, gpus_per_node // (layout.tp * layout.cp)))
    return layout.dp // shard, shard


def build_mesh(device_type: str, layout: Layout, gpus_per_node: int, training: bool) -> DeviceMesh:
    """Axes pp, dp_replicate, dp_shard, cp, tp, slowest to fastest (the rank order of `coords`;
    torchtitan's order, with cp between the data and tensor axes)."""
    rep, shard = dp_split(layout, gpus_per_node, training)
    return init_device_mesh(device_type, (layout.pp, rep, shard, layout.cp, layout.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))


def chunk_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Model chunks this pipeline rank runs: pp_rank, pp_rank + pp, ... (interleaved)."""
    return [pp_rank + k * layout.pp for k in range(layout.virtual_stages)]


def build_chunks(spec, layout: Layout, pp_rank: int) -> list[Decoder]:
    """This pipeline rank's chunks, on the meta device (no memory until materialised)."""
    ranges = layout_stage_ranges(spec.num_layers, layout)[pp_rank]
    last_chunk = layout.pp * layout.virtual_stages - 1
    with torch.device("meta"):
        return [Decoder(spec, list(r), first=c == 0, last=c == last_chunk)
                for c, r in zip(chunk_ids(layout, pp_rank), ranges)]


def _canonical(name: str) -> str:
    """A parameter's name without wrappers' prefixes: the name in the unsharded model."""
    return name.replace(CHECKPOINT_PREFIX, "")


def split_key(module_path: str) -> str:
    """`layers.3.mlp.experts.5.up_proj` -> `mlp.experts.up_proj.weight` (the manifest's key)."""
    parts = _canonical(module_path).split(".")
    if parts[0] == "layers":
        parts = parts[2:]
    if "experts" in parts:
        i = parts.index("experts")
        parts = parts[: i + 1] + parts[i + 2:]
    return ".".join(parts) + ".weight"


def apply_tp(chunk: Decoder, tp_mesh: DeviceMesh, tp_splits: dict[str, str], *, loss_parallel: bool,
             sequence_parallel: bool = False) -> None:
    """Column/row-wise DTensor sharding of every linear and the vocabulary, as the manifest's
    `tp_splits` say (column and kv_column: ColwiseParallel; row: RowwiseParallel; vocab:
    embedding rows / lm_head columns). Training keeps the logits vocabulary-sharded for
    loss parallelism; serving gathers them for the sampler (as vLLM does).

    Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2; torchtitan's plan): the
    residual stream and the norms hold a 1/tp share of the sequence (SequenceParallel), the
    row-parallel outputs are reduce-scattered into it (RowwiseParallel to Shard(1)), and the
    column-parallel projections gather it first (`SequenceParallelRegion`)."""
    plan: dict[str, object] = {}
    seq = Shard(1)
    if sequence_parallel:
        for path, mod in chunk.named_modules():
            if isinstance(mod, RMSNorm):
                plan[path] = SequenceParallel()
    reduce_in_place: list[nn.Module] = []
    for path, mod in chunk.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        split = tp_splits.get(split_key(path))
        if split is None:
            raise KeyError(f"no tp split for {path} in the manifest")
        if split == "replicated":
            continue
        if path == "embed_tokens":
            plan[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate(),
                                         use_local_output=not sequence_parallel)
        elif path == "lm_head":
            plan[path] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
        elif split in ("column", "kv_column"):
            plan[path] = ColwiseParallel()
        elif split == "row" and sequence_parallel:
            plan[path] = RowwiseParallel(output_layouts=seq, use_local_output=False)
        elif split == "row" and not loss_parallel:
            # Serving: the partial sums are reduced in place (vLLM's RowParallelLinear), not
            # into a new tensor as DTensor's redistribute does.
            plan[path] = RowwiseParallel(output_layouts=Partial())
            if ".experts." in path:  # the fused MoE sums its experts' partial outputs first
                moe = chunk.get_submodule(path[: path.index(".experts.")])
                if moe not in reduce_in_place:
                    reduce_in_place.append(moe)
            else:
                reduce_in_place.append(mod)
        elif split == "row":
            plan[path] = RowwiseParallel()
        else:
            raise KeyError(f"unknown split {split!r} for {path}")
    parallelize_module(chunk, tp_mesh, plan)
    if sequence_parallel:
        region = SequenceParallelRegion(tp_mesh)
        for mod in chunk.modules():
            if hasattr(mod, "sequence_parallel"):
                mod.sequence_parallel = region
    for mod in reduce_in_place:  # after the style's own hooks, which hand over the local partial sums
        mod.register_forward_hook(_all_reduce_in_place(tp_mesh.get_group()))


def _keep_matmul_outputs(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class SequenceParallelRegion:
    """Where the sequence-sharded residual stream meets the column-parallel projections.

    Megatron (`ColumnParallelLinear` with `sequence_parallel`, Korthikanti et al. 2022, Sec.
    4.2.2) all-gathers the sequence before the projections and keeps for backward only this
    rank's share, gathering it again in backward. DTensor's ColwiseParallel alone would keep
    the gathered input (torchtitan does). Here the gather and the projections run under
    torch's selective activation checkpointing: the projections' outputs are saved, the
    gather is recomputed, so backward holds the share, as Megatron does, at the cost of the
    second all-gather Megatron also pays."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def enter(self, local: torch.Tensor) -> DTensor:
        """A pipeline stage's received share of the sequence, as the sharded residual stream."""
        return DTensor.from_local(local, self.mesh, [Shard(1)], run_check=False)

    def leave(self, h: torch.Tensor) -> torch.Tensor:
        """The share this rank sends to the next pipeline stage."""
        return h.to_local() if isinstance(h, DTensor) else h

    def vocab_sharded(self, logits: torch.Tensor) -> DTensor:
        """This rank's vocabulary columns of the logits, as loss parallelism takes them."""
        return DTensor.from_local(logits, self.mesh, [Shard(-1)], run_check=False)

    def project(self, x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        from functools import partial

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        def run(share: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # Each rank's columns give a partial sum of the input's gradient: reduce-scattered
            # back into the sequence share (Megatron's backward of the gather).
            full = share.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            # ColwiseParallel's own matmul on this rank's columns, without its output hook,
            # whose view of the result could not be rotated in place (model.apply_rope).
            return tuple(F.linear(full, lin.weight.to_local()) for lin in linears)

        return checkpoint(run, x, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, _keep_matmul_outputs))


def _all_reduce_in_place(group: dist.ProcessGroup):
    wait_for_release = dist.get_backend(group) == "gloo"

    def hook(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        refs_before = output._use_count()
        dist.all_reduce(output, group=group)
        if wait_for_release:
            measure.await_release(output, refs_before)
        return output

    return hook


def keep_grads_sharded(chunk: nn.Module) -> None:
    """After materialising (which replaces the parameter objects): gradients of DTensor
    parameters take their parameter's placement."""
    for p in chunk.parameters():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_grad_like_param)


def _grad_like_param(p: torch.Tensor) -> None:
    """Give a gradient the parameter's placement. DTensor's embedding backward returns a
    replicated (full-vocabulary) gradient for a vocabulary-sharded table; Megatron's
    VocabParallelEmbedding keeps it sharded, and so do we (the full one is freed here)."""
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        local = g.redistribute(p.device_mesh, p.placements).to_local().clone()
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def apply_checkpointing(chunk: Decoder, layout: Layout) -> None:
    """Full recomputation: each block keeps only its input (torch's checkpoint wrapper)."""
    if layout.recompute is not Recompute.FULL:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name in list(chunk.layers.keys()):
        chunk.layers[name] = checkpoint_wrapper(chunk.layers[name], preserve_rng_state=False)


def full_init(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The unsharded value of parameter `name`: norms 1, everything else N(0, INIT_STD), drawn
    from a generator seeded by the name, so any shard of it can be made anywhere."""
    if name.endswith("norm0.weight") or name.endswith("norm1.weight") or name == "final_norm.weight":
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * INIT_STD


def init_module(module: nn.Module, prefix: str, device: torch.device, seed: int) -> None:
    """Materialise `module` on `device` and fill each parameter with its own shard of the
    unsharded value (DTensor: this rank's slice, no communication)."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = full_init(_canonical(prefix + name), p.shape, seed).to(device)
            if isinstance(p, DTensor):
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)


def materialise(chunk: Decoder, device: torch.device, seed: int, shard=None) -> None:
    """Head, tail and then block by block: at most one block's unsharded tensors exist at once
    before FSDP shards it."""
    for attr in ("embed_tokens", "final_norm", "lm_head"):
        mod = getattr(chunk, attr)
        if mod is not None:
            init_module(mod, f"{attr}.", device, seed)
    chunk.cos_sin = rope_cache(chunk.spec, device)
    for name, block in chunk.layers.items():
        init_module(block, f"layers.{name}.", device, seed)
        if shard is not None:
            shard(block)
    if shard is not None:
        shard(chunk)


def fsdp_sharder(mesh: DeviceMesh, layout: Layout, gpus_per_node: int):
    """fully_shard over the data-parallel mesh (HSDP when it replicates too), resharding
    parameters after forward only for ZeRO-3; None when nothing is sharded. Offloaded states
    (ZeRO-3 with parameters and optimizer on the CPU, as DeepSpeed's offload_param and
    offload_optimizer) use FSDP2's CPUOffloadPolicy: sharded parameters, gradients and
    optimizer states live in host memory, each unit is copied to the device and gathered for
    its forward and backward, even over one data-parallel rank (ZeRO-Infinity on one GPU)."""
    rep, shard = dp_split(layout, gpus_per_node, True)
    offload = layout.offload_params is not Offload.NONE
    if layout.zero_stage == 0 or (shard * layout.cp == 1 and not offload):
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # pin_memory=False: pinning needs a GPU (VERIFY-NOTES); on GPUs pinned buffers copy faster.
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()

    shard_dim = "dp_shard"
    if layout.cp > 1:  # torchtitan's dp_shard_cp: the context ranks hold the same replica, so shard over them too
        shard_dim = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard_dim)
    dp_mesh = mesh["dp_replicate", shard_dim] if rep > 1 else mesh[shard_dim]
    reshard = layout.zero_stage >= 3

    def apply(module: nn.Module) -> None:
        fsdp = fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, offload_policy=policy)
        # gloo has no PREMUL_SUM; divide before a plain SUM instead (the same average).
        fsdp.set_force_sum_reduction_for_comms(True)

    return apply


def fsdp_offloads(modules: list[nn.Module]) -> bool:
    """Whether FSDP2 keeps these modules' states in host memory: a CPUOffloadPolicy is in
    force on one of their parameter groups (asked of FSDP itself, not of the plan)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for sub in (s for m in modules for s in m.modules()):
        if isinstance(sub, FSDPModule):
            group = sub._get_fsdp_state()._fsdp_param_group
            if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
                return True
    return False


def all_reduce_grads(modules: list[nn.Module], group: dist.ProcessGroup) -> None:
    """ZeRO-0 data parallelism: average every gradient over the data-parallel ranks (what DDP's
    buckets do, without the buckets)."""
    world = dist.get_world_size(group)
    for m in modules:
        for p in m.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
            g.div_(world)
