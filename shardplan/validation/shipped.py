"""The published corpora shardplan ships, read into typed cases.

Each corpus keeps its measurements as published, with their sources: engine start-up logs
(`engine_logs/index.yaml`: a `case:` block per log), training measurements per stack
(`training_stacks/<stack>.yaml`: a `case:` and the `measured:` figures as the source printed
them), LoRA/QLoRA peaks (`finetune/lora_memory.yaml`) and serving benchmark runs
(`serving_load/*.yaml`: each run's result block quoted, its deployment and traffic as fields; the
configs of the models shardplan does not bundle in `serving_load/models`). Rows without a
complete case (a model or a GPU shardplan does not have, or a figure that is not a measurement)
are listed as skipped with the reason, never dropped silently.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shardplan.specs.loading import read_structured, validation_error
from shardplan.units import BYTES_PER_GIB
from shardplan.specs.cases import (
    Case,
    EngineFlags,
    EngineLogCase,
    FineTuneCase,
    ServingLoadCase,
    ServingLoadMeasured,
    TrainingCase,
    TrainingMeasured,
)

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
STACKS = ("megatron", "torchtitan", "deepspeed", "hf")


@dataclass(frozen=True)
class Skipped:
    id: str
    reason: str
    # The run's engine, or the training stack, where the row names one (`validate --engine/--stack` filter on them).
    engine: str | None = None
    stack: str | None = None


def _source(value: Any) -> str:
    """A row's source as one string: the URL, with its locator where the row gives one."""
    if isinstance(value, dict):
        url = value.get("url") or value.get("link") or ""
        where = value.get("locator") or value.get("table") or ""
        return f"{url} ({where})" if url and where else str(url or where)
    return str(value)


def engine_log_cases(corpus: Path = CORPUS_DIR) -> tuple[list[Case], list[Skipped]]:
    path = corpus / "engine_logs" / "index.yaml"
    cases: list[Case] = []
    skipped: list[Skipped] = []
    for entry in read_structured(path):
        c = entry.get("case") or {}
        if not (c.get("hardware") and c.get("engine_version") and c.get("flags_known", True)):
            skipped.append(Skipped(entry["id"], "the log lacks the GPU, the engine version or the flags",
                                   engine=c.get("engine") or entry.get("engine")))
            continue
        cases.append(_typed(EngineLogCase, path, entry["id"], dict(
            id=entry["id"], source=_source(entry["source"]), model=c["model"], hardware=c["hardware"],
            gpus=c["gpus"], engine=c["engine"], engine_version=str(c["engine_version"]), tp=c["tp"],
            pp=c.get("pp") or 1, device_total_gib=c.get("device_total_gib"), device_free_gib=c.get("device_free_gib"),
            flags=EngineFlags(**(c.get("flags") or {})), kv_cache_tokens=c.get("kv_tokens"), started=c["started"])))
    return cases, skipped


def memory_gib(measured: dict) -> tuple[float | None, str]:
    """The peak memory a training row printed, GiB, and its counter (allocated or reserved)."""
    for key, scale in (("peak_memory_gib", 1.0), ("peak_memory_mib", 1 / 1024), ("memory_gib", 1.0),
                       ("mem_max_allocated_bytes", 1 / BYTES_PER_GIB)):
        if isinstance(measured.get(key), (int, float)) and not isinstance(measured.get(key), bool):
            counter = str(measured.get("memory_counter", ""))
            return measured[key] * scale, "allocated" if "allocated" in counter else "reserved"
    return None, "reserved"


def tokens_per_second_per_gpu(row: dict) -> float | None:
    """Measured tokens/s per GPU from whichever throughput figure the source printed; the case's
    seq_len, global_batch and gpus convert samples/s and step times (one step = the global
    batch). Where the source printed only a TFLOP/s figure, the row's `inferred` value (the
    source's own FLOP formula inverted, shown in the row) is used."""
    measured, c = row.get("measured") or {}, row["case"]
    gpus, seq = c["gpus"], c["seq_len"]

    def number(key: str, d: dict = measured) -> float | None:
        v = d.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    if (v := number("tokens_per_s_per_gpu")) is not None:
        return v
    if (v := number("tokens_per_s_all_gpus")) is not None:
        return v / gpus
    if (v := number("samples_per_s_all_gpus")) is not None:
        return v * seq / gpus
    if (v := number("step_time_s")) is not None:
        return (c.get("global_batch") or gpus * c["micro_batch"]) * seq / gpus / v
    inferred = row.get("inferred") or {}
    if isinstance(inferred.get("tokens_per_s_per_gpu"), str):  # "inferred: <how> = N": the N
        m = re.search(r"=\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*$", inferred["tokens_per_s_per_gpu"])
        return float(m.group(1).replace(",", "")) if m else None
    return number("tokens_per_s_per_gpu", inferred)


