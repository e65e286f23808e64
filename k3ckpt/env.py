"""The ``K3CKPT_*`` environment variables, each declared once here with its type, default and
meaning (cf. ``huggingface_hub.constants``); ``docs/env.md`` lists them and a test keeps the
two in step.

Every variable is read when it is used, never at import, so a test or a long-lived process
can change it, and a bad value is reported by the command that needs it rather than as a
traceback from ``import k3ckpt``::

    >>> from k3ckpt.env import K3CKPT_HASH_BUFFER
    >>> K3CKPT_HASH_BUFFER.get()            # $K3CKPT_HASH_BUFFER, else the default
    1048576

Values are parsed the way people write them: byte sizes as ``16MiB``, ``16M`` or ``16777216``
(the CLI's size options use the same parser, :func:`k3ckpt.utils.parse_size`), seconds as a
decimal number, paths with ``~`` expanded. An unset or blank variable means its default. A
value that cannot be parsed raises :class:`~k3ckpt.errors.EnvError` (exit 2), which the CLI
prints as one line: ``k3ckpt: error: K3CKPT_HASH_BUFFER='16Q' is not a byte count (...)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from .errors import EnvError
from .utils import parse_size

__all__ = [
    "REGISTRY",
    "EnvVar",
    "K3CKPT_CACHE_DIR",
    "K3CKPT_DIRECT_IO",
    "K3CKPT_HASH_BUFFER",
    "K3CKPT_KEY_PASSPHRASE",
    "K3CKPT_LOCK_STALE_SECONDS",
    "K3CKPT_MAX_HEADER_BYTES",
    "K3CKPT_MX_CHUNK_BYTES",
    "K3CKPT_MX_INSPECT_CHUNK_BYTES",
    "K3CKPT_PREFLIGHT_FREE_BYTES",
    "K3CKPT_PREFLIGHT_MEM_BYTES",
    "K3CKPT_SHARE_FILES",
    "K3CKPT_TEST_PAUSE_AT",
    "K3CKPT_TEST_PAUSE_FILE",
    "PATH",
    "SECONDS",
    "SIZE",
    "SWITCH",
    "TEXT",
]

T = TypeVar("T")

#: The types a variable can have, as ``docs/env.md`` names them.
SIZE, SECONDS, PATH, TEXT, SWITCH = "size", "seconds", "path", "text", "switch"


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One ``K3CKPT_*`` variable. :meth:`get` reads and parses it at each call.

    Args:
        name (`str`):
            The variable's name, ``K3CKPT_...``.
        kind (`str`):
            ``"size"`` (bytes), ``"seconds"``, ``"path"``, ``"text"`` or ``"switch"`` (on/off).
        default:
            What :meth:`get` returns when the variable is unset or blank (``None``: the
            feature is off, or the default is worked out elsewhere - see ``default_doc``).
        meaning (`str`):
            One sentence for ``docs/env.md``: what it changes, and where.
        parse (`Callable[[str], T]`):
            Turns the raw value into a ``T``; raises ``ValueError`` whose message completes
            ``"K3CKPT_X='raw' ..."`` (e.g. ``"is not a byte count (...)"``).
        default_doc (`str`, *optional*):
            How the docs show the default when it is not a constant.
    """

    name: str
    kind: str
    default: T
    meaning: str
    parse: Callable[[str], T] = field(repr=False, compare=False)
    default_doc: str | None = None

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in ``environ`` (default ``os.environ``), parsed, or :attr:`default`.

        Raises:
            EnvError: the value is set but cannot be parsed.
        """
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise EnvError(self.name, raw, str(e)) from None

    @property
    def shown_default(self) -> str:
        """The default as ``docs/env.md`` writes it."""
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "unset"
        if self.kind == SWITCH:
            return "on" if self.default else "off"
        if self.kind == SIZE and isinstance(self.default, int):
            return _size_text(self.default)
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


# -- parsers: each raises ValueError with the end of the one-line message ----------------------

_SIZE_HINT = "(examples: 16MiB, 16M, 1048576)"


def _bytes(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            n = parse_size(raw)
        except ValueError:
            raise ValueError(f"is not a byte count {_SIZE_HINT}") from None
        if n < minimum:
            raise ValueError(f"must be at least {minimum} byte{'s' if minimum != 1 else ''} {_SIZE_HINT}")
        return n

    return parse


def _seconds(raw: str) -> float:
    try:
        s = float(raw)
    except ValueError:
        raise ValueError("is not a number of seconds (examples: 60, 0.5, 86400)") from None
    if not math.isfinite(s) or s < 0:
        raise ValueError("is not a number of seconds >= 0 (examples: 60, 0.5, 86400)")
    return s


_ON, _OFF = ("1", "on", "yes", "true"), ("0", "off", "no", "false")


def _switch(raw: str) -> bool:
    word = raw.strip().lower()
    if word not in _ON + _OFF:
        raise ValueError("is not on or off (examples: on, off, 1, 0)")
    return word in _ON


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _text(raw: str) -> str:
    return raw


def _size_text(n: int) -> str:
    """The shortest exact way to write ``n`` bytes that :func:`parse_size` reads back."""
    for unit, mult in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024),
                       ("T", 1000**4), ("G", 1000**3), ("M", 1000**2), ("K", 1000)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


# -- the registry -------------------------------------------------------------------------------

#: Every variable by name, in declaration order.
REGISTRY: dict[str, EnvVar[Any]] = {}


def _declare(var: EnvVar[T]) -> EnvVar[T]:
    if var.name in REGISTRY or not var.name.startswith("K3CKPT_"):
        raise ValueError(f"bad or duplicate declaration: {var.name}")  # a bug here, not a user error
    REGISTRY[var.name] = var
    return var


K3CKPT_CACHE_DIR: EnvVar[Path | None] = _declare(EnvVar(
    "K3CKPT_CACHE_DIR", PATH, None,
    "Directory of the stat cache of `verify` (also run by `fetch`): digests of files whose size, "
    "mtime and inode have not changed are reused.",
    _path, default_doc="$XDG_CACHE_HOME/k3ckpt, else ~/.cache/k3ckpt"))

K3CKPT_HASH_BUFFER: EnvVar[int] = _declare(EnvVar(
    "K3CKPT_HASH_BUFFER", SIZE, 1024**2,
    "Bytes read and hashed per step (verify, manifest build, fetch's checks, reshard), one buffer per "
    "hashing thread: small enough that sha256 finds the bytes still in the CPU's cache.",
    _bytes(1)))

K3CKPT_MAX_HEADER_BYTES: EnvVar[int] = _declare(EnvVar(
    "K3CKPT_MAX_HEADER_BYTES", SIZE, 100_000_000,
    "Largest safetensors header accepted, checked before anything is read or allocated "
    "(K3's headers are under 1 MB; the safetensors library caps at 100 MB).",
    _bytes(1)))

K3CKPT_KEY_PASSPHRASE: EnvVar[str | None] = _declare(EnvVar(
    "K3CKPT_KEY_PASSPHRASE", TEXT, None,
    "Passphrase of an encrypted ed25519 private key (`manifest sign`, `manifest build --sign`).",
    _text))

K3CKPT_LOCK_STALE_SECONDS: EnvVar[float] = _declare(EnvVar(
    "K3CKPT_LOCK_STALE_SECONDS", SECONDS, 24 * 3600.0,
    "Age after which another host's fetch lock on the destination is taken as abandoned.",
    _seconds))

K3CKPT_DIRECT_IO: EnvVar[bool] = _declare(EnvVar(
    "K3CKPT_DIRECT_IO", SWITCH, True,
    "`fetch` writes downloaded bytes with O_DIRECT on a local disk's filesystem (ext4, xfs, btrfs...): "
    "no copy into the page cache, no dirty pages left to flush; off: through the page cache, so the "
    "files stay cached.",
    _switch))

K3CKPT_SHARE_FILES: EnvVar[bool | None] = _declare(EnvVar(
    "K3CKPT_SHARE_FILES", SWITCH, None,
    "Whether a spare worker of a whole `fetch` may share a file another worker is downloading "
    "(its bytes are read back from the disk to hash the file in order; `fetch --node` and `--ranks` "
    "workers always may: they hash each tensor as it arrives): on: always; off: never; unset: "
    "while a probe shows it raises the receive rate (a slow stream per connection).",
    _switch, default_doc="auto"))

K3CKPT_MX_CHUNK_BYTES: EnvVar[int] = _declare(EnvVar(
    "K3CKPT_MX_CHUNK_BYTES", SIZE, 8 * 1024**2,
    "Packed bytes per step of `mx dequant` and input bytes per step of `mx quantize` (the fp32 "
    "output of a dequant step is 8x this).",
    _bytes(1)))

K3CKPT_MX_INSPECT_CHUNK_BYTES: EnvVar[int] = _declare(EnvVar(
    "K3CKPT_MX_INSPECT_CHUNK_BYTES", SIZE, 1024**2,
    "Packed bytes per chunk of `mx inspect` (a worker needs about 30x this).",
    _bytes(1)))

K3CKPT_PREFLIGHT_FREE_BYTES: EnvVar[int | None] = _declare(EnvVar(
    "K3CKPT_PREFLIGHT_FREE_BYTES", SIZE, None,
    "Test hook: the free disk bytes `preflight` uses instead of what statvfs reports.",
    _bytes(0)))

K3CKPT_PREFLIGHT_MEM_BYTES: EnvVar[int | None] = _declare(EnvVar(
    "K3CKPT_PREFLIGHT_MEM_BYTES", SIZE, None,
    "Test hook: the available host memory `preflight` uses instead of MemAvailable in /proc/meminfo.",
    _bytes(0)))

K3CKPT_TEST_PAUSE_AT: EnvVar[str | None] = _declare(EnvVar(
    "K3CKPT_TEST_PAUSE_AT", TEXT, None,
    "Test hook: a fetch, reshard or unshard stops itself (SIGSTOP) at this point (`after_chunk:N`, "
    "`before_rename`, `after_piece:N`, `before_shard_rename`, `reshard_file:N`, `unshard_shard:N`; "
    "k3ckpt.faults lists them) so crash tests can kill it there.",
    _text))

K3CKPT_TEST_PAUSE_FILE: EnvVar[Path | None] = _declare(EnvVar(
    "K3CKPT_TEST_PAUSE_FILE", PATH, None,
    "Test hook: the file a run writes when it reaches K3CKPT_TEST_PAUSE_AT's point (it goes on once "
    "the file is removed and the process continued).",
    _path))

