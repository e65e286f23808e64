"""Which output directories k3ckpt may write into: the one rule every writing command follows.

A command writes into a directory only if it is new or empty, or if it carries k3ckpt's
*ownership record* for that same command, ``DIR/.cache/k3ckpt/owner.json``::

    {"format": "k3ckpt-owner", "version": 1, "command": "reshard",
     "entries": [".cache", "config.json", "node-00000", "topology.json"]}

``entries`` are the top-level names the command has written (or is about to write) there: a
recorded directory (``node-00000``, ``.cache``) is the command's whole, what it holds is not
checked name by name. Anything else at the top level is *foreign* - a file k3ckpt did not
write - and the command refuses the directory (exit 2, naming the first foreign file),
``--force`` included: ``--force`` only lets a command replace its own earlier output.

Why one explicit record rather than the markers each layout already has (``topology.json``,
``k3ckpt-node.json``, ``k3ckpt-partial.json``, fetch's ``.cache/k3ckpt/source.json``): a marker
says what a directory *is*, not what else is in it - a user's ``config.json`` next to a
``topology.json`` is not ours - and a marker appears only when its command finishes, while a
killed first run must still be resumable. The record is written (exclusively, the first time)
before the first byte, lists what the run will write, and is hidden in the ``.cache`` directory
that checkpoint walks already skip, so it changes no checkpoint's or layout's contents.

Never foreign: k3ckpt's lock files (:func:`k3ckpt.utils.lock.is_lock_file`), and, in a
directory with a record, the hidden temporary files of recorded names (``.<entry>.<...>.tmp``)
that a killed run left.

A refused run leaves no directory behind (:func:`locked_output_dir`): a command creates its
output directory (and the parents it lacks) and takes its lock there through it, and when the
run raises before writing anything but its records - a refusal for disk space, another
topology, a manifest - what it created goes again: its records, then, lock released, each
directory it made, deepest first, each only while empty. A directory that existed before is
never removed (an empty one is left empty), and neither is anything another run or the user put
there.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import OutputNotOwnedError
from ._fs import fsync_dir, temp_name, write_atomic
from .lock import DirLock, is_lock_file

__all__ = ["OWNER_RECORD", "RECORD_FORMAT", "OwnedDir", "check_output_dir", "claim_output_dir", "locked_output_dir",
           "refuse_foreign_file"]

#: Where the record lives, relative to the directory it describes.
OWNER_RECORD = ".cache/k3ckpt/owner.json"
#: The record's ``format`` value.
RECORD_FORMAT = "k3ckpt-owner"
_CACHE = OWNER_RECORD.split("/")[0]
_ADVICE = "choose a new or empty directory"


class OwnedDir:
    """A directory a command has claimed (:func:`claim_output_dir`): its record names ``entries``."""

    def __init__(self, path: Path, command: str, entries: set[str]) -> None:
        self.path = path
        self.command = command
        self.entries = entries

    def add(self, names: Iterable[str]) -> None:
        """Record more top-level names (relative paths: their first component) before writing
        them; the record is rewritten only when something is new."""
        new = {_top(n) for n in names} - self.entries
        if new:
            self.entries |= new
            _write_record(self.path, self.command, self.entries, first=False)


def _top(rel: str) -> str:
    return rel.replace(os.sep, "/").split("/", 1)[0]


def _is_own_temp(name: str, entries: set[str]) -> bool:
    return name.startswith(".") and name.endswith(".tmp") and any(name.startswith(f".{e}.") for e in entries)


def _read_record(path: Path) -> dict[str, Any] | None:
    """The record's JSON, ``None`` when there is none; a record that is not one raises."""
    rec = path / OWNER_RECORD
    try:
        doc = json.loads(rec.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        doc = None
    if (not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT or not isinstance(doc.get("command"), str)
            or not isinstance(doc.get("entries"), list) or not all(isinstance(e, str) for e in doc["entries"])):
        raise OutputNotOwnedError(f"{path}: {rec} is not a k3ckpt ownership record; {_ADVICE}", path=rec)
    return doc


def _cache_is_bare(path: Path) -> bool:
    """``.cache`` holds nothing but the record's (empty) directory and its temporary files: what
    a first run killed before its record was in place leaves."""
    for dirpath, _dirs, files in os.walk(path / _CACHE):
        rel = Path(dirpath).relative_to(path).as_posix()
        if rel not in (_CACHE, os.path.dirname(OWNER_RECORD)) or any(not f.endswith(".tmp") for f in files):
            return False
    return True


def _foreign(path: Path, entries: set[str] | None, working: Callable[[str], bool] | None) -> list[str]:
    """Top-level names in ``path`` that are not k3ckpt's (sorted); ``entries`` None: no record."""
    out = []
    for name in sorted(os.listdir(path)):
        if is_lock_file(name) or (working is not None and working(name)):
            continue
        if entries is None:
            if name == _CACHE and (path / name).is_dir() and not (path / name).is_symlink() and _cache_is_bare(path):
                continue
        elif name in entries or _is_own_temp(name, entries):
            continue
        out.append(name)
    return out


def _write_record(path: Path, command: str, entries: set[str], *, first: bool) -> None:
    rec = path / OWNER_RECORD
    rec.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps({"format": RECORD_FORMAT, "version": 1, "command": command,
                        "entries": sorted(entries)}, indent=1, sort_keys=True) + "\n").encode()
    if not first:
        write_atomic(rec, data)
        return
    # The first record is created exclusively (a hard link of a complete temporary file): of two
    # commands claiming one empty directory at once, only one can win.
    tmp = temp_name(rec)
    write_atomic(tmp, data)
    try:
        os.link(tmp, rec)
    except FileExistsError:
        raise OutputNotOwnedError(f"{path}: another k3ckpt command claimed this directory just now "
                                  f"({rec}); {_ADVICE}", path=rec) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(rec.parent)


