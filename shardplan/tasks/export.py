"""The I/O edge of `shardplan export`: read the plan and its model spec back, run the pure
exporter, write its files into a folder, all or none (or return them for stdout)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from shardplan.errors import ShardplanError
from shardplan.exporters import ExportOptions, export
from shardplan.fileio import PendingFile, write_files_atomic
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


def export_plan(plan: Path, target: str, options: ExportOptions, out_dir: Path | None, *,
                plan_copy: Path | None = None, also: Sequence[PendingFile] = ()) -> ExportResult:
    """Export; with `out_dir`, write the files there (created if missing), all or none
    (`fileio.write_files_atomic`): when one cannot be written (a folder in the way, an unwritable
    folder), no file is replaced and a folder made for them is removed. `plan_copy` (recommend -o PLAN
    --export): `plan` is the manifest staged elsewhere, written to `plan_copy` in the same all-or-none
    write; errors and the result name `plan_copy`. `also`: more files of that write (recommend's
    --plot). Returns a summary: target, and per file its name,
    path (when written), bytes and text."""
    label = str(plan_copy or plan)
    m = load_manifest(plan)
    spec = readback.optional_checked_spec(m, label)
    try:
        files = export(m, target, spec=spec, options=options)
    except ShardplanError as e:
        if e.source is None and e.field is not None and not e.field.startswith("-"):  # a plan field: name the plan
            e.source = label
        raise
    pending = [] if plan_copy is None else [PendingFile(path=plan_copy, data=plan.read_bytes(), what="-o")]
    pending += also
    if out_dir is not None:
        pending += [PendingFile(path=out_dir / f.name, data=f.text.encode(), executable=f.executable,
                                what=f"the {target} export's {f.name}") for f in files]
    if pending:
        _write_all(pending, out_dir)
    return ExportResult(target=target, plan=label, files=[
        ExportedFile(name=f.name, bytes=len(f.text.encode()), text=f.text,
                     path=None if out_dir is None else str(out_dir / f.name)) for f in files])


def _write_all(pending: list[PendingFile], out_dir: Path | None) -> None:
    """The files written all or none into `out_dir`, made (with missing parents) first and removed
    again when the write fails."""
    made = [] if out_dir is None else [d for d in (out_dir, *out_dir.parents) if not d.exists()]
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ShardplanError(f"cannot create the folder: {e.strerror}", source=str(out_dir),
                                 hint="pass a writable -o folder") from None
    try:
        write_files_atomic(pending)
    except BaseException:
        for d in made:  # deepest first; a folder something else wrote into meanwhile stays
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
