"""Atomic file writes: every file shardplan writes (manifests, exports) goes through here, so
a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from shardplan.errors import ShardplanError


def write_text_atomic(path: str | Path, text: str, *, executable: bool = False) -> None:
    """Write `text` (UTF-8) to a new file beside `path`, fsync it, then rename it over `path`
    and fsync the folder. `executable`: mode 0o777 before the umask (scripts), else 0o666."""
    write_bytes_atomic(path, text.encode("utf-8"), executable=executable)  # encoded before touching the disk


def write_bytes_atomic(path: str | Path, data: bytes, *, executable: bool = False) -> None:
    """write_text_atomic for bytes already rendered (images)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
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


def _fsync_dir(folder: Path) -> None:
    """Persist the rename itself (POSIX); where a folder cannot be opened or synced, skip it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
