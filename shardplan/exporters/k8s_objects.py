"""Kubernetes object builders shared by the `kubernetes` target and the engines' own exports
(vLLM writes a LeaderWorkerSet for a replica that spans nodes). A leaf: it imports no engine
module; an engine hands in its image and pod commands as a `ServingEngine`.

Pods request the replica's or node's GPUs (`nvidia.com/gpu`, `amd.com/gpu` on AMD) and mount a
memory-backed /dev/shm: the container default (64 MiB) is too small for NCCL's shared-memory
transport and the engines' inter-process queues between tensor-parallel ranks (NCCL's
troubleshooting guide asks for at least 1 GiB; vLLM production-stack #899/#994 added a shm
size knob for TP). We size it 1 GiB plus 1 GiB per GPU in the pod; it counts against the pod's
memory.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import yaml

from shardplan.errors import ShardplanError
from shardplan.exporters.base import ExportContext, comment, gpus_per_node_used, nodes_per_replica, replica_gpus
from shardplan.exporters.serving import DEFAULT_PORT

K8S_API_VERSION = "1.34"
LWS_API = "leaderworkerset.x-k8s.io/v1"  # kubernetes-sigs/lws, api/leaderworkerset/v1


# An engine's pod commands: (leader or only pod, worker) shell lines for a port.
PodCommands = Callable[..., tuple[str, str]]


def name_for(ctx: ExportContext) -> str:
    """A DNS-1123 label from the model name (leaves room for pod-name suffixes)."""
    base = re.sub(r"[^a-z0-9-]+", "-", ctx.manifest.model.name.lower()).strip("-")[:40].strip("-")
    return f"{base or 'model'}-{ctx.manifest.workload.kind[:5]}"


def shm_gib(gpus: int) -> int:
    return 1 + gpus


def _gpu_resource(ctx: ExportContext) -> str:
    gpu = ctx.manifest.hardware.gpu_model.lower()
    return "amd.com/gpu" if gpu.startswith(("mi", "amd")) or "instinct" in gpu else "nvidia.com/gpu"


# An image reference: [registry[:port]/]path[:tag][@digest] (distribution/reference grammar, loosened
# to one character class); no spaces, quotes or line breaks, and never a leading '-'.
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}")


def image_for(ctx: ExportContext, default: str) -> str:
    image = ctx.options.image
    if image is None:
        return default
    if not _IMAGE.fullmatch(image):
        raise ShardplanError(f"{image!r} is not a container image reference", field="--image",
                             hint="give e.g. registry.example.com/team/trainer:1.2 (letters, digits, . _ / : @ -)")
    return image


def pod_spec(ctx: ExportContext, *, image: str, shell: str, gpus: int, port: int | None,
              labels: dict[str, str]) -> dict[str, Any]:
    res = _gpu_resource(ctx)
    container: dict[str, Any] = {
        "name": "main",
        "image": image_for(ctx, image),
        "command": ["/bin/bash", "-c"],
        "args": [shell],
        "resources": {"limits": {res: gpus}, "requests": {res: gpus}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if port is not None:
        container["ports"] = [{"containerPort": port, "name": "http"}]
    return {
        "metadata": {"labels": labels},
        "spec": {
            "containers": [container],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib(gpus)}Gi"}}],
        },
    }


def service(name: str, selector: dict[str, str], port: int, *, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": selector, "ports": [{"name": "http" if not headless else "rdzv",
                                                            "port": port, "targetPort": port}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def leader_worker_set(ctx: ExportContext, *, image: str, pod_commands: PodCommands) -> list[dict[str, Any]]:
    """One group of nodes_per_replica pods per replica: the leader starts the engine, workers join it."""
    m = ctx.manifest
    name, port = name_for(ctx), ctx.options.port or DEFAULT_PORT
    gpus = gpus_per_node_used(m)
    leader_cmd, worker_cmd = pod_commands(ctx, port=port, multi_node=True)
    labels = {"app": name}
    lws = {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": m.layout.dp,
            "leaderWorkerTemplate": {
                "size": nodes_per_replica(m),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_spec(ctx, image=image, shell=leader_cmd, gpus=gpus, port=port,
                                            labels={**labels, "role": "leader"}),
                "workerTemplate": pod_spec(ctx, image=image, shell=worker_cmd, gpus=gpus, port=None,
                                            labels={**labels, "role": "worker"}),
            },
        },
    }
    return [lws, service(name, {**labels, "role": "leader"}, port)]


def deployment(ctx: ExportContext, *, image: str, pod_commands: PodCommands) -> list[dict[str, Any]]:
    """One pod per replica, all the replica's GPUs in it."""
    m = ctx.manifest
    name, port = name_for(ctx), ctx.options.port or DEFAULT_PORT
    shell, _ = pod_commands(ctx, port=port, multi_node=False)
    labels = {"app": name}
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": m.layout.dp,
            "selector": {"matchLabels": labels},
            "template": pod_spec(ctx, image=image, shell=shell, gpus=replica_gpus(m), port=port, labels=labels),
        },
    }
    return [dep, service(name, labels, port)]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (shell commands, the embedded plan) as literal blocks, as people write them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: list[dict[str, Any]], header: list[str] | None = None) -> str:
    head = "".join(f"# {comment(h)}\n" for h in header or [])
    return head + yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=1 << 30)


