"""SGLang: `python -m sglang.launch_server` arguments, checked against the flag list of the plan's
SGLang version (`flags/sglang-<version>.yaml`, dumped from that release's ServerArgs by
tools/dump_engine_flags.py; base.engine_flags picks the list, by default the pinned one). Where the
lists differ (--attn-dp-size, the cuda-graph backends) the flags follow the chosen list. Mapping:
- tp, pp -> --tp-size, --pp-size (a replica's tp x pp GPUs); replicas on a node -> --dp-size
  (without --enable-dp-attention each DP rank is a whole replica); ep -> --ep-size (SGLang carves
  the expert group out of the tp group: moe_tp_size = tp_size // ep_size, parallel_state.py).
- dp x ep (the expert group spans k = ep x etp / tp replicas): one server per group with DP
  attention, --tp-size k x tp --attn-dp-size k --ep-size ep (SGLang <= 0.5.x before --attn-dp-size:
  --dp-size k --enable-dp-attention, which 0.5.23 marks deprecated): attention runs
  k data-parallel ways of tp GPUs each (tp_size / dp_size), the MoE layers ep x etp over all
  k x tp GPUs; --max-running-requests and --chunked-prefill-size are k x the plan's per-replica
  limits, as SGLang divides them over the DP ranks. Refused with pipeline stages (this export does not combine them with DP attention).
- --mem-fraction-static covers the weights and the KV pool (server_args help); it is the plan's
  predicted weights + KV cache over the GPU's memory, rounded down to 0.01, raised to the least
  that holds one max_model_len sequence when that is more.
- a replica over k nodes: --nnodes k --node-rank i --dist-init-addr HEAD:PORT on each node.
- speculative decoding: mtp -> --speculative-algorithm NEXTN, draft_model -> STANDALONE with
  --speculative-draft-model-path, each with --speculative-num-steps K, --speculative-eagle-topk 1 and
  --speculative-num-draft-tokens K + 1 (server_args.py sets draft tokens to steps + 1 at topk 1);
  ngram -> NGRAM with --speculative-num-draft-tokens K + 1.
"""

from __future__ import annotations

import math

from shardplan.exporters.base import (
    Arg,
    overlap_args,
    ChosenFlags,
    ExportContext,
    ExportFile,
    FlagTable,
    Raw,
    checked_kv_value,
    checked_word,
    command,
    engine_flags,
    engine_replicas,
    model_ref,
    nodes_per_replica,
    plan_header,
    safe_name,
    script,
    serving,
    share_holding_one_sequence,
    torch_dtype,
)
from shardplan.exporters.serving import (
    DEFAULT_PORT,
    shipped_as_planned,
    shipped_notes,
    each_node_note,
    node_replicas,
    plan_split,
    pool_context,
    pool_servers,
    replicas_script,
    split_summary,
)
from shardplan.exporters.targets import check

TARGET = "sglang"
DIST_PORT = 20000
HEALTH_PATH = "/health"  # GET, 200 once the server runs (python/sglang/srt/entrypoints/http_server.py)
_QUANT = {"fp8": "fp8", "awq": "awq", "gptq": "gptq"}
_KV = {"fp8": "fp8_e4m3"}


def flags(ctx: ExportContext) -> ChosenFlags:
    """The launch_server flag list this export is checked against: the plan's --engine-version's
    (base.engine_flags), by default the pinned one."""
    return engine_flags(ctx, TARGET)


def image(ctx: ExportContext) -> str:
    """The release image of the flag list's version."""
    return f"lmsysorg/sglang:v{flags(ctx).table.version}"


def mem_fraction_static(ctx: ExportContext) -> float:
    """The plan's weights + KV cache over capacity, rounded down (what --mem-fraction-static covers)."""
    m = ctx.manifest
    b = m.predicted.memory.per_gpu_bytes
    cap = m.hardware.memory_capacity_bytes
    planned = math.floor((b["weights"] + b.get("kv_cache", 0.0)) / cap * 100) / 100
    return share_holding_one_sequence(ctx, planned=planned, static_bytes=b["weights"], of_bytes=cap,
                                      target=TARGET, flag="--mem-fraction-static")


def kv_cache_dtype(ctx: ExportContext, table: FlagTable) -> str:
    """--kv-cache-dtype for a KV cache not in the activation dtype: fp8 as fp8_e4m3, bf16 as is. Refused
    when the chosen list's argparse choices lack it: SGLang has no fp16 or fp32 KV cache, 0.5.3 no bf16."""
    serving(ctx, TARGET)
    kv = ctx.manifest.layout.kv_cache_dtype
    return checked_kv_value(ctx, TARGET, table, _KV.get(kv, kv), "SGLang")


