"""vLLM: the `vllm serve` command line; for plans whose replica spans nodes, the Ray head and
worker commands and a Kubernetes LeaderWorkerSet.

Every flag is checked against `flags/vllm.yaml`, the flag list of the pinned vLLM version,
taken from that version's source (the file says which). Mapping:
- tp, pp -> --tensor-parallel-size, --pipeline-parallel-size; replicas (dp) -> --data-parallel-size
  on a node. vLLM's expert parallelism spans all tp x dp ranks of one server, so a plan with ep = tp
  per replica and several replicas runs one server per replica.
- --gpu-memory-utilization: the plan's, when its predicted KV cache holds one max_model_len
  sequence (vLLM refuses to start otherwise); else the least share that does.
- weights: fp8 -> --quantization fp8 (vLLM quantizes a 16-bit checkpoint at load); awq/gptq name
  their method; int8/int4 need a pre-quantized checkpoint, whose config names the method.
- speculative decoding: --speculative-config '{"method": "mtp"|"ngram", "num_speculative_tokens": K}'.
  A separate draft model is refused: vLLM 0.11.0 raises NotImplementedError for method draft_model
  (vllm/config/speculative.py and engine/arg_utils.py at v0.11.0: "Draft model speculative decoding
  is not supported yet"); later V1 releases run it (vllm/v1/spec_decode/draft_model.py at v0.22.0).
"""

from __future__ import annotations

import json

from shardplan.exporters import k8s_objects as k8s
from shardplan.exporters.base import (
    memory_utilization as base_memory_utilization,
    Arg,
    ExportContext,
    ExportFile,
    Raw,
    cannot,
    command,
    flag_table,
    kv_tokens_at,
    model_ref,
    nodes_per_replica,
    non_kv_bytes,
    plan_header,
    script,
    serving,
    torch_dtype,
)
from shardplan.exporters.serving import DEFAULT_PORT, each_node_note, node_replicas, replicas_script

TARGET = "vllm"
IMAGE = f"vllm/vllm-openai:v{flag_table(TARGET).version}"  # the release image of the pinned version
RAY_PORT = 6379
_QUANT = {"fp8": "fp8", "awq": "awq", "gptq": "gptq"}


def memory_utilization(ctx: ExportContext) -> float:
    return base_memory_utilization(ctx, TARGET, "--gpu-memory-utilization")


def separate_replicas(ctx: ExportContext) -> bool:
    """One server per replica: vLLM's data parallelism would widen expert parallelism to tp x dp."""
    L = ctx.manifest.layout
    return L.ep > 1 and L.dp > 1


def serve_args(ctx: ExportContext, *, data_parallel: int, port: int, ray: bool = False) -> list[Arg]:
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    L = m.layout
    kv = m.predicted.kv_cache
    assert kv is not None
    args: list[Arg] = [("tensor-parallel-size", L.tp), ("pipeline-parallel-size", L.pp)]
    if data_parallel > 1:
        args.append(("data-parallel-size", data_parallel))
    if L.ep > 1:
        args.append(("enable-expert-parallel", None))
    if ray:
        args.append(("distributed-executor-backend", "ray"))
    args += [
        ("dtype", torch_dtype(wl.activation_dtype)),
        ("max-model-len", kv.max_model_len_tokens),
        ("gpu-memory-utilization", memory_utilization(ctx)),
        ("block-size", wl.block_size),
        ("kv-cache-dtype", "auto" if L.kv_cache_dtype == wl.activation_dtype else L.kv_cache_dtype),
    ]
    if L.weight_quantization in _QUANT:
        args.append(("quantization", _QUANT[L.weight_quantization]))
    args += [("max-num-seqs", wl.max_num_seqs), ("max-num-batched-tokens", wl.max_num_batched_tokens)]
    if wl.enforce_eager:
        args.append(("enforce-eager", None))
    if wl.speculative is not None:
        args.append(("speculative-config", speculative_config(wl.speculative)))
    args.append(("port", port))
    return args


