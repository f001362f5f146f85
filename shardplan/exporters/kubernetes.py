"""Kubernetes objects for a plan: serving replicas as a Deployment (one pod per replica) or,
when a replica spans nodes, a LeaderWorkerSet (one group of pods per replica); training as an
Indexed Job (one pod per node, torchrun with c10d rendezvous through a headless Service).

Pods request the replica's or node's GPUs (`nvidia.com/gpu`, `amd.com/gpu` on AMD) and mount a
memory-backed /dev/shm: the container default (64 MiB) is too small for NCCL's shared-memory
transport and the engines' inter-process queues between tensor-parallel ranks (NCCL's
troubleshooting guide asks for at least 1 GiB; vLLM production-stack #899/#994 added a shm
size knob for TP). We size it 1 GiB plus 1 GiB per GPU in the pod; it counts against the pod's
memory. Core objects are checked in the tests with kubernetes-validate for API 1.34.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import replace
from typing import Any

import yaml

from shardplan.errors import ShardplanError
from shardplan.exporters.base import (
    ExportContext,
    ExportFile,
    comment,
    gpus_per_node_used,
    nodes_per_replica,
    plan_header,
    replica_gpus,
    training,
)
from shardplan.exporters.serving import DEFAULT_PORT
from shardplan.exporters.torchrun import RDZV_PORT, torchrun_command
from shardplan.manifest import dump_manifest

TARGET = "kubernetes"
K8S_API_VERSION = "1.34"
LWS_API = "leaderworkerset.x-k8s.io/v1"  # kubernetes-sigs/lws, api/leaderworkerset/v1
SERVING_ENGINES = ("vllm", "sglang", "tgi", "trtllm")
PLAN_MOUNT = "/etc/shardplan"
TRAINING_IMAGE = "REPLACE-WITH-YOUR-TRAINING-IMAGE"  # an image with torch and your script (or shardplan)


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


def _pod_spec(ctx: ExportContext, *, image: str, shell: str, gpus: int, port: int | None,
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


def _engine(engine: str) -> Any:
    if engine not in SERVING_ENGINES:
        raise ShardplanError(f"unknown serving engine '{engine}'", field="--engine",
                             hint=f"use one of {', '.join(SERVING_ENGINES)}")
    return importlib.import_module(f"shardplan.exporters.{engine}")


def _service(name: str, selector: dict[str, str], port: int, *, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": selector, "ports": [{"name": "http" if not headless else "rdzv",
                                                            "port": port, "targetPort": port}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def leader_worker_set(ctx: ExportContext, *, engine: str) -> list[dict[str, Any]]:
    """One group of nodes_per_replica pods per replica: the leader starts the engine, workers join it."""
    m = ctx.manifest
    mod = _engine(engine)
    name, port = name_for(ctx), ctx.options.port or DEFAULT_PORT
    gpus = gpus_per_node_used(m)
    leader_cmd, worker_cmd = mod.pod_commands(ctx, port=port, multi_node=True)
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
                "leaderTemplate": _pod_spec(ctx, image=mod.IMAGE, shell=leader_cmd, gpus=gpus, port=port,
                                            labels={**labels, "role": "leader"}),
                "workerTemplate": _pod_spec(ctx, image=mod.IMAGE, shell=worker_cmd, gpus=gpus, port=None,
                                            labels={**labels, "role": "worker"}),
            },
        },
    }
    return [lws, _service(name, {**labels, "role": "leader"}, port)]


def deployment(ctx: ExportContext, *, engine: str) -> list[dict[str, Any]]:
    m = ctx.manifest
    mod = _engine(engine)
    name, port = name_for(ctx), ctx.options.port or DEFAULT_PORT
    shell, _ = mod.pod_commands(ctx, port=port, multi_node=False)
    labels = {"app": name}
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": m.layout.dp,
            "selector": {"matchLabels": labels},
            "template": _pod_spec(ctx, image=mod.IMAGE, shell=shell, gpus=replica_gpus(m), port=port, labels=labels),
        },
    }
    return [dep, _service(name, labels, port)]


def training_job(ctx: ExportContext) -> list[dict[str, Any]]:
    """An Indexed Job, one pod per node; pod i is `<name>-i.<name>` through the headless Service."""
    m = ctx.manifest
    name = name_for(ctx)
    n = m.hardware.num_nodes
    port = ctx.options.port or RDZV_PORT
    verify = ctx.options.script is None  # ranks run `shardplan verify` on the plan, mounted from a ConfigMap
    run = replace(ctx, options=replace(ctx.options, plan_file=f"{PLAN_MOUNT}/plan.yaml")) if verify else ctx
    shell = torchrun_command(run, nnodes=n, rdzv_id=name, head=f"{name}-0.{name}")
    labels = {"app": name}
    tmpl = _pod_spec(ctx, image=TRAINING_IMAGE, shell=shell, gpus=gpus_per_node_used(m), port=None, labels=labels)
    tmpl["spec"] |= {"subdomain": name, "restartPolicy": "Never"}
    objs: list[dict[str, Any]] = []
    if verify:
        plan = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-plan"},
                "data": {"plan.yaml": dump_manifest(m)}}
        tmpl["spec"]["volumes"].append({"name": "plan", "configMap": {"name": f"{name}-plan"}})
        tmpl["spec"]["containers"][0]["volumeMounts"].append({"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True})
        objs.append(plan)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"completionMode": "Indexed", "completions": n, "parallelism": n, "backoffLimit": 0,
                 "template": tmpl},
    }
    return [*objs, job, _service(name, labels, port, headless=True)]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (shell commands, the embedded plan) as literal blocks, as people write them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: list[dict[str, Any]], header: list[str] | None = None) -> str:
    head = "".join(f"# {comment(h)}\n" for h in header or [])
    return head + yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=1 << 30)


def export_kubernetes(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    header = plan_header(m, TARGET)
    if m.workload.kind == "training":
        training(ctx, TARGET)
        objs = training_job(ctx)
        if ctx.options.image is None:
            header.append(f"replace {TRAINING_IMAGE} with an image holding torch and "
                          f"{'shardplan' if ctx.options.script is None else 'the script'} (or pass --image)")
        return [ExportFile("job.yaml", dump(objs, header))]
    engine = ctx.options.engine
    if nodes_per_replica(m) > 1:
        header.append("needs the LeaderWorkerSet controller: https://github.com/kubernetes-sigs/lws")
        return [ExportFile("lws.yaml", dump(leader_worker_set(ctx, engine=engine), header))]
    return [ExportFile("deployment.yaml", dump(deployment(ctx, engine=engine), header))]
