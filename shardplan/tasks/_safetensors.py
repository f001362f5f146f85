"""Reading safetensors headers and mapping a tensor slice to its byte range: shared by
`checkpoint` (what each rank of a plan reads) and `replan --from-checkpoint` (what a new rank
reads for the slices no surviving rank holds).

A safetensors file is (the format's documentation, huggingface/safetensors README "Format"):
8 bytes, a little-endian u64 N; N bytes of UTF-8 JSON mapping each tensor name to {"dtype",
"shape", "data_offsets": [begin, end]} (offsets into the data that follows the header; an
optional "__metadata__" entry of strings); then the data, row-major. A sharded checkpoint adds
`model.safetensors.index.json`, whose `weight_map` names the file of every tensor. Only headers
are read, never tensor data.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardplan.errors import InputFileError, ShardplanError
from shardplan.fileio import loads_json, read_regular_file_bytes
from shardplan.plan.placement import Box, model_tensors
from shardplan.specs.model import ModelSpec
from shardplan.units import parse_dtype

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library refuses headers above 100 MB too
MAX_INDEX_BYTES = 100 * 2**20
MAX_TENSORS = 1_000_000  # tensors in one shard's header: a bound on the work a hostile header can ask for
MAX_SHARDS = 100_000  # files of one checkpoint

# safetensors dtype -> bytes per element (safetensors `Dtype`)
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
# what a model spec's `dtype` (HF torch_dtype) is stored as
_SPEC_DTYPE = {"fp32": "F32", "bf16": "BF16", "fp16": "F16", "fp8": "F8_E4M3", "int8": "I8"}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor entry of a safetensors header."""

    name: str
    file: str  # relative to the checkpoint folder
    dtype: str
    shape: tuple[int, ...]
    data_start: int  # absolute offset of its first byte in the file
    nbytes: int


# ----- reading headers ----------------------------------------------------------------------


def _confined(folder: Path, name: Any, source: str, field: str) -> Path:
    """A file named by the index, refused unless it is a plain relative name inside `folder`."""
    hint = "name files relative to the checkpoint folder, without '..', and keep links inside it"
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or ".." in Path(name).parts:
        raise InputFileError(f"file name {name!r} leaves the checkpoint folder", source=source, field=field, hint=hint)
    path = folder / name
    try:
        inside = path.resolve().is_relative_to(folder.resolve())
    except OSError as e:
        raise InputFileError(f"cannot resolve {name!r}: {e.strerror}", source=source, field=field, hint=hint) from None
    if not inside:
        raise InputFileError(f"{name!r} links outside the checkpoint folder", source=source, field=field, hint=hint)
    return path


def read_header(path: Path, rel: str) -> list[StoredTensor]:
    """The tensors of one safetensors file, from its header alone (bounded reads)."""
    label = str(path)
    hint = "pass a file written by safetensors (save_file / save_pretrained)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_LENGTH_BYTES)
            if len(head) < HEADER_LENGTH_BYTES:
                raise InputFileError(f"{size} bytes: too short for a safetensors header", source=label, hint=hint)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + n > size:
                raise InputFileError(f"header claims {n} bytes; the file has {size} and the cap is {MAX_HEADER_BYTES}",
                                     source=label, field="header length", hint=hint)
            raw = f.read(n)
    except OSError as e:
        raise InputFileError(f"cannot read: {e.strerror}", source=label, hint="check the path and permissions") from None
    # strict: a key twice (SECURITY.md), NaN, or nesting past 64 levels is refused, naming the file
    header = loads_json(raw, label=label, what="header", field="header", hint=hint)
    if not isinstance(header, dict):
        raise InputFileError("header is not a JSON object", source=label, field="header", hint=hint)
    return _stored_tensors(header, rel, label, HEADER_LENGTH_BYTES + n, size - HEADER_LENGTH_BYTES - n)


