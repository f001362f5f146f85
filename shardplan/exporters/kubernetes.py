"""Kubernetes objects for a plan: serving replicas as a Deployment (one pod per replica) or,
when a replica spans nodes, a LeaderWorkerSet (one group of pods per replica); training as an
Indexed Job (one pod per node, torchrun with c10d rendezvous through a headless Service).
A dp x ep serving plan, whose expert group spans replicas, runs one pod (or LWS group) per
engine group rather than per replica. What the pods carry (probes, model cache, HF_TOKEN) is
described in `k8s_objects`.
The pod builders live in `k8s_objects` (a leaf the engines import too). Core objects are
checked in the tests with kubernetes-validate for API 1.34.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any

from shardplan.errors import ShardplanError
from shardplan.exporters import sglang, tgi, trtllm, vllm
from shardplan.exporters.base import ExportContext, ExportFile, gpus_per_node_used, nodes_per_replica, plan_header, training
from shardplan.exporters.k8s_objects import pod_spec, service, deployment, dump, leader_worker_set, name_for
from shardplan.exporters.torchrun import RDZV_PORT, torchrun_command
from shardplan.plan.manifest import dump_manifest

TARGET = "kubernetes"
PLAN_MOUNT = "/etc/shardplan"
TRAINING_IMAGE = "REPLACE-WITH-YOUR-TRAINING-IMAGE"  # an image with torch and your script (or shardplan)
SERVING_ENGINES: dict[str, ModuleType] = {"vllm": vllm, "sglang": sglang, "tgi": tgi, "trtllm": trtllm}


def _engine(name: str) -> ModuleType:
    if name not in SERVING_ENGINES:
        raise ShardplanError(f"unknown serving engine '{name}'", field="--engine",
                             hint=f"use one of {', '.join(SERVING_ENGINES)}")
    return SERVING_ENGINES[name]


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
    tmpl = pod_spec(ctx, image=TRAINING_IMAGE, shell=shell, gpus=gpus_per_node_used(m), port=None, labels=labels)
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
    return [*objs, job, service(name, labels, port, headless=True)]


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
    eng = _engine(ctx.options.engine)
    kw = {"image": eng.IMAGE, "pod_commands": eng.pod_commands, "health_path": eng.HEALTH_PATH}
    if nodes_per_replica(m, eng.TARGET) > 1:
        header.append("needs the LeaderWorkerSet controller: https://github.com/kubernetes-sigs/lws")
        return [ExportFile("lws.yaml", dump(leader_worker_set(ctx, **kw), header))]
    return [ExportFile("deployment.yaml", dump(deployment(ctx, **kw), header))]
