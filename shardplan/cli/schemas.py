"""The `--json` output of each command, by name, for `shardplan schema --output NAME`.

A plain dict literal of where each result model lives: commands add theirs at the end. The
models are imported only when `schema` asks for one (importing all of them, tasks and verify
reports included, took a third of every command's start-up)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel

OUTPUTS: dict[str, str] = {
    "manifest": "shardplan.plan.schema:DeploymentManifest",
    "estimate": "shardplan.cost.report:CostReport",
    "recommend": "shardplan.search.results:RecommendResult",
    "models": "shardplan.tasks.catalog:ModelList",
    "hardware": "shardplan.tasks.catalog:HardwareList",
    "capacity": "shardplan.tasks.capacity:CapacityResult",
    "export": "shardplan.tasks.export:ExportResult",
    "checkpoint": "shardplan.tasks.checkpoint:CheckpointResult",
    "replan": "shardplan.tasks.replan:ReplanResult",
    "calibrate": "shardplan.tasks.calibrate:CalibrateResult",
    "verify": "shardplan.verify.report:VerifyReport",
    "engine-log": "shardplan.verify.engine_log_check:EngineLogCheck",
    "validate": "shardplan.tasks.validate:ValidateResult",
    "watch": "shardplan.tasks.watch:WatchScrape",
    "reshard": "shardplan.verify.report:ReshardReport",
}


def output_model(name: str) -> type[BaseModel] | None:
    """The result model printed by the command output `name`; None: no such output."""
    where = OUTPUTS.get(name)
    if where is None:
        return None
    module, attr = where.split(":")
    return getattr(importlib.import_module(module), attr)
