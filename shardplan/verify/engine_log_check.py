"""An engine's own start-up log against the cost model: one row per figure both state.
Pure: no torch, no I/O.

Which log figure is which cost-model term (shardplan/cost/memory_serving.py, vLLM semantics):
- weights: vLLM's "model weights take" / "Loading model weights took" is what the load
  allocated, rotary cos/sin cache included -> `per_gpu_bytes["weights"]` of stage 0 (the driver
  prints its own rank; stage 0 is rank 0's stage).
- activations: vLLM >= 0.6.5 prints the activation peak; 0.6.4 prints `peak_torch_memory`
  (weights + activations), so the measured term is peak_torch - weights -> `["activations"]`.
- non_torch, cuda_graphs: `detail_bytes["overhead.non_torch"]`, `["overhead.cuda_graphs"]`; profile
  constants, reported, not checked (their error shows in the KV cache rows).
- kv_cache bytes, tokens, blocks, max concurrency: vLLM sizes the cache on every rank and uses
  the minimum, so the prediction is the minimum over pipeline stages (`kv_cache.*`).
- the budget (total_gpu_memory x gpu_memory_utilization) -> `memory.budget_bytes`.
- inputs the log echoes (gpu_memory_utilization, the max_model_len of the concurrency line or the
  refusal) must equal the plan's, else the comparison is of different runs.
SGLang and TGI logs: checked like vLLM's when the plan was sized by that engine's rules
(`--engine sglang|tgi`); against a plan sized by another engine's rules their KV figures are
reported with no tolerance. A log that prints its version (vLLM) must be the plan's version.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from shardplan.cost.report import CostReport
from shardplan.errors import ShardplanError
from shardplan.knowledge.schema import parse_version
from shardplan.specs._base import StrictModel
from shardplan.specs.engine_log import ENGINE_NAMES, EngineLog, IntTerm
from shardplan.verify.compare import TOLERANCES

# KV capacity (bytes, tokens, blocks, concurrency) is what is left of the budget after every
# other term, so each of their errors adds up in it: a wider band than one component's.
KV_CAPACITY_TOLERANCE = 0.05
# Device memory as torch reports it against the profile's capacity, and the budget from it.
DEVICE_MEMORY_TOLERANCE = TOLERANCES["weights"]
INPUT_TOLERANCE = 0.0  # an input the log echoes must be the plan's own

Term = Literal["total_gpu_memory", "gpu_memory_utilization", "max_model_len", "budget", "weights", "activations",
               "non_torch", "cuda_graphs", "kv_cache", "kv_cache_tokens", "num_gpu_blocks", "max_concurrency"]
Unit = Literal["bytes", "tokens", "blocks", "fraction", "ratio"]


class PredictedServing(StrictModel):
    """The cost model's figures an engine log can state, taken from a serving CostReport."""

    memory_capacity_bytes: float = Field(description="the profile's device memory, bytes")
    gpu_memory_utilization: float = Field(description="the plan's share of device memory (fraction)")
    max_model_len: int = Field(description="the plan's max_model_len, tokens")
    budget_bytes: float = Field(description="capacity x gpu_memory_utilization, bytes")
    weights_bytes: float = Field(description="stage 0's weights (rotary cache included), bytes")
    activation_peak_bytes: float = Field(description="stage 0's profiling-pass activation peak, bytes")
    non_torch_bytes: float | None = Field(description="stage 0's non-torch memory, bytes; None: not itemised")
    cuda_graph_bytes: float | None = Field(description="stage 0's CUDA-graph memory, bytes; None: not itemised")
    kv_cache_bytes: float = Field(description="the KV cache of the tightest stage, bytes")
    kv_cache_tokens: int = Field(description="tokens the cache holds (minimum over stages)")
    num_gpu_blocks: int = Field(description="paged blocks (minimum over stages)")
    max_concurrency: float = Field(description="max_model_len sequences the cache holds")
    overhead_bytes: float | None = Field(None, description="stage 0's runtime overheads inside the budget, bytes")
    engine: str = Field("vllm", description="the engine whose rules sized the plan")
    engine_version: str | None = Field(None, description="its version; None: no version rules")
    fits: bool = Field(description="the plan fits (the engine would start)")
    reason: str | None = Field(description="why not, when it does not fit")


