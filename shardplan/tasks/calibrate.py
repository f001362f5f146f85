"""`shardplan calibrate`: a GPU verify report's hardware probes -> a hardware profile whose
efficiencies are the measured ones, so that later estimates predict this machine's times.

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
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Literal

import yaml

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardplan import units
from shardplan.errors import InputFileError
from shardplan.fileio import write_text_atomic
from shardplan.specs import loading
from shardplan.specs.hardware import HardwareProfileFile
from shardplan.tasks._results import Result

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


class CalibrationReport(_Loose):
    """The parts of a `verify --report` file calibration reads; the rest is ignored."""

    plan: str
    status: Literal["ok", "mismatch"]
    device: Literal["cuda"]
    world_size: int = Field(ge=1)
    hardware: ReportHardware
    probes: list[ProbeRow] = Field(min_length=1)


class CalibrationChange(Result):
    """One efficiency the measurement replaced."""

    field: str = Field(description="the profile key, e.g. efficiency.matmul")
    old: float = Field(description="the base profile's efficiency (0-1)")
    new: float = Field(description="the measured efficiency, capped at 1 (0-1)")
    measured: float = Field(description="the median over ranks, in SI units (FLOP/s or bytes/s)")
    peak: float = Field(description="what it is a share of, in SI units (FLOP/s or bytes/s)")
    unit: str = Field(description="the human unit the table shows measured and peak in (TFLOP/s or GB/s)")
    what: str = Field(description="what the probe ran")


class CalibrateResult(Result):
    """What `calibrate --json` prints."""

    profile: str = Field(description="the calibrated profile's path")
    name: str = Field(description="the calibrated profile's name")
    base: str = Field(description="the base profile's file name")
    changes: list[CalibrationChange]
    notes: list[str] = Field(description="what was not calibrated, capped or mismatched, and why")


def parse_report(data: Any, source: str) -> CalibrationReport:
    """The report, or a one-line error naming the field: a CPU report and a report without
    probes (verify before this version, or every probe out of memory) are refused."""
    if isinstance(data, dict) and data.get("status") == "failed":
        raise InputFileError("the verify run failed, so it measured nothing", source=source, field="status",
                             hint="fix the run and pass the report of one that completed")
    if isinstance(data, dict) and data.get("device") == "cpu":
        raise InputFileError("measured on a CPU, which says nothing about a GPU's efficiencies", source=source,
                             field="device", hint="run `shardplan verify PLAN --backend nccl --report FILE` on the GPUs")
    try:
        return CalibrationReport.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InputFileError(err["msg"], source=source, field=where or None,
                             hint="pass the JSON file `shardplan verify --report` wrote on GPUs") from None


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
            peak = units.tflops_to_flops(peak_tflops) * _share(n, half) ** 3
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
    if not rows:
        raise InputFileError("no probe figure to calibrate from", source=report_source, field="probes",
                             hint="every rank's probes failed; rerun verify with more free GPU memory")
    out["sources"] = sources
    HardwareProfileFile.model_validate(out)  # what is written must load
    return out, rows, notes


def calibrate_profile(report: Path, hardware: str, output: Path, *, name: str | None = None) -> CalibrateResult:
    """Read a GPU verify report and a base profile (a bundled name or a YAML file), write a copy
    of the profile with the measured efficiencies to `output` (atomically; it loads as
    written), and say what changed. The new profile is named `name`, default the file's stem."""
    parsed = parse_report(loading.read_structured(report), str(report))
    base_path = loading.hardware_path(hardware)
    data, rows, notes = calibrate(parsed, loading.read_structured(base_path), name=name or output.stem,
                                  report_source=str(report))
    text = (f"# calibrated by `shardplan calibrate {report}` from {base_path.name}\n"
            + yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    loading.hardware_from_data(yaml.safe_load(text), str(output))  # loads as written
    write_text_atomic(output, text)
    return CalibrateResult(profile=str(output), name=data["name"], base=base_path.name,
                           changes=[CalibrationChange(**r) for r in rows], notes=notes)
