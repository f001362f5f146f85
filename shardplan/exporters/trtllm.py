"""TensorRT-LLM: `trtllm-serve` on the PyTorch backend (takes the Hugging Face checkpoint as it
is), and, for Llama-family models, the checkpoint conversion and `trtllm-build` of the
TensorRT-engine path. Flags are checked against `flags/trtllm-*.yaml` (TensorRT-LLM 1.0; those
files say how far their reading could be tied to the tag).
- tp, pp, ep -> --tp_size, --pp_size, --ep_size; replicas run as separate servers.
- --kv_cache_free_gpu_memory_fraction is a share of the memory left free after the weights and
  buffers are loaded (serve's help): the plan's KV cache over capacity minus its other bytes,
  rounded down to 0.01 (raised to the least that holds one max_model_len sequence if short).
- A replica over several nodes needs an MPI launch (trtllm-llmapi-launch) that this export does
  not write: such plans are refused.
"""

from __future__ import annotations

import math

import yaml

from shardplan.exporters.base import (
    Arg,
    ExportContext,
    ExportFile,
    command,
    flag_table,
    model_ref,
    non_kv_bytes,
    plan_header,
    script,
    serving,
    share_holding_one_sequence,
    torch_dtype,
)
from shardplan.exporters.serving import each_node_note, node_replicas, replicas_script
from shardplan.exporters.targets import check

TARGET = "trtllm"
IMAGE = f"nvcr.io/nvidia/tensorrt-llm/release:{flag_table('trtllm-serve').version}"
LLAMA_CONVERTER = "examples/models/core/llama/convert_checkpoint.py"  # in the TensorRT-LLM repository
_LLAMA_FAMILY = ("llama", "mistral", "mixtral")
HEALTH_PATH = "/health"  # GET (tensorrt_llm/serve/openai_server.py, register_routes)


def image(ctx: ExportContext) -> str:
    """The release image of the pinned trtllm-serve list."""
    return IMAGE


def kv_free_fraction(ctx: ExportContext) -> float:
    """The plan's KV cache over the memory left after everything else, rounded down."""
    m = ctx.manifest
    serving(ctx, TARGET)
    free_bytes = m.hardware.memory_capacity_bytes - non_kv_bytes(m)
    planned = math.floor(m.predicted.memory.per_gpu_bytes.get("kv_cache", 0.0) / free_bytes * 100) / 100
    return share_holding_one_sequence(ctx, planned=planned, static_bytes=0.0, of_bytes=free_bytes,
                                      target=TARGET, flag="--kv_cache_free_gpu_memory_fraction")


def _expressible(ctx: ExportContext) -> None:
    """One trtllm-serve per replica on one node, no offload (knowledge/targets.yaml)."""
    check(ctx, TARGET)


def serve_args(ctx: ExportContext, *, port: int) -> list[Arg]:
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    L, kv = m.layout, m.predicted.kv_cache
    assert kv is not None
    args: list[Arg] = [("backend", "pytorch"), ("tp_size", L.tp), ("pp_size", L.pp)]
    if L.ep > 1:
        args.append(("ep_size", L.ep))
    args += [("max_batch_size", wl.max_num_seqs), ("max_num_tokens", wl.max_num_batched_tokens),
             ("max_seq_len", kv.max_model_len_tokens), ("kv_cache_free_gpu_memory_fraction", kv_free_fraction(ctx)),
             ("host", "0.0.0.0"), ("port", port), ("extra_llm_api_options", "extra_llm_api_options.yaml")]
    return args


def serve_command(ctx: ExportContext, *, port: int) -> str:
    return command(flag_table("trtllm-serve"), ["trtllm-serve", model_ref(ctx)], serve_args(ctx, port=port))


def extra_options(ctx: ExportContext) -> dict:
    """The LLM API options trtllm-serve has no flag for: the KV cache's format."""
    m = ctx.manifest
    serving(ctx, TARGET)
    kv_dtype = "fp8" if m.layout.kv_cache_dtype == "fp8" else "auto"  # auto: the model's dtype
    return {"kv_cache_config": {"dtype": kv_dtype, "free_gpu_memory_fraction": kv_free_fraction(ctx)}}


def build_script(ctx: ExportContext) -> str | None:
    """convert_checkpoint.py + trtllm-build for the TensorRT backend (Llama family only)."""
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    L, kv = m.layout, m.predicted.kv_cache
    assert kv is not None
    if ctx.spec is None or ctx.spec.model_type not in _LLAMA_FAMILY:
        return None
    conv: list[Arg] = [("model_dir", model_ref(ctx)), ("output_dir", "ckpt"), ("dtype", torch_dtype(wl.activation_dtype)),
                       ("tp_size", L.tp), ("pp_size", L.pp)]
    if L.ep > 1:
        conv += [("moe_ep_size", L.ep), ("moe_tp_size", L.tp // L.ep)]
    if L.weight_quantization == "fp8":
        conv.append(("use_fp8", None))
    elif L.weight_quantization in ("int8", "int4"):
        conv += [("use_weight_only", None), ("weight_only_precision", L.weight_quantization)]
    build: list[Arg] = [("checkpoint_dir", "ckpt"), ("output_dir", "engine"), ("gemm_plugin", "auto"),
                        ("max_batch_size", wl.max_num_seqs), ("max_input_len", kv.max_model_len_tokens - 1),
                        ("max_seq_len", kv.max_model_len_tokens), ("max_num_tokens", wl.max_num_batched_tokens),
                        ("tokens_per_block", wl.block_size)]
    lines = [command(flag_table("trtllm-convert-llama"), ["python", LLAMA_CONVERTER], conv), "",
             command(flag_table("trtllm-build"), ["trtllm-build"], build), "",
             "# then serve the engine: trtllm-serve engine --backend tensorrt (with the serve.sh limits)"]
    return script(lines, header=[*plan_header(m, TARGET, flag_table("trtllm-build")),
                                 "the TensorRT-engine path (serve.sh runs the PyTorch backend and needs no build)"])


def export_trtllm(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    serving(ctx, TARGET)
    _expressible(ctx)
    header = [*plan_header(m, TARGET, flag_table("trtllm-serve")), *each_node_note(ctx)]
    if len(node_replicas(ctx)) > 1:
        body = replicas_script(ctx, lambda r: serve_command(ctx, port=r.port))
    else:
        body = [serve_command(ctx, port=node_replicas(ctx)[0].port)]
    files = [ExportFile("serve.sh", script(body, header=header), executable=True),
             ExportFile("extra_llm_api_options.yaml", yaml.safe_dump(extra_options(ctx), sort_keys=False))]
    build = build_script(ctx)
    if build is not None:
        files.append(ExportFile("build.sh", build, executable=True))
    return files


def pod_commands(ctx: ExportContext, *, port: int, multi_node: bool) -> tuple[str, str | None]:
    _expressible(ctx)
    opts = yaml.safe_dump(extra_options(ctx), sort_keys=False).replace("'", "'\\''")
    return f"printf '%s' '{opts}' > extra_llm_api_options.yaml && \\\n{serve_command(ctx, port=port)}", None
