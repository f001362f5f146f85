"""Base class for every schema: strict (unknown keys are errors), frozen, keyword-only."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=False,
        validate_default=True,
        allow_inf_nan=False,
        use_enum_values=False,
        defer_build=True,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Lax mode reads `true` as 1 in a numeric field; a YAML or JSON boolean where a count or
        size belongs is a mistake, so it is refused."""
        if isinstance(value, bool) and info.field_name is not None:
            ann = cls.model_fields[info.field_name].annotation
            kinds = set(get_args(ann)) or {ann}
            if bool not in kinds and kinds & {int, float}:
                raise ValueError("a number is expected here, not true/false")
        return value
