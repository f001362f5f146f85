"""Error statistics of predictions against measurements, per group and quantity.

The band a group's prediction carries is the 90th percentile of the absolute relative errors
of its cases (nearest rank: the smallest error at least 90% of the cases are within), so that
a group of fewer than ten cases takes its largest error. The signed mean says which way the
model leans.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from shardplan.validation.predict import Comparison

BAND_PERCENTILE = 90


def nearest_rank(values: list[float], percentile: float) -> float:
    """The nearest-rank percentile: the value at rank ceil(p/100 x n) of the sorted values."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(percentile / 100 * len(ordered))) - 1]


@dataclass(frozen=True)
class GroupStats:
    kind: str
    group: str
    quantity: str
    versions: tuple[str, ...]  # the engine versions of the cases, oldest first (empty for stacks)
    num_cases: int
    mean_abs_error: float
    median_abs_error: float
    band_abs_error: float  # the BAND_PERCENTILE-th percentile of |error|
    max_abs_error: float
    mean_signed_error: float
    worst: Comparison


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in v.replace("-", ".").split("."))


def group_stats(comparisons: Iterable[Comparison]) -> list[GroupStats]:
    """Statistics per (kind, group, quantity), in the order groups first appear. Verdicts count
    as 0 (right) or 1 (wrong), so their mean is the share the model got wrong."""
    groups: dict[tuple[str, str, str], list[Comparison]] = {}
    for c in comparisons:
        groups.setdefault((c.kind, c.group, c.quantity), []).append(c)
    out = []
    for (kind, group, quantity), cs in groups.items():
        errors = [abs(c.error) for c in cs]
        worst = max(cs, key=lambda c: abs(c.error))
        versions = tuple(sorted({c.version for c in cs if c.version}, key=_version_key))
        out.append(GroupStats(
            kind=kind, group=group, quantity=quantity, versions=versions, num_cases=len(cs),
            mean_abs_error=statistics.fmean(errors), median_abs_error=statistics.median(errors),
            band_abs_error=nearest_rank(errors, BAND_PERCENTILE), max_abs_error=max(errors),
            mean_signed_error=statistics.fmean(c.error for c in cs), worst=worst))
    return out


__all__ = ["BAND_PERCENTILE", "GroupStats", "group_stats", "nearest_rank"]
