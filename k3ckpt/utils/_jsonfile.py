"""The small files of a checkpoint (config, index, manifests, keys): read with one-line errors,
written atomically."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from ..errors import K3ckptError


def load_json(path: Path, error: type[K3ckptError]) -> tuple[Any, bytes]:
    """``(parsed, raw bytes)`` of the JSON file at ``path``.

    Raises:
        error: the file is missing, unreadable, not UTF-8 or not JSON - naming the file.
    """
    try:
        raw = path.read_bytes()
        return json.loads(raw), raw
    except FileNotFoundError:
        raise error(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read ({e})") from None
    except RecursionError:  # hostile nesting ([[[[...) overflows the parser's stack
        raise error(f"{path}: not valid JSON (nested too deeply)") from None


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write a small file so that its final name never holds a partial one.

    The bytes go to a unique hidden temporary file next to ``path`` (created exclusively and
    never through a symlink), are fsync-ed, renamed over ``path``, and the directory is fsync-ed
    so the rename survives a power loss. On any failure the temporary file is removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(path.absolute().parent, os.O_RDONLY)
    except OSError:
        return  # directories cannot be opened here (some network filesystems): the data is synced
    try:
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)
