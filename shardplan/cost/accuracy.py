"""The measured error band of each predicted quantity, and "fits" decided at the band's edge.

The bands are data (`knowledge/bands.yaml`: `shardplan validate`'s p90 of |predicted /
measured - 1| over the shipped measured cases, by engine generation or stack) that the caller
loads and passes in; this module only looks them up and applies them, so cost/ stays pure.

Which band a prediction carries:
  serving   KV capacity, the cases of the workload's engine generation ('vLLM V1' for vLLM
            0.21.0: `knowledge.load.engine_generation`); none without an engine version. Under
            traffic (the report's `load`), also the median TTFT, TPOT and ITL and the output tokens/s,
            from the generation's serving benchmark runs in the same regime: saturated (requests
            wait in the engine's queue) or below saturation
  training  peak memory and tokens/s per GPU, the cases of the stack ('torchtitan'); with
            LoRA / QLoRA, peak memory from the stack's fine-tuning cases ('hf qlora')

The edge (the band applied to the prediction, pessimistically):
  training  fits when the largest per-rank reserved peak x (1 + peak-memory band) is within the
            device's memory; tight when it fits only at the prediction
  serving   fits when KV capacity x (1 - KV band) still holds one max_model_len sequence;
            tight when the plan fits only at the prediction
A band no case measured is unknown: the verdict is the prediction's, and the note says so.

A calibrated hardware profile carries the runs measured on it (`measured_cases:`, written by
`shardplan calibrate`). Where those cases measured the prediction's own group and quantity (its
vLLM V1 start-up logs, for a vLLM V1 KV capacity), their band replaces the shipped one: the
caller predicts them with the profile and passes the statistics in as `ProfileBands`, and the
note says "measured on this profile". Every other quantity keeps the shipped band.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.cost.report import CostReport, FitAtBandEdge, PredictionBand
from shardplan.knowledge.schema import BandsFile, ErrorBand
from shardplan.units import BYTES_PER_GIB

# What one case of each corpus is, in the notes.
_CASE_WORDS = {"engine_log": "start-up logs", "training": "runs", "finetune": "runs", "serving_load": "serving benchmark runs"}
# The figures under traffic that carry a band, and the regimes their cases are grouped by
# (validation/predict.py decides a case's regime as an estimate decides its own: cost.traffic.is_saturated).
LOAD_QUANTITIES = ("ttft_p50", "tpot_p50", "itl_p50", "output_tokens_per_second")
SATURATED, BELOW_SATURATION = "saturated", "below saturation"


def load_group(engine_generation: str, saturated: bool) -> str:
    """'vLLM V1, saturated': the group of a serving benchmark run, or of an estimate under traffic."""
    return f"{engine_generation}, {SATURATED if saturated else BELOW_SATURATION}"


def _pct(fraction: float) -> str:
    """'3.4%'; under 1%, two significant figures ('0.031%'), so a profile's own band is not '0.0%'."""
    if 0 < abs(fraction) < 0.01:
        return f"{100 * fraction:.2g}%"
    return f"{100 * fraction:.1f}%"


@dataclass(frozen=True)
class ProfileBands:
    """The bands of one hardware profile's own measured cases: `shardplan validate`'s statistics
    over them, as the caller computed them with the profile (few cases, so on the fly)."""

    profile: str  # the profile's name, for the notes
    bands: tuple[ErrorBand, ...]

    def band(self, kind: str, group: str, quantity: str) -> ErrorBand | None:
        return next((b for b in self.bands if (b.kind, b.group, b.quantity) == (kind, group, quantity)), None)


def _cases(kind: str, group: str, versions: list[str], num_cases: int, measured_on: str | None = None) -> str:
    """'11 vLLM V1 0.8.5.post1-0.10.2 start-up logs', '20 torchtitan runs', '1 vLLM V1 0.10.1.1
    start-up log measured on this profile (my-a100)'."""
    span = "" if not versions else f" {versions[0]}" if len(versions) == 1 else f" {versions[0]}-{versions[-1]}"
    words = _CASE_WORDS[kind] if num_cases != 1 else _CASE_WORDS[kind].removesuffix("s")
    where = "" if measured_on is None else f" measured on this profile ({measured_on})"
    if kind == "serving_load" and ", " in group:  # 'vLLM V1, saturated': the regime after the runs
        generation, regime = group.split(", ", 1)
        return f"{num_cases} {generation}{span} {words} {regime}{where}"
    if group == "layouts":  # validation.predict.layout_pairs: two runs of one setting each
        return f"{num_cases} pair{'s' if num_cases != 1 else ''} of measured layouts of one setting{where}"
    return f"{num_cases} {group}{span} {words}{where}"