def group_replicas(ctx: ExportContext) -> int:
    """Replicas one server runs with DP attention because experts are split among them (1: none);
    what SGLang's export cannot run is refused first (knowledge/targets.yaml)."""
    check(ctx, TARGET)
    return engine_replicas(ctx.manifest, TARGET)


def server_args(ctx: ExportContext, *, data_parallel: int, port: int, nnodes: int = 1,
                node_rank: str | None = None, head: str | None = None) -> list[Arg]:
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    L, kv = m.layout, m.predicted.kv_cache
    assert kv is not None
    k = group_replicas(ctx)
    table = flags(ctx).table
    args: list[Arg] = [("model-path", model_ref(ctx)), ("tp-size", L.tp * k), ("pp-size", L.pp)]
    if k > 1:
        args += dp_attention_args(table, k)
    elif data_parallel > 1:
        args.append(("dp-size", data_parallel))
    if L.ep > 1:
        args.append(("ep-size", L.ep))
    if nnodes > 1:
        args += [("nnodes", nnodes), ("node-rank", Raw(node_rank or "$NODE_RANK")),
                 ("dist-init-addr", Raw(f"{head or '$HEAD_ADDR'}:{DIST_PORT}"))]
    args += [("dtype", torch_dtype(wl.activation_dtype)), ("context-length", kv.max_model_len_tokens),
             ("mem-fraction-static", mem_fraction_static(ctx)), ("page-size", wl.block_size)]
    if L.kv_cache_dtype != wl.activation_dtype:
        args.append(("kv-cache-dtype", kv_cache_dtype(ctx, table)))
    if L.weight_quantization in _QUANT and not shipped_as_planned(ctx):  # else SGLang reads it from the checkpoint
        args.append(("quantization", _QUANT[L.weight_quantization]))
    # With DP attention SGLang divides both over the DP ranks (server_args.py: chunked_prefill_size //= dp_size;
    # the model runner: max_running_requests // dp_size), so a group of k replicas is given k times the plan's.
    args += [("max-running-requests", wl.max_num_seqs * k), ("chunked-prefill-size", wl.max_num_batched_tokens * k)]
    if wl.enforce_eager:
        args += eager_args(table)
    args += overlap_args(ctx, TARGET)
    if wl.speculative is not None:
        args += speculative_args(wl.speculative)
    args += [("host", "0.0.0.0"), ("port", port)]
    return args


def dp_attention_args(table: FlagTable, k: int) -> list[Arg]:
    """k data-parallel attention groups: --attn-dp-size where the chosen list has it (0.5.23: the
    old --dp-size --enable-dp-attention spelling resolves to it and is deprecated), else the old one."""
    if "attn-dp-size" in table.flags:
        return [("attn-dp-size", k)]
    return [("dp-size", k), ("enable-dp-attention", None)]


def eager_args(table: FlagTable) -> list[Arg]:
    """No CUDA graphs: per phase where the chosen list has the backends (0.5.23 marks
    --disable-cuda-graph deprecated: "Use --cuda-graph-backend-{decode,prefill}=disabled"), else the old switch."""
    if "cuda-graph-backend-decode" in table.flags and "cuda-graph-backend-prefill" in table.flags:
        return [("cuda-graph-backend-decode", "disabled"), ("cuda-graph-backend-prefill", "disabled")]
    return [("disable-cuda-graph", None)]


def speculative_args(sp) -> list[Arg]:
    """SGLang's speculative flags for a plan's speculative setup (the same in 0.5.3 and 0.5.23)."""
    k = sp.num_speculative_tokens
    if sp.method == "ngram":
        return [("speculative-algorithm", "NGRAM"), ("speculative-num-draft-tokens", k + 1)]
    args: list[Arg] = [("speculative-algorithm", "NEXTN" if sp.method == "mtp" else "STANDALONE")]
    if sp.method == "draft_model":
        ref = sp.draft_hf_id or f"/models/{safe_name(sp.draft_model or 'draft', 'draft')}"
        args.append(("speculative-draft-model-path", checked_word(ref, "workload.speculative.draft_hf_id",
                                                                  "a Hugging Face id")))
    return args + [("speculative-num-steps", k), ("speculative-eagle-topk", 1), ("speculative-num-draft-tokens", k + 1)]


def launch_command(ctx: ExportContext, **kw) -> str:
    return command(flags(ctx).table, ["python", "-m", "sglang.launch_server"], server_args(ctx, **kw))


