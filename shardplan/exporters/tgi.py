"""Hugging Face TGI: `text-generation-launcher` per replica, checked against the flag list of the
plan's TGI version (`flags/tgi-<version>.yaml`, read from the launcher's clap struct at the release
tag and cross-checked against its --help page by tools/dump_tgi_flags.py; base.engine_flags picks
the list, by default the pinned 3.3.7, TGI's last release). TGI shards a model with tensor parallelism on one node only: it has
no pipeline parallelism, no multi-node shards and no expert parallelism (experts are tensor
sharded), so plans with those are refused. Replicas run as separate launchers, each on its
own GPUs, port, shard socket and NCCL port.
- --cuda-memory-fraction caps what a shard uses (weights, KV cache, activations), the meaning
  of vLLM's --gpu-memory-utilization: the plan's, raised to the least that holds one
  max_model_len sequence when that is more. TGI sizes its KV cache itself after a warm-up.
- --max-total-tokens = max_model_len; --max-input-tokens one less (TGI requires input < total).
- weights: fp8 -> --quantize fp8, awq/gptq by name; int8 -> eetq (8-bit weights quantized at
  load: the same bytes as the plan's W8A8); int4 needs a GPTQ/AWQ checkpoint (TGI reads it).
- metrics: the router builds its Prometheus exporter on 0.0.0.0:9000 (metrics-exporter-prometheus's
  default listener; router/src/server.rs) and exits with "failed to build prometheus recorder" when
  that port is taken (huggingface/text-generation-inference#3062). --prometheus-port arrived in
  v3.3.0 (PR #3187): with a chosen list that has it (3.3.7), each replica on a node gets its own
  (9000 + slot); with 3.2.0's, the script says that replicas of one node contend for 9000.
  Kubernetes pods each have their own network namespace, so they never contend.
"""

from __future__ import annotations

from shardplan.exporters.base import (
    memory_utilization as base_memory_utilization,
    Arg,
    ChosenFlags,
    ExportContext,
    ExportFile,
    FlagTable,
    command,
    engine_flags,
    model_ref,
    plan_header,
    script,
    serving,
    torch_dtype,
)
from shardplan.exporters.serving import each_node_note, node_replicas, replicas_script
from shardplan.exporters.targets import check

TARGET = "tgi"
_QUANT = {"fp8": "fp8", "awq": "awq", "gptq": "gptq", "int8": "eetq"}
_KV = {"fp8": "fp8_e4m3fn"}
NCCL_PORT = 29500
PROMETHEUS_PORT = 9000  # the router's default metrics listener (see above)
HEALTH_PATH = "/health"  # GET, 200 when the shards answer (router/src/server.rs at v3.2.0)
# Printed in every TGI serve.sh: the project's README has said it is in maintenance mode since PR #3344
# (2025-12-11): "text-generation-inference is now in maintenance mode" (minor bug fixes, docs and
# lightweight maintenance only). v3.3.7 (2025-12-18) is the newest tag of its repository.
MAINTENANCE_NOTICE = ("notice: TGI has been in maintenance mode since December 2025 (source: its README, "
                      "https://github.com/huggingface/text-generation-inference, PR #3344; 3.3.7 is its newest "
                      "release); consider --to vllm or sglang")


def flags(ctx: ExportContext) -> ChosenFlags:
    """The launcher's flag list for this export: the plan's --engine-version's (base.engine_flags)."""
    return engine_flags(ctx, TARGET)


def image(ctx: ExportContext) -> str:
    """The release image of the flag list's version (ghcr.io tags carry no leading v)."""
    return f"ghcr.io/huggingface/text-generation-inference:{flags(ctx).table.version}"


def _expressible(ctx: ExportContext) -> None:
    """No pipeline or expert parallelism, shards on one node, no offload (knowledge/targets.yaml)."""
    check(ctx, TARGET)


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
    if has_prometheus_port(flags(ctx).table):
        args.append(("prometheus-port", PROMETHEUS_PORT + slot))
    return args


def has_prometheus_port(table: FlagTable) -> bool:
    """Whether the launcher of that list can move the router's metrics listener (TGI >= 3.3.0)."""
    return "prometheus-port" in table.flags


def launch_command(ctx: ExportContext, *, slot: int, port: int) -> str:
    return command(flags(ctx).table, ["text-generation-launcher"], launcher_args(ctx, slot=slot, port=port))


def export_tgi(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    serving(ctx, TARGET)
    _expressible(ctx)
    chosen = flags(ctx)
    header = [*plan_header(m, TARGET, chosen), MAINTENANCE_NOTICE, *each_node_note(ctx)]
    if m.layout.weight_quantization == "int4":
        header.append("int4 weights: point --model-id at a GPTQ/AWQ int4 checkpoint (TGI reads its quantization config)")
    if len(node_replicas(ctx)) > 1 and not has_prometheus_port(chosen.table):
        header.append(f"TGI {chosen.table.version}'s routers all bind the metrics port {PROMETHEUS_PORT} at start "
                      "(no --prometheus-port before 3.3.0): if a replica exits with 'failed to build prometheus "
                      "recorder', start the replicas one after another")
    body = replicas_script(ctx, lambda r: launch_command(ctx, slot=r.slot, port=r.port))
    return [ExportFile("serve.sh", script(body, header=header), executable=True)]


def pod_commands(ctx: ExportContext, *, port: int, multi_node: bool) -> tuple[str, str | None]:
    if multi_node:
        _expressible(ctx)
    return launch_command(ctx, slot=0, port=port), None
