"""What the serving engines share: the engine process groups one node hosts, and a launch
script that starts them as independent servers (each its own GPUs and port). An engine group
is one replica, or the replicas a dp x ep plan's expert group spans (`base.engine_replicas`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardplan.exporters.base import ExportContext, cannot, engine_gpus, gpus_per_node_used, num_engines

DEFAULT_PORT = 8000


def shipped_as_planned(ctx: ExportContext) -> bool:
    """The checkpoint ships the plan's weight format (ModelSpec.shipped_format: block FP8, gpt-oss's
    MXFP4 experts, 4-bit AWQ/GPTQ), so the engine reads it from its quantization_config and needs no
    --quantization."""
    spec = ctx.spec
    return spec is not None and spec.ships(ctx.manifest.layout.weight_quantization)


def shipped_notes(ctx: ExportContext, engine: str) -> list[str]:
    """A plan of a checkpoint that ships a quantized format, in another one the engine will not load
    from it: the engine loads the shipped format whatever the flags say, so the plan needs another
    checkpoint (a 16-bit copy of a block-FP8 release, DeepSeek-V3's inference/fp8_cast_bf16.py)."""
    spec = ctx.spec
    planned = ctx.manifest.layout.weight_quantization
    if spec is None or spec.shipped_format is None or spec.ships(planned) or planned == "mxfp4_marlin":
        return []
    shown = "16-bit" if planned == "none" else planned
    return [f"the checkpoint ships {spec.shipped_format} weights (its quantization_config), which {engine} loads as "
            f"they are; this plan's {shown} weights need a checkpoint in that format: point the model at one"]


@dataclass(frozen=True)
class Replica:
    slot: int  # index on its node
    gpus: tuple[int, ...]  # local GPU indices
    port: int


def node_replicas(ctx: ExportContext, target: str = "export") -> list[Replica]:
    """The engine groups (replicas, unless expert parallelism spans several) one node hosts
    (every node hosts the same set when a group fits in a node: the GPUs per node are a
    multiple of a group's, so nodes are filled alike)."""
    m = ctx.manifest
    g = engine_gpus(m, target)
    n = num_engines(m, target) if m.hardware.num_nodes == 1 else gpus_per_node_used(m) // g
    base = ctx.options.port or DEFAULT_PORT
    return [Replica(s, tuple(range(s * g, (s + 1) * g)), base + s) for s in range(n)]


def replicas_script(ctx: ExportContext, one: Callable[[Replica], str]) -> list[str]:
    """Lines that start each replica of the node in the background, then wait."""
    lines = []
    for r in node_replicas(ctx):
        devices = ",".join(map(str, r.gpus))
        lines += [f"# replica {r.slot}: GPUs {devices}, port {r.port}", f"CUDA_VISIBLE_DEVICES={devices} {one(r)} &"]
    return [*lines, "wait"]


def each_node_note(ctx: ExportContext, script_name: str = "serve.sh") -> list[str]:
    n = ctx.manifest.hardware.num_nodes
    return [f"run the same script on each of the {n} nodes (each hosts {len(node_replicas(ctx))} replica(s)); "
            f"put a load balancer in front: bash {script_name}"] if n > 1 else []


# Disaggregated plans (the manifest's `disaggregation`): what every engine's export shares.
DECODE_PORT_OFFSET = 100  # decode servers listen from --port + 100, prefill servers from --port


@dataclass(frozen=True)
class PoolServer:
    role: str  # "prefill" or "decode"
    index: int  # within its pool
    gpus: str  # local GPU indices, comma-separated (CUDA_VISIBLE_DEVICES)
    port: int


def plan_split(ctx: ExportContext, target: str):
    """The manifest's prefill/decode split, or the one-line refusal when it has none."""
    d = ctx.manifest.disaggregation
    if d is None:
        raise cannot(target, "disaggregation", "the plan has no prefill/decode split",
                     "write one with `shardplan recommend ... --gpus N --disaggregated -o plan.yaml`")
    return d


def pool_context(ctx: ExportContext, role: str) -> ExportContext:
    """The plan as one server of a pool sees it: the pool's tp, one stage, one replica."""
    d = plan_split(ctx, "export")
    pool = d.prefill if role == "prefill" else d.decode
    layout = ctx.manifest.layout.model_copy(update={"tp": pool.tp, "pp": 1, "dp": 1, "ep": 1})
    return ExportContext(ctx.manifest.model_copy(update={"layout": layout}), ctx.spec, ctx.options)


def pool_servers(ctx: ExportContext, target: str, port: int) -> list[PoolServer]:
    """Every server of both pools on one node: GPUs in order (prefill first), ports by pool."""
    d = plan_split(ctx, target)
    gpn = ctx.manifest.hardware.gpus_per_node
    gpus = d.prefill.tp * d.prefill.replicas + d.decode.tp * d.decode.replicas
    if gpus > gpn:
        raise cannot(target, "disaggregation", f"the pools take {gpus} GPUs, more than one node's {gpn}",
                     "split within one node, or launch each pool's nodes by hand")
    out, first = [], 0
    for role, pool, base in (("prefill", d.prefill, port), ("decode", d.decode, port + DECODE_PORT_OFFSET)):
        for i in range(pool.replicas):
            out.append(PoolServer(role, i, ",".join(str(g) for g in range(first, first + pool.tp)), base + i))
            first += pool.tp
    return out


def split_summary(d) -> str:
    """The header line every export of a split carries: the pools, the KV transfer, the prediction."""
    return (f"disaggregated: {d.prefill.replicas} prefill server(s) of tp={d.prefill.tp}, {d.decode.replicas} decode "
            f"server(s) of tp={d.decode.tp}; each prompt's KV ({d.kv_transfer_bytes_per_request / 2**20:,.0f} MiB) "
            f"crosses {d.link} (~{d.kv_transfer_seconds * 1e3:,.1f} ms); shardplan predicted "
            f"{d.output_tokens_per_second_per_gpu:,.0f} output tokens/s per GPU against "
            f"{d.aggregated_output_tokens_per_second_per_gpu:,.0f} aggregated ({d.winner} wins)")
