"""Inputs: model specs, hardware profiles (and a profile sized to a cluster, `cluster.py`),
and their loaders (files, config.json, bundled catalogs).

Rules (tests/test_architecture.py): imports nothing from `cost` or later wings, no rich,
typer or torch."""

from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec

__all__ = ["HardwareProfile", "ModelSpec"]
