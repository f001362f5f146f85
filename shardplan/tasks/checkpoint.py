"""`shardplan checkpoint`: which bytes of a safetensors checkpoint each rank of a plan reads.

Only headers are read, never tensor data (`tasks/_safetensors.py` reads them and describes the
format).

Byte ranges: a rank's slice of a tensor (`placement`) is a box; its bytes are `count` runs of
`length` bytes, `stride` bytes apart, from `start` (absolute file offset). A row slice (dim 0
of an [out, in] weight, vocab rows, a whole tensor) is one run; a column slice is one run per
row. The rule: read exactly the bytes the rank keeps (`bytes`); `span_bytes` says what one
contiguous read from the first byte to the last would fetch instead. Whole runs that abut
in a file (consecutive tensors a rank reads entirely) are merged into one range.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shardplan.errors import InputFileError, ShardplanError
from shardplan.plan import readback
from shardplan.plan.manifest import load_manifest
from shardplan.plan.schema import DeploymentManifest
from shardplan.plan.placement import check_nameable, model_tensors, rank_holdings
from shardplan.specs import hub
from shardplan.specs.model import ModelSpec
from shardplan.tasks._results import Result
from shardplan.tasks._safetensors import (  # re-exported: tests and callers import them from here
    HEADER_LENGTH_BYTES,
    INDEX_FILE,
    MAX_HEADER_BYTES,
    MAX_SHARDS,
    MAX_TENSORS,
    SAFETENSORS_DTYPE_BYTES,
    Read,
    StoredTensor,
    _check_index_agrees,
    _stored_tensors,
    box_read,
    check_tensors,
    expected_dtype,
    read_checkpoint,
    read_header,
)


# ----- the result ---------------------------------------------------------------------------


class ByteRange(Result):
    """`count` runs of `length` bytes, `stride` bytes apart, from absolute file offset `start`."""

    start: int = Field(description="absolute offset of the first byte in the file (bytes)")
    length: int = Field(description="bytes per run")
    count: int = Field(description="runs (count)")
    stride: int = Field(description="distance between run starts (bytes); 0 for one run")
    bytes: int = Field(description="length x count (bytes)")
    span_bytes: int = Field(description="first byte to last: what one contiguous read would fetch (bytes)")


class RankFileReads(Result):
    """What one rank reads from one file."""

    file: str = Field(description="file name relative to the checkpoint folder")
    bytes: int = Field(description="bytes read from it")
    num_reads: int = Field(description="byte ranges (count)")
    num_runs: int = Field(description="contiguous runs over all ranges (count)")
    reads: list[ByteRange]


class RankReads(Result):
    """What one rank of the plan reads."""

    rank: int
    node: int = Field(description="rank // gpus_per_node")
    num_tensors: int = Field(description="tensor slices it holds (count)")
    bytes: int = Field(description="bytes it reads in all")
    files: list[RankFileReads]


class CheckpointFile(Result):
    file: str = Field(description="file name relative to the checkpoint folder")
    bytes: int = Field(description="file size (bytes)")


class NodeReads(Result):
    node: int
    bytes: int = Field(description="bytes the node's ranks read (bytes)")


class CheckpointResult(Result):
    """What `checkpoint --json` prints: the check's result and per rank the byte ranges it reads."""

    plan: str = Field(description="the manifest")
    checkpoint: str = Field(description="the checkpoint folder")
    model: str
    dtype: str = Field(description="safetensors dtype of the tensors (e.g. BF16)")
    num_tensors: int = Field(description="tensors checked (count)")
    files: list[CheckpointFile]
    checkpoint_tensor_bytes: int = Field(description="bytes of the model's tensors in the checkpoint")
    num_ranks: int
    ranks: list[RankReads]
    nodes: list[NodeReads]
    total_read_bytes: int = Field(description="bytes all ranks read")
    replication: float = Field(description="total_read_bytes / checkpoint_tensor_bytes (the plan's replication)")


def _merge(reads: list[Read]) -> list[Read]:
    out: list[Read] = []
    for r in sorted(reads, key=lambda r: r.start):
        last = out[-1] if out else None
        if last is not None and last.count == 1 and r.count == 1 and last.start + last.length == r.start:
            out[-1] = Read(last.start, last.length + r.length, 1, 0)
        else:
            out.append(r)
    return out