def compiled(value: Any) -> bool:
    """torch_compile as the rows write it: a bool, or text such as "true (inductor)" or "regional
    compilation (...)"; "not stated" and "false" are eager."""
    if isinstance(value, bool):
        return value
    text = str(value or "").lower()
    return text.startswith("true") or ("compil" in text and not text.startswith(("false", "no", "not")))


def training_row_case(stack: str, row: dict, path: Path | None = None) -> TrainingCase | Skipped:
    """One `training_stacks/<stack>.yaml` row as a case, or why it cannot be predicted."""
    c = row.get("case") or {}
    model, hardware = c.get("model"), c.get("hardware") or c.get("closest_hardware_profile") or row.get(
        "closest_hardware_profile")
    has_model = isinstance(model, str) or (model is None and isinstance(c.get("shape"), dict))
    if not (has_model and hardware and c.get("gpus") and c.get("micro_batch") and c.get("seq_len")):
        return Skipped(row["id"], "the row lacks the model, the GPU profile, the batch or the sequence length",
                       stack=stack)
    mem, counter = memory_gib(row.get("measured") or {})
    tps = tokens_per_second_per_gpu(row)
    if mem is None and tps is None:
        return Skipped(row["id"], "no memory or throughput figure", stack=stack)
    tp = c.get("tp") or 1
    fields = dict(
        id=row["id"], source=_source(row["source"]), model=model, shape=c.get("shape") if model is None else None,
        hardware=hardware, gpus=c["gpus"], stack=stack, tp=tp, pp=c.get("pp") or 1, dp=c.get("dp"),
        cp=c.get("cp") or 1, ep=c.get("ep") or 1, vp=c.get("vp") or 1,
        sequence_parallel=c["sequence_parallel"] if isinstance(c.get("sequence_parallel"), bool) else None,
        zero_stage=c.get("zero_stage") or 0, micro_batch=c["micro_batch"], seq_len=c["seq_len"],
        global_batch=c.get("global_batch"), recompute=c.get("recompute") or "none",
        recompute_modules=c.get("recompute_modules"),
        flash_attention=c.get("flash_attention"), dropout=bool(c.get("dropout")), fp8=c.get("dtype") == "fp8",
        compile=compiled(row.get("torch_compile")), compile_loss=c.get("compile_loss"),
        tp_comm_overlap=bool(c.get("tp_comm_overlap")), pp_embedding_as_layer=bool(c.get("pp_embedding_as_layer")),
        pp_loss_as_layer=bool(c.get("pp_loss_as_layer")),
        master_dtype=c.get("master_dtype") or "fp32", moment_dtype=c.get("moment_dtype") or "fp32",
        reduce_bucket_size=c.get("reduce_bucket_size"), overlap_comm=c.get("overlap_comm", True),
        measured=TrainingMeasured(peak_memory_gib=mem, memory_counter=counter, tokens_per_second_per_gpu=tps))
    return _typed(TrainingCase, path, row["id"], fields)


def training_cases(corpus: Path = CORPUS_DIR, stacks: tuple[str, ...] = STACKS) -> tuple[list[Case], list[Skipped]]:
    cases: list[Case] = []
    skipped: list[Skipped] = []
    for stack in stacks:
        path = corpus / "training_stacks" / f"{stack}.yaml"
        for row in read_structured(path)["rows"]:
            got = training_row_case(stack, row, path)
            (skipped if isinstance(got, Skipped) else cases).append(got)
    return cases, skipped


def finetune_cases(corpus: Path = CORPUS_DIR) -> tuple[list[Case], list[Skipped]]:
    path = corpus / "finetune" / "lora_memory.yaml"
    cases: list[Case] = []
    skipped: list[Skipped] = []
    for row in read_structured(path)["rows"]:
        c = row.get("case")
        if not c:
            skipped.append(Skipped(row["id"], f"stack {str(row.get('stack', '?')).split(' ')[0]} or its model is not "
                                              "one shardplan predicts"))
            continue
        fields = {k: v for k, v in c.items() if k != "note"}
        if isinstance(fields.get("lora_targets"), str):  # "q_proj,v_proj" as the CLI takes it
            fields["lora_targets"] = [t.strip() for t in fields["lora_targets"].split(",") if t.strip()]
        cases.append(_typed(FineTuneCase, path, row["id"], dict(id=row["id"], source=_source(row["source"]), **fields)))
    return cases, skipped


