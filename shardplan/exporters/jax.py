"""JAX/XLA: the device mesh (axis names and sizes) and the PartitionSpec of each weight kind.

Axes, outer to inner, as shardplan ranks them: ("data", "context", "tensor"). Specs are for the
weights as the Hugging Face checkpoint stores them: linear weights [out_features, in_features],
embeddings and lm_head [vocab, hidden], routed experts stacked [num_experts, out, in]. Tensor
parallelism splits column weights on `out`, row weights on `in`, vocab weights on `vocab`
(Megatron-LM's split, Shoeybi et al. 2019). ZeRO-3 (FSDP) also shards every weight over
"data" on its other dimension; ZeRO 1-2 shard the optimizer state that way and keep the weights.
Expert parallelism puts the expert dimension on the innermost axes whose sizes multiply to ep.
JAX meshes have no pipeline axis: a plan with pp > 1 is refused.
"""

from __future__ import annotations

from typing import Any

from shardplan.exporters.base import ExportContext, ExportFile, plan_header
from shardplan.exporters.targets import check

TARGET = "jax"
AXES = (("data", "dp"), ("context", "cp"), ("tensor", "tp"))  # mesh axis name, layout field


def _expert_axes(ctx: ExportContext) -> tuple[str, ...]:
    """The innermost mesh axes whose sizes multiply to ep (whole experts: knowledge/targets.yaml
    refuses etp > 1 and an ep that is no such product)."""
    L = ctx.manifest.layout
    if L.ep == 1:
        return ()
    prod, axes = 1, []
    for name, field in reversed(AXES):
        if prod == L.ep:
            break
        prod *= getattr(L, field)
        axes.insert(0, name)
    return tuple(axes)


def partition_specs(ctx: ExportContext) -> dict[str, list[Any]]:
    """Weight name (per layer where it repeats) -> PartitionSpec entries, one per dimension."""
    m = ctx.manifest
    L = m.layout
    check(ctx, TARGET)  # pipeline stages, experts split both ways or off the inner axes, offload
    fsdp = "data" if L.zero_stage == 3 and L.dp > 1 else None
    tensor = "tensor" if L.tp > 1 else None
    experts = _expert_axes(ctx)
    expert_dim: Any = (experts[0] if len(experts) == 1 else list(experts)) if experts else None
    out: dict[str, list[Any]] = {}
    for name, split in m.placement.tp_splits.items():
        if name.endswith(".bias") or "norm" in name.rsplit(".", 2)[-2]:  # one dimension
            spec: list[Any] = [tensor if split in ("column", "kv_column", "vocab") else None]
        elif split in ("column", "vocab"):
            spec = [tensor, fsdp]
        elif split == "kv_column":  # tp beyond the KV heads replicates them: no even split of the stored tensor
            spec = [tensor if L.tp <= m.model.num_kv_heads else None, fsdp]
        elif split == "row":
            spec = [fsdp, tensor]
        else:
            spec = [None, fsdp]
        if ".experts." in name:
            inner = [None if a == "tensor" and L.etp == 1 and L.ep > 1 else a for a in spec]
            spec = [expert_dim, *inner]
        out[name] = spec
    return out


def export_jax(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    L = m.layout
    specs = partition_specs(ctx)
    shape = [getattr(L, f) for _, f in AXES]
    names = [n for n, _ in AXES]
    opt_axis = "data" if L.zero_stage in (1, 2) and L.dp > 1 else None
    lines = [*(f"# {h}" for h in plan_header(m, TARGET)),
             "# Mesh and PartitionSpecs for the weights as the Hugging Face checkpoint stores them",
             "# (linear [out, in], embeddings/lm_head [vocab, hidden], routed experts [experts, out, in]).",
             "from jax.sharding import PartitionSpec as P", "",
             f"MESH_AXES = {tuple(names)!r}", f"MESH_SHAPE = {tuple(shape)!r}", "",
             "PARTITION_SPECS = {"]
    for name, spec in specs.items():
        lines.append(f"    {name!r}: P({', '.join(_py(a) for a in spec)}),")
    lines += ["}", "",
              f"# ZeRO-{L.zero_stage}: optimizer states are sharded over {opt_axis!r} on the dimension the weight leaves unsharded"
              if opt_axis else f"# ZeRO-{L.zero_stage}: optimizer states follow the weights' specs",
              f"OPTIMIZER_STATE_EXTRA_AXIS = {opt_axis!r}", "", "",
              "def make_mesh():", '    """The mesh over all devices (jax.make_mesh orders them for the interconnect)."""',
              "    import jax", "", "    return jax.make_mesh(MESH_SHAPE, MESH_AXES)", ""]
    return [ExportFile("jax_mesh.py", "\n".join(lines))]


def _py(a: Any) -> str:
    return repr(tuple(a)) if isinstance(a, list) else repr(a)