def band_cases(band: PredictionBand) -> str:
    """'p90 of 6 vLLM V1 0.10.2-0.11.0 serving benchmark runs below saturation': what a known band is over."""
    return f"p{band.percentile} of {_cases(band.kind, band.group, band.versions, band.num_cases, band.measured_on)}"


def prediction_band(bands: BandsFile, quantity: str, kind: str, group: str | None,
                    unknown_group: str | None = None, own: ProfileBands | None = None) -> PredictionBand:
    """The band of `quantity` for `group`: the profile's own cases' where they measured it, else
    the shipped cases'; a band with `band_abs_error` None when no case measured it
    (`unknown_group` names what was looked for when `group` is None)."""
    mine = own.band(kind, group, quantity) if own is not None and group is not None else None
    if own is not None and mine is not None:
        versions = list(mine.versions)
        return PredictionBand(
            quantity=mine.quantity, kind=mine.kind, group=mine.group, band_abs_error=mine.band_abs_error,
            percentile=bands.percentile, mean_signed_error=mine.mean_signed_error, num_cases=mine.num_cases,
            versions=versions, measured_on=own.profile,
            note=f"±{_pct(mine.band_abs_error)} (p{bands.percentile} of "
                 f"{_cases(mine.kind, mine.group, versions, mine.num_cases, own.profile)})")
    found = bands.band(kind, group, quantity) if group is not None else None
    if found is None:
        what = group if group is not None else (unknown_group or "this workload")
        return PredictionBand(quantity=quantity, kind=kind, group=group or what, band_abs_error=None,  # type: ignore[arg-type]
                              percentile=bands.percentile, mean_signed_error=None, num_cases=0, versions=[],
                              note=f"no measured cases for {what}: band unknown")
    versions = list(found.versions)
    # Under traffic the model leans one way (TTFT low): the mean signed error says which.
    lean = f"; mean {100 * found.mean_signed_error:+.0f}%" if found.kind == "serving_load" else ""
    return PredictionBand(
        quantity=found.quantity, kind=found.kind, group=found.group, band_abs_error=found.band_abs_error,
        percentile=bands.percentile, mean_signed_error=found.mean_signed_error, num_cases=found.num_cases,
        versions=versions,
        note=f"±{_pct(found.band_abs_error)} (p{bands.percentile} of "
             f"{_cases(found.kind, found.group, versions, found.num_cases)}{lean})")


def training_group(stack: str | None, finetune: str) -> tuple[str, str | None]:
    """(kind, group) of a training workload's peak memory: the stack's full-training runs, or its
    LoRA / QLoRA runs ('hf lora'). The group is None without a stack (the fields as given)."""
    if finetune == "full":
        return "training", stack
    return "finetune", None if stack is None else f"{stack} {finetune}"


def training_bands(bands: BandsFile, stack: str | None, finetune: str,
                   own: ProfileBands | None = None) -> list[PredictionBand]:
    """Peak memory, then tokens/s per GPU (fine-tuning: the stack's full-training tokens/s cases,
    the only throughput measurements there are)."""
    kind, group = training_group(stack, finetune)
    unknown = "training without a stack" if stack is None else None
    return [prediction_band(bands, "peak_memory", kind, group, unknown, own),
            prediction_band(bands, "tokens_per_second", "training", stack, unknown, own)]


def serving_bands(bands: BandsFile, engine_generation: str | None, engine: str,
                  own: ProfileBands | None = None, saturated: bool | None = None) -> list[PredictionBand]:
    """KV capacity of the engine generation's start-up logs; under traffic (`saturated` given: the
    load's regime) then the median TTFT, TPOT and ITL and the output tokens/s of its serving runs
    in that regime (LOAD_QUANTITIES)."""
    found = [prediction_band(bands, "kv_capacity", "engine_log", engine_generation, f"{engine} without a version", own)]
    if saturated is not None:
        group = None if engine_generation is None else load_group(engine_generation, saturated)
        found += [prediction_band(bands, q, "serving_load", group, f"{engine} without a version", own)
                  for q in LOAD_QUANTITIES]
    return found


