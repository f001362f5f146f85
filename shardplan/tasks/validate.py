"""`shardplan validate`: the cost model against every measured case shardplan ships (engine
start-up logs, training runs per stack, LoRA/QLoRA peaks, serving benchmark runs), or against a user's own cases
(`--cases FILE`), with the error statistics per engine generation or stack and quantity. The
bands that predictions carry (`knowledge/bands.yaml`) are these statistics over the shipped
corpus."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shardplan.errors import ShardplanError
from shardplan.tasks._cases import read_case_file
from shardplan.tasks._results import Result
from shardplan.specs.cases import Case, EngineLogCase, ServingLoadCase
from shardplan.validation.predict import PAIRS_GROUP, Comparison, compare, layout_pairs, shipped_predictions
from shardplan.validation.shipped import CORPUS_DIR
from shardplan.validation.stats import BAND_PERCENTILE, group_stats

UNITS = {"kv_capacity": "tokens", "peak_memory": "bytes", "tokens_per_second": "tokens_per_second_per_gpu",
         "start_verdict": "started (1) or refused (0)", "ttft_p50": "seconds", "tpot_p50": "seconds", "itl_p50": "seconds",
         "output_tokens_per_second": "tokens_per_second",
         "layout_speed_ratio": "ratio of the measured-faster layout's tokens/s per GPU to the other's"}


class CaseRow(Result):
    case_id: str
    source: str
    kind: str = Field(description="engine_log, training, finetune or serving_load")
    group: str = Field(description="the engine generation (a serving run's with its regime), or the stack (and "
                                   "fine-tuning method)")
    quantity: str = Field(description="kv_capacity, peak_memory, tokens_per_second, start_verdict; serving runs: "
                                      "ttft_p50, tpot_p50, output_tokens_per_second; two training runs of one "
                                      "setting (case_id 'A vs B'): layout_speed_ratio")
    unit: str = Field(description="the unit of measured and predicted")
    measured: float
    predicted: float
    error: float = Field(description="predicted / measured - 1 (a verdict: 0 right, 1 wrong)")


class GroupRow(Result):
    kind: str
    group: str
    quantity: str
    versions: list[str] = Field(description="the engine versions of the cases, oldest first (empty for stacks)")
    num_cases: int
    mean_abs_error: float = Field(description="mean |predicted / measured - 1|")
    median_abs_error: float
    band_abs_error: float = Field(description=f"the {BAND_PERCENTILE}th percentile of |error| (nearest rank)")
    max_abs_error: float
    mean_signed_error: float = Field(description="mean predicted / measured - 1: above 0 the model is optimistic")
    worst_case_id: str
    worst_source: str
    worst_error: float


class LeftOut(Result):
    case_id: str
    reason: str


class ValidateResult(Result):
    corpus: str = Field(description="'shipped' or the --cases file")
    band_percentile: int
    num_cases: int = Field(description="cases predicted")
    groups: list[GroupRow]
    cases: list[CaseRow]
    skipped: list[LeftOut] = Field(description="shipped rows without a complete case (a model or GPU not modelled)")


def _keep(case: Case, engine: str | None, stack: str | None) -> bool:
    if engine is None and stack is None:
        return True
    if isinstance(case, (EngineLogCase, ServingLoadCase)):
        return engine is not None and case.engine == engine
    return stack is not None and case.stack == stack


def validate(*, engine: str | None = None, stack: str | None = None, cases_file: Path | None = None,
             corpus: Path = CORPUS_DIR) -> ValidateResult:
    """Predict every case and gather the errors. A user's case the model refuses is bad input
    (exit 2, naming the file and the case); a shipped one is listed as skipped with the reason."""
    paired: list[tuple[Case, Comparison]] = []  # each case with each of its comparisons
    if cases_file is not None:
        cases, skipped, label = read_case_file(cases_file), [], str(cases_file)
        for case in cases:
            if not _keep(case, engine, stack):
                continue
            try:
                paired += [(case, c) for c in compare(case, cases_file.parent)]
            except ShardplanError as e:
                raise ShardplanError(f"case {case.id}: {e.message}", source=label, field=e.field, hint=e.hint) from None
    else:
        predicted, left = shipped_predictions(corpus)
        cases, label = [p.case for p in predicted], "shipped"
        skipped = [LeftOut(case_id=s.id, reason=s.reason) for s in left
                   if (engine is None and stack is None) or (engine is not None and s.engine == engine)
                   or (stack is not None and s.stack == stack)]
        for p in predicted:
            if not _keep(p.case, engine, stack):
                continue
            if p.refused is not None:  # a published run with a layout shardplan cannot express yet: listed, not counted
                skipped.append(LeftOut(case_id=p.case.id, reason=p.refused))
            paired += [(p.case, c) for c in p.comparisons]
    comparisons = [c for _, c in paired]
    if not comparisons:
        what = " and ".join(x for x in (f"engine {engine}" if engine else "", f"stack {stack}" if stack else "") if x)
        engines = sorted({c.engine for c in cases if getattr(c, "engine", None)})
        stacks = sorted({c.stack for c in cases if getattr(c, "stack", None)})
        raise ShardplanError(f"no case matches {what}" + (": no measurement of it ships yet" if cases_file is None else ""),
                             source=label,
                             hint=f"leave --engine/--stack out, or name one the cases use (engines: {', '.join(engines)}; "
                                  f"stacks: {', '.join(stacks)})")
    # Two runs of one setting in different layouts: how far the model's ratio of their speeds is from the measured one.
    comparisons += layout_pairs(paired)
    groups = [GroupRow(kind=g.kind, group=g.group, quantity=g.quantity, versions=list(g.versions),
                       num_cases=g.num_cases, mean_abs_error=g.mean_abs_error, median_abs_error=g.median_abs_error,
                       band_abs_error=g.band_abs_error, max_abs_error=g.max_abs_error,
                       mean_signed_error=g.mean_signed_error, worst_case_id=g.worst.case_id,
                       worst_source=g.worst.source, worst_error=g.worst.error)
              for g in group_stats(comparisons)]
    rows = [CaseRow(case_id=c.case_id, source=c.source, kind=c.kind, group=c.group, quantity=c.quantity,
                    unit=UNITS[c.quantity], measured=c.measured, predicted=c.predicted, error=c.error)
            for c in comparisons]
    return ValidateResult(corpus=label, band_percentile=BAND_PERCENTILE,
                          num_cases=len({(c.kind, c.case_id) for c in comparisons if c.group != PAIRS_GROUP}), groups=groups, cases=rows,
                          skipped=skipped)


__all__ = ["CaseRow", "GroupRow", "LeftOut", "ValidateResult", "read_case_file", "validate"]
