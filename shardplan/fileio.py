"""Atomic file writes: every file shardplan writes (manifests, exports) goes through here, so
a reader sees the old file or the new one, never half of one. Bounded reads of files that may
be anyone's (`read_regular_file_bytes`)."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
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
    path = regular_target(path)
    token = secrets.token_hex(6)
    # The temporary file sits beside the target; a name near the file system's 255-byte limit gets a short one.
    tmp = path.with_name(f".{path.name}.{token}.tmp" if len(path.name.encode()) <= 200 else f".shardplan.{token}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777 if executable else 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ShardplanError(f"cannot write: {e.strerror}", source=str(path),
                             hint="check that the folder exists and is writable") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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