SERVING_LOAD_FILES = ("gpustack_performance_lab.yaml", "sglang_cookbook.yaml", "vllm_recipes_and_github_threads.yaml")
# The GPUs the runs name -> shardplan's profiles.
SERVING_GPUS = {
    "NVIDIA H100 SXM (80GB)": "h100-sxm-80gb",
    "NVIDIA H200 SXM (141GB)": "h200-sxm-141gb",
    "NVIDIA B200": "b200-sxm-180gb",
    "NVIDIA A100 80GB": "a100-sxm-80gb",
    "NVIDIA A100 (memory size not stated)": "a100-sxm-80gb",
}
# Engine flags the model reads (as EngineFlags, or as the layout: enable_expert_parallel puts the
# experts over the tensor-parallel ranks; guided decoding is off in these runs' requests); a run with
# any other flag is listed as skipped, never judged.
SERVING_FLAGS = {"max_model_len", "max_num_batched_tokens", "max_num_seqs", "enforce_eager", "gpu_memory_utilization",
                 "async_scheduling", "disable_overlap_schedule"}
SERVING_LAYOUT_FLAGS = {"enable_expert_parallel", "guided_decoding_backend"}
# SGLang releases that switch --enable-dp-attention off when --dp is 1 (its default), so that
# `--tp 8 --enable-dp-attention` alone runs plain tensor parallelism: ServerArgs._handle_data_parallelism,
# "if self.dp_size == 1: self.enable_dp_attention = False" (python/sglang/srt/server_args.py in the 0.5.3
# wheel; attention is then split tp_size // dp_size = 8 ways, layers/dp_attention.py
# compute_dp_attention_world_info). Only the release read is listed.
SGLANG_DP_ATTENTION_OFF_AT_DP1 = {"0.5.3"}
# Bundled model specs for the runs whose config is not in serving_load/models.
SERVING_BUNDLED = {"meta-llama/Llama-3.1-70B": "llama-3.1-70b", "deepseek-ai/DeepSeek-R1-0528": "deepseek-v3",
                   "Qwen/Qwen3-235B-A22B-Instruct-2507": "qwen3-235b-a22b"}


def _engine_version(text: str) -> str | None:
    """'v0.11.0' -> '0.11.0', '0.5.5.post1' -> '0.5.5', '0.5.3rc0' -> '0.5.3' (a release candidate
    runs its release's rules); None when the run names no release."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.\d+)?(?:rc\d+|\.post\d+)?$", str(text).split()[0])
    return ".".join(g for g in m.groups() if g is not None) if m else None


def _serving_model(row: dict, models: Path) -> str | None:
    """A bundled name, or the config in `models` named like the served checkpoint (relative to the corpus)."""
    hf = row["hf_id"]
    if hf in SERVING_BUNDLED:
        return SERVING_BUNDLED[hf]
    names = {f.stem.lower(): f for f in models.glob("*.json")} if models.is_dir() else {}
    for candidate in (str(row.get("served_checkpoint") or hf).split("/")[-1].lower(), hf.split("/")[-1].lower()):
        if candidate in names:
            return f"{models.parent.name}/{models.name}/{names[candidate].name}"
    return None


def _serving_client(row: dict) -> str:
    """SGLang's bench_serving sent the requests (the cookbook's commands), else vLLM's client."""
    command = str(row.get("benchmark_command", ""))
    sglang = "vllm bench" not in command and "benchmark_serving" not in command and "sglang" in command
    return "sglang" if sglang else "vllm"