def speculative_config(sp) -> str:
    """The --speculative-config JSON of a plan's speculative setup (mtp, ngram)."""
    if sp.method == "draft_model":
        raise cannot(TARGET, "workload.speculative.method",
                     f"vLLM {flag_table(TARGET).version} does not run a separate draft model (NotImplementedError in "
                     "vllm/config/speculative.py)", "export for sglang, or re-plan with --speculative-method mtp or ngram")
    return json.dumps({"method": sp.method, "num_speculative_tokens": sp.num_speculative_tokens})


def serve_command(ctx: ExportContext, *, data_parallel: int, port: int, ray: bool = False) -> str:
    return command(flag_table(TARGET), ["vllm", "serve", model_ref(ctx)],
                   serve_args(ctx, data_parallel=data_parallel, port=port, ray=ray))


def ray_head_command() -> str:
    return command(flag_table("ray"), ["ray", "start"], [("head", None), ("port", RAY_PORT)])


def ray_worker_command(head: str) -> str:
    return command(flag_table("ray"), ["ray", "start"], [("address", Raw(f"{head}:{RAY_PORT}")), ("block", None)])


def _notes(ctx: ExportContext) -> list[str]:
    m = ctx.manifest
    L, kv = m.layout, m.predicted.kv_cache
    assert kv is not None
    util = memory_utilization(ctx)
    out = [f"predicted KV cache: {kv_tokens_at(m, util * m.hardware.memory_capacity_bytes - non_kv_bytes(m)):,} tokens "
           f"per replica at --gpu-memory-utilization {util:.2f} ({kv.max_model_len_tokens}-token max_model_len)"]
    if L.weight_quantization in ("int8", "int4"):
        out.append(f"{L.weight_quantization} weights: point the model at a pre-quantized {L.weight_quantization} "
                   "checkpoint (GPTQ/AWQ/compressed-tensors); vLLM reads the method from its config")
    return out


def export_vllm(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    serving(ctx, TARGET)
    table = flag_table(TARGET)
    header = [*plan_header(m, TARGET, table), *_notes(ctx)]
    port = ctx.options.port or DEFAULT_PORT
    if nodes_per_replica(m) > 1:
        return _multi_node(ctx, header, port)
    header += each_node_note(ctx)
    if separate_replicas(ctx):
        body = replicas_script(ctx, lambda r: serve_command(ctx, data_parallel=1, port=r.port))
    else:
        body = [serve_command(ctx, data_parallel=len(node_replicas(ctx)), port=port)]
    return [ExportFile("serve.sh", script(body, header=header), executable=True)]


def _multi_node(ctx: ExportContext, header: list[str], port: int) -> list[ExportFile]:
    """Each replica spans nodes_per_replica nodes: one Ray cluster per replica, vLLM on its head."""
    m = ctx.manifest
    k = nodes_per_replica(m)
    header = [*header, f"each of the {m.layout.dp} replica(s) spans {k} nodes and runs as its own Ray cluster:",
              "  1. on the replica's first node: bash ray-head.sh",
              f"  2. on its other {k - 1} node(s): HEAD_ADDR=<first node> bash ray-worker.sh",
              "  3. on the first node, once `ray status` shows every GPU: bash serve.sh",
              "or apply lws.yaml (LeaderWorkerSet) on Kubernetes"]
    head = script([ray_head_command()], header=header[:2])
    worker = script(['HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the Ray head node}"', "",
                     ray_worker_command("$HEAD_ADDR")], header=header[:2])
    serve = script([serve_command(ctx, data_parallel=1, port=port, ray=True)], header=header)
    return [ExportFile("ray-head.sh", head, executable=True), ExportFile("ray-worker.sh", worker, executable=True),
            ExportFile("serve.sh", serve, executable=True),
            ExportFile("lws.yaml", k8s.dump(k8s.leader_worker_set(ctx, image=IMAGE, pod_commands=pod_commands)))]


def pod_commands(ctx: ExportContext, *, port: int, multi_node: bool) -> tuple[str, str | None]:
    """Container shell commands: (leader or only pod, worker or None) for Kubernetes."""
    if not multi_node:
        return serve_command(ctx, data_parallel=1, port=port), None
    leader = f"{ray_head_command()} && \\\n{serve_command(ctx, data_parallel=1, port=port, ray=True)}"
    worker = ray_worker_command("$LWS_LEADER_ADDRESS")
    return leader, worker


__all__ = ["export_vllm", "serve_command", "memory_utilization", "pod_commands"]
