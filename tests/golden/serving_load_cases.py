"""Published benchmark_serving runs (shardplan/validation/corpus/serving_load, sources in
docs/research/serving-load-sources.md) as the package reads them (`validation.shipped.serving_load_cases`:
each row's model, GPU, engine version, flags, layout and traffic as a `ServingLoadCase`) and predicts
them (`validation.predict.predict_serving_load`): shared by tests/golden/test_serving_load_published.py
and benchmarks/serving_load_errors.py, so that the golden test, the benchmark table, `shardplan
validate` and the bands the estimates print judge the same runs the same way."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from shardplan.errors import ShardplanError
from shardplan.specs.cases import ServingLoadCase
from shardplan.validation.predict import predict_serving_load, serving_load_inputs
from shardplan.validation.shipped import CORPUS_DIR, Skipped, serving_load_cases


@lru_cache(maxsize=1)
def _read() -> tuple[tuple[ServingLoadCase, ...], tuple[Skipped, ...]]:
    cases, skipped = serving_load_cases(CORPUS_DIR)
    return tuple(cases), tuple(skipped)  # type: ignore[arg-type]


def cases() -> list[ServingLoadCase]:
    """The runs the model is asked about."""
    return list(_read()[0])


def skipped() -> list[Skipped]:
    """The runs it is not asked about, each with the reason (flags it does not read, no version...)."""
    return list(_read()[1])


class NotModelled(Exception):
    """The case's deployment does not start as shardplan sizes it: nothing to compare."""


@lru_cache(maxsize=None)
def predict(case: ServingLoadCase) -> Any:
    """The model's LoadResult for a case; NotModelled when shardplan says the deployment does not start."""
    try:
        return predict_serving_load(case, CORPUS_DIR)[0]
    except ShardplanError as e:
        raise NotModelled(e.message) from None


def is_moe(case: ServingLoadCase) -> bool:
    return serving_load_inputs(case, CORPUS_DIR)[0].moe is not None


def errors(case: ServingLoadCase, result: Any) -> dict[str, float]:
    """Relative errors (predicted / measured - 1) of the judged figures (NaN: the run has no TPOT or ITL)."""
    m = case.measured
    return {
        "median_ttft": result.ttft_seconds.p50 * 1e3 / m.median_ttft_ms - 1,
        "median_tpot": result.tpot_seconds.p50 * 1e3 / m.median_tpot_ms - 1 if m.median_tpot_ms else float("nan"),
        "median_itl": (result.itl_seconds.p50 * 1e3 / m.median_itl_ms - 1
                       if m.median_itl_ms and result.itl_seconds is not None else float("nan")),
        "output_throughput": result.output_tokens_per_second / m.output_tokens_per_second - 1,
    }
