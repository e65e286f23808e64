"""Verify's background hashing: files hashed in threads while the main thread checks the
structure, each scanned for NaN scale bytes by its own header's spans in the same read.

A :class:`HashPlan` says which files a run hashes, which tensors' digests it takes and which
files also get a git blob id; :class:`BackgroundHashing` runs it - or starts before there is a
plan (the manifest still being parsed) and is told the plan later. While threads hash, the GIL
changes hands more often (:class:`_ShortTurns`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..env import K3CKPT_HASH_BUFFER
from ..errors import K3ckptError
from ..format.checkpoint import SharedHeaders
from . import hashing as _hashing  # (hash_file looked up at call time: tests and profiles replace it)
from .hashing import FileDigest, HashError, Progress, Span
from .scales import shard_scale_spans

if TYPE_CHECKING:
    from ..format.header import ShardHeader


@dataclass
class HashPlan:
    """Which files a verify run hashes (``files``), which tensors' digests it takes in the same
    read (``spans``), and which files also get a git blob id (``git_sha1``)."""

    files: set[str]
    spans: dict[str, list[Span]] = field(default_factory=dict)
    git_sha1: set[str] = field(default_factory=set)


class _ShortTurns:
    """While hashing threads run, the GIL changes hands every 0.5 ms instead of Python's 5: a
    thread that has hashed its chunk needs the GIL for a moment to begin the next, and while the
    main thread runs Python (the structure check) it waited up to 5 ms for it - at times both
    threads at once, leaving a core idle (2 files hashed next to 0.12 s of Python: 0.31 -> 0.25 s).
    Counted, so that overlapping runs restore the interval once, when the last one ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = sys.getswitchinterval()

    def enter(self) -> None:
        with self._lock:
            if not self._users:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, 0.0005))
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if not self._users:
                sys.setswitchinterval(self._saved)


_SHORT_TURNS = _ShortTurns()


