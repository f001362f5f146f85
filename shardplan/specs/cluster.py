"""A hardware profile sized to a cluster: --gpus/--nodes/--gpus-per-node applied to a
profile, with the bounds that keep every count finite."""

from __future__ import annotations

import math

from shardplan.errors import ShardplanError
from shardplan.specs.hardware import HardwareProfile

# Command-line counts past these are typos or attacks (the largest clusters hold ~10^5 GPUs); they
# keep every figure finite and every search bounded.
MAX_GPUS = 2**24


def at_most(value: int | None, limit: int, option: str) -> None:
    """Refuse a command-line count above `limit`, naming the option."""
    if value is not None and value > limit:
        raise ShardplanError(f"{value} is more than the {limit} shardplan plans for", field=option,
                             hint=f"give at most {limit}")


def cluster(hw: HardwareProfile, *, gpus: int | None, nodes: int | None, gpus_per_node: int | None) -> HardwareProfile:
    """Apply --gpus/--nodes/--gpus-per-node to a profile. --gpus below one node's size uses
    part of one node; above it, whole nodes."""
    at_most(gpus, MAX_GPUS, "--gpus")
    at_most(nodes, MAX_GPUS, "--nodes")
    at_most(gpus_per_node, MAX_GPUS, "--gpus-per-node")
    gpn = gpus_per_node or hw.gpus_per_node
    if gpn * (nodes or 1) > MAX_GPUS:
        raise ShardplanError(f"{nodes or 1} node(s) of {gpn} GPUs is {gpn * (nodes or 1)} GPUs, more than the {MAX_GPUS} "
                             "shardplan plans for", field="--nodes", hint=f"give at most {MAX_GPUS // gpn} nodes of {gpn}")
    if gpus is None:
        return hw.with_topology(gpus_per_node=gpn, num_nodes=nodes or 1)
    if gpus <= gpn and not nodes:
        return hw.with_topology(gpus_per_node=gpus, num_nodes=1)
    num_nodes = nodes or math.ceil(gpus / gpn)
    if gpus != gpn * num_nodes:
        raise ShardplanError(
            f"{gpus} GPUs is not {num_nodes} whole node(s) of {gpn}",
            field="--gpus",
            hint=f"use a multiple of {gpn}, or set --gpus-per-node",
        )
    return hw.with_topology(gpus_per_node=gpn, num_nodes=num_nodes)
