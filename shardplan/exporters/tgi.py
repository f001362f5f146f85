"""Hugging Face TGI: `text-generation-launcher` per replica, checked against `flags/tgi.yaml`
(TGI 3.2.0's launcher). TGI shards a model with tensor parallelism on one node only: it has
no pipeline parallelism, no multi-node shards and no expert parallelism (experts are tensor
sharded), so plans with those are refused. Replicas run as separate launchers, each on its
own GPUs, port, shard socket and NCCL port.
- --cuda-memory-fraction caps what a shard uses (weights, KV cache, activations), the meaning
  of vLLM's --gpu-memory-utilization: the plan's, raised to the least that holds one
  max_model_len sequence when that is more. TGI sizes its KV cache itself after a warm-up.
- --max-total-tokens = max_model_len; --max-input-tokens one less (TGI requires input < total).
- weights: fp8 -> --quantize fp8, awq/gptq by name; int8 -> eetq (8-bit weights quantized at
  load: the same bytes as the plan's W8A8); int4 needs a GPTQ/AWQ checkpoint (TGI reads it).
"""

from __future__ import annotations

from shardplan.exporters.base import (
    memory_utilization as base_memory_utilization,
    Arg,
    ExportContext,
    ExportFile,
    cannot,
    command,
    flag_table,
    model_ref,
    plan_header,
    script,
    serving,
    torch_dtype,
)
from shardplan.exporters.serving import each_node_note, replicas_script

TARGET = "tgi"
IMAGE = f"ghcr.io/huggingface/text-generation-inference:{flag_table(TARGET).version}"
_QUANT = {"fp8": "fp8", "awq": "awq", "gptq": "gptq", "int8": "eetq"}
_KV = {"fp8": "fp8_e4m3fn"}
NCCL_PORT = 29500


def _expressible(ctx: ExportContext) -> None:
    L, m = ctx.manifest.layout, ctx.manifest
    if L.pp > 1:
        raise cannot(TARGET, "layout.pp", f"TGI has no pipeline parallelism (pp={L.pp})",
                     "re-plan with --pp 1, or export --to vllm or sglang")
    if L.ep > 1:
        raise cannot(TARGET, "layout.ep", f"TGI shards experts with tensor parallelism only (ep={L.ep})",
                     "re-plan with --ep 1, or export --to vllm or sglang")
    if L.tp > m.hardware.gpus_per_node:
        raise cannot(TARGET, "layout.tp", f"TGI's shards run on one node (tp={L.tp} > {m.hardware.gpus_per_node} GPUs per node)",
                     "export --to vllm or sglang")


def memory_fraction(ctx: ExportContext) -> float:
    return base_memory_utilization(ctx, TARGET, "--cuda-memory-fraction")


def launcher_args(ctx: ExportContext, *, slot: int, port: int) -> list[Arg]:
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    _expressible(ctx)
    L, kv = m.layout, m.predicted.kv_cache
    assert kv is not None
    args: list[Arg] = [("model-id", model_ref(ctx)), ("num-shard", L.tp), ("sharded", "true" if L.tp > 1 else "false")]
    if L.weight_quantization in _QUANT:
        args.append(("quantize", _QUANT[L.weight_quantization]))
    elif L.weight_quantization == "none":  # TGI refuses --dtype together with --quantize
        args.append(("dtype", torch_dtype(wl.activation_dtype)))
    if L.kv_cache_dtype != wl.activation_dtype:
        args.append(("kv-cache-dtype", _KV.get(L.kv_cache_dtype, L.kv_cache_dtype)))
    n = kv.max_model_len_tokens
    args += [
        ("max-input-tokens", n - 1),
        ("max-total-tokens", n),
        ("max-batch-prefill-tokens", max(wl.max_num_batched_tokens, n - 1)),
        ("max-batch-size", wl.max_num_seqs),
        ("cuda-memory-fraction", memory_fraction(ctx)),
    ]
    if wl.enforce_eager:
        args.append(("cuda-graphs", "0"))
    args += [("port", port), ("shard-uds-path", f"/tmp/tgi-replica-{slot}"), ("master-port", NCCL_PORT + slot)]
    return args


def launch_command(ctx: ExportContext, *, slot: int, port: int) -> str:
    return command(flag_table(TARGET), ["text-generation-launcher"], launcher_args(ctx, slot=slot, port=port))


def export_tgi(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    serving(ctx, TARGET)
    _expressible(ctx)
    header = [*plan_header(m, TARGET, flag_table(TARGET)), *each_node_note(ctx)]
    if m.layout.weight_quantization == "int4":
        header.append("int4 weights: point --model-id at a GPTQ/AWQ int4 checkpoint (TGI reads its quantization config)")
    body = replicas_script(ctx, lambda r: launch_command(ctx, slot=r.slot, port=r.port))
    return [ExportFile("serve.sh", script(body, header=header), executable=True)]


def pod_commands(ctx: ExportContext, *, port: int, multi_node: bool) -> tuple[str, str | None]:
    if multi_node:
        _expressible(ctx)
    return launch_command(ctx, slot=0, port=port), None
