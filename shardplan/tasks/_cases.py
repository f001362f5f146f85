"""A user's `--cases` file read (the schema of `shardplan.specs.cases`): shared by `validate` and by
`calibrate --serving-run`."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from shardplan.errors import ShardplanError
from shardplan.specs.cases import Case, CaseFile
from shardplan.specs.loading import load_hardware, read_structured, validation_error


def read_case_file(path: Path) -> list[Case]:
    """A user's `--cases` file (YAML or JSON, the schema of `shardplan.specs.cases`), or a
    calibrated hardware profile, whose `measured_cases:` are predicted with the profile itself."""
    data = read_structured(path)
    if isinstance(data, dict) and "measured_cases" in data:
        cases = load_hardware(str(path)).measured_cases
        if not cases:
            raise ShardplanError("the profile has no measured cases", source=str(path), field="measured_cases",
                                 hint="calibrate it with `shardplan calibrate --engine-log LOG --plan PLAN`")
        return list(cases)
    if not isinstance(data, dict):
        raise ShardplanError(f"expected a mapping with a `cases:` list at the top level, got {type(data).__name__}",
                             source=str(path), field="cases",
                             hint="see `shardplan validate --help` for the cases file's schema")
    try:
        return list(CaseFile.model_validate(data).cases)
    except ValidationError as e:
        raise validation_error(e, str(path)) from None
