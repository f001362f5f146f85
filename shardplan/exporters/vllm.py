"""vLLM: the `vllm serve` command line; for plans whose replica spans nodes, the Ray head and
worker commands and a Kubernetes LeaderWorkerSet.

Every flag is checked against the flag list of the plan's vLLM version (`flags/vllm-<version>.yaml`,
dumped from that release's own parser by tools/dump_engine_flags.py; the file says which wheel;
base.engine_flags picks the list, by default the pinned one), and the image is that version's. Mapping:
- tp, pp -> --tensor-parallel-size, --pipeline-parallel-size; replicas (dp) -> --data-parallel-size
  on a node. vLLM's MoE layers span all tp x dp ranks of one server (FusedMoEParallelConfig:
  ep = tp x dp, experts unsplit, with --enable-expert-parallel; else tensor-parallel over tp x dp),
  so a mixture-of-experts plan whose replicas each hold every expert (ep = 1 or ep = tp) runs one
  server per replica, and a dp x ep plan (ep = tp x k: the expert group spans k replicas) runs one
  server per group: --data-parallel-size k --enable-expert-parallel. Other ep/etp are refused.
  A group wider than a node uses vLLM's multi-node data parallelism (no Ray): the first node runs
  the API server with --data-parallel-size-local, --data-parallel-address and -rpc-port, the
  others `--headless --data-parallel-start-rank` (vLLM docs, serving/data_parallel_deployment.md).
- --gpu-memory-utilization: the plan's, when its predicted KV cache holds one max_model_len
  sequence (vLLM refuses to start otherwise); else the least share that does.
- weights: fp8 -> --quantization fp8 (vLLM quantizes a 16-bit checkpoint at load); awq/gptq name
  their method; int8/int4 need a pre-quantized checkpoint, whose config names the method. A
  checkpoint that ships the plan's format (block FP8, gpt-oss's MXFP4 experts: ModelSpec.shipped_format)
  gets no --quantization: vLLM reads it from the checkpoint's quantization_config. A 16-bit plan of
  such a checkpoint says that vLLM would load the shipped format, and to point at a 16-bit copy.
- KV cache: --kv-cache-dtype auto in the activation dtype, else fp8 / bfloat16 / float16 where the
  version's CacheDType lists it (the flag list's choices_source); a plan with another is refused.
- weight offload (`layout.offload_layers`): --cpu-offload-gb, the plan's host_offload_bytes per GPU in
  GiB of 2^30 bytes, rounded up to 0.01 GiB so that the GPU holds no more than planned. vLLM reads it
  as "The space in GiB to offload to CPU, per GPU" (vllm/config/offload.py:21-22, OffloadConfig.
  cpu_offload_gb, main at 00593fa7) and offloads parameters of the first decoder layers until
  int(cpu_offload_gb * 1024**3) bytes are reached (vllm/model_executor/offloader/base.py:172,
  create_offloader -> UVAOffloader, main at 03584c33); the flag is in the pinned 0.33.0 and 0.11.0
  lists. vLLM has no disk offload: an NVMe plan is refused.
- speculative decoding: --speculative-config '{"method": "mtp"|"ngram", "num_speculative_tokens": K}';
  a separate draft model as {"method": "draft_model", "model": ID, ...} from vLLM 0.22.0
  (vllm/v1/spec_decode/draft_model.py at v0.22.0 and v0.33.0), refused for older pins: vLLM 0.11.0
  raises NotImplementedError for it (vllm/config/speculative.py and engine/arg_utils.py at v0.11.0:
  "Draft model speculative decoding is not supported yet").
"""

from __future__ import annotations

import json
import math

from shardplan.exporters import k8s_objects as k8s
from shardplan.exporters.base import (
    overlap_args,
    memory_utilization as base_memory_utilization,
    GIB,
    checked_word,
    safe_name,
    Arg,
    ChosenFlags,
    ExportContext,
    ExportFile,
    Raw,
    cannot,
    checked_kv_value,
    command,
    engine_flags,
    engine_replicas,
    flag_table,
    gpus_per_node_used,
    kv_tokens_at,
    model_ref,
    nodes_per_replica,
    non_kv_bytes,
    plan_header,
    replica_gpus,
    script,
    serving,
    torch_dtype,
)
from shardplan.exporters.serving import (
    DECODE_PORT_OFFSET,
    shipped_as_planned,
    shipped_notes,
    DEFAULT_PORT,
    each_node_note,
    node_replicas,
    plan_split,
    pool_context,
    pool_servers,
    replicas_script,
    split_summary,
)
from shardplan.exporters.targets import check

