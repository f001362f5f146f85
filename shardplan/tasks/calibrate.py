"""`shardplan calibrate`: a GPU verify report's hardware probes -> a hardware profile whose
efficiencies are the measured ones, so that later estimates predict this machine's times; or
a vLLM start-up log's memory figures -> a profile whose device memory and runtime overheads are
the engine's own, so that later estimates predict this machine's KV cache (see
`calibrate_from_engine_log` for the mapping).

`calibrate` is pure: the report and the base profile come in as plain data, the new profile
goes out as plain data. `calibrate_profile` is the command's I/O edge: it reads the report and
the base profile, calibrates, writes the YAML atomically and returns a CalibrateResult. What each probe measures and the convention
that makes it comparable with a bundled efficiency is in `verify/probes.py`.

- efficiency.matmul = measured FLOP/s / (peak of the probe's dtype x the shape share the cost
  model applies to an n x n x n GEMM, prod d / (d + matmul_half_dim));
- efficiency.memory_bandwidth = measured copy bytes/s / the profile's memory bandwidth;
- efficiency.intra_node_link (the ranks on one node) or inter_node_link (over nodes: a ring's
  slowest hop) = measured all-reduce bus bytes/s / that link's bandwidth per direction.

The median over ranks is taken (one slow rank does not set the machine's speed). A measured
figure above the profile's peak is capped at efficiency 1 and said: the peak is wrong then.

Calibration closes the loop: what it was given is also recorded in the written profile as a
measured case (`measured_cases:`, the `--cases` schema; validation/measured.py makes them), so
that predictions made with the profile carry the error band of the runs measured on it
(tasks/_bands.py). An engine log with the plan it deployed (`--plan`) is an engine_log case; a
GPU verify report of a full-scale training run, a training case with its allocated peak. A
base profile's own cases are carried over (one with the same id is replaced).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

import yaml

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardplan import units
from shardplan.errors import InputFileError, ShardplanError
from shardplan.fileio import write_text_atomic
from shardplan.specs import loading
from shardplan.specs.engine_log import ENGINE_NAMES, EngineLog, IntTerm, read_engine_log
from shardplan.specs.hardware import HardwareProfileFile
from shardplan.plan import readback
from shardplan.specs.cases import Case, EngineLogCase, ServingLoadCase, TrainingCase
from shardplan.tasks._cases import read_case_file
from shardplan.tasks._results import Result
from shardplan.validation import measured

MAX_EFFICIENCY = 1.0


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ProbeRow(_Loose):
    rank: int = Field(ge=0)
    device_name: str
    matmul_dtype: str
    matmul_size: int | None = Field(None, gt=0)
    matmul_flops_per_second: float | None = Field(None, gt=0, allow_inf_nan=False)
    memory_bytes_per_second: float | None = Field(None, gt=0, allow_inf_nan=False)
    all_reduce_bus_bytes_per_second: float | None = Field(None, gt=0, allow_inf_nan=False)
    all_reduce_ranks: int = Field(1, ge=1)
    error: str | None = None


class ReportHardware(_Loose):
    profile: str
    num_nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)


class OutOfMemoryRow(_Loose):
    """The parts of a report's `oom` section calibration names in its notes."""

    rank: int = Field(ge=0)
    step: int | None = None
    op: str | None = None
    component: str | None = None
    measured_components: list[str] = Field(default_factory=list)
    unmeasured_components: list[str] = Field(default_factory=list)


class CalibrationReport(_Loose):
    """The parts of a `verify --report` file calibration reads; the rest is ignored. A run that
    ran out of memory ("oom") still ran the matmul and memory probes on the rank that failed,
    after freeing its memory; its peers could not join an all-reduce."""

    plan: str
    status: Literal["ok", "mismatch", "oom"]
    device: Literal["cuda"]
    world_size: int = Field(ge=1)
    hardware: ReportHardware
    probes: list[ProbeRow] = Field(min_length=1)
    oom: OutOfMemoryRow | None = None


class CalibrationChange(Result):
    """One efficiency the measurement replaced."""

    field: str = Field(description="the profile key, e.g. efficiency.matmul")
    old: float = Field(description="the base profile's efficiency (0-1)")
    new: float = Field(description="the measured efficiency, capped at 1 (0-1)")
    measured: float = Field(description="the median over ranks, in SI units (FLOP/s or bytes/s)")
    peak: float = Field(description="what it is a share of, in SI units (FLOP/s or bytes/s)")
    unit: str = Field(description="the human unit the table shows measured and peak in (TFLOP/s or GB/s)")
    what: str = Field(description="what the probe ran")