def predicted_from_report(report: CostReport) -> PredictedServing:
    """The figures of a serving estimate that an engine log can be held against."""
    kv = report.kv_cache
    if kv is None or report.training:
        raise ShardplanError("the plan is a training plan: an inference engine's log cannot check it",
                             field="workload.kind", hint="pass a serving plan")
    stage0 = report.memory.per_rank[0]
    wl = report.workload
    return PredictedServing(
        memory_capacity_bytes=report.hardware.memory_capacity_bytes,
        gpu_memory_utilization=getattr(wl, "gpu_memory_utilization"),
        max_model_len=kv.max_model_len,
        budget_bytes=report.memory.budget_bytes,
        weights_bytes=stage0.per_gpu_bytes["weights"],
        activation_peak_bytes=stage0.per_gpu_bytes.get("activations", 0.0),
        non_torch_bytes=stage0.detail_bytes.get("overhead.non_torch"),
        cuda_graph_bytes=stage0.detail_bytes.get("overhead.cuda_graphs"),
        kv_cache_bytes=min(r.per_gpu_bytes["kv_cache"] for r in report.memory.per_rank),
        overhead_bytes=stage0.per_gpu_bytes.get("overhead"),
        engine=getattr(wl, "engine", "vllm"), engine_version=getattr(wl, "engine_version", None),
        kv_cache_tokens=kv.capacity_tokens,
        num_gpu_blocks=kv.num_blocks,
        max_concurrency=kv.max_concurrency,
        fits=report.fits,
        reason=report.reason,
    )


class TermCheck(StrictModel):
    """One figure the log and the cost model both state."""

    term: Term = Field(description="the cost-model term")
    unit: Unit = Field(description="unit of measured and predicted")
    measured: float = Field(description="what the engine printed, in SI units")
    predicted: float = Field(description="the cost model's figure, in SI units")
    relative_error: float | None = Field(description="(measured - predicted) / predicted; None: predicted 0")
    tolerance: float | None = Field(description="allowed |relative_error| (fraction); None: reported, not checked")
    ok: bool = Field(description="within tolerance (always true when not checked)")
    log_line: int = Field(description="the log line the measured figure comes from")
    note: str | None = Field(None, description="how the measured figure was derived, when it needs saying")


class VerdictCheck(StrictModel):
    """Did the engine start, and did the cost model say it would?"""

    engine_started: bool = Field(description="false: the log holds the engine's refusal")
    predicted_fits: bool = Field(description="the cost model's verdict")
    checked: bool = Field(description="false: not comparable (an engine whose budget the cost model does not follow)")
    ok: bool = Field(description="they agree (always true when not checked)")
    log_line: int | None = Field(description="the refusal's line; None: no refusal in the log")
    predicted_reason: str | None = Field(description="the cost model's reason, when it predicts a refusal")


class EngineLogCheck(StrictModel):
    """What `verify PLAN --engine-log FILE --json` prints."""

    plan: str = Field(description="the manifest")
    log: EngineLog = Field(description="what the log said")
    status: Literal["ok", "mismatch"] = Field(description="mismatch: a checked row or the verdict out of tolerance")
    terms: list[TermCheck] = Field(description="one row per figure both state")
    verdict: VerdictCheck = Field(description="started or refused, against fits")
    mismatches: list[str] = Field(description="one line per row out of tolerance")
    notes: list[str] = Field(description="what could not be compared and why")


def _relative_error(measured: float, predicted: float) -> float | None:
    if predicted == 0:
        return 0.0 if measured == 0 else None
    return (measured - predicted) / predicted


def _row(term: Term, unit: Unit, measured: float, predicted: float, tolerance: float | None, line: int,
         note: str | None = None) -> TermCheck:
    err = _relative_error(measured, predicted)
    ok = tolerance is None or (err is not None and math.isfinite(err) and abs(err) <= tolerance + 1e-12)
    return TermCheck(term=term, unit=unit, measured=measured, predicted=predicted, relative_error=err,
                     tolerance=tolerance, ok=ok, log_line=line, note=note)