TARGET = "vllm"
RAY_PORT = 6379
DP_RPC_PORT = 13345  # --data-parallel-rpc-port: the engines' coordination port on the first node (vLLM docs' example)
HEALTH_PATH = "/health"  # GET, 200 once the engine serves (vllm/entrypoints/openai/api_server.py)
_QUANT = {"fp8": "fp8", "awq": "awq", "gptq": "gptq"}
DRAFT_MODEL_SINCE = (0, 22, 0)  # first release known to run method draft_model (see the module docstring)


def flags(ctx: ExportContext) -> ChosenFlags:
    """The `vllm serve` flag list this export is checked against: the plan's --engine-version's
    (base.engine_flags), by default the pinned one."""
    return engine_flags(ctx, TARGET)


def image(ctx: ExportContext) -> str:
    """The release image of the flag list's version."""
    return f"vllm/vllm-openai:v{flags(ctx).table.version}"


def memory_utilization(ctx: ExportContext) -> float:
    return base_memory_utilization(ctx, TARGET, "--gpu-memory-utilization")


def separate_replicas(ctx: ExportContext) -> bool:
    """One server per replica of a mixture-of-experts plan whose replicas each hold every expert:
    vLLM's data parallelism would spread the experts over the tp x dp ranks of the server,
    expert-parallel (ep = tp x dp) with --enable-expert-parallel and tensor-parallel over all of
    them without it (FusedMoEParallelConfig.make flattens tp across dp either way), and tie the
    replicas' steps together, which the plan's memory and time do not assume."""
    m = ctx.manifest
    return bool(m.model.num_experts) and m.layout.dp > 1 and group_replicas(ctx) == 1


def group_replicas(ctx: ExportContext) -> int:
    """Replicas one vLLM server runs as data-parallel ranks because experts are split among them
    (1 when each replica holds every expert). vLLM's expert-parallel size is tp x that, with whole
    experts: a plan with another ep, or experts split by tensor parallelism under ep, is refused
    (knowledge/targets.yaml)."""
    check(ctx, TARGET)
    return engine_replicas(ctx.manifest, TARGET)


def cpu_offload_gib(ctx: ExportContext) -> float | None:
    """--cpu-offload-gb: the most any rank of the plan keeps in host memory, in GiB (2^30 bytes, as
    vLLM multiplies it by 1024**3), rounded up to 0.01; None when the plan offloads nothing. NVMe
    offload is refused: vLLM offloads to host memory only."""
    m = ctx.manifest
    check(ctx, TARGET)  # no disk offload (knowledge/targets.yaml)
    host = max((st.host_offload_bytes for st in m.predicted.memory.stages), default=0.0)
    if host <= 0:
        return None
    return math.ceil(host / GIB * 100 - 1e-9) / 100


def kv_cache_dtype(ctx: ExportContext) -> str:
    """--kv-cache-dtype: auto (the model's dtype) for a KV cache in the activation dtype, else the plan's
    format as vLLM spells it (fp8; bfloat16, float16 as torch names them). Refused when the chosen flag
    list's choices, which vLLM checks after parsing (vllm/config/cache.py CacheDType, read from that
    release's wheel), lack it: vLLM 0.11.0 has no float16 KV cache, none of them a float32 one."""
    L, wl = ctx.manifest.layout, serving(ctx, TARGET)
    if L.kv_cache_dtype == wl.activation_dtype:
        return "auto"
    return checked_kv_value(ctx, TARGET, flags(ctx).table, torch_dtype(L.kv_cache_dtype), "vLLM")


def serve_args(ctx: ExportContext, *, data_parallel: int, port: int, ray: bool = False,
               dp_nodes: list[Arg] | None = None) -> list[Arg]:
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    L = m.layout
    kv = m.predicted.kv_cache
    assert kv is not None
    args: list[Arg] = [("tensor-parallel-size", L.tp), ("pipeline-parallel-size", L.pp)]
    if data_parallel > 1:
        args.append(("data-parallel-size", data_parallel))
    args += dp_nodes or []
    if L.ep > 1:
        args.append(("enable-expert-parallel", None))
    if ray:
        args.append(("distributed-executor-backend", "ray"))
    args += [
        ("dtype", torch_dtype(wl.activation_dtype)),
        ("max-model-len", kv.max_model_len_tokens),
        ("gpu-memory-utilization", memory_utilization(ctx)),
        ("block-size", wl.block_size),
        ("kv-cache-dtype", kv_cache_dtype(ctx)),
    ]
    if L.weight_quantization in _QUANT and not shipped_as_planned(ctx):
        args.append(("quantization", _QUANT[L.weight_quantization]))
    offload = cpu_offload_gib(ctx)
    if offload is not None:
        args.append(("cpu-offload-gb", offload))
    args += [("max-num-seqs", wl.max_num_seqs), ("max-num-batched-tokens", wl.max_num_batched_tokens)]
    if wl.enforce_eager:
        args.append(("enforce-eager", None))
    args += overlap_args(ctx, TARGET)
    if wl.speculative is not None:
        args.append(("speculative-config", speculative_config(wl.speculative, flags(ctx).table.version)))
    args.append(("port", port))
    return args