def claim_output_dir(path: str | os.PathLike[str], command: str, entries: Iterable[str], *,
                     working: Callable[[str], bool] | None = None,
                     adopt: Callable[[Path], bool] | None = None) -> OwnedDir:
    """Make ``path`` (created if missing) the output of ``command`` before anything is written.

    Accepted: a new or empty directory, or one whose record is ``command``'s and that holds
    nothing else at the top level (see the module doc). The record then lists the earlier
    entries still there plus ``entries`` (relative paths the run will write; their first
    components are recorded). Call it while holding the output's lock, if the command takes one.

    Args:
        working: Names of the command's own working files (fetch's ``*.part``): never foreign,
            record or not - the command validates them before trusting a byte.
        adopt: For a directory without a record: True when an earlier version of the command
            left it (fetch's ``.cache/k3ckpt/`` records); its entries are then recorded as the
            command's.

    Raises:
        OutputNotOwnedError: a file k3ckpt did not write (named: the first in name order),
            another command's record, or a record that is not one. Nothing was written.
    """
    out = Path(path)
    _refuse_not_a_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    doc, old = _owned_entries(out, command, working, adopt)
    present = {e for e in old or () if os.path.lexists(out / e)}
    want = present | {_top(e) for e in entries} | {_CACHE}
    _write_record(out, command, want, first=doc is None)
    return OwnedDir(out, command, want)


def check_output_dir(path: str | os.PathLike[str], command: str, *,
                     working: Callable[[str], bool] | None = None,
                     adopt: Callable[[Path], bool] | None = None) -> None:
    """Refuse ``path`` as :func:`claim_output_dir` would, creating and writing nothing: what a
    dry run says of the directory its real run would claim. A missing directory is accepted.

    Raises:
        OutputNotOwnedError: as :func:`claim_output_dir`.
    """
    out = Path(path)
    _refuse_not_a_dir(out)
    if out.is_dir():
        _owned_entries(out, command, working, adopt)


def _refuse_not_a_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise OutputNotOwnedError(f"{out}: exists and is not a directory; {_ADVICE}", path=out)


def _owned_entries(out: Path, command: str, working: Callable[[str], bool] | None,
                   adopt: Callable[[Path], bool] | None) -> tuple[dict[str, Any] | None, set[str] | None]:
    """The directory's record (None: none yet) and the entries it makes ``command``'s (None:
    none); refuses another command's record and any file k3ckpt did not write."""
    doc = _read_record(out)
    if doc is not None and doc["command"] != command:
        raise OutputNotOwnedError(f"{out}: holds the output of k3ckpt {doc['command']} ({out / OWNER_RECORD}), "
                                  f"not of k3ckpt {command}; {_ADVICE}", path=out / OWNER_RECORD)
    old = set(doc["entries"]) if doc is not None else None
    if old is None and adopt is not None and adopt(out):
        old = set(os.listdir(out))
    foreign = _foreign(out, old, working)
    if foreign:
        raise OutputNotOwnedError(f"{out}: holds files k3ckpt did not write ({out / foreign[0]}); {_ADVICE}",
                                  path=out / foreign[0])
    return doc, old


