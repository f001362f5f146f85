"""The measured error bands, loaded once and attached to what the tasks predict (shared by
recommend, capacity and replan, and by the CLI's estimate; not a task). The lookup and the edge
are pure (cost/accuracy.py); this is where the bands file is read, the engine version is
resolved to its generation, and a calibrated profile's own measured cases are predicted.

A profile `shardplan calibrate` wrote carries the runs it was calibrated from
(`measured_cases:`). Its bands are `shardplan validate`'s statistics over those cases, predicted
with the profile by the validation code (validation/predict.py, validation/stats.py) when a
prediction made with the profile is banded: a few cases, so computed on the fly (and cached per
profile) rather than stored, and never stale when the cost model moves. They replace the shipped
band where they measured the prediction's group and quantity (its engine generation's KV
capacity, its stack's peak memory); the rest keep the shipped band."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from shardplan.cost import accuracy
from shardplan.cost.report import CostReport, PredictionBand
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import bands_file, engine_generation
from shardplan.knowledge.schema import ErrorBand
from shardplan.search import Goal
from shardplan.specs.cases import Case
from shardplan.specs.hardware import HardwareProfile
from shardplan.validation.bands import BANDED
from shardplan.validation.predict import PAIRS_GROUP, Comparison, compare, layout_pairs
from shardplan.validation.stats import group_stats


def profile_bands(hw: HardwareProfile) -> accuracy.ProfileBands | None:
    """The bands of `hw`'s own measured cases (None without any). A case the model cannot
    predict (its model file gone) is bad input: one line naming the profile and the case."""
    if not hw.measured_cases:
        return None
    # Each case states its own GPUs: one computation per profile, whatever cluster it was sized to.
    return _profile_bands(hw.with_topology(gpus_per_node=1, num_nodes=1))


@lru_cache(maxsize=32)
def _profile_bands(hw: HardwareProfile) -> accuracy.ProfileBands:
    paired: list[tuple[Case, Comparison]] = []  # each case with each of its comparisons
    for i, case in enumerate(hw.measured_cases):
        try:
            paired += [(case, c) for c in compare(case)]
        except ShardplanError as e:
            raise ShardplanError(f"measured case {case.id}: {e.message}", source=case.hardware,
                                 field=f"measured_cases.{i}" + (f".{e.field}" if e.field else ""),
                                 hint=e.hint or "fix the case or remove it from the profile") from None
    comparisons = [c for _, c in paired] + layout_pairs(paired)
    bands = tuple(
        ErrorBand(kind=g.kind, group=g.group, quantity=g.quantity, versions=g.versions, num_cases=g.num_cases,  # type: ignore[arg-type]
                  band_abs_error=g.band_abs_error, mean_signed_error=g.mean_signed_error)
        for g in group_stats(comparisons) if g.quantity in BANDED)
    return accuracy.ProfileBands(profile=hw.name, bands=bands)


def banded(report: CostReport, hw: HardwareProfile) -> CostReport:
    """`report`, predicted on `hw`, with its bands and its verdict at the band's edge
    (`cost.accuracy.with_bands`): `hw`'s own measured cases' bands where they match, else the
    shipped ones."""
    w = report.workload
    generation = engine_generation(w.engine, w.engine_version) if w.kind == "inference" else None
    return accuracy.with_bands(report, bands_file(), engine_generation=generation, own=profile_bands(hw))


def workload_bands(workload: InferenceWorkload | TrainingWorkload, hw: HardwareProfile) -> list[PredictionBand]:
    """The bands a workload's predictions on `hw` carry; the first is the one "fits" is decided on."""
    own = profile_bands(hw)
    if isinstance(workload, TrainingWorkload):
        return accuracy.training_bands(bands_file(), workload.stack, workload.finetune.value, own)
    generation = engine_generation(workload.engine, workload.engine_version)
    return accuracy.serving_bands(bands_file(), generation, workload.engine, own)


def layout_band(hw: HardwareProfile) -> PredictionBand:
    """The error of the model's ratio of two layouts' training tokens/s in one setting
    (`validation.predict.layout_pairs`): `hw`'s own measured pairs where its cases hold some, else
    the shipped ones (pooled over stacks)."""
    return accuracy.prediction_band(bands_file(), "layout_speed_ratio", "training", PAIRS_GROUP, own=profile_bands(hw))


def load_bands(workload: InferenceWorkload, hw: HardwareProfile, saturated: bool) -> list[PredictionBand]:
    """The bands of a serving plan's figures under traffic in its regime (median TTFT, TPOT and ITL,
    output tokens/s), without the KV capacity's."""
    generation = engine_generation(workload.engine, workload.engine_version)
    return accuracy.serving_bands(bands_file(), generation, workload.engine, profile_bands(hw), saturated=saturated)[1:]


def goal_at_edge(goal: Goal, workload: InferenceWorkload | TrainingWorkload, hw: HardwareProfile, *,
                 strict_fit: bool) -> Goal:
    """`goal` with the band the search applies where it decides fit: tight plans rank after
    those that fit at the band's edge, or are left out with `strict_fit`."""
    bands = workload_bands(workload, hw)
    band = bands[0].band_abs_error
    # Ties: plans whose ranked figure is within the measured error of comparing two layouts of one
    # setting (training: `layout_band`). Not the band of the figure itself: what every layout of a
    # setting shares (the GPU's real efficiency, the stack's overheads) moves them together, so the
    # error of their ratio is several times smaller than a stack's tokens/s band (BENCHMARKS.md). Serving:
    # only equal values tie; its output tokens/s band measures whole deployments against their
    # benchmarks, not one layout against another, and no two shipped runs compare layouts.
    if isinstance(workload, TrainingWorkload):
        return replace(goal, peak_memory_band_fraction=band, strict_fit=strict_fit,
                       tie_band_fraction=layout_band(hw).band_abs_error)
    return replace(goal, kv_capacity_band_fraction=band, strict_fit=strict_fit)


__all__ = ["banded", "goal_at_edge", "layout_band", "load_bands", "profile_bands", "workload_bands"]
