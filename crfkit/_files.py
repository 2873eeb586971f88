"""Files the package writes that a kill must not damage, and directories it must be able to write.

    atomic_write(path, data)                  path holds its old content or all of data, never part
    ensure_writable_directory(path, "--workdir")   before hours of work, not at its first checkpoint
    read_json(path, "a saved tagger's config")     FileNotFoundError / ValueError naming the file
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import tempfile

__all__ = ["atomic_write", "ensure_writable_directory", "read_json"]


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write data to path so that path is either absent / its old content, or all of data: a
    temporary file ``.NAME.tmp-PID-RANDOM`` beside it, flushed and fsync'ed, then os.replace'd
    onto path (atomic on POSIX), then the directory fsync'ed."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid():x}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)


def ensure_writable_directory(path: str, argument: str) -> str:
    """Create directory path if needed and check that a file can be created in it, so that a
    training run into a read-only or mistyped folder fails at once. Raises NotADirectoryError
    (path is a file), PermissionError or another OSError, each naming `argument` and path in its
    strerror. Returns path."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"{argument} {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".crfkit-write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        message = f"{argument} {path!r} is not a writable directory ({error.strerror or error})"
        raise type(error)(error.errno or errno.EIO, message) from None
    return path


def read_json(path: str, what: str):
    """The JSON value in file path. A missing file is a FileNotFoundError and one that is not
    UTF-8 JSON a ValueError, each naming path and saying what the file should be (`what`)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: it should be {what}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not {what} (not JSON: {error})") from None
