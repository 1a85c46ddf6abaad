"""Writes that leave a file either as it was or whole: a temporary file beside the target,
flushed to disk, renamed over it, and the directory flushed so the rename itself survives a
power loss. One place for the pattern, so every durable file (checkpoint markers, the ledger,
the guard's state, effective configs) gets all of its steps."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from typing import Any, Iterator, Optional


def write_text_atomic(path: str, text: str, *, mode: int = 0o666) -> None:
    """Write ``text`` (UTF-8) so that ``path`` holds either the old or the whole new file, also
    after a power loss. ``mode`` is the new file's permission bits before the umask (0o600: a
    file only this user may read). Raises OSError when any step fails; the temporary file is
    removed then."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: ranks writing one file never rename each other's
    _remove(tmp)  # a stale one from a crashed run would keep its old permission bits
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_directory(directory)


def write_json_atomic(path: str, value: Any, *, indent: Optional[int] = None) -> None:
    """``value`` as JSON, written like :func:`write_text_atomic`. A value that is not JSON
    raises (TypeError, ValueError) before anything is written: the old file stays."""
    write_text_atomic(path, json.dumps(value, indent=indent))


def fsync_directory(directory: str) -> None:
    """Flush a directory's entries (a rename in it) to disk. File systems that cannot sync a
    directory (EINVAL, ENOTSUP: some network and FUSE mounts) are passed over."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
    """Fill a directory that appears at ``path`` only when complete: yields a ``.tmp-`` sibling
    to write into, which replaces ``path`` when the block ends, or is removed (its space given
    back) when the block raises."""
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    fsync_directory(parent)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
