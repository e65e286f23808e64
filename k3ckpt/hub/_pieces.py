"""Pieces, tasks and journals: how the rank-aware fetch (:mod:`k3ckpt.hub.rankfetch`, ``--format
partial``) and the node fetch (:mod:`k3ckpt.hub.nodefetch`, ``--format node``) cut an output file
of their own into Range requests of the hub's shards, and the ``.part`` + journal each output
file is written through (the workers that fill them: :mod:`k3ckpt.hub._workers`).

How bytes move. Tensors adjacent in one source shard *and* in the output (an expert's six
tensors; a rank's run of experts) are coalesced into one Range request (a :class:`Piece`) of at
most ``chunk_size`` bytes, so requests are parallel and a crash loses little; a tensor larger
than a chunk gets a sequence of requests (:func:`pieces_and_tasks`). Each response streams into
a preallocated ``<file>.part`` at the tensor's *new* offset. Requests are grouped into *tasks*
(:class:`Task`), the unit of hashing: one request of whole tensors, or the requests of one large
tensor, fetched in order by one worker.

Crash safety (SIGKILL at any moment) follows the downloader's design: the ``.part`` is
preallocated and its new header written and ``fsync``-ed before a journal
(``<file>.part.journal``, :class:`OutputJob`) exists; a request's bytes are ``fdatasync``-ed
before its index is added to the journal (rewritten atomically); the journal records a
fingerprint of the exact output (source files, new header, request layout), so a journal of
another selection or chunk size is discarded.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Protocol

from ..integrity.hashing import Span
from ..utils import write_atomic
from . import _dest
from .client import HubFile

#: The version of the ``.part.journal`` documents :class:`OutputJob` writes.
JOURNAL_VERSION = 1


@dataclass(frozen=True)
class Piece:
    """One ranged GET: ``length`` bytes at absolute offset ``src`` of the source shard, written
    at absolute offset ``dst`` of the output file. ``file``: the source shard's path when the
    output gathers from several (a node directory's files); empty when the output has one source
    (a rewritten shard), so a rewritten shard's fingerprint is what it always was."""

    src: int
    dst: int
    length: int
    file: str = ""


@dataclass(frozen=True)
class Task:
    """The unit of hashing: whole tensors adjacent in the source fetched by one piece, or one
    tensor larger than a chunk fetched by several pieces in order.

    Attributes:
        tensors: ``(name, start, stop)`` of each tensor, absolute offsets in the output file.
        pieces: Indices into :attr:`OutputPlan.pieces`, in output order.
    """

    tensors: tuple[tuple[str, int, int], ...]
    pieces: tuple[int, ...]


#: ``(name, source file, src_start, dst_start, dst_stop)`` of one tensor to fetch.
Span5 = tuple[str, str, int, int, int]


def pieces_and_tasks(spans: list[Span5], chunk_size: int) -> tuple[list[Piece], list[Task]]:
    """Coalesce ``(name, file, src_start, dst_start, dst_stop)`` spans (in output order) into
    pieces of at most ``chunk_size`` bytes and group them into tasks (see :class:`Task`). Spans
    are coalesced only when adjacent in the same source file *and* in the output: one Range
    request reads one file."""
    pieces: list[Piece] = []
    tasks: list[Task] = []
    group: list[Span5] = []

    def flush() -> None:
        if not group:
            return
        file, src, dst, stop = group[0][1], group[0][2], group[0][3], group[-1][4]
        ids: tuple[int, ...] = ()
        if stop > dst:  # a group of zero-byte tensors needs no request
            pieces.append(Piece(src, dst, stop - dst, file))
            ids = (len(pieces) - 1,)
        tasks.append(Task(tuple((n, b, e) for n, _, _, b, e in group), ids))
        group.clear()

    for span in spans:
        name, file, src, dst, stop = span
        nbytes = stop - dst
        if nbytes > chunk_size:
            flush()
            first = len(pieces)
            pieces.extend(Piece(src + off, dst + off, min(chunk_size, nbytes - off), file)
                          for off in range(0, nbytes, chunk_size))
            tasks.append(Task(((name, dst, stop),), tuple(range(first, len(pieces)))))
            continue
        if group:
            last = group[-1]
            adjacent = last[1] == file and last[2] + (last[4] - last[3]) == src and last[4] == dst
            if not adjacent or stop - group[0][3] > chunk_size:
                flush()
        group.append(span)
    flush()
    return pieces, tasks


class OutputPlan(Protocol):
    """What the download machinery needs of an output file: a rewritten shard
    (:class:`k3ckpt.hub.rankfetch.ShardPlan`) or a node directory's file (:class:`k3ckpt.hub.nodefetch.NodeFilePlan`)."""

    path: str
    names: list[str]
    prefix: bytes
    size: int
    pieces: list[Piece]
    tasks: list[Task]

    def fingerprint(self) -> str: ...

    def content_key(self) -> str: ...

    def source_of(self, piece: Piece) -> HubFile: ...


def looks_complete(op: OutputPlan, final: str) -> bool:
    """Whether ``final`` is a regular file (not a link) of ``op``'s size that starts with its
    header bytes: the first check of an output file already present (the tensor bytes are the
    caller's to check)."""
    try:
        if os.path.islink(final) or not os.path.isfile(final) or os.path.getsize(final) != op.size:
            return False
        with open(final, "rb") as f:
            return f.read(len(op.prefix)) == op.prefix
    except OSError:
        return False


def tensor_spans(op: OutputPlan) -> list[Span]:
    """Each tensor's absolute ``[start, stop)`` in the output file, in file order."""
    return [Span(name, start, stop) for task in op.tasks for name, start, stop in task.tensors]


class PieceFailed(Exception):
    """A piece, a task or an output file that cannot be completed: fails that file (its message is
    the reason reported), never the run."""


class OutputJob:
    """One output file being written (a rewritten shard, a node directory's file): its
    ``.part``, journal and outstanding tasks."""

    def __init__(self, plan: OutputPlan, final: str, dest_real: str) -> None:
        self.plan = plan
        self.final = final
        self.dest_real = dest_real
        self.part = final + ".part"
        self.journal = self.part + ".journal"
        self.fingerprint = plan.fingerprint()
        self.done: set[int] = set()
        self.lock = threading.Lock()
        # The .part's descriptor: set by open() before the first piece, None again after
        # close(). Calls made while the job runs pass it with "type: ignore[arg-type]".
        self.fd: int | None = None
        # The same file opened with O_DIRECT (a run's aligned pieces are written through it), or
        # None: K3CKPT_DIRECT_IO off, or a filesystem without direct I/O. Closed with fd.
        self.dfd: int | None = None
        self.remaining = len(plan.tasks)
        self.failed: str | None = None

    def load_resume(self) -> None:
        """Adopt a ``.part`` + journal of this exact selection; otherwise forget them."""
        self.done = _dest.resumable(self.journal, self.part, self.plan.size,
                                    {"version": JOURNAL_VERSION, "fingerprint": self.fingerprint},
                                    len(self.plan.pieces))

    def todo_bytes(self) -> int:
        return sum(p.length for i, p in enumerate(self.plan.pieces) if i not in self.done)

    def open(self) -> None:
        """Resume the ``.part``, or create it: preallocate, write the new header, sync, journal."""
        try:
            self.fd = _dest.open_part(self.part, self.final, self.dest_real, self.plan.path, self.plan.size,
                                      self.plan.prefix, resume=bool(self.done))
        except ValueError as e:  # its directory resolves outside the destination
            raise PieceFailed(str(e)) from None
        if not self.done:
            self.write_journal()

    def write_journal(self) -> None:
        doc = {"version": JOURNAL_VERSION, "path": self.plan.path, "fingerprint": self.fingerprint,
               "size": self.plan.size, "done": sorted(self.done)}
        write_atomic(self.journal, json.dumps(doc).encode(), reuse_temp=True)  # as the downloader's journal

    def close(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
