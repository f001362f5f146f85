"""The I/O edge of `shardplan export`: read the plan and its model spec back, run the pure
exporter, write its files atomically into a folder (or return them for stdout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardplan.errors import InputFileError, ShardplanError, UnknownNameError
from shardplan.exporters import ExportOptions, export
from shardplan.fileio import write_text_atomic
from shardplan.manifest import load_manifest, spec_sha256
from shardplan.manifest_schema import DeploymentManifest
from shardplan.specs import loading
from shardplan.specs.model import ModelSpec


def read_source_model(m: DeploymentManifest, plan: str | None = None) -> loading.LoadedModel:
    """The model spec at the plan's `model.source`: a bundled name (`bundled:<name>` names the catalog
    only, never a path), or a model file. The plan may be anyone's, so the path is read as a
    model spec and nothing else (regular files, size-limited). Raises ShardplanError."""
    src = m.model.source
    if src.startswith("bundled:"):
        name = src.removeprefix("bundled:")
        if name not in loading.bundled_names(loading.model_specs_dir()):
            raise UnknownNameError(f"no bundled model named {name!r}", source=plan, field="model.source",
                                   hint="run `shardplan models` for the list, or re-plan")
        src = name
    return loading.load_model(src)


def source_spec(m: DeploymentManifest) -> ModelSpec | None:
    """The spec at the plan's `model.source`, when it can be read (see read_source_model)."""
    try:
        return read_source_model(m).spec
    except ShardplanError:
        return None


def plan_spec(m: DeploymentManifest) -> ModelSpec | None:
    """The plan's model spec, when its source still exists and hashes to what the plan recorded."""
    spec = source_spec(m)
    return spec if spec is not None and spec_sha256(spec) == m.model.spec_sha256 else None


def export_plan(plan: Path, target: str, options: ExportOptions, out_dir: Path | None) -> dict[str, Any]:
    """Export; with `out_dir`, write the files there (created if missing). Returns a summary:
    target, and per file its name, path (when written), bytes and text."""
    m = load_manifest(plan)
    spec = source_spec(m)
    if spec is not None and spec_sha256(spec) != m.model.spec_sha256:
        raise InputFileError(f"the model spec at {m.model.source} has changed since this plan was made",
                             source=str(plan), field="model.spec_sha256",
                             hint="re-plan from the spec with shardplan recommend")
    try:
        files = export(m, target, spec=spec, options=options)
    except ShardplanError as e:
        if e.source is None and e.field is not None and not e.field.startswith("-"):  # a plan field: name the plan
            e.source = str(plan)
        raise
    out = {"target": target, "plan": str(plan), "files": []}
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ShardplanError(f"cannot create the folder: {e.strerror}", source=str(out_dir),
                                 hint="pass a writable -o folder") from None
    for f in files:
        entry: dict[str, Any] = {"name": f.name, "bytes": len(f.text.encode()), "text": f.text}
        if out_dir is not None:
            path = out_dir / f.name
            write_text_atomic(path, f.text, executable=f.executable)
            entry["path"] = str(path)
        out["files"].append(entry)
    return out