def serving_load_row_case(row: dict, corpus: Path = CORPUS_DIR, path: Path | None = None) -> ServingLoadCase | Skipped:
    """One published serving run as a case, or why the model is not asked about it."""
    if not row.get("golden_suitable"):
        return Skipped(row["id"], f"not a complete run: {row.get('golden_unsuitable_reason') or 'see its note'}",
                       engine=row.get("engine"))
    flags = dict(row.get("engine_flags") or {})
    if (row.get("engine") == "sglang" and (row.get("dp") or 1) == 1 and flags.get("enable_dp_attention")
            and _engine_version(str(row.get("engine_version", ""))) in SGLANG_DP_ATTENTION_OFF_AT_DP1):
        del flags["enable_dp_attention"]  # the server ran plain tensor parallelism (SGLANG_DP_ATTENTION_OFF_AT_DP1)
    extra = sorted(set(flags) - SERVING_FLAGS - SERVING_LAYOUT_FLAGS)
    if extra:
        return Skipped(row["id"], f"flags not modelled: {', '.join(extra)}", engine=row.get("engine"))
    model = _serving_model(row, corpus / "serving_load" / "models")
    if model is None:
        return Skipped(row["id"], f"no config for {row['hf_id']} in serving_load/models", engine=row.get("engine"))
    hardware = SERVING_GPUS.get(row["gpu"])
    if hardware is None:
        return Skipped(row["id"], f"no profile for {row['gpu']}", engine=row.get("engine"))
    version = _engine_version(row["engine_version"])
    if version is None:
        return Skipped(row["id"], "engine version not stated", engine=row.get("engine"))
    if (row.get("dp") or 1) > 1:
        return Skipped(row["id"], "data-parallel attention not modelled", engine=row.get("engine"))
    tp = int(row["tp"])
    quant = (row.get("quantization") or "").lower()
    m = row["measured"]
    rate = row.get("request_rate")
    return _typed(ServingLoadCase, path, row["id"], dict(
        id=row["id"], source=_source(row["source"]), model=model, hardware=hardware, gpus=tp * int(row.get("pp") or 1),
        engine=row["engine"], engine_version=version, tp=tp, pp=int(row.get("pp") or 1),
        ep=tp if flags.get("enable_expert_parallel") else int(row.get("ep") or 1),
        flags=EngineFlags(**{k: v for k, v in flags.items() if k in SERVING_FLAGS}),
        quantization="fp8" if quant.startswith("fp8") else "awq" if quant.startswith("awq") else None,
        client=_serving_client(row), dataset=row["dataset"], input_len=row.get("input_len"),
        output_len=row.get("output_len"), num_requests=int(m["successful_requests"]),
        total_input_tokens=int(m["total_input_tokens"]), total_output_tokens=int(m["total_generated_tokens"]),
        max_concurrency=row.get("max_concurrency"),
        request_rate_per_second=None if rate in (None, "inf") else float(rate),
        measured=ServingLoadMeasured(median_ttft_ms=m["median_ttft_ms"], median_tpot_ms=m.get("median_tpot_ms"),
                                     median_itl_ms=m.get("median_itl_ms"),
                                     output_tokens_per_second=m["output_tokens_per_second"])))


def serving_load_cases(corpus: Path = CORPUS_DIR) -> tuple[list[Case], list[Skipped]]:
    cases: list[Case] = []
    skipped: list[Skipped] = []
    for name in SERVING_LOAD_FILES:
        path = corpus / "serving_load" / name
        for row in read_structured(path)["runs"]:
            got = serving_load_row_case(row, corpus, path)
            (skipped if isinstance(got, Skipped) else cases).append(got)
    return cases, skipped


def shipped_cases(corpus: Path = CORPUS_DIR) -> tuple[list[Case], list[Skipped]]:
    """Every shipped case: engine logs, training per stack, fine-tuning, serving benchmark runs."""
    cases: list[Case] = []
    skipped: list[Skipped] = []
    reader: Callable[[Path], tuple[list[Case], list[Skipped]]]
    for reader in (engine_log_cases, training_cases, finetune_cases, serving_load_cases):
        got, left = reader(corpus)
        cases += got
        skipped += left
    return cases, skipped


def _typed(kind: type, path: Path | None, row_id: str, fields: dict) -> Any:
    try:
        return kind(**fields)
    except ValidationError as e:  # a shipped row the schema refuses is a bug in the corpus
        raise validation_error(e, f"{path or 'corpus'} (row {row_id})") from None


__all__ = ["CORPUS_DIR", "SERVING_GPUS", "STACKS", "Skipped", "compiled", "engine_log_cases", "finetune_cases", "memory_gib",
           "serving_load_cases", "serving_load_row_case", "shipped_cases", "tokens_per_second_per_gpu", "training_cases",
           "training_row_case"]
