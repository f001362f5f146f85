"""What the serving engines share: the engine process groups one node hosts, and a launch
script that starts them as independent servers (each its own GPUs and port). An engine group
is one replica, or the replicas a dp x ep plan's expert group spans (`base.engine_replicas`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardplan.exporters.base import ExportContext, engine_gpus, gpus_per_node_used, num_engines

DEFAULT_PORT = 8000


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