def speculative_config(sp, version: str) -> str:
    """The --speculative-config JSON of a plan's speculative setup (mtp, ngram; a draft model from
    DRAFT_MODEL_SINCE) for vLLM `version`."""
    if sp.method == "draft_model":
        if tuple(int(p) for p in version.split(".")[:3]) < DRAFT_MODEL_SINCE:
            raise cannot(TARGET, "workload.speculative.method",
                         f"vLLM {version} does not run a separate draft model (NotImplementedError in "
                         "vllm/config/speculative.py)", "export for sglang, or re-plan with --speculative-method mtp or ngram")
        ref = sp.draft_hf_id or f"/models/{safe_name(sp.draft_model or 'draft', 'draft')}"
        return json.dumps({"method": "draft_model", "model": checked_word(ref, "workload.speculative.draft_hf_id",
                                                                            "a Hugging Face id"),
                           "num_speculative_tokens": sp.num_speculative_tokens})
    return json.dumps({"method": sp.method, "num_speculative_tokens": sp.num_speculative_tokens})


def serve_command(ctx: ExportContext, *, data_parallel: int, port: int, ray: bool = False,
                  dp_nodes: list[Arg] | None = None) -> str:
    return command(flags(ctx).table, ["vllm", "serve", model_ref(ctx)],
                   serve_args(ctx, data_parallel=data_parallel, port=port, ray=ray, dp_nodes=dp_nodes))


def local_dp_ranks(ctx: ExportContext) -> int:
    """Data-parallel ranks (replicas) per node when a dp x ep group spans nodes; refused unless
    each rank sits on one node and the group fills whole nodes."""
    m = ctx.manifest
    group_replicas(ctx)  # refuses groups whose ranks do not tile nodes (knowledge/targets.yaml)
    return gpus_per_node_used(m) // replica_gpus(m)


def dp_node_args(ctx: ExportContext, *, head: str, node_rank: str) -> list[Arg]:
    """vLLM's multi-node data parallelism: node 0 runs the API server and ranks 0..local-1; the
    others run `--headless` from rank node_rank x local."""
    local = local_dp_ranks(ctx)
    args: list[Arg] = [("data-parallel-size-local", local), ("data-parallel-address", Raw(head)),
                       ("data-parallel-rpc-port", DP_RPC_PORT)]
    if node_rank != "0":
        args = [("headless", None), ("data-parallel-start-rank", Raw(f"$(({node_rank} * {local}))")), *args]
    return args


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
    offload = cpu_offload_gib(ctx)
    if offload is not None:
        host = max(st.host_offload_bytes for st in m.predicted.memory.stages)
        out.append(f"--cpu-offload-gb {offload}: the plan keeps {host / GIB:.3f} GiB of weights per GPU in host memory "
                   f"({L.offload_layers} decoder layers; vLLM offloads the first layers' parameters until it reaches "
                   "the figure, and streams them to the GPU on every forward)")
    if L.weight_quantization in ("int8", "int4"):
        out.append(f"{L.weight_quantization} weights: point the model at a pre-quantized {L.weight_quantization} "
                   "checkpoint (GPTQ/AWQ/compressed-tensors); vLLM reads the method from its config")
    out += shipped_notes(ctx, "vLLM")
    return out