def refuse_foreign_file(path: str | os.PathLike[str], is_own: bool, kind: str) -> None:
    """The rule for commands whose output is one file (a manifest, a key, a signature, an MX
    conversion): an existing ``path`` may be replaced only when ``is_own`` (the caller checked
    that it is k3ckpt's own ``kind``, e.g. a k3ckpt manifest); anything else is refused.

    Raises:
        OutputNotOwnedError: ``path`` exists and is not k3ckpt's ``kind``.
    """
    p = Path(path)
    if (p.exists() or p.is_symlink()) and not is_own:
        raise OutputNotOwnedError(f"{p}: exists and is not a {kind} k3ckpt wrote; choose a new file name "
                                  "(k3ckpt replaces only its own output)", path=p)


@contextlib.contextmanager
def locked_output_dir(path: str | os.PathLike[str], lock: DirLock, *, resumable: bool = True,
                      records: str = _CACHE) -> Iterator[None]:
    """Create the output directory ``path`` (and its missing parents, and the directory of
    ``lock``, a lock inside it) and hold ``lock`` for the body of a run.

    When the body raises in a ``path`` that was new or empty, what the run wrote there goes again
    while the lock is held - its records (the top-level directory ``records``) when that is all
    it holds besides empty directories; everything, when the command is not ``resumable`` (a
    re-run rewrites it all anyway) - and then, the lock released, the directories left and every
    directory this run created, deepest first, each only while empty (``rmdir``): an empty
    directory the user made stays, empty. Nothing is removed while another run holds a lock there
    (at its top level), nor from a directory that held anything before, nor through a symlink: a
    run refused before its first byte leaves nothing behind, and a resumable one that failed
    later keeps what a re-run resumes from.

    Raises:
        whatever ``lock`` or the body raises (``OSError`` when ``path`` cannot be created).
    """
    out = Path(path)
    created = _missing_dirs(out)
    cleared = fresh = False
    try:
        out.mkdir(parents=True, exist_ok=True)
        with os.scandir(out) as it:
            fresh = next(it, None) is None  # new or empty: all it will hold is this run's
        Path(lock.path).parent.mkdir(parents=True, exist_ok=True)
        with lock:
            try:
                yield
            except BaseException:
                if fresh and _only_ours(out, lock, records if resumable else None):
                    _clear(out)
                    cleared = True
                raise
    except BaseException:
        if cleared:
            _remove_empty_dirs(out)
        for d in created:  # deepest first; the first one that is not empty keeps its parents
            try:
                os.rmdir(d)
            except OSError:
                break
        raise


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first."""
    out = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p.parent != p:
        out.append(p)
        p = p.parent
    return out


def _only_ours(out: Path, lock: DirLock, records: str | None) -> bool:
    """No other run's lock at ``out``'s top level, and (``records`` given) nothing in ``out`` but
    that records directory, ``lock``'s files and empty directories: no file a run wrote, no
    symlink."""
    own = os.path.basename(lock.path)
    for entry in os.scandir(out):
        if is_lock_file(entry.name):
            if not entry.name.startswith(own):
                return False  # another command's run is in here
        elif records is not None and (entry.is_symlink() or not entry.is_dir()
                                      or (entry.name != records and not _holds_no_file(Path(entry.path)))):
            return False
    return True


def _holds_no_file(d: Path) -> bool:
    return all(e.is_dir() and not e.is_symlink() and _holds_no_file(Path(e.path)) for e in os.scandir(d))


def _clear(out: Path) -> None:
    """Remove every file, symlink and directory under ``out`` but lock files (the lock's release
    removes its own) and the directories holding them; never through a symlink."""
    for dirpath, dirs, files in os.walk(out, topdown=False):
        for name in files:
            if not is_lock_file(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, name))
        for name in dirs:
            p = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                os.unlink(p) if os.path.islink(p) else os.rmdir(p)


def _remove_empty_dirs(out: Path) -> None:
    """``rmdir`` every directory under ``out``, deepest first, that is empty by now."""
    for dirpath, dirs, _files in os.walk(out, topdown=False):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(dirpath, name))