def export_sglang(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    serving(ctx, TARGET)
    check(ctx, TARGET)
    port = ctx.options.port or DEFAULT_PORT
    header = [*plan_header(m, TARGET, flags(ctx)),
              f"--mem-fraction-static {mem_fraction_static(ctx):.2f}: the plan's weights + KV cache share of the GPU",
              *shipped_notes(ctx, "SGLang")]
    if ctx.options.disaggregated:
        return _disaggregated(ctx, header, port)
    g = group_replicas(ctx)
    if g > 1:
        header.append(f"expert parallelism spans {g} replicas: they run as one server with DP attention "
                      f"({' '.join(f'--{n} {v}' if v is not None else f'--{n}' for n, v in dp_attention_args(flags(ctx).table, g))}, "
                      f"--ep-size {m.layout.ep}); SGLang supports DP attention "
                      "for DeepSeek- and Qwen-MoE-style models")
    k = nodes_per_replica(m, TARGET)
    if k > 1:
        header += [f"each of the {m.layout.dp // g} server(s) spans {k} nodes: run on each of them with HEAD_ADDR "
                   f"(the server's first node) and NODE_RANK (0..{k - 1}) set"]
        body = ['HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the first node of the replica}"',
                f'NODE_RANK="${{NODE_RANK:?set NODE_RANK to 0..{k - 1}}}"', "",
                launch_command(ctx, data_parallel=1, port=port, nnodes=k)]
    elif g > 1 and len(node_replicas(ctx, TARGET)) > 1:
        header += each_node_note(ctx)
        body = replicas_script(ctx, lambda r: launch_command(ctx, data_parallel=1, port=r.port))
    else:
        header += each_node_note(ctx)
        body = [launch_command(ctx, data_parallel=len(node_replicas(ctx)), port=port)]
    return [ExportFile("serve.sh", script(body, header=header), executable=True)]


def pod_commands(ctx: ExportContext, *, port: int, multi_node: bool) -> tuple[str, str | None]:
    """Kubernetes: one pod per replica, or a LeaderWorkerSet group (LWS sets LWS_LEADER_ADDRESS and
    LWS_WORKER_INDEX, 0 on the leader)."""
    if not multi_node:
        return launch_command(ctx, data_parallel=1, port=port), None
    k = nodes_per_replica(ctx.manifest, TARGET)
    cmd = launch_command(ctx, data_parallel=1, port=port, nnodes=k, node_rank="$LWS_WORKER_INDEX",
                         head="$LWS_LEADER_ADDRESS")
    return cmd, cmd


# SGLang's prefill/decode disaggregation (docs/advanced_features/pd_disaggregation.md): each server
# runs with --disaggregation-mode prefill or decode and a transfer backend (NIXL here, as vLLM's
# export uses; mooncake is SGLang's default), prefill servers each with a bootstrap port; the
# sglang_router in --pd-disaggregation mode pairs them.
TRANSFER_BACKEND = "nixl"
BOOTSTRAP_PORT = 8998


def role_command(ctx: ExportContext, role: str, *, port: int, index: int = 0) -> str:
    """One server of the manifest's prefill or decode pool at the pool's tp; a prefill server's
    bootstrap port is BOOTSTRAP_PORT + `index` (servers sharing a host need their own)."""
    args = server_args(pool_context(ctx, role), data_parallel=1, port=port) + [
        ("disaggregation-mode", role), ("disaggregation-transfer-backend", TRANSFER_BACKEND)]
    if role == "prefill":
        args.append(("disaggregation-bootstrap-port", BOOTSTRAP_PORT + index))
    return command(flags(ctx).table, ["python", "-m", "sglang.launch_server"], args)


def _disaggregated(ctx: ExportContext, header: list[str], port: int) -> list[ExportFile]:
    """serve_disagg.sh: the manifest's prefill and decode pools on one node, each server its own
    GPUs and port (prefill servers their own bootstrap port), with the plan's engine settings."""
    lines: list[str] = []
    urls: list[str] = []
    for srv in pool_servers(ctx, TARGET, port):
        urls.append(f"--prefill http://127.0.0.1:{srv.port} {BOOTSTRAP_PORT + srv.index}" if srv.role == "prefill"
                    else f"--decode http://127.0.0.1:{srv.port}")
        lines += [f"# {srv.role} server {srv.index}: GPUs {srv.gpus}, port {srv.port}",
                  f"CUDA_VISIBLE_DEVICES={srv.gpus} {role_command(ctx, srv.role, port=srv.port, index=srv.index)} &"]
    header = [*header, split_summary(plan_split(ctx, TARGET)),
              "pair them with the router: python -m sglang_router.launch_router --pd-disaggregation " + " ".join(urls),
              "--mem-fraction-static is the aggregated plan's share; a pool whose tp differs holds its weights over "
              "fewer or more GPUs, so check each server's start-up log for its KV pool"]
    return [ExportFile("serve_disagg.sh", script([*lines, "wait"], header=header), executable=True)]