def _stored_tensors(header: dict[str, Any], rel: str, label: str, data_base: int, data_bytes: int) -> list[StoredTensor]:
    """The entries of a parsed header, each checked: a known dtype, a shape, and offsets that
    hold exactly its bytes inside the `data_bytes` of data starting at file offset `data_base`."""
    hint = "pass a file written by safetensors (save_file / save_pretrained)"
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(entry, dict) and entry.get("dtype") in SAFETENSORS_DTYPE_BYTES \
            and isinstance(entry.get("shape"), list) and all(type(d) is int and d >= 0 for d in entry["shape"]) \
            and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2 \
            and all(type(o) is int for o in entry["data_offsets"])
        if not ok:
            raise InputFileError("needs a known dtype, a shape of non-negative integers and data_offsets [begin, end]",
                                 source=label, field=f"header.{name}", hint=hint)
        begin, end = entry["data_offsets"]
        expected = math.prod(entry["shape"]) * SAFETENSORS_DTYPE_BYTES[entry["dtype"]]
        if not 0 <= begin <= end <= data_bytes or end - begin != expected:
            raise InputFileError(f"data_offsets [{begin}, {end}] do not hold {expected} bytes inside the {data_bytes} "
                                 "bytes of data", source=label, field=f"header.{name}.data_offsets", hint=hint)
        out.append(StoredTensor(name, rel, entry["dtype"], tuple(entry["shape"]), data_base + begin, expected))
    return out


