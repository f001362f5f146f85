"""Atomic file writes: every file shardplan writes (manifests, exports) goes through here, so
a reader sees the old file or the new one, never half of one. Bounded reads of files that may
be anyone's (`read_regular_file_bytes`)."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardplan.errors import InputFileError, ShardplanError


def write_text_atomic(path: str | Path, text: str, *, executable: bool = False) -> None:
    """Write `text` (UTF-8) to a new file beside `path`, fsync it, then rename it over `path`
    and fsync the folder. `executable`: mode 0o777 before the umask (scripts), else 0o666."""
    write_bytes_atomic(path, text.encode("utf-8"), executable=executable)  # encoded before touching the disk


def write_bytes_atomic(path: str | Path, data: bytes, *, executable: bool = False) -> None:
    """write_text_atomic for bytes already rendered (images). The target must be a regular file or
    not exist: renaming over a device (`-o /dev/null` as root), a FIFO or a folder would replace it.
    A symbolic link is written through: its target is the file replaced."""
    write_files_atomic([PendingFile(path=Path(path), data=data, executable=executable)])


@dataclass(frozen=True)
class PendingFile:
    """One file of a write that is all or nothing (`write_files_atomic`)."""

    path: Path
    data: bytes
    executable: bool = False  # mode 0o777 before the umask (scripts), else 0o666
    what: str | None = None  # how an error names it (e.g. "--moves", "serve.sh"); None: by its path


def write_files_atomic(files: Sequence[PendingFile]) -> None:
    """Write several files all or nothing: every target is checked (a regular file or none, no two
    of them one file), every file is written and fsynced to a temporary file beside its target, and
    only then is each renamed over its target. When a check, a write or a rename fails, no target
    is replaced (renames already done are undone from hard-link copies of the old files), the
    temporary files are removed and a ShardplanError names the file. Symbolic links are written
    through, as `write_bytes_atomic` does."""
    targets = [regular_target(f.path) for f in files]
    check_distinct_outputs([(f.what or str(f.path), t) for f, t in zip(files, targets)])
    staged: list[Path] = []
    try:
        for f, target in zip(files, targets):
            staged.append(_temp_beside(target))
            _write_new(staged[-1], f.data, f.executable, label=target)
        _rename_all(list(zip(staged, targets)))
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)  # after the renames none is left; after a failure, all are
    for folder in dict.fromkeys(t.parent for t in targets):
        _fsync_dir(folder)


def check_distinct_outputs(outputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """The outputs of one command, as (option or name, path; None: not given), name different files:
    else a ShardplanError naming both (exit 2), raised before anything is written. Two names of one
    file count as the same file: a symbolic link and its target, hard links, `a/../b` and `b`."""
    seen: dict[tuple[object, ...], str] = {}
    for what, path in outputs:
        if path is None or not str(path):
            continue
        key = _file_identity(Path(path))
        if key in seen:
            raise ShardplanError(f"{seen[key]} and {what} name the same file: one would overwrite the other",
                                 source=str(path), hint="give each output its own file name")
        seen[key] = what


def check_output_targets(outputs: Iterable[tuple[str, str | Path | None]], folders_made: Iterable[str] = ()) -> None:
    """Before a command does its work: its outputs (option, path; None: not given) name different
    files, each a regular file or none (`regular_target`), in a folder that exists (or that the
    command makes: the options in `folders_made`); a ShardplanError (exit 2) otherwise, with
    nothing written."""
    given = [(what, path) for what, path in outputs if path is not None]
    check_distinct_outputs(given)
    made = set(folders_made)
    for what, path in given:
        target = regular_target(path)
        if what not in made and not target.parent.is_dir():
            raise ShardplanError(f"cannot write {what}: no folder {str(target.parent)!r}", source=str(path),
                                 hint="check that the folder exists and is writable")


def _file_identity(path: Path) -> tuple[object, ...]:
    """What tells files apart: the device and inode of an existing file (its links and hard links
    share them), else the folder's device and inode and the name (symbolic links resolved first)."""
    real = Path(os.path.realpath(path))
    with contextlib.suppress(OSError):
        st = real.stat()
        return ("file", st.st_dev, st.st_ino)
    with contextlib.suppress(OSError):
        st = real.parent.stat()
        return ("new", st.st_dev, st.st_ino, real.name)
    return ("path", str(real))