class ProfileChange(Result):
    """One memory figure of the profile an engine log replaced (GiB, as the YAML key holds it)."""

    field: str = Field(description="the profile key, e.g. runtime.non_torch_gib")
    old_gib: float = Field(description="the base profile's figure, GiB")
    new_gib: float = Field(description="the calibrated figure, GiB")
    log_line: int = Field(ge=1, description="the 1-based line of the log it comes from")
    printed: str = Field(description="the log's text it comes from, e.g. non_torch_memory=0.35GiB")
    rule: str = Field(description="how the engine's figure maps to this key")


class FitFigure(Result):
    """One figure of the serving run: measured, and predicted before and after the fit."""

    figure: str = Field(description="median_ttft_ms, median_tpot_ms or output_tokens_per_second")
    measured: float
    before: float = Field(description="predicted on the base profile")
    after: float = Field(description="predicted on the calibrated profile")


class CalibrateResult(Result):
    """What `calibrate --json` prints."""

    profile: str = Field(description="the calibrated profile's path")
    name: str = Field(description="the calibrated profile's name")
    base: str = Field(description="the base profile's file name")
    measured_by: Literal["verify-report", "engine-log", "serving-run"] = Field(
        "verify-report", description="what the figures come from: a GPU verify report, an engine start-up log or a "
                                     "serving benchmark run")
    input_file: str = Field(description="the verify report or engine log read")
    changes: list[CalibrationChange] = Field(description="efficiencies a verify report replaced (none from a log)")
    profile_changes: list[ProfileChange] = Field(
        default_factory=list, description="device memory and runtime overheads an engine log replaced (none from a report)")
    notes: list[str] = Field(description="what was not calibrated, capped or mismatched, and why")
    measured_case: str | None = Field(
        None, description="the id of the measured case the profile records from this input (its `measured_cases:`); "
                          "null: none, and a note says why")
    num_measured_cases: int = Field(0, ge=0, description="measured cases the written profile carries (count)")
    fit_figures: list[FitFigure] = Field(
        default_factory=list, description="a serving run's figures, measured and predicted before and after the fit "
                                          "(none from a report or a log)")


def parse_report(data: Any, source: str) -> CalibrationReport:
    """The report, or a one-line error naming the field: a CPU report, a failed run's and a
    report without probes (verify before this version, or every probe out of memory) are
    refused; a run that ran out of memory is read for the probes it ran."""
    if isinstance(data, dict) and data.get("status") == "failed":
        raise InputFileError("the verify run failed, so it measured nothing", source=source, field="status",
                             hint="fix the run and pass the report of one that completed")
    if isinstance(data, dict) and data.get("device") == "cpu":
        raise InputFileError("measured on a CPU, which says nothing about a GPU's efficiencies", source=source,
                             field="device", hint="run `shardplan verify PLAN --backend nccl --report FILE` on the GPUs")
    try:
        parsed = CalibrationReport.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InputFileError(err["msg"], source=source, field=where or None,
                             hint="pass the JSON file `shardplan verify --report` wrote on GPUs") from None
    if parsed.status == "oom" and parsed.oom is None:
        raise InputFileError("status is 'oom' but the report has no 'oom' section", source=source, field="oom",
                             hint="pass the JSON file `shardplan verify --report` wrote")
    return parsed