def export_vllm(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    serving(ctx, TARGET)
    check(ctx, TARGET)
    header = [*plan_header(m, TARGET, flags(ctx)), *_notes(ctx)]
    port = ctx.options.port or DEFAULT_PORT
    if ctx.options.disaggregated:
        return _disaggregated(ctx, header, port)
    k = group_replicas(ctx)
    if k > 1:
        header.append(f"expert parallelism spans {k} replicas: they run as one vLLM server, --data-parallel-size {k} "
                      f"--enable-expert-parallel (ep = tp x dp = {m.layout.tp * k})")
    if nodes_per_replica(m, TARGET) > 1:
        return _multi_node_dp(ctx, header, port) if k > 1 else _multi_node(ctx, header, port)
    header += each_node_note(ctx)
    if separate_replicas(ctx) or (k > 1 and len(node_replicas(ctx, TARGET)) > 1):
        body = replicas_script(ctx, lambda r: serve_command(ctx, data_parallel=k, port=r.port))
    else:
        body = [serve_command(ctx, data_parallel=k if k > 1 else len(node_replicas(ctx)), port=port)]
    return [ExportFile("serve.sh", script(body, header=header), executable=True)]


def _multi_node_dp(ctx: ExportContext, header: list[str], port: int) -> list[ExportFile]:
    """A dp x ep group over several nodes: one serve.sh run on each with HEAD_ADDR and NODE_RANK."""
    m = ctx.manifest
    n = nodes_per_replica(m, TARGET)
    header = [*header, f"each of the {m.layout.dp // group_replicas(ctx)} server(s) spans {n} nodes: run serve.sh on each "
              f"of them with HEAD_ADDR (the first node) and NODE_RANK (0..{n - 1}) set; node 0 serves the API",
              "or apply lws.yaml (LeaderWorkerSet) on Kubernetes"]
    body = ['HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the first node of the server}"',
            f'NODE_RANK="${{NODE_RANK:?set NODE_RANK to 0..{n - 1}}}"', "",
            'if [ "$NODE_RANK" = 0 ]; then',
            dp_serve_command(ctx, port=port, head="$HEAD_ADDR", node_rank="0"),
            "else",
            dp_serve_command(ctx, port=port, head="$HEAD_ADDR", node_rank="$NODE_RANK"),
            "fi"]
    return [ExportFile("serve.sh", script(body, header=header), executable=True),
            ExportFile("lws.yaml", k8s.dump(k8s.leader_worker_set(ctx, image=image(ctx), pod_commands=pod_commands,
                                                                  health_path=HEALTH_PATH)))]


def dp_serve_command(ctx: ExportContext, *, port: int, head: str, node_rank: str) -> str:
    return serve_command(ctx, data_parallel=group_replicas(ctx), port=port,
                         dp_nodes=dp_node_args(ctx, head=head, node_rank=node_rank))


def _multi_node(ctx: ExportContext, header: list[str], port: int) -> list[ExportFile]:
    """Each replica spans nodes_per_replica nodes: one Ray cluster per replica, vLLM on its head."""
    m = ctx.manifest
    k = nodes_per_replica(m, TARGET)
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
            ExportFile("lws.yaml", k8s.dump(k8s.leader_worker_set(ctx, image=image(ctx), pod_commands=pod_commands,
                                                                  health_path=HEALTH_PATH)))]


def pod_commands(ctx: ExportContext, *, port: int, multi_node: bool) -> tuple[str, str | None]:
    """Container shell commands: (leader or only pod, worker or None) for Kubernetes."""
    k = group_replicas(ctx)
    if not multi_node:
        return serve_command(ctx, data_parallel=k, port=port), None
    if k > 1:  # LWS sets LWS_LEADER_ADDRESS and LWS_WORKER_INDEX (0 on the leader) in every pod
        return (dp_serve_command(ctx, port=port, head="$LWS_LEADER_ADDRESS", node_rank="0"),
                dp_serve_command(ctx, port=port, head="$LWS_LEADER_ADDRESS", node_rank="$LWS_WORKER_INDEX"))
    leader = f"{ray_head_command()} && \\\n{serve_command(ctx, data_parallel=1, port=port, ray=True)}"
    worker = ray_worker_command("$LWS_LEADER_ADDRESS")
    return leader, worker


__all__ = ["export_vllm", "serve_command", "memory_utilization", "pod_commands", "image", "flags"]


# vLLM's disaggregated serving with NIXL (docs/features/disagg_prefill.md and
# examples/online_serving/disaggregated_serving at v0.11+): every instance runs the NixlConnector
# with kv_role kv_both; a proxy sends each request to a prefill instance with max_tokens 1 and then
# to a decode instance, which pulls the prompt's KV blocks.
NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def role_command(ctx: ExportContext, role: str, *, port: int, index: int = 0) -> str:
    """One server of the manifest's prefill or decode pool: the plan's engine settings at the pool's
    tp, with the KV-transfer connector (`index` is unused: every vLLM instance is configured alike)."""
    args = serve_args(pool_context(ctx, role), data_parallel=1, port=port) + [("kv-transfer-config", json.dumps(NIXL_CONFIG))]
    return command(flags(ctx).table, ["vllm", "serve", model_ref(ctx)], args)


def _disaggregated(ctx: ExportContext, header: list[str], port: int) -> list[ExportFile]:
    """serve_disagg.sh: the manifest's prefill and decode pools on one node, each replica its own
    GPUs and port, with the KV-transfer connector; the plan's engine settings otherwise."""
    lines: list[str] = []
    for srv in pool_servers(ctx, TARGET, port):
        lines += [f"# {srv.role} replica {srv.index}: GPUs {srv.gpus}, port {srv.port}",
                  f"CUDA_VISIBLE_DEVICES={srv.gpus} {role_command(ctx, srv.role, port=srv.port)} &"]
    header = [*header, split_summary(plan_split(ctx, TARGET)),
              f"prefill servers listen from port {port}, decode servers from {port + DECODE_PORT_OFFSET}; route "
              "requests through a prefill/decode proxy (vLLM's examples/online_serving/disaggregated_serving): "
              "prefill with max_tokens 1, then decode on a decode instance"]
    return [ExportFile("serve_disagg.sh", script([*lines, "wait"], header=header), executable=True)]