def loading_plan(m: DeploymentManifest, spec: ModelSpec, folder: Path, stored: list[StoredTensor],
                 sizes: dict[str, int], *, dtype: str, source: str) -> CheckpointResult:
    """What `shardplan checkpoint --json` prints: the check's result, per rank the files and
    byte ranges it reads and their total, totals per node, and how they add up."""
    if m.workload.kind == "inference" and m.workload.quantization != "none":
        raise ShardplanError(f"the plan stores {m.workload.quantization} weights; this reads unquantized checkpoints",
                             source=source, field="workload.quantization",
                             hint="plan with the checkpoint's own format (no --quantization)")
    by_name = check_tensors(spec, stored, dtype, str(folder))
    checkpoint_bytes = sum(by_name[t.name].nbytes for t in model_tensors(spec))
    ranks: list[RankReads] = []
    gpn = m.placement.gpus_per_node
    per_node: dict[int, int] = {}
    for rank, held in enumerate(rank_holdings(m, spec)):
        files: dict[str, list[Read]] = {}
        for h in held:
            st = by_name[h.tensor.name]
            files.setdefault(st.file, []).append(box_read(st, h.box))
        entries = []
        for rel in sorted(files):
            reads = _merge(files[rel])
            entries.append(RankFileReads(
                file=rel, bytes=sum(r.nbytes for r in reads), num_reads=len(reads), num_runs=sum(r.count for r in reads),
                reads=[ByteRange(start=r.start, length=r.length, count=r.count, stride=r.stride, bytes=r.nbytes,
                                 span_bytes=r.span_bytes) for r in reads]))
        total = sum(e.bytes for e in entries)
        per_node[rank // gpn] = per_node.get(rank // gpn, 0) + total
        ranks.append(RankReads(rank=rank, node=rank // gpn, num_tensors=len(held), bytes=total, files=entries))
    total_read = sum(r.bytes for r in ranks)
    return CheckpointResult(
        plan=source,
        checkpoint=str(folder),
        model=spec.name,
        dtype=dtype,
        num_tensors=len(by_name),
        files=[CheckpointFile(file=rel, bytes=sizes[rel]) for rel in sorted(sizes)],
        checkpoint_tensor_bytes=checkpoint_bytes,
        num_ranks=len(ranks),
        ranks=ranks,
        nodes=[NodeReads(node=n, bytes=b) for n, b in sorted(per_node.items())],
        total_read_bytes=total_read,
        replication=total_read / checkpoint_bytes,
    )


def plan_checkpoint(plan: Path, checkpoint: Path, *, dtype: str | None = None) -> CheckpointResult:
    """The I/O edge of `shardplan checkpoint`: read the plan, its model and the checkpoint's
    headers (from a local folder, or a Hub id `org/name[@revision]` that is not a local path),
    check them against each other, and return the loading plan."""
    m = load_manifest(plan)
    spec = readback.checked_model(m, str(plan)).spec
    check_nameable(spec, str(plan))
    text = str(checkpoint)
    if not checkpoint.exists() and hub.is_hub_candidate(text):
        folder, stored, sizes = remote_checkpoint(hub.safetensors_headers(hub.parse_hub_id(text)))
    else:
        folder, stored, sizes = read_checkpoint(checkpoint)
    return loading_plan(m, spec, folder, stored, sizes, dtype=expected_dtype(spec, dtype), source=str(plan))


# ----- a checkpoint on the Hub ----------------------------------------------------------------


def _natural(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def remote_checkpoint(rc: hub.RemoteCheckpoint) -> tuple[Path, list[StoredTensor], dict[str, int]]:
    """`read_checkpoint` for headers fetched from the Hub: the same tensors, absolute offsets
    and file sizes a local copy of the same files gives. The Hub reports each header's entries
    but not its length; the format fixes it: the data section is "entirely indexed, and cannot
    contain holes" (huggingface/safetensors README, "Format"), so it is exactly as long as the
    entries' extent, and the header is what remains of the file after the 8-byte length."""
    folder = Path(rc.origin)
    label = str(folder / INDEX_FILE)
    hint = "check the repository's safetensors files"
    tensors: list[StoredTensor] = []
    sizes: dict[str, int] = {}
    if len(rc.shards) > MAX_SHARDS:
        raise InputFileError(f"{len(rc.shards)} safetensors files, more than {MAX_SHARDS}", source=label, hint=hint)
    for shard in rc.shards:
        rel = shard.file
        if not rel or rel.startswith("/") or "\\" in rel or ".." in Path(rel).parts:
            raise InputFileError(f"file name {rel!r} is not a plain name in the repository", source=label,
                                 field="weight_map", hint=hint)
        where = f"{rc.origin}/{rel}"
        if len(shard.tensors) > MAX_TENSORS:
            raise InputFileError(f"{len(shard.tensors)} tensors, more than {MAX_TENSORS}", source=where, field="header",
                                 hint=hint)
        for name, t in shard.tensors.items():  # huggingface_hub passes the header's entries through unchecked
            offsets, shape = tuple(t.data_offsets or ()), tuple(t.shape or ())
            if len(offsets) != 2 or not all(_natural(x) for x in offsets) or offsets[0] > offsets[1] \
                    or not all(_natural(x) for x in shape):
                raise InputFileError(f"tensor {str(name)[:80]!r} has data_offsets {str(t.data_offsets)[:40]} and shape "
                                     f"{str(t.shape)[:40]}: two offsets begin <= end and a shape of sizes are needed",
                                     source=where, field="header", hint=hint)
        header = {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
                  for name, t in shard.tensors.items()}
        extents = sorted(tuple(t.data_offsets) for t in shard.tensors.values())
        data_bytes = extents[-1][1] if extents else 0
        holes = any(b0 != a1 for (_, a1), (b0, _) in zip([(0, 0), *extents], extents))
        header_bytes = shard.size_bytes - HEADER_LENGTH_BYTES - data_bytes
        if holes or not 2 <= header_bytes <= MAX_HEADER_BYTES:  # 2: the shortest header, '{}'
            raise InputFileError(f"tensor data does not tile {data_bytes} bytes ending the {shard.size_bytes}-byte file",
                                 source=where, field="header", hint=hint)
        tensors += _stored_tensors(header, rel, where, HEADER_LENGTH_BYTES + header_bytes, data_bytes)
        sizes[rel] = shard.size_bytes
    _check_index_agrees(Path(label), rc.weight_map, tensors)
    return folder, tensors, sizes