class BackgroundHashing:
    """Files hashed in background threads, largest first, each scanned for NaN scale bytes by
    the spans of its own header in the same read.

    Started with a :class:`HashPlan`, or without one to start at once - before the manifest is
    parsed - over every file listed; :meth:`decide` then says which files the run wants: files
    not yet begun that it does not want are skipped, any finished before it said so are left out
    of :meth:`result`.
    """

    def __init__(self, root: Path, stats: dict[str, os.stat_result], *, jobs: int | None,
                 headers: SharedHeaders | None, progress: Progress | None, cancel: threading.Event,
                 plan: HashPlan | None = None) -> None:
        self._root, self._headers, self._progress, self._cancel = root, headers, progress, cancel
        self._plan = plan
        files = sorted(plan.files if plan is not None else stats, key=lambda f: -stats[f].st_size)
        self._todo = iter(files)  # big files first: the last thread to finish idles least
        self._lock = threading.Lock()
        self._chunk = K3CKPT_HASH_BUFFER.get()  # here, not in the threads: a bad value stops the run once
        self.digests: dict[str, FileDigest] = {}
        self.errors: dict[str, HashError] = {}
        self.scanned: dict[str, list[Span]] = {}  # the spans each file was scanned by
        self._header_of: dict[str, ShardHeader] = {}  # the header those spans came from
        self._unplanned: dict[str, threading.Event] = {}  # files begun before the plan: their own cancel
        self._failed: list[BaseException] = []  # what a thread raised other than a file's HashError (a bug)
        workers = self._running = max(1, min(jobs or os.cpu_count() or 1, len(files)))
        _SHORT_TURNS.enter()  # until the last thread is done (see _work)
        # Plain threads, not a ThreadPoolExecutor: concurrent.futures (with logging) is 6 ms of
        # imports before the first hashed byte.
        self._threads = [threading.Thread(target=self._work, name=f"k3ckpt-hash-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()

    def decide(self, plan: HashPlan) -> None:
        """From now on hash what ``plan`` says; a file being hashed that it does not want stops
        at its next chunk (a large stray file would otherwise be read to its end for nothing)."""
        with self._lock:
            self._plan = plan
            for f, stop in self._unplanned.items():
                if f not in plan.files:
                    stop.set()

    def stop(self, wait: bool = True) -> None:
        """Cancel every thread at its next chunk, and wait for them (``wait``)."""
        with self._lock:
            self._cancel.set()
            for stop in self._unplanned.values():
                stop.set()
        if wait:
            for t in self._threads:
                t.join()

    def result(self) -> tuple[dict[str, FileDigest], dict[str, HashError]]:
        """Digests and errors of the planned files, once every thread is done."""
        for t in self._threads:
            t.join()
        if self._failed:
            raise self._failed[0]
        files = self._plan.files if self._plan is not None else set()
        return ({f: d for f, d in self.digests.items() if f in files},
                {f: e for f, e in self.errors.items() if f in files})

    def spans_of(self, file: str, header: ShardHeader) -> list[Span] | None:
        """The scale spans a thread derived from ``header`` (this very object), else ``None``."""
        return self.scanned.get(file) if self._header_of.get(file) is header else None

    def _spans_decided(self, f: str) -> Sequence[Span] | None:
        """The tensor spans of ``f`` once the plan is decided (``None`` until then)."""
        plan = self._plan
        return plan.spans.get(f, ()) if plan is not None else None

    def _progress_if_wanted(self, f: str, progress: Progress, n: int) -> None:
        """``progress(n)`` unless the plan, decided since ``f`` was begun, does not want ``f``
        (its bytes are not in the total the plan announced)."""
        with self._lock:  # with decide(): once it returned (and the total is announced), ``f`` is not counted
            if self._plan is None or f in self._plan.files:
                progress(n)

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    f = next(self._todo, None)
                if f is None:
                    return
                plan = self._plan  # (read once: the main thread may decide meanwhile)
                if plan is None or f in plan.files:
                    self._one(f, plan)
        except BaseException as e:  # raised in the main thread by result()
            self._failed.append(e)
        finally:
            with self._lock:
                self._running -= 1
                last = not self._running
            if last:
                _SHORT_TURNS.leave()

    def _one(self, f: str, plan: HashPlan | None) -> None:
        path = self._root / f
        if self._cancel.is_set():
            with self._lock:
                self.errors[f] = HashError(0, "cancelled", str(path))
            return
        scan: list[Span] = []

        def scale_spans_once_parsed(now: bool) -> list[Span] | None:
            # Not parsed here before hashing: a parse holds the GIL (JSON), and so would keep
            # this thread from starting while the main thread parses the manifest. The main
            # thread's structure check parses the headers; the spans follow once it did.
            assert self._headers is not None
            try:
                header = self._headers.get(f) if now else self._headers.parsed(f)
            except K3ckptError:
                return []  # the structure check reports it; without spans the file is not scanned here
            if header is None:
                return None
            scan[:] = shard_scale_spans(header)
            with self._lock:
                self._header_of[f] = header
            return scan

        progress, cancel = self._progress, self._cancel
        if plan is None:
            if progress is not None:
                progress = partial(self._progress_if_wanted, f, progress)
            with self._lock:
                cancel = self._unplanned[f] = threading.Event()
                if self._cancel.is_set() or (self._plan is not None and f not in self._plan.files):
                    cancel.set()  # (stopped, or decided, since this thread looked)
        scanning = self._headers is not None and f.endswith(".safetensors")
        try:
            d = _hashing.hash_file(path, rel=f, spans=plan.spans.get(f, ()) if plan is not None else (),
                                   git_sha1=plan is not None and f in plan.git_sha1, progress=progress,
                                   chunk_bytes=self._chunk, cancel=cancel,
                                   late_spans=partial(self._spans_decided, f) if plan is None else None,
                                   late_scan=scale_spans_once_parsed if scanning else None)
        except HashError as e:
            with self._lock:
                self.errors[f] = e
            return
        with self._lock:
            self.digests[f], self.scanned[f] = d, scan