def _temp_beside(path: Path) -> Path:
    """A fresh temporary name in `path`'s folder (a rename from it is atomic); a name near the file
    system's 255-byte limit gets a short one."""
    token = secrets.token_hex(6)
    return path.with_name(f".{path.name}.{token}.tmp" if len(path.name.encode()) <= 200 else f".shardplan.{token}.tmp")


def _write_new(tmp: Path, data: bytes, executable: bool, *, label: Path) -> None:
    """Create `tmp` (it must not exist), write `data` and fsync it; an OSError becomes a
    ShardplanError naming `label`, the file the data is for."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777 if executable else 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ShardplanError(f"cannot write: {e.strerror}", source=str(label),
                             hint="check that the folder exists and is writable") from None


def _rename_all(staged: list[tuple[Path, Path]]) -> None:
    """Rename each (temporary, target) pair; when one fails, undo those done: a target that was new
    is removed, one that existed gets its old file back from a hard link made before the rename
    (where the file system has no hard links, the new file stays)."""
    done: list[tuple[Path, Path | None, bool]] = []  # (target, hard link to its old file, whether it existed)
    try:
        for tmp, target in staged:
            existed = target.exists()
            backup = _hard_link_beside(target) if existed else None
            try:
                os.replace(tmp, target)
            except BaseException:
                if backup is not None:
                    backup.unlink(missing_ok=True)
                raise
            done.append((target, backup, existed))
    except OSError as e:
        _undo(done)
        raise ShardplanError(f"cannot write: {e.strerror}", source=str(staged[len(done)][1]),
                             hint="check that the folder exists and is writable") from None
    except BaseException:
        _undo(done)
        raise
    for _, backup, _ in done:
        if backup is not None:
            backup.unlink(missing_ok=True)


def _hard_link_beside(path: Path) -> Path | None:
    """A second name for the file at `path` (so that it can be put back), or None where no hard link
    can be made."""
    link = _temp_beside(path).with_suffix(".old")
    try:
        os.link(path, link)
    except OSError:
        return None
    return link


def _undo(done: list[tuple[Path, Path | None, bool]]) -> None:
    """Put back what `_rename_all` replaced, last first."""
    for target, backup, existed in reversed(done):
        with contextlib.suppress(OSError):
            if backup is not None:
                os.replace(backup, target)
            elif not existed:
                target.unlink()


# The longest path and file name the file systems take (Linux PATH_MAX, NAME_MAX): past them the OS
# answers ENAMETOOLONG, so no file can have the name.
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 255


def no_file_can_have_name(name: str | Path) -> bool:
    """Whether `name` is longer than any path or path part a file system holds."""
    longest = max((len(part) for part in Path(name).parts), default=0)
    return len(str(name)) > MAX_PATH_CHARS or longest > MAX_NAME_CHARS


def regular_target(path: str | Path) -> Path:
    """The file a write to `path` replaces (a symbolic link's target), or a ShardplanError when that
    is no file to write: an empty name, a folder, a device, a FIFO or a socket."""
    label = str(path)
    if not str(path) or Path(path).name in ("", ".", ".."):
        raise ShardplanError("needs a file name", source=label or "''", hint="e.g. -o plan.yaml")
    path = Path(path)
    try:
        if path.is_symlink():
            path = path.resolve(strict=False)
        mode = path.stat().st_mode
    except FileNotFoundError:
        return path
    except RuntimeError:  # a loop of symbolic links (pathlib's resolve)
        raise ShardplanError("cannot write: a loop of symbolic links", source=label, hint="name a file to write") from None
    except OSError as e:  # a name too long, a loop (ELOOP), no permission to look
        raise ShardplanError(f"cannot write: {e.strerror}", source=label,
                             hint="check that the folder exists and is writable, and the name's length") from None
    if stat.S_ISDIR(mode):
        raise ShardplanError("is a directory", source=label, hint="name a file inside it")
    if not stat.S_ISREG(mode):
        raise ShardplanError("not a regular file (a device, FIFO or socket): it would be replaced", source=label,
                             hint="name a file to write, e.g. -o plan.yaml; leave -o out to write no file")
    return path


def _fsync_dir(folder: Path) -> None:
    """Persist the rename itself (POSIX); where a folder cannot be opened or synced, skip it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_regular_file_bytes(path: str | Path, *, max_bytes: int, label: str, what: str, hint: str) -> bytes:
    """At most `max_bytes` of a regular file, or an InputFileError naming `label`: never a
    directory, device, FIFO or socket (a path naming /dev/zero or a pipe must not hang or
    fill memory). `what` names the kind of file in the size error ("an engine log"); `hint`
    is the fix for a file over the cap."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise InputFileError("file not found", source=label, hint="check the path") from None
    except OSError as e:
        raise InputFileError(f"cannot read: {e.strerror}", source=label) from None
    if stat.S_ISDIR(st.st_mode):
        raise InputFileError("is a directory", source=label, hint="name a file inside it")
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError("not a regular file", source=label, hint=f"pass {what} as a file, not a device or pipe")
    too_big = InputFileError(f"file is over the {max_bytes} byte limit for {what}", source=label, hint=hint)
    if st.st_size > max_bytes:
        raise too_big
    try:
        with path.open("rb") as f:
            data = f.read(st.st_size + 1)  # sized to the file: read(max_bytes) would reserve max_bytes
            if len(data) > st.st_size:  # it grew since stat
                data += f.read(max_bytes - len(data) + 1)
    except OSError as e:
        raise InputFileError(f"cannot read: {e.strerror}", source=label) from None
    if len(data) > max_bytes:
        raise too_big
    return data


# Parsed data from a file anyone may have written is nested at most this deep (SECURITY.md).
MAX_JSON_NESTING_DEPTH = 64


def loads_json(text: str | bytes, *, label: str, hint: str, what: str = "the file", field: str | None = None,
               max_depth: int = MAX_JSON_NESTING_DEPTH) -> object:
    """Strict JSON from a file anyone may have written (a safetensors header, a checkpoint index):
    text that is not UTF-8, NaN or Infinity, a key twice in one object, and nesting past
    `max_depth` levels are each an InputFileError naming `label` and `field` (one line, exit 2),
    never a traceback; `what` names the text in the message ("header"). Nesting deep enough to
    exhaust the parser's recursion is reported the same way; below that the depth is checked
    without recursion once parsed."""
    import json

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputFileError(f"{what} is not UTF-8 text (byte {e.start})", source=label, field=field,
                                 hint=hint) from None
    too_deep = InputFileError(f"{what} is nested more than {max_depth} levels deep", source=label, field=field,
                              hint=hint)
    try:
        data = json.loads(text, parse_constant=refuse_json_constant, object_pairs_hook=unique_json_keys)
    except RecursionError:
        raise too_deep from None
    except json.JSONDecodeError as e:
        raise InputFileError(f"{what} is not JSON: line {e.lineno} column {e.colno}: {e.msg}", source=label,
                             field=field, hint=hint) from None
    except ValueError as e:  # a key twice, NaN or Infinity, an integer too long to convert
        too_long = long_integer(e)
        raise InputFileError(f"{what} holds {too_long}" if too_long else f"{what} {e}", source=label, field=field,
                             hint=hint) from None
    stack = [(data, 1)] if isinstance(data, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        for child in (item.values() if isinstance(item, dict) else item):
            if isinstance(child, (dict, list)):
                if depth >= max_depth:
                    raise too_deep
                stack.append((child, depth + 1))
    return data


def refuse_json_constant(value: str) -> object:
    """json.loads' parse_constant: NaN and Infinity are refused (Python's json reads them; JSON has no such numbers)."""
    raise ValueError(f"holds {value}, which is not a number JSON allows")


def unique_json_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """An object with a key twice is refused (json keeps the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                shown = key if len(key) <= 80 else key[:77] + "..."
                raise ValueError(f"holds the key {shown!r} twice in one object")
            seen.add(key)
    return out


def long_integer(e: ValueError) -> str | None:
    """What a JSON parse's ValueError means when it is about an integer past Python's digit limit
    (its own text names an interpreter setting, not the file's problem); None for any other."""
    if "integer string conversion" in str(e):
        return f"an integer of more than {sys.get_int_max_str_digits():,} digits (no count or size is that long)"
    return None
