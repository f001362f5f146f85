"""The `--json` output of each command, by name, for `shardplan schema --output NAME`.

A plain dict literal: commands add their result model at the end."""

from __future__ import annotations

from pydantic import BaseModel

from shardplan.cost.report import CostReport
from shardplan.plan.schema import DeploymentManifest
from shardplan.search.results import RecommendResult
from shardplan.tasks.calibrate import CalibrateResult
from shardplan.tasks.capacity import CapacityResult
from shardplan.tasks.catalog import HardwareList, ModelList
from shardplan.tasks.checkpoint import CheckpointResult
from shardplan.tasks.export import ExportResult
from shardplan.tasks.replan import ReplanResult
from shardplan.tasks.validate import ValidateResult
from shardplan.verify.engine_log_check import EngineLogCheck
from shardplan.tasks.watch import WatchScrape
from shardplan.verify.report import VerifyReport
from shardplan.verify.report import ReshardReport

OUTPUTS: dict[str, type[BaseModel]] = {
    "manifest": DeploymentManifest,
    "estimate": CostReport,
    "recommend": RecommendResult,
    "models": ModelList,
    "hardware": HardwareList,
    "capacity": CapacityResult,
    "export": ExportResult,
    "checkpoint": CheckpointResult,
    "replan": ReplanResult,
    "calibrate": CalibrateResult,
    "verify": VerifyReport,
    "engine-log": EngineLogCheck,
    "validate": ValidateResult,
    "watch": WatchScrape,
    "reshard": ReshardReport,
}