def _vllm_rows(log: EngineLog, p: PredictedServing) -> list[TermCheck]:
    rows: list[TermCheck] = []
    if log.total_gpu_memory_bytes:
        t = log.total_gpu_memory_bytes
        rows.append(_row("total_gpu_memory", "bytes", t.value, p.memory_capacity_bytes, DEVICE_MEMORY_TOLERANCE, t.line,
                         "torch's total against the hardware profile's capacity"))
    if log.gpu_memory_utilization:
        u = log.gpu_memory_utilization
        rows.append(_row("gpu_memory_utilization", "fraction", u.value, p.gpu_memory_utilization, INPUT_TOLERANCE,
                         u.line, "an input: the log's run must use the plan's"))
    for lens, what in ((log.max_concurrency_tokens_per_request, "the max-concurrency line"),
                       (log.refusal_max_model_len, "the refusal")):
        if lens:
            rows.append(_row("max_model_len", "tokens", lens.value, p.max_model_len, INPUT_TOLERANCE, lens.line,
                             f"an input, from {what}: the log's run must use the plan's"))
            break
    if log.budget_bytes:
        rows.append(_row("budget", "bytes", log.budget_bytes.value, p.budget_bytes, DEVICE_MEMORY_TOLERANCE,
                         log.budget_bytes.line))
    elif log.total_gpu_memory_bytes and log.gpu_memory_utilization:
        rows.append(_row("budget", "bytes", log.total_gpu_memory_bytes.value * log.gpu_memory_utilization.value,
                         p.budget_bytes, DEVICE_MEMORY_TOLERANCE, log.total_gpu_memory_bytes.line,
                         "total_gpu_memory x gpu_memory_utilization"))
    if log.weights_bytes:
        rows.append(_row("weights", "bytes", log.weights_bytes.value, p.weights_bytes, TOLERANCES["weights"],
                         log.weights_bytes.line, "rotary cache included"))
    if log.activation_peak_bytes:
        rows.append(_row("activations", "bytes", log.activation_peak_bytes.value, p.activation_peak_bytes,
                         TOLERANCES["activations"], log.activation_peak_bytes.line))
    elif log.peak_torch_bytes and log.weights_bytes:
        rows.append(_row("activations", "bytes", log.peak_torch_bytes.value - log.weights_bytes.value,
                         p.activation_peak_bytes, TOLERANCES["activations"], log.peak_torch_bytes.line,
                         "peak_torch_memory - weights (vLLM 0.6.4 prints their sum)"))
    if log.non_torch_bytes and p.non_torch_bytes is not None:
        rows.append(_row("non_torch", "bytes", log.non_torch_bytes.value, p.non_torch_bytes, None,
                         log.non_torch_bytes.line, "the hardware profile's constant; its error shows in kv_cache"))
    if log.cuda_graph_bytes and p.cuda_graph_bytes is not None:
        rows.append(_row("cuda_graphs", "bytes", log.cuda_graph_bytes.value, p.cuda_graph_bytes, None,
                         log.cuda_graph_bytes.line, "the hardware profile's constant"))
    kv_bytes = log.kv_cache_bytes or log.refusal_available_bytes
    if kv_bytes:
        rows.append(_row("kv_cache", "bytes", kv_bytes.value, p.kv_cache_bytes, KV_CAPACITY_TOLERANCE, kv_bytes.line,
                         "the engine's minimum over ranks"))
    tokens = log.kv_cache_tokens or log.refusal_kv_tokens
    if tokens:
        rows.append(_row("kv_cache_tokens", "tokens", tokens.value, p.kv_cache_tokens, KV_CAPACITY_TOLERANCE,
                         tokens.line, None if tokens is log.kv_cache_tokens else "from the refusal"))
    if log.num_gpu_blocks:
        rows.append(_row("num_gpu_blocks", "blocks", log.num_gpu_blocks.value, p.num_gpu_blocks, KV_CAPACITY_TOLERANCE,
                         log.num_gpu_blocks.line))
    if log.max_concurrency:
        rows.append(_row("max_concurrency", "ratio", log.max_concurrency.value, p.max_concurrency,
                         KV_CAPACITY_TOLERANCE, log.max_concurrency.line))
    return rows


