"""Kubernetes object builders shared by the `kubernetes` target and the engines' own exports
(vLLM writes a LeaderWorkerSet for a replica that spans nodes). A leaf: it imports no engine
module; an engine hands in its image and pod commands as a `ServingEngine`.

Pods request the replica's or node's GPUs (`nvidia.com/gpu`, `amd.com/gpu` on AMD) and mount a
memory-backed /dev/shm: the container default (64 MiB) is too small for NCCL's shared-memory
transport and the engines' inter-process queues between tensor-parallel ranks (NCCL's
troubleshooting guide asks for at least 1 GiB; vLLM production-stack #899/#994 added a shm
size knob for TP). We size it 1 GiB plus 1 GiB per GPU in the pod; it counts against the pod's
memory.

What a platform team asks of a serving pod:
- probes on the engine's health endpoint (GET /health in vLLM, SGLang, TGI and trtllm-serve; the
  engine passes its path in) on every container that serves the API (LWS worker pods serve none):
  readiness gates traffic, liveness restarts a wedged engine, and a startup probe holds both off
  while weights download and load and CUDA graphs are captured: 10 s x 360 = 1 hour, because an
  800 GB checkpoint (405B in bf16) takes 13+ minutes to read at 1 GB/s before any compilation,
  and a liveness probe that fires during loading would restart the pod forever;
- a model cache mounted at HF_CACHE_PATH with HF_HOME pointing there (the engines and
  huggingface_hub read it; TGI's image otherwise sets HF_HOME=/data): an existing
  PersistentVolumeClaim with --cache-pvc NAME (ReadWriteMany, or ReadOnlyMany pre-filled, when
  several pods share it), else an emptyDir: it passes the restricted Pod Security Standard that
  forbids hostPath, at the price of a download per pod start;
- HF_TOKEN for gated weights from a Secret (default `hf-token`, key `token`, --hf-token-secret
  NAME), optional so that open models start without it;
- GPUs as the vendor's extended resource (nvidia.com/gpu, amd.com/gpu), requests = limits;
- one port per pod: each pod has its own network namespace, so replicas never share a port
  (the engines serve Prometheus metrics on it at /metrics).
The YAML has no anchors or aliases (`&id001`/`*id001`, which PyYAML writes for a dict used twice,
such as the labels of a selector and its template): the dumper ignores aliases.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import yaml

from shardplan.errors import ShardplanError
from shardplan.exporters.base import (
    ExportContext,
    comment,
    engine_gpus,
    gpus_per_node_used,
    nodes_per_replica,
    num_engines,
)
from shardplan.exporters.serving import DEFAULT_PORT

K8S_API_VERSION = "1.34"
LWS_API = "leaderworkerset.x-k8s.io/v1"  # kubernetes-sigs/lws, api/leaderworkerset/v1
HF_CACHE_PATH = "/root/.cache/huggingface"  # HF_HOME's default for root in the vLLM and SGLang images
HF_TOKEN_KEY = "token"  # the key inside the Secret: kubectl create secret generic hf-token --from-literal=token=...
PROBE_PERIOD_SECONDS = 10
STARTUP_FAILURES = 360  # x 10 s = 1 hour for download, load and graph capture


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


# A DNS-1123 subdomain (object names of PVCs and Secrets): lower-case alphanumerics, '-' and '.'.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def object_name(value: str, field: str) -> str:
    if len(value) > 253 or not _OBJECT_NAME.fullmatch(value):
        raise ShardplanError(f"{value!r} is not a Kubernetes object name", field=field,
                             hint="give a DNS-1123 name: lower-case letters, digits, '-' and '.', e.g. llama-cache")
    return value


def probes(port: int, path: str) -> dict[str, Any]:
    """Readiness, liveness and startup probes on the engine's health endpoint."""
    get = {"path": path, "port": port}
    return {
        "startupProbe": {"httpGet": dict(get), "periodSeconds": PROBE_PERIOD_SECONDS,
                         "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": {"httpGet": dict(get), "periodSeconds": PROBE_PERIOD_SECONDS, "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": dict(get), "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 5},
    }


def cache_volume(ctx: ExportContext) -> dict[str, Any]:
    pvc = ctx.options.cache_pvc
    if pvc is None:
        return {"name": "model-cache", "emptyDir": {}}
    return {"name": "model-cache", "persistentVolumeClaim": {"claimName": object_name(pvc, "--cache-pvc")}}


def pod_spec(ctx: ExportContext, *, image: str, shell: str, gpus: int, port: int | None,
             labels: dict[str, str], health_path: str | None = None) -> dict[str, Any]:
    """A pod template; `port` given: the container serves the API there, probed at health_path."""
    res = _gpu_resource(ctx)
    secret = object_name(ctx.options.hf_token_secret, "--hf-token-secret")
    container: dict[str, Any] = {
        "name": "main",
        "image": image_for(ctx, image),
        "command": ["/bin/bash", "-c"],
        "args": [shell],
        "env": [{"name": "HF_HOME", "value": HF_CACHE_PATH},
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": HF_TOKEN_KEY,
                                                                   "optional": True}}}],
        "resources": {"limits": {res: gpus}, "requests": {res: gpus}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "model-cache", "mountPath": HF_CACHE_PATH}],
    }
    if port is not None:
        container["ports"] = [{"containerPort": port, "name": "http"}]
        if health_path is not None:
            container |= probes(port, health_path)
    return {
        "metadata": {"labels": dict(labels)},
        "spec": {
            "containers": [container],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib(gpus)}Gi"}},
                        cache_volume(ctx)],
        },
    }


def service(name: str, selector: dict[str, str], port: int, *, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": selector, "ports": [{"name": "http" if not headless else "rdzv",
                                                            "port": port, "targetPort": port}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def leader_worker_set(ctx: ExportContext, *, image: str, pod_commands: PodCommands,
                      health_path: str) -> list[dict[str, Any]]:
    """One group of pods per engine (a replica, or a dp x ep group) over nodes_per_replica nodes:
    the leader starts the engine and serves the API, workers join it."""
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
            "replicas": num_engines(m, "kubernetes"),
            "leaderWorkerTemplate": {
                "size": nodes_per_replica(m, "kubernetes"),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_spec(ctx, image=image, shell=leader_cmd, gpus=gpus, port=port,
                                           labels={**labels, "role": "leader"}, health_path=health_path),
                "workerTemplate": pod_spec(ctx, image=image, shell=worker_cmd, gpus=gpus, port=None,
                                            labels={**labels, "role": "worker"}),
            },
        },
    }
    return [lws, service(name, {**labels, "role": "leader"}, port)]


def deployment(ctx: ExportContext, *, image: str, pod_commands: PodCommands,
               health_path: str) -> list[dict[str, Any]]:
    """One pod per engine (a replica, or a dp x ep group on one node), all its GPUs in it."""
    m = ctx.manifest
    name, port = name_for(ctx), ctx.options.port or DEFAULT_PORT
    shell, _ = pod_commands(ctx, port=port, multi_node=False)
    labels = {"app": name}
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": num_engines(m, "kubernetes"),
            "selector": {"matchLabels": labels},
            "template": pod_spec(ctx, image=image, shell=shell, gpus=engine_gpus(m, "kubernetes"), port=port,
                                 labels=labels, health_path=health_path),
        },
    }
    return [dep, service(name, labels, port)]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (shell commands, the embedded plan) as literal blocks, as people write them;
    an object used twice written out twice, never as an anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: list[dict[str, Any]], header: list[str] | None = None) -> str:
    head = "".join(f"# {comment(h)}\n" for h in header or [])
    return head + yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=1 << 30)


