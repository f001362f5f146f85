"""Measured cases made from what `shardplan calibrate` is given, so that a calibrated profile
carries the runs it was calibrated from (its `measured_cases:`) and its predictions are banded
by them (tasks/_bands.py).

- a plan and the engine start-up log of that plan's deployment -> an `engine_log` case: the
  plan gives the model, tp/pp, the engine, its flags (as the plan resolved them) and the version
  (the log's own where it prints one: that is what ran); the log gives the KV capacity (V1's
  'GPU KV cache size' tokens, V0's blocks x the plan's block size) and whether it started;
- a GPU `verify --report` of a training plan -> a `training` case: the plan's layout and stack,
  the peak of torch's allocated counter over the ranks (`memory_peak.allocated_peak_bytes`).

Each case's `hardware` is the calibrated profile's own file name (the loader points it at the
profile wherever the file is), and its `source` names the log or report and the date. What
cannot be a case (a proxy-scale run, a fine-tuning or stackless plan, speculative decoding the
case schema cannot state) is returned as the reason, which calibrate prints as a note.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardplan.errors import InputFileError, ShardplanError
from shardplan.knowledge.load import engine_rules
from shardplan.plan.readback import BUNDLED_PREFIX, PlanInputs
from shardplan.plan.schema import InferenceWorkloadSection, TrainingWorkloadSection
from shardplan.specs.cases import EngineFlags, EngineLogCase, TrainingCase, TrainingMeasured
from shardplan.specs.engine_log import EngineLog
from shardplan.units import BYTES_PER_GIB

# The plan's weight format -> a vLLM --quantization the case schema maps back to it
# (validation/predict.py QUANTIZATION).
PLAN_QUANTIZATION = {"none": None, "fp8": "fp8", "int8": "eetq", "int4": "gptq", "gptq": "gptq", "awq": "awq"}
STACKS = ("megatron", "torchtitan", "deepspeed", "hf")


def case_id(path: Path) -> str:
    """A case id from a file name: its stem with the characters ids refuse replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9_.:+-]", "_", path.stem)[:200] or "case"


def measured_source(path: Path, what: str, day: datetime.date | None = None) -> str:
    """'engine log vllm.log, calibrated 2025-06-01'."""
    return f"{what} {path.name}, calibrated {(day or datetime.date.today()).isoformat()}"


def model_ref(plan: PlanInputs, profile_dir: Path) -> str:
    """The plan's model as a case names it: a bundled name, a Hub id, or the spec file, relative
    to the profile's folder when it lies under it (the loader resolves it there), else absolute."""
    src = plan.manifest.model.source
    if src.startswith(BUNDLED_PREFIX):
        return src.removeprefix(BUNDLED_PREFIX)
    path = Path(src).expanduser()
    if not path.exists():
        return src  # a Hub id (hf:org/name@commit), read from the Hub cache as the plan was
    path, folder = path.resolve(), profile_dir.resolve()
    return os.path.relpath(path, folder) if path.is_relative_to(folder) else str(path)


def engine_log_case(plan: PlanInputs, log: EngineLog, *, hardware: str, model: str,
                    source: str) -> EngineLogCase | str:
    """The plan's deployment as its log measured it, or why it cannot be a case."""
    w = plan.manifest.workload
    if not isinstance(w, InferenceWorkloadSection):
        raise InputFileError("a training plan: an engine log is the start-up of a serving plan", source=plan.source,
                             field="workload.kind", hint="pass the serving plan this log's engine was started from")
    if w.engine != log.engine:
        raise InputFileError(f"the plan is for {w.engine}, the log is {log.engine}'s", source=plan.source,
                             field="workload.engine", hint="pass the plan this log's engine was started from")
    if w.speculative is not None:
        return "the plan uses speculative decoding, which a measured case cannot state"
    version = log.engine_version or w.engine_version
    if version is None:
        return "neither the log nor the plan names the engine version"
    try:
        engine_rules(log.engine, version)  # the case must predict: a version shardplan has rules for
    except ShardplanError as e:
        return f"shardplan has no rules for {log.engine} {version} ({e.message})"
    if log.refused:
        tokens, started = None, False
    elif log.kv_cache_tokens is not None:
        tokens, started = log.kv_cache_tokens.value, True
    elif log.num_gpu_blocks is not None:
        tokens, started = log.num_gpu_blocks.value * w.block_size, True
    else:
        return "the log prints neither the KV cache size nor a refusal"
    L = plan.manifest.layout
    total = log.total_gpu_memory_bytes
    flags = EngineFlags(max_model_len=w.max_model_len, max_num_seqs=w.max_num_seqs,
                        max_num_batched_tokens=w.max_num_batched_tokens,
                        gpu_memory_utilization=w.gpu_memory_utilization, enforce_eager=w.enforce_eager,
                        quantization=PLAN_QUANTIZATION[w.quantization],
                        kv_cache_dtype=w.kv_cache_dtype if w.kv_cache_dtype != w.activation_dtype else None)
    return EngineLogCase(
        id=case_id(Path(log.source)), source=source, model=model, hardware=hardware, gpus=L.tp * L.pp,
        engine=log.engine, engine_version=version, tp=L.tp, pp=L.pp,
        device_total_gib=total.value / BYTES_PER_GIB if total is not None and total.value > 0 else None,
        flags=flags, kv_cache_tokens=tokens, started=started)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Peak(_Loose):
    allocated_peak_bytes: int = Field(gt=0)


