"""The I/O edge of `shardplan export`: read the plan and its model spec back, run the pure
exporter, write its files atomically into a folder (or return them for stdout)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shardplan.errors import ShardplanError
from shardplan.exporters import ExportOptions, export
from shardplan.fileio import write_text_atomic
from shardplan.plan import readback
from shardplan.plan.manifest import load_manifest
from shardplan.tasks._results import Result, absent


class ExportedFile(Result):
    """One file the exporter produced."""

    name: str = Field(description="file name (no folder)")
    bytes: int = Field(description="size of the UTF-8 text (bytes)")
    text: str = Field(description="the file's content")
    path: str | None = absent("where it was written (only with -o)")


class ExportResult(Result):
    """What `export --json` prints."""

    target: str = Field(description="the exporter (vllm, torchrun, kubernetes, ...)")
    plan: str = Field(description="the manifest exported")
    files: list[ExportedFile]


def export_plan(plan: Path, target: str, options: ExportOptions, out_dir: Path | None) -> ExportResult:
    """Export; with `out_dir`, write the files there (created if missing). Returns a summary:
    target, and per file its name, path (when written), bytes and text."""
    m = load_manifest(plan)
    spec = readback.optional_checked_spec(m, str(plan))
    try:
        files = export(m, target, spec=spec, options=options)
    except ShardplanError as e:
        if e.source is None and e.field is not None and not e.field.startswith("-"):  # a plan field: name the plan
            e.source = str(plan)
        raise
    entries: list[ExportedFile] = []
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ShardplanError(f"cannot create the folder: {e.strerror}", source=str(out_dir),
                                 hint="pass a writable -o folder") from None
    for f in files:
        path = None
        if out_dir is not None:
            path = out_dir / f.name
            write_text_atomic(path, f.text, executable=f.executable)
        entries.append(ExportedFile(name=f.name, bytes=len(f.text.encode()), text=f.text,
                                    path=None if path is None else str(path)))
    return ExportResult(target=target, plan=str(plan), files=entries)