def read_checkpoint(path: Path) -> tuple[Path, list[StoredTensor], dict[str, int]]:
    """(folder, tensors, file sizes) of a checkpoint folder (an index, or one safetensors file)
    or of a single .safetensors / index file."""
    path = Path(path)
    if path.is_file():
        folder, chosen = path.parent, path.name
    elif path.is_dir():
        folder = path
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if (path / INDEX_FILE).is_file():
            chosen = INDEX_FILE
        elif (path / SINGLE_FILE).is_file() or len(found) == 1:
            chosen = SINGLE_FILE if (path / SINGLE_FILE).is_file() else found[0]
        else:
            raise InputFileError(f"no {INDEX_FILE} and {len(found)} .safetensors files", source=str(path),
                                 hint=f"pass a folder with {INDEX_FILE} or a single {SINGLE_FILE}")
    else:
        raise InputFileError("no such file or folder", source=str(path), hint="pass the checkpoint folder")
    weight_map = _weight_map(folder / chosen) if chosen.endswith(".json") else None
    files = sorted(set(weight_map.values())) if weight_map is not None else [chosen]
    tensors: list[StoredTensor] = []
    sizes: dict[str, int] = {}
    for rel in files:
        p = folder / rel if weight_map is not None else _confined(folder, rel, str(folder / chosen), "weight_map")
        if not p.is_file():
            raise InputFileError(f"names {rel!r}, which does not exist", source=str(folder / chosen), field="weight_map",
                                 hint="copy every shard of the checkpoint into the folder")
        tensors += read_header(p, rel)
        sizes[rel] = p.stat().st_size
    if weight_map is not None:
        _check_index_agrees(folder / chosen, weight_map, tensors)
    return folder, tensors, sizes


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map, each file it names confined to the folder. The map names many
    tensors per file: each file is resolved once, and at most MAX_SHARDS files are named."""
    label = str(index)
    hint = "pass a Hugging Face index file"
    raw = read_regular_file_bytes(index, max_bytes=MAX_INDEX_BYTES, label=label, what="a checkpoint index", hint=hint)
    data = loads_json(raw, label=label, what="the index", hint=hint)  # strict, as a header is read
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise InputFileError("no weight_map", source=label, field="weight_map",
                             hint="give weight_map: {tensor name: file name}")
    first_named: dict[str, str] = {}  # file -> the first tensor naming it, for the error
    for name, rel in wm.items():
        if not isinstance(rel, str):
            _confined(index.parent, rel, label, f"weight_map.{name}")  # refuses it, naming the tensor
        if rel not in first_named:
            first_named[rel] = name
            if len(first_named) > MAX_SHARDS:
                raise InputFileError(f"names more than {MAX_SHARDS} files", source=label, field="weight_map",
                                     hint="a checkpoint has at most that many shards; check the index")
    for rel, name in first_named.items():
        _confined(index.parent, rel, label, f"weight_map.{name}")
    return wm


def _check_index_agrees(index: Path, wm: dict[str, str], tensors: list[StoredTensor]) -> None:
    for t in tensors:
        if wm.get(t.name) != t.file:
            raise InputFileError(f"tensor '{t.name}' is in {t.file}, the index says {wm.get(t.name)!r}",
                                 source=str(index), field=f"weight_map.{t.name}", hint="regenerate the index")
    stored = {t.name for t in tensors}
    for name, rel in wm.items():
        if name not in stored:
            raise InputFileError(f"tensor '{name}' is not in {rel}", source=str(index), field=f"weight_map.{name}",
                                 hint="regenerate the index or copy the missing shard")


# ----- checking against the model ------------------------------------------------------------


def expected_dtype(spec: ModelSpec, override: str | None) -> str:
    text = override or spec.dtype
    if text.upper() in SAFETENSORS_DTYPE_BYTES:
        return text.upper()
    try:
        return _SPEC_DTYPE[parse_dtype(text).value]
    except KeyError:
        raise ShardplanError(f"no safetensors dtype for {text!r}", field="--dtype", hint="use bf16, fp16 or fp32") from None


def check_tensors(spec: ModelSpec, stored: list[StoredTensor], dtype: str, source: str) -> dict[str, StoredTensor]:
    """Name, shape and dtype of every tensor against the model; the first problem is an error
    naming the tensor and its file."""
    expected = {t.name: t for t in model_tensors(spec)}
    by_name = {t.name: t for t in stored}
    for t in stored:
        if t.name not in expected:
            if spec.tie_word_embeddings and t.name == "lm_head.weight":
                continue  # some tied checkpoints store the head too; the embedding is read instead
            raise InputFileError(f"tensor '{t.name}' is not part of model '{spec.name}'", source=source,
                                 field=f"{t.file}:{t.name}", hint="check that the checkpoint is of this model")
        e = expected[t.name]
        if t.shape != e.shape:
            raise InputFileError(f"tensor '{t.name}' has shape {list(t.shape)}, the model's is {list(e.shape)}",
                                 source=source, field=f"{t.file}:{t.name}", hint="check that the checkpoint is of this model")
        if t.dtype != dtype:
            raise InputFileError(f"tensor '{t.name}' is {t.dtype}, expected {dtype}", source=source,
                                 field=f"{t.file}:{t.name}", hint=f"pass --dtype {t.dtype.lower()} if the checkpoint "
                                 "was converted on purpose")
    missing = [n for n in expected if n not in by_name]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InputFileError(f"tensor '{missing[0]}'{more} of model '{spec.name}' is missing", source=source,
                             hint="copy every shard of the checkpoint into the folder")
    return by_name


# ----- byte ranges --------------------------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """`count` runs of `length` bytes, `stride` apart, from absolute offset `start`."""

    start: int
    length: int
    count: int
    stride: int

    @property
    def nbytes(self) -> int:
        return self.length * self.count

    @property
    def span_bytes(self) -> int:
        return (self.count - 1) * self.stride + self.length


def box_read(t: StoredTensor, box: Box) -> Read:
    """The bytes of a box of a row-major tensor. Dimensions after the last partial one are
    read whole, so a box is one run per index of the dimensions before it."""
    esize = SAFETENSORS_DTYPE_BYTES[t.dtype]
    shape = t.shape
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1:]) * esize  # bytes of one index of dim k
    outer = box[:k]
    if any(b - a != 1 for a, b in outer[:-1]):
        raise ShardplanError(f"a slice of '{t.name}' cut in more than two dimensions", hint="report this layout")
    start = t.data_start + box[k][0] * inner
    row = math.prod(shape[k:]) * esize  # stride between consecutive indices of dim k-1
    start += sum(a * math.prod(shape[j + 1:]) * esize for j, (a, _) in enumerate(outer))
    count = outer[-1][1] - outer[-1][0] if outer else 1
    return Read(start, (box[k][1] - box[k][0]) * inner, count, row if count > 1 else 0)