class _Rank(_Loose):
    rank: int = Field(ge=0)
    memory_peak: _Peak | None = None


class _Run(_Loose):
    kind: Literal["training", "inference"]
    scale: str
    dtype: str
    plan_dtype: str | None = None
    work: dict[str, Any] = Field(default_factory=dict)


class _Measured(_Loose):
    status: str
    run: _Run
    ranks: list[_Rank] = Field(default_factory=list)


def training_case(plan: PlanInputs, report: Any, *, report_source: str, hardware: str, model: str,
                  source: str, case: str) -> TrainingCase | str:
    """A GPU verify report's allocated peak of a full-scale training run, in the plan's format,
    as a case of the plan's stack; or why it cannot be one (a report without its `run` and
    `ranks` sections among them: its probes still calibrate)."""
    try:
        r = _Measured.model_validate(report)
    except ValidationError as e:  # the probes calibrate still reads may be there: a note, not an error
        err = e.errors(include_url=False)[0]
        return f"{report_source}: {'.'.join(str(p) for p in err['loc']) or 'the report'}: {err['msg']}"
    w = plan.manifest.workload
    if r.run.kind != "training" or not isinstance(w, TrainingWorkloadSection):
        return "a serving run: its memory is checked by verify, and a serving case is an engine's start-up log"
    if r.status == "oom":
        return "the run ran out of memory, so it has no complete peak"
    if r.run.scale != "full" or (r.run.plan_dtype is not None and r.run.dtype != r.run.plan_dtype):
        return f"the run was at --scale {r.run.scale} in {r.run.dtype}, not the plan's model in its format"
    if w.finetune != "full":
        return f"a {w.finetune} plan: fine-tuning cases are not made from verify reports"
    if w.stack not in STACKS:
        return f"the plan names no training stack ({', '.join(STACKS)}), which a training case needs"
    peaks = [x.memory_peak.allocated_peak_bytes for x in r.ranks if x.memory_peak is not None]
    if not peaks:
        return "the report has no per-rank allocated peak"
    L, m = plan.manifest.layout, plan.manifest
    work = r.run.work
    return TrainingCase(
        id=case, source=source, model=model, hardware=hardware, gpus=m.hardware.num_gpus, stack=w.stack,
        tp=L.tp, pp=L.pp, dp=L.dp, cp=L.cp, ep=L.ep, vp=L.virtual_stages, sequence_parallel=L.sequence_parallel,
        zero_stage=L.zero_stage, micro_batch=int(work.get("micro_batch_size") or L.micro_batch_size),
        seq_len=int(work.get("seq_len") or w.seq_len), global_batch=w.global_batch_size, recompute=L.recompute,
        flash_attention=w.flash_attention, dropout=w.dropout, fp8=w.matmul_dtype == "fp8",
        tp_comm_overlap=w.tp_comm_overlap, pp_embedding_as_layer=L.pp_embedding_as_layer,
        pp_loss_as_layer=L.pp_loss_as_layer,
        measured=TrainingMeasured(peak_memory_gib=max(peaks) / BYTES_PER_GIB, memory_counter="allocated"))


__all__ = ["PLAN_QUANTIZATION", "case_id", "engine_log_case", "measured_source", "model_ref", "training_case"]
