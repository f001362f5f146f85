"""The published corpora shardplan ships, read into typed cases.

Each corpus keeps its measurements as published, with their sources: engine start-up logs
(`engine_logs/index.yaml`: a `case:` block per log), training measurements per stack
(`training_stacks/<stack>.yaml`: a `case:` and the `measured:` figures as the source printed
them) and LoRA/QLoRA peaks (`finetune/lora_memory.yaml`). Rows without a complete case (a model
or a GPU shardplan does not have, or a figure that is not a measurement) are listed as skipped
with the reason, never dropped silently.
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
    TrainingCase,
    TrainingMeasured,
)

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
STACKS = ("megatron", "torchtitan", "deepspeed", "hf")


@dataclass(frozen=True)
class Skipped:
    id: str
    reason: str


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
            skipped.append(Skipped(entry["id"], "the log lacks the GPU, the engine version or the flags"))
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
        return Skipped(row["id"], "the row lacks the model, the GPU profile, the batch or the sequence length")
    mem, counter = memory_gib(row.get("measured") or {})
    tps = tokens_per_second_per_gpu(row)
    if mem is None and tps is None:
        return Skipped(row["id"], "no memory or throughput figure")
    tp = c.get("tp") or 1
    fields = dict(
        id=row["id"], source=_source(row["source"]), model=model, shape=c.get("shape") if model is None else None,
        hardware=hardware, gpus=c["gpus"], stack=stack, tp=tp, pp=c.get("pp") or 1, dp=c.get("dp"),
        cp=c.get("cp") or 1, ep=c.get("ep") or 1, vp=c.get("vp") or 1,
        sequence_parallel=c["sequence_parallel"] if isinstance(c.get("sequence_parallel"), bool) else None,
        zero_stage=c.get("zero_stage") or 0, micro_batch=c["micro_batch"], seq_len=c["seq_len"],
        global_batch=c.get("global_batch"), recompute=c.get("recompute") or "none",
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


def shipped_cases(corpus: Path = CORPUS_DIR) -> tuple[list[Case], list[Skipped]]:
    """Every shipped case, engine logs first, then training per stack, then fine-tuning."""
    cases: list[Case] = []
    skipped: list[Skipped] = []
    reader: Callable[[Path], tuple[list[Case], list[Skipped]]]
    for reader in (engine_log_cases, training_cases, finetune_cases):
        got, left = reader(corpus)
        cases += got
        skipped += left
    return cases, skipped


def _typed(kind: type, path: Path | None, row_id: str, fields: dict) -> Any:
    try:
        return kind(**fields)
    except ValidationError as e:  # a shipped row the schema refuses is a bug in the corpus
        raise validation_error(e, f"{path or 'corpus'} (row {row_id})") from None


__all__ = ["CORPUS_DIR", "STACKS", "Skipped", "compiled", "engine_log_cases", "finetune_cases", "memory_gib",
           "shipped_cases", "tokens_per_second_per_gpu", "training_cases", "training_row_case"]
