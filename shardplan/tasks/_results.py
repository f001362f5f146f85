"""The base of every task's result: a frozen pydantic model whose `model_dump(mode="json")` is
what `--json` prints. Not a task (tasks import it; it imports nothing of shardplan)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Result(BaseModel):
    """Frozen, strict, keyword-only; fields named with their units."""

    model_config = ConfigDict(frozen=True, extra="forbid", serialize_by_alias=True, validate_by_name=True, defer_build=True)


def _is_none(value: Any) -> bool:
    return value is None


def absent(description: str) -> Any:
    """A field that is left out of the JSON when None (a key the object has only sometimes,
    e.g. a layout's figures only when one was found), rather than printed as null."""
    return Field(None, exclude_if=_is_none, description=description)