def _share(d: float, half_dim: float) -> float:
    return d / (d + half_dim)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def calibrate(report: CalibrationReport, base: dict[str, Any], *, name: str, report_source: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(the new profile's data, one row per efficiency changed, notes). `base` is the base
    profile's data as its YAML holds it (validated here)."""
    prof = HardwareProfileFile.model_validate(base)
    out = prof.model_dump(mode="json", exclude_none=True)
    out["name"] = name
    out["description"] = f"{prof.description} (efficiencies calibrated from {report_source})".strip()
    sources = dict(out.get("sources", {}))
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    probes = [p for p in report.probes if p.error is None]
    for p in report.probes:
        if p.error is not None:
            notes.append(f"rank {p.rank}: probes did not run ({p.error.splitlines()[0][:120]})")
    if report.oom is not None:
        o = report.oom
        ranks = ", ".join(str(p.rank) for p in probes) or "none"
        notes.append(f"the run ran out of memory on rank {o.rank} (step {o.step}, {o.component or 'an allocation'}: "
                     f"{o.op or '?'}); calibrated from the probes rank(s) {ranks} ran alone after freeing their memory")
        if o.measured_components or o.unmeasured_components:
            notes.append(f"memory measured before the failure ({', '.join(o.measured_components) or 'none'}) is compared "
                         f"in the report, not calibrated; not measured: {', '.join(o.unmeasured_components) or 'none'}")
    devices = sorted({p.device_name for p in probes})
    where = f"shardplan verify on {', '.join(devices) or 'the GPUs'}, {report.world_size} rank(s), {report_source}"
    if devices and any(prof.gpu.model.lower() not in d.lower() and d.lower() not in prof.gpu.model.lower() for d in devices):
        notes.append(f"the report was measured on {', '.join(devices)}; the base profile describes {prof.gpu.model}")

    def put(field: str, measured: float | None, peak: float, unit: str, scale: float, what: str) -> None:
        if measured is None:
            return
        old = out["efficiency"][field]
        eff = measured / peak
        if eff > MAX_EFFICIENCY:
            notes.append(f"{field}: measured {measured / scale:.4g} {unit} is above the profile's {peak / scale:.4g}; "
                         f"capped at {MAX_EFFICIENCY} (check the profile's peak)")
            eff = MAX_EFFICIENCY
        new = round(eff, 4)
        out["efficiency"][field] = new
        sources[f"efficiency.{field}"] = (f"measured by {where}: {what} {measured / scale:.4g} {unit} of "
                                          f"{peak / scale:.4g} {unit} = {new}")
        rows.append({"field": f"efficiency.{field}", "old": old, "new": new, "measured": measured,
                     "peak": peak, "unit": unit, "what": what})

    # matmul: the probe's dtype peak, less the shape share the cost model applies to that GEMM
    mm = [p for p in probes if p.matmul_flops_per_second is not None]
    if mm:
        dtype = mm[0].matmul_dtype
        peak_tflops = getattr(prof.gpu.peak_dense_tflops, dtype, None)
        if peak_tflops is None:
            notes.append(f"efficiency.matmul: the profile has no {dtype} peak; not calibrated")
        else:
            n = mm[0].matmul_size
            half = prof.efficiency.matmul_half_dim
            peak = units.tflops_to_flops(peak_tflops) * prof.gpu.power_limited_compute_fraction * _share(n, half) ** 3
            put("matmul", _median([p.matmul_flops_per_second for p in mm]), peak, "TFLOP/s", 1e12,
                f"{dtype} {n}x{n}x{n} matmul")
    put("memory_bandwidth", _median([p.memory_bytes_per_second for p in probes if p.memory_bytes_per_second]),
        units.gb_per_s_to_bytes_per_second(prof.gpu.memory_bandwidth_gb_per_s), "GB/s", 1e9, "device copy")
    ar = [p for p in probes if p.all_reduce_bus_bytes_per_second is not None]
    if ar:
        over_nodes = report.hardware.num_nodes > 1
        link = "inter_node_link" if over_nodes else "intra_node_link"
        link_file = prof.node.inter_node_link if over_nodes else prof.node.intra_node_link
        put(link, _median([p.all_reduce_bus_bytes_per_second for p in ar]),
            units.gb_per_s_to_bytes_per_second(link_file.bandwidth_gb_per_s), "GB/s", 1e9,
            f"all-reduce bus bandwidth over {ar[0].all_reduce_ranks} ranks on {report.hardware.num_nodes} node(s)")
    elif report.world_size == 1:
        notes.append("one rank: no all-reduce, so the link efficiencies are the base profile's")
    elif report.oom is not None:
        link = "inter_node_link" if report.hardware.num_nodes > 1 else "intra_node_link"
        notes.append(f"efficiency.{link}: not measured (the run ran out of memory; the peers could not join the "
                     f"all-reduce probe), so it is the base profile's")
    if not rows:
        raise InputFileError("no probe figure to calibrate from", source=report_source, field="probes",
                             hint="every rank's probes failed; rerun verify with more free GPU memory")
    out["sources"] = sources
    HardwareProfileFile.model_validate(out)  # what is written must load
    return out, rows, notes


def calibrate_profile(report: Path, hardware: str, output: Path, *, name: str | None = None,
                      plan: Path | None = None) -> CalibrateResult:
    """Read a GPU verify report and a base profile (a bundled name or a YAML file), write a copy
    of the profile with the measured efficiencies to `output` (atomically; it loads as
    written), and say what changed. The new profile is named `name`, default the file's stem.
    A full-scale training run's allocated peak is recorded as a measured case of `plan` (default:
    the plan the report names)."""
    raw = loading.read_structured(report)
    parsed = parse_report(raw, str(report))
    base_path = loading.hardware_path(hardware)
    data, rows, notes = calibrate(parsed, loading.read_structured(base_path), name=name or output.stem,
                                  report_source=str(report))
    case = _report_case(report, raw, parsed, plan, hardware, output, notes)
    text = _profile_text(f"shardplan calibrate {report}", base_path, data, case, output, notes)
    write_text_atomic(output, text)
    return CalibrateResult(profile=str(output), name=data["name"], base=base_path.name, measured_by="verify-report",
                           input_file=str(report), changes=[CalibrationChange(**r) for r in rows], notes=notes,
                           measured_case=case.id if case else None,
                           num_measured_cases=len(data.get("measured_cases", [])))


def _report_case(report: Path, raw: Any, parsed: CalibrationReport, plan: Path | None, hardware: str, output: Path,
                 notes: list[str]) -> Case | None:
    """The report's training case, or None with a note saying why. The plan is `plan`, else the
    one the report names (as given to verify: from here, or beside the report)."""
    path = plan
    if path is None:
        named = Path(parsed.plan)
        path = next((p for p in (named, report.parent / named) if p.is_file()), None)
        if path is None:
            notes.append(f"no measured case: the plan the report names ({parsed.plan}) is not here; pass --plan")
            return None
    try:
        inputs = readback.read_plan(path, hardware_override=hardware)
    except ShardplanError as e:
        if plan is not None:
            raise  # asked for: bad input
        notes.append(f"no measured case: the plan the report names ({path}) cannot be read ({e.message}); pass --plan")
        return None
    got = measured.training_case(inputs, raw, report_source=str(report), hardware=output.name,
                                 model=measured.model_ref(inputs, output.parent),
                                 source=measured.measured_source(report, "verify report"), case=measured.case_id(report))
    if isinstance(got, str):
        notes.append(f"no measured case: {got}")
        return None
    return got


def _profile_text(command: str, base_path: Path, data: dict[str, Any], case: Case | None, output: Path,
                  notes: list[str]) -> str:
    """The profile's YAML, with `case` added to the measured cases the base carried (each pointed
    at this file); checked to load as written."""
    carried = [c for c in data.pop("measured_cases", []) if case is None or c["id"] != case.id]
    cases = [{**c, "hardware": output.name} for c in carried]
    if case is not None:
        cases.append(case.model_dump(mode="json", exclude_none=True))
        if isinstance(case, TrainingCase):
            what = f"allocated peak {case.measured.peak_memory_gib:.2f} GiB"
        elif isinstance(case, EngineLogCase) and case.kv_cache_tokens is not None:
            what = f"KV capacity {case.kv_cache_tokens:,} tokens"
        else:
            what = "a refusal to start"
        notes.append(f"recorded measured case {case.id} ({case.kind}, {what}): predictions with this profile take "
                     "their band from its measured cases where they match")
    if cases:
        data["measured_cases"] = cases
    text = f"# calibrated by `{command}` from {base_path.name}\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    loading.hardware_from_data(yaml.safe_load(text), str(output))  # loads as written
    return text


# --- from an engine start-up log -------------------------------------------------------------

GIB_DECIMALS = 4  # vLLM prints GiB with 2 decimals; 4 keeps a difference of two printed figures exact
RUNTIME = "runtime"


def _gib(term: IntTerm) -> float:
    return round(term.value / units.BYTES_PER_GIB, GIB_DECIMALS)


def _split(logged_gib: float, order: list[str], runtime: dict[str, float]) -> dict[str, float]:
    """The logged sum of the runtime terms in `order`, split so that the terms after the first
    keep the profile's figures and the first takes the remainder. A negative remainder (the
    profile's other terms alone exceed the log's figure) floors it at 0 and hands the rest to
    the next term, so the split always sums to the logged figure."""
    out: dict[str, float] = {}
    for i, key in enumerate(order):
        rest = sum(runtime[k] for k in order[i + 1:])
        share = round(logged_gib - rest, GIB_DECIMALS)
        if share >= 0 or i == len(order) - 1:
            out[key] = max(share, 0.0)
            return out
        out[key] = 0.0
    return out


def calibrate_from_engine_log(log: EngineLog, base: dict[str, Any], *, name: str, tp: int = 1
                              ) -> tuple[dict[str, Any], list[ProfileChange], list[str]]:
    """(the new profile's data, one row per key the log set, notes): what a vLLM start-up log
    measured about the device, mapped onto the profile keys the cost model
    (cost/memory_serving.py) charges against vLLM's budget. `tp` is the tensor-parallel size
    of the logged run (vLLM's log does not print it in the lines read here).

    - `total_gpu_memory` -> `gpu.memory_capacity_gib`. vLLM logs the device total it sizes the
      budget from, `torch.cuda.mem_get_info()[1]` in GiB: V0 0.6.4 in "Memory profiling
      results: total_gpu_memory=X GiB" (vllm/worker/worker.py determine_num_available_blocks,
      PR #9352), 0.6.5+ and V1 in "total_gpu_memory (X GiB) x gpu_memory_utilization (u)"
      (PR #10511; vllm/v1/worker/gpu_worker.py determine_available_memory). The cost model's
      budget is that capacity x utilization, so the capacity is the device as the engine sees it.
    - vLLM 0.6.4 `non_torch_memory=X GiB` -> cuda_context_gib + non_torch_gib (+ nccl_buffers_gib
      at tp > 1). There, after the profiling run, non-torch = (total - free, from
      mem_get_info) - torch's allocated bytes, added to the peak that is subtracted from the
      budget, with no baseline snapshot: the CUDA context, library workspaces, NCCL
      communicators and anything else on the device are all in it, and the cost model charges
      exactly that sum inside this era's budget (knowledge/engines/vllm.yaml,
      cuda_context_in_budget). That era's profiling pass adds no non-torch memory of its own
      (its rules set non_torch_gib to 0: the RTX 3090 log shows the same 0.35 GiB before and
      after the pass), so cuda_context_gib takes the figure, less nccl_buffers_gib (the
      profile's) at tp > 1, floored at 0; non_torch_gib, which 0.6.5+/V1 estimates charge, keeps
      the profile's figure.
    - vLLM 0.6.5+ / V1 `non_torch_memory takes X GiB` -> non_torch_gib. The profile pass there
      charges the non-torch increase over a baseline snapshot taken once the CUDA context
      exists (PR #10511, `memory_profiling(baseline_snapshot, ...)`; V1 `init_snapshot`), so
      the context is not in it. At tp > 1 it also holds the NCCL communicators (0.16 GiB at
      tp 1 against 0.33 at tp 2, vllm issue #14452): nccl_buffers_gib keeps the profile's figure
      and non_torch_gib takes the remainder (the same rule as above; a tp 1 log separates them
      better).
    - `Graph capturing finished in N secs, took X GiB` -> cuda_graphs_gib: free memory before the
      capture less free memory after it (V0 model_runner.py capture_model; V1
      gpu_model_runner.py capture_model), the graphs' whole footprint.

    Only vLLM logs: SGLang and TGI size their pools by other rules, and the cost model follows
    vLLM's budget. A log with none of these figures is refused, naming what is missing."""
    src = Path(log.source).name
    if log.engine != "vllm":
        raise InputFileError(f"a {ENGINE_NAMES[log.engine]} log: calibrate reads vLLM's start-up memory figures "
                             "(the cost model follows vLLM's budget)", source=log.source,
                             hint="pass a vLLM start-up log, or a GPU `verify --report` file")
    v064 = log.generation == "vllm-v0-0.6.4"
    era = "vLLM 0.6.4" if v064 else "vLLM 0.6.5+/V1"
    total = log.total_gpu_memory_bytes if log.total_gpu_memory_bytes and log.total_gpu_memory_bytes.value > 0 else None
    if total is None and log.non_torch_bytes is None and log.cuda_graph_bytes is None:
        have = ", ".join(log.found()) or "nothing"
        raise InputFileError(f"no device or runtime memory figure to calibrate from (found {have}); missing "
                             "'total_gpu_memory', 'non_torch_memory' and 'Graph capturing finished ... took X GiB'",
                             source=log.source, hint="pass the whole vLLM start-up log, with its 'Memory profiling "
                                                     "results' or 'model weights take ... non_torch_memory takes' line")
    prof = HardwareProfileFile.model_validate(base)
    out = prof.model_dump(mode="json", exclude_none=True)
    out["name"] = name
    out["description"] = f"{prof.description} (memory figures calibrated from {src})".strip()
    sources = dict(out.get("sources", {}))
    runtime: dict[str, float] = dict(out[RUNTIME])
    rows: list[ProfileChange] = []
    notes: list[str] = [f"{era} log at tp {tp}; vLLM prints GiB to 2 decimals, so each figure is within 0.005 GiB"]

    def put(section: str, key: str, new: float, term: IntTerm, printed: str, rule: str) -> None:
        old = out[section][key]
        out[section][key] = new
        sources[f"{section}.{key}"] = f"calibrated from {src} line {term.line}: '{printed}' ({rule})"
        rows.append(ProfileChange(field=f"{section}.{key}", old_gib=old, new_gib=new, log_line=term.line,
                                  printed=printed, rule=rule))

    if (t := total) is not None:
        printed = f"total_gpu_memory={t.printed}" if v064 else f"total_gpu_memory ({t.printed})"
        put("gpu", "memory_capacity_gib", _gib(t), t, printed,
            "the device total vLLM sees, torch.cuda.mem_get_info()[1]; its budget is this x gpu_memory_utilization")
    if (t := log.non_torch_bytes) is not None:
        logged = _gib(t)
        nccl = ["nccl_buffers_gib"] if tp > 1 else []
        # 0.6.4's profiling pass adds no non-torch memory beyond the context (knowledge/engines/
        # vllm.yaml, non_torch_gib: 0 for that era), so the context takes the figure, less NCCL.
        order = ["cuda_context_gib", *nccl] if v064 else ["non_torch_gib", *nccl]
        split = _split(logged, order, runtime)
        final = runtime | split
        printed = f"non_torch_memory={t.printed}" if v064 else f"non_torch_memory takes {t.printed}"
        what = ("vLLM 0.6.4 counts the CUDA context" + (" and NCCL buffers" if tp > 1 else "")
                + " in non-torch memory (no baseline snapshot)") if v064 else \
            ("vLLM 0.6.5+/V1 excludes the CUDA context (baseline snapshot)"
             + ("; at tp > 1 NCCL buffers are in it" if tp > 1 else ""))
        for key, new in split.items():
            others = [k for k in order if k != key]
            if new == 0 and logged > 0:
                how = f"0 (floored: the profile's {' + '.join(others)} exceed the logged figure)"
            else:
                how = f"{logged:g}" + "".join(f" - {k} {final[k]:g}" for k in others)
            put(RUNTIME, key, new, t, printed, f"{what}: {' + '.join(order)} = {logged:g}; {key} = {how}")
        if any(v == 0 for v in split.values()) and len(split) > 1:
            notes.append(f"the profile's {', '.join(order[1:])} alone exceed the logged {logged:g} GiB: "
                         f"{', '.join(k for k, v in split.items() if v == 0)} set to 0 so the terms still sum to it")
        if v064:
            notes.append("vLLM 0.6.4 measures non-torch memory as device used minus torch's allocations, so "
                         "another process on the GPU (a desktop on a GeForce card) is in cuda_context_gib too; "
                         "estimate with --engine-version 0.6.4 to charge it as this log's engine did")
    if (t := log.cuda_graph_bytes) is not None:
        put(RUNTIME, "cuda_graphs_gib", _gib(t), t, f"Graph capturing finished ..., took {t.printed}",
            "free memory before the capture less after it (model_runner capture_model)")
    else:
        notes.append("no 'Graph capturing finished ... took X GiB' line (the log ends before capture, or "
                      "--enforce-eager): cuda_graphs_gib is the base profile's")
    if log.gpu_memory_utilization is not None:
        notes.append(f"the log ran at gpu_memory_utilization {log.gpu_memory_utilization.value:g} "
                     f"(line {log.gpu_memory_utilization.line}); it is a workload input, not a profile figure")
    out["sources"] = sources
    HardwareProfileFile.model_validate(out)  # what is written must load
    return out, rows, notes


def calibrate_profile_from_engine_log(log: Path, hardware: str, output: Path, *, name: str | None = None,
                                      tp: int | None = None, plan: Path | None = None) -> CalibrateResult:
    """Read a vLLM start-up log (bounded, specs.engine_log) and a base profile, write a copy of
    the profile with the log's device memory and runtime overheads to `output` (atomically; it
    loads as written), and say what changed. Nothing is written when the log has no figure.
    With `plan` (the plan whose deployment logged it) the log is also recorded as a measured
    case, and `tp` defaults to the plan's (else 1)."""
    if tp is not None and tp < 1:
        raise InputFileError(f"--tp {tp} is not a tensor-parallel size", field="--tp", hint="pass 1 or more")
    parsed = read_engine_log(log)
    base_path = loading.hardware_path(hardware)
    inputs = readback.read_plan(plan, hardware_override=hardware) if plan is not None else None
    if inputs is not None:
        if tp is not None and tp != inputs.manifest.layout.tp:
            raise InputFileError(f"--tp {tp}, but the plan's tp is {inputs.manifest.layout.tp}", field="--tp",
                                 hint="drop --tp: the plan states it")
        tp = inputs.manifest.layout.tp
    data, rows, notes = calibrate_from_engine_log(parsed, loading.read_structured(base_path),
                                                  name=name or output.stem, tp=tp or 1)
    case: Case | None = None
    if inputs is None:
        notes.append("no measured case: pass --plan (the plan this engine was started from) to record the log as "
                     "one, so that this profile's KV capacity band comes from it")
    else:
        got = measured.engine_log_case(inputs, parsed, hardware=output.name,
                                       model=measured.model_ref(inputs, output.parent),
                                       source=measured.measured_source(log, "engine log"))
        if isinstance(got, str):
            notes.append(f"no measured case: {got}")
        else:
            case = got
    text = _profile_text(f"shardplan calibrate --engine-log {log}", base_path, data, case, output, notes)
    write_text_atomic(output, text)
    return CalibrateResult(profile=str(output), name=data["name"], base=base_path.name, measured_by="engine-log",
                           input_file=str(log), changes=[], profile_changes=rows, notes=notes,
                           measured_case=case.id if case else None,
                           num_measured_cases=len(data.get("measured_cases", [])))


# --- from a serving benchmark run ------------------------------------------------------------
#
# A GPU held below its chip's rated power (a board limit, a data-centre cap, lower application
# clocks) lowers its clocks under tensor-core load, while memory-bound work draws less and keeps
# its bandwidth (docs/research/h100-power-cap.md). Its compute-bound steps then run slower than
# the datasheet peaks say and its decode steps do not: the profile's
# `gpu.power_limited_compute_fraction`. A serving benchmark run whose steps are compute-bound (long
# prompts, many at once) measures it: the fraction at which the cost model's simulation of the run
# (validation/predict.py, the `validate --cases` schema) gives the run's measured output
# throughput. A run whose throughput hardly moves with the compute rate (short prompts, decode at
# small batches) is refused: it cannot tell it.

# The compute rate the fit may find, as a share of the profile's: below it the run is not read as a
# slow GPU (its inputs are wrong, or something else limits it).
FIT_LOWEST_SHARE = 0.05
FIT_BISECTIONS = 14  # the fraction to about 1e-4 of its range
# A run whose predicted throughput at the chip's full peaks is less than this many times that at
# half of them does not depend enough on the compute rate to measure it.
FIT_MIN_LEVERAGE = 1.15


def fit_compute_share(predict: Callable[[float], float], measured: float, highest: float) -> tuple[float, str | None]:
    """(share, note): the share of the profile's compute rate, at most `highest`, at which
    `predict(share)` (a run's output throughput, growing with the share) gives `measured`, by
    bisection; `highest` with a note when the run was faster than even that predicts. Raises
    ValueError when the run does not depend on the compute rate (FIT_MIN_LEVERAGE) or is slower
    than FIT_LOWEST_SHARE of it."""
    top = predict(highest)
    half = predict(highest / 2)
    if not top > 0 or top < FIT_MIN_LEVERAGE * half:
        raise ValueError(f"its predicted throughput moves by {100 * (top / half - 1) if half > 0 else 0:.0f}% between "
                         "half and all of the compute rate: its steps are bound by memory bandwidth or the host, so it "
                         "cannot measure the GPU's compute rate")
    if measured >= top:
        return highest, (f"the run was {100 * (measured / top - 1):.0f}% faster than predicted at the chip's full peaks: "
                         "the fraction stays at its highest, 1")
    lo, hi = FIT_LOWEST_SHARE, highest
    if predict(lo) > measured:
        raise ValueError(f"it is slower than {FIT_LOWEST_SHARE:.0%} of the compute rate predicts: check the run's "
                         "lengths, counts and flags")
    for _ in range(FIT_BISECTIONS):
        mid = (lo + hi) / 2
        if predict(mid) > measured:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2, None


def _serving_case(cases_file: Path, case_id: str | None) -> ServingLoadCase:
    runs = [c for c in read_case_file(cases_file) if isinstance(c, ServingLoadCase)]
    if case_id is not None:
        chosen = [c for c in runs if c.id == case_id]
        if not chosen:
            raise InputFileError(f"no serving_load case with id {case_id!r}", source=str(cases_file), field="--case",
                                 hint=f"its serving_load cases: {', '.join(c.id for c in runs) or 'none'}")
        return chosen[0]
    if len(runs) != 1:
        raise InputFileError(f"{len(runs)} serving_load cases; calibrate fits one run", source=str(cases_file),
                             field="--case", hint="name the run with --case ID" if runs
                             else "give a `validate --cases` file with a serving_load case (kind: serving_load)")
    return runs[0]


def calibrate_profile_from_serving_run(cases_file: Path, output: Path, *, case_id: str | None = None,
                                       hardware: str | None = None, name: str | None = None) -> CalibrateResult:
    """Read a serving run (a `validate --cases` file's serving_load case) and the profile it ran on
    (its `hardware`, or `hardware` where given), fit the GPU's compute rate to the run's output
    throughput (`fit_compute_share`), and write a copy of the profile with it as
    `gpu.power_limited_compute_fraction` to `output` (atomically; it loads as written). The run is
    not recorded as a measured case: a band from the run a profile was fitted to would be
    in-sample."""
    import dataclasses

    from shardplan.validation.predict import case_file_ref, predict_serving_load

    case = _serving_case(cases_file, case_id)
    folder = cases_file.parent  # the case's relative model and profile files are beside it
    base_path = loading.hardware_path(hardware or case_file_ref(case.hardware, folder))
    base_data = loading.read_structured(base_path)
    prof = HardwareProfileFile.model_validate(base_data)
    hw = loading.hardware_from_data(base_data, str(base_path))  # read once: its measured cases are not predicted here
    f0 = prof.gpu.power_limited_compute_fraction
    results: dict[float, Any] = {}

    def run(share: float) -> Any:
        if share not in results:
            scaled = dataclasses.replace(hw, peak_flops={k: v * share for k, v in hw.peak_flops.items()})
            results[share] = predict_serving_load(case, folder, scaled)[0]
        return results[share]

    try:
        run(1.0)
        share, note = fit_compute_share(lambda s: run(s).output_tokens_per_second,
                                        case.measured.output_tokens_per_second, 1.0 / f0)
    except ShardplanError as e:
        raise InputFileError(f"case {case.id}: {e.message}", source=str(cases_file), field=e.field, hint=e.hint) from None
    except ValueError as e:
        raise InputFileError(f"case {case.id}: {e}", source=str(cases_file), field="measured.output_tokens_per_second",
                             hint="calibrate from a compute-bound run: long prompts, short outputs, every request at "
                                  "once (e.g. `vllm bench serve --dataset-name random --random-input-len 2000 "
                                  "--random-output-len 100 --num-prompts 500`)") from None
    fraction = round(min(1.0, f0 * share), 4)  # as the profile holds it
    before, after = run(1.0), run(fraction / f0)
    out = prof.model_dump(mode="json", exclude_none=True)
    out["name"] = name or output.stem
    out["description"] = f"{prof.description} (compute rate calibrated from serving run {case.id})".strip()
    out["gpu"]["power_limited_compute_fraction"] = fraction
    sources = dict(out.get("sources", {}))
    sources["gpu.power_limited_compute_fraction"] = (
        f"fitted by `shardplan calibrate --serving-run {cases_file}` to serving run {case.id} ({case.source}): "
        f"{case.engine} {case.engine_version}, {case.gpus} GPU(s) tp {case.tp}, output "
        f"{case.measured.output_tokens_per_second:,.0f} tok/s measured, {before.output_tokens_per_second:,.0f} "
        f"predicted on {base_path.name} (fraction {f0:g}), matched at {fraction:.4f}")
    out["sources"] = sources
    m = case.measured
    figures = [FitFigure(figure="output_tokens_per_second", measured=m.output_tokens_per_second,
                         before=before.output_tokens_per_second, after=after.output_tokens_per_second),
               FitFigure(figure="median_ttft_ms", measured=m.median_ttft_ms, before=before.ttft_seconds.p50 * 1e3,
                         after=after.ttft_seconds.p50 * 1e3)]
    if m.median_tpot_ms is not None:
        figures.append(FitFigure(figure="median_tpot_ms", measured=m.median_tpot_ms, before=before.tpot_seconds.p50 * 1e3,
                                 after=after.tpot_seconds.p50 * 1e3))
    notes = [note] if note else []
    notes.append(f"not recorded as a measured case: the profile was fitted to {case.id}, so a band from it would be "
                 "in-sample; check the profile on other runs with `shardplan validate --cases FILE`")
    text = _profile_text(f"shardplan calibrate --serving-run {cases_file}", base_path, out, None, output, notes)
    write_text_atomic(output, text)
    change = CalibrationChange(field="gpu.power_limited_compute_fraction", old=f0, new=fraction,
                               measured=m.output_tokens_per_second, peak=before.output_tokens_per_second,
                               unit="tok/s", what=f"serving run {case.id}: output throughput, measured and at the "
                                                  f"base profile's compute rate")
    return CalibrateResult(profile=str(output), name=out["name"], base=base_path.name, measured_by="serving-run",
                           input_file=str(cases_file), changes=[change], notes=notes, measured_case=None,
                           num_measured_cases=len(out.get("measured_cases", [])), fit_figures=figures)