def _other_rows(log: EngineLog, p: PredictedServing, same_engine: bool) -> list[TermCheck]:
    """SGLang and TGI. SGLang's 'mem usage' of the load is the weights and the non-torch memory
    allocated while loading. Their KV figures are checked when the plan was sized by that engine's
    rules, else reported beside a prediction made by another engine's rules."""
    rows: list[TermCheck] = []
    if log.weights_bytes:
        rows.append(_row("weights", "bytes", log.weights_bytes.value, p.weights_bytes + (p.overhead_bytes or 0.0),
                         TOLERANCES["weights"], log.weights_bytes.line,
                         "mem usage of the load: weights and the non-torch memory allocated while loading"))
    name = ENGINE_NAMES[log.engine]
    tolerance = KV_CAPACITY_TOLERANCE if same_engine else None
    kv_note = None if same_engine else f"not checked: the plan was sized by {p.engine}'s rules; {name} sizes its own"
    if log.kv_cache_bytes:
        rows.append(_row("kv_cache", "bytes", log.kv_cache_bytes.value, p.kv_cache_bytes, tolerance,
                         log.kv_cache_bytes.line, kv_note))
    tokens: IntTerm | None = log.kv_cache_tokens or log.max_total_num_tokens or log.max_batch_total_tokens
    if tokens:
        rows.append(_row("kv_cache_tokens", "tokens", tokens.value, p.kv_cache_tokens, tolerance, tokens.line, kv_note))
    if log.cuda_graph_bytes and p.cuda_graph_bytes is not None:
        rows.append(_row("cuda_graphs", "bytes", log.cuda_graph_bytes.value, p.cuda_graph_bytes, None,
                         log.cuda_graph_bytes.line, "the hardware profile's constant"))
    return rows


# Terms that do not depend on which engine sized the plan: the device, the inputs and the weights.
ENGINE_INDEPENDENT = frozenset({"total_gpu_memory", "gpu_memory_utilization", "max_model_len", "weights"})


def _fmt(row: TermCheck) -> str:
    how = f"{row.relative_error:+.1%}" if row.relative_error is not None else "measured where none was predicted"
    return f"{row.term}: {how} (tolerance {row.tolerance:.0%})"


def compare_engine_log(log: EngineLog, predicted: PredictedServing, *, plan: str) -> EngineLogCheck:
    """Each figure the log and the cost model both state, measured against predicted, and the
    verdict. Raises ShardplanError when they share no figure."""
    same = log.engine == predicted.engine
    rows = _vllm_rows(log, predicted) if log.engine == "vllm" else _other_rows(log, predicted, same)
    if not same:  # sized by another engine's rules: what depends on the engine is reported, not checked
        rows = [r if r.term in ENGINE_INDEPENDENT else
                r.model_copy(update={"tolerance": None, "ok": True,
                                     "note": f"not checked: the plan was sized by {predicted.engine}'s rules"})
                for r in rows]
    checked = same
    if not rows and not log.refused:
        raise ShardplanError(f"the log states none of the figures the cost model predicts (found: "
                             f"{', '.join(log.found())})", source=log.source,
                             hint="pass a start-up log with the weights or KV cache lines")
    refusal_line = log.refusal_max_model_len.line if log.refusal_max_model_len else None
    verdict_ok = log.refused != predicted.fits
    verdict = VerdictCheck(engine_started=not log.refused, predicted_fits=predicted.fits, checked=checked,
                           ok=verdict_ok or not checked, log_line=refusal_line,
                           predicted_reason=None if predicted.fits else predicted.reason)
    mismatches = [_fmt(r) for r in rows if not r.ok]
    notes: list[str] = []
    if not same:
        notes.append(f"a {ENGINE_NAMES[log.engine]} log against a plan sized by {predicted.engine}'s rules: "
                     f"make the plan with --engine {log.engine} to check its KV cache")
    if same and log.engine_version and predicted.engine_version and \
            parse_version(log.engine_version) != parse_version(predicted.engine_version):
        mismatches.append(f"engine version: the log is {ENGINE_NAMES[log.engine]} {log.engine_version}, the plan was "
                          f"sized by {predicted.engine_version}'s rules (make it with --engine-version "
                          f"{log.engine_version})")
    if not verdict.ok:
        said = "refused" if log.refused else "started"
        mismatches.append(f"verdict: the engine {said}, the cost model says it "
                          f"{'fits' if predicted.fits else 'does not fit'}")
    return EngineLogCheck(plan=plan, log=log, status="ok" if not mismatches else "mismatch", terms=rows,
                          verdict=verdict, mismatches=mismatches, notes=notes)


__all__ = ["EngineLogCheck", "TermCheck", "VerdictCheck", "PredictedServing", "predicted_from_report",
           "compare_engine_log", "KV_CAPACITY_TOLERANCE"]