def memory_fits_at_edge(peak_bytes: float, capacity_bytes: float, band_abs_error: float | None) -> bool:
    """The reserved peak x (1 + band) within the device (an unknown band counts as 0)."""
    return peak_bytes * (1 + (band_abs_error or 0.0)) <= capacity_bytes


def kv_holds_at_edge(kv_capacity_tokens: float, max_model_len: int, band_abs_error: float | None) -> bool:
    """KV capacity x (1 - band) still holds one max_model_len sequence (an unknown band counts as 0)."""
    return kv_capacity_tokens * (1 - (band_abs_error or 0.0)) >= max_model_len


def _edge_words(band: PredictionBand, sign: str) -> str:
    assert band.band_abs_error is not None
    return (f"{sign}{_pct(band.band_abs_error)} p{band.percentile} on "
            f"{_cases(band.kind, band.group, band.versions, band.num_cases, band.measured_on)}")


def fit_at_band_edge(report: CostReport, band: PredictionBand) -> FitAtBandEdge:
    """The verdict of `report` at the pessimistic edge of `band` (peak memory for training, KV
    capacity for serving)."""
    b = band.band_abs_error
    gib = BYTES_PER_GIB
    if report.kv_cache is None:
        peak = max(r.reserved_bytes for r in report.memory.per_rank)
        cap = float(report.hardware.memory_capacity_bytes)
        edge = None if b is None else peak * (1 + b)
        at_edge = memory_fits_at_edge(peak, cap, b)
        figures = f"{peak / gib:.2f} GiB reserved + {_pct(b or 0)} = {(edge or 0) / gib:.2f} GiB"
        fits_words = f"{figures} within {cap / gib:.2f} GiB"
        tight_words = f"{figures}, over {cap / gib:.2f} GiB"
        sign, quantity, unit, predicted, limit = "+", "peak_memory", "bytes", peak, cap
    else:
        kv = report.kv_cache
        tokens, need = float(kv.capacity_tokens), kv.max_model_len
        edge = None if b is None else tokens * (1 - b)
        at_edge = kv_holds_at_edge(tokens, need, b)
        figures = f"KV capacity {tokens:,.0f} tokens - {_pct(b or 0)} = {edge or 0:,.0f}"
        fits_words = f"{figures} hold a {need:,}-token sequence"
        tight_words = f"{figures}, under max_model_len {need:,}"
        sign, quantity, unit, predicted, limit = "-", "kv_capacity", "tokens", tokens, float(need)

    def verdict(word: str, note: str) -> FitAtBandEdge:
        return FitAtBandEdge(verdict=word, quantity=quantity, unit=unit, predicted=predicted,  # type: ignore[arg-type]
                             at_band_edge=edge, limit=limit, band_abs_error=b, note=note)

    if not report.fits:
        return verdict("does not fit", "does not fit at the prediction")
    if b is None:
        return verdict("fits", f"fits at the prediction; {band.note}")
    if at_edge:
        return verdict("fits", f"fits at the band's edge: {fits_words} ({_edge_words(band, sign)})")
    return verdict("tight", f"tight: fits at the prediction, not at the band's edge ({_edge_words(band, sign)}): "
                            f"{tight_words}")


def with_bands(report: CostReport, bands: BandsFile, *, engine_generation: str | None,
               own: ProfileBands | None = None) -> CostReport:
    """`report` with the band of each figure it predicts and its verdict at the band's edge.
    `engine_generation`: serving, the generation of the workload's engine and version
    (`knowledge.load.engine_generation`); ignored for training. `own`: the bands of the hardware
    profile's own measured cases, which replace the shipped ones where they match."""
    w = report.workload
    if w.kind == "training":
        found = training_bands(bands, w.stack, w.finetune, own)
    else:
        found = serving_bands(bands, engine_generation, w.engine, own,
                              saturated=None if report.load is None else report.load.saturated)
    verdict = fit_at_band_edge(report, found[0])
    return report.model_copy(update={"bands": found, "fit_at_band_edge": verdict})


__all__ = ["BELOW_SATURATION", "LOAD_QUANTITIES", "ProfileBands", "SATURATED", "band_cases", "fit_at_band_edge", "kv_holds_at_edge",
           "load_group", "memory_fits_at_edge", "prediction_band", "serving_bands", "training_bands", "training_group",
           "with_bands"]
