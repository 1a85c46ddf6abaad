"""Replace a file's contents so that a crash leaves either the old file or the whole new one."""

from __future__ import annotations

import errno
import os
from typing import Optional


def write_text_atomic(path: str, text: str, mode: Optional[int] = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file beside it: flushed to disk,
    renamed over ``path``, then the directory flushed so the rename is on disk too. ``mode``
    (e.g. ``0o600``) is the new file's permission bits; None leaves them to the umask. The
    temporary name carries this process's id, so ranks writing the same file never rename
    each other's half-written copy. Raises OSError when any of it fails, removing the
    temporary file first."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with open(fd, "w", encoding="utf-8") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)  # a stale temporary file keeps its old bits otherwise
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_directory(os.path.dirname(os.path.abspath(path)))


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
