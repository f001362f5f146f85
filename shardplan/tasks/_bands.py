"""The measured error bands, loaded once and attached to what the tasks predict (shared by
recommend and capacity, and by the CLI's estimate; not a task). The lookup and the edge are
pure (cost/accuracy.py); this is where the bands file is read and the engine version is
resolved to its generation."""

from __future__ import annotations

from dataclasses import replace

from shardplan.cost import accuracy
from shardplan.cost.report import CostReport, PredictionBand
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.knowledge.load import bands_file, engine_generation
from shardplan.search import Goal


def banded(report: CostReport) -> CostReport:
    """`report` with its bands and its verdict at the band's edge (`cost.accuracy.with_bands`)."""
    w = report.workload
    generation = engine_generation(w.engine, w.engine_version) if w.kind == "inference" else None
    return accuracy.with_bands(report, bands_file(), engine_generation=generation)


def workload_bands(workload: InferenceWorkload | TrainingWorkload) -> list[PredictionBand]:
    """The bands a workload's predictions carry; the first is the one "fits" is decided on."""
    if isinstance(workload, TrainingWorkload):
        return accuracy.training_bands(bands_file(), workload.stack, workload.finetune.value)
    generation = engine_generation(workload.engine, workload.engine_version)
    return accuracy.serving_bands(bands_file(), generation, workload.engine)


def goal_at_edge(goal: Goal, workload: InferenceWorkload | TrainingWorkload, *, strict_fit: bool) -> Goal:
    """`goal` with the band the search applies where it decides fit: tight plans rank after
    those that fit at the band's edge, or are left out with `strict_fit`."""
    band = workload_bands(workload)[0].band_abs_error
    if isinstance(workload, TrainingWorkload):
        return replace(goal, peak_memory_band_fraction=band, strict_fit=strict_fit)
    return replace(goal, kv_capacity_band_fraction=band, strict_fit=strict_fit)


__all__ = ["banded", "goal_at_edge", "workload_bands"]
