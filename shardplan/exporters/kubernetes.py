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
from shardplan.exporters.base import ExportContext, ExportFile, cannot, gpus_per_node_used, nodes_per_replica, plan_header, training
from shardplan.exporters.k8s_objects import pod_spec, service, deployment, dump, leader_worker_set, name_for
from shardplan.exporters.serving import plan_split
from shardplan.exporters.torchrun import RDZV_PORT, fault_lines, max_restarts, nnodes_range, rdzv_id, torchrun_command
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
    """An Indexed Job, one pod per node; pod i is `<name>-i.<name>` through the headless Service.
    Faults: torchrun restarts the ranks up to --max-restarts times; when it gives up, its container
    fails and restarts in place (restartPolicy OnFailure), and the Job fails after as many
    container restarts as torchrun's (backoffLimit = --max-restarts)."""
    m = ctx.manifest
    name = name_for(ctx)
    n = m.hardware.num_nodes
    port = ctx.options.port or RDZV_PORT
    verify = ctx.options.script is None  # ranks run `shardplan verify` on the plan, mounted from a ConfigMap
    run = replace(ctx, options=replace(ctx.options, plan_file=f"{PLAN_MOUNT}/plan.yaml")) if verify else ctx
    low, high = nnodes_range(ctx)
    shell = torchrun_command(run, nnodes=f"{low}:{high}", rdzv_id=rdzv_id(m), head=f"{name}-0.{name}")
    labels = {"app": name}
    tmpl = pod_spec(ctx, image=TRAINING_IMAGE, shell=shell, gpus=gpus_per_node_used(m), port=None, labels=labels)
    # A failed container restarts in its pod, which keeps its name <name>-i and so its DNS name:
    # node 0 stays the rendezvous host, and the restarted torchrun rejoins the others' rendezvous.
    tmpl["spec"] |= {"subdomain": name, "restartPolicy": "OnFailure"}
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
        "spec": {"completionMode": "Indexed", "completions": n, "parallelism": n, "backoffLimit": max_restarts(ctx),
                 "template": tmpl},
    }
    return [*objs, job, service(name, labels, port, headless=True)]


def export_kubernetes(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    header = plan_header(m, TARGET)
    if m.workload.kind == "training":
        training(ctx, TARGET)
        objs = training_job(ctx)
        header += [*fault_lines(ctx), f"a pod whose torchrun gave up restarts in place (restartPolicy OnFailure); "
                   f"the Job fails after {max_restarts(ctx)} such restarts (backoffLimit)"]
        if ctx.options.image is None:
            header.append(f"replace {TRAINING_IMAGE} with an image holding torch and "
                          f"{'shardplan' if ctx.options.script is None else 'the script'} (or pass --image)")
        return [ExportFile("job.yaml", dump(objs, header))]
    eng = _engine(ctx.options.engine)
    if ctx.options.disaggregated:
        return [ExportFile("deployment.yaml", dump(_disaggregated(ctx, eng), [*header, *_pool_notes(ctx, eng)]))]
    kw = {"image": eng.image(ctx), "pod_commands": eng.pod_commands, "health_path": eng.HEALTH_PATH}
    if nodes_per_replica(m, eng.TARGET) > 1:
        header.append("needs the LeaderWorkerSet controller: https://github.com/kubernetes-sigs/lws")
        return [ExportFile("lws.yaml", dump(leader_worker_set(ctx, **kw), header))]
    return [ExportFile("deployment.yaml", dump(deployment(ctx, **kw), header))]


def _disaggregated(ctx: ExportContext, eng: ModuleType) -> list[dict[str, Any]]:
    """The manifest's prefill and decode pools as two Deployments (one pod per server, the pool's tp
    GPUs each) with a Service each; the engine's role commands (vllm, sglang)."""
    d = plan_split(ctx, TARGET)
    if not hasattr(eng, "role_command"):
        raise cannot(TARGET, "disaggregation", f"shardplan exports prefill/decode roles for vllm and sglang, "
                     f"not {ctx.options.engine}", "pass --engine vllm or --engine sglang")
    port = ctx.options.port or eng.DEFAULT_PORT
    objs: list[dict[str, Any]] = []
    for role, pool in (("prefill", d.prefill), ("decode", d.decode)):
        name = f"{name_for(ctx)}-{role}"
        labels = {"app": name, "role": role}
        tmpl = pod_spec(ctx, image=eng.image(ctx), shell=eng.role_command(ctx, role, port=port), gpus=pool.tp, port=port,
                        labels=labels, health_path=eng.HEALTH_PATH)
        objs += [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
                  "spec": {"replicas": pool.replicas, "selector": {"matchLabels": labels}, "template": tmpl}},
                 service(name, labels, port)]
    return objs


def _pool_notes(ctx: ExportContext, eng: ModuleType) -> list[str]:
    d = ctx.manifest.disaggregation
    if d is None:
        return []
    return [f"disaggregated: {d.prefill.replicas} prefill pod(s) of tp={d.prefill.tp}, {d.decode.replicas} decode "
            f"pod(s) of tp={d.decode.tp} ({d.winner} wins by shardplan's prediction); route through a prefill/decode "
            f"proxy ({'sglang_router --pd-disaggregation' if ctx.options.engine == 'sglang' else 'vLLM disaggregated_serving'})"
            " pointed at the two Services"]
