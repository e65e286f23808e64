"""Handing a run's tasks to its worker threads: shared by the downloader
(:mod:`k3ckpt.hub._fetchrun`) and the rank-aware fetch (:mod:`k3ckpt.hub._workers`).

:class:`SpreadQueue` spreads workers over files first, so that each file is written in order by
one worker and its digest is fed as the bytes arrive; :class:`JoinGate` decides when a spare
worker may still join a file someone is streaming (the bytes it receives ahead of the file's
digest are hashed later, read back from the disk, so a join must buy receive rate);
:func:`next_task` and :func:`run_workers` are the pool.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, Protocol, TypeVar


class TaskQueue(Protocol):
    """What :func:`next_task` takes tasks from: a ``collections.deque``, or a queue with its own
    order (the downloader hands out chunks per file). ``popleft`` may answer None while tasks
    are queued: nothing may be handed out yet (:class:`SpreadQueue` with a :class:`JoinGate`)."""

    def __len__(self) -> int: ...

    def popleft(self) -> Any: ...


class JoinGate:
    """Whether a spare worker may join a file another worker is already streaming.

    A join splits a file over two streams, and the in-order digest can take only one of them as
    it arrives: the other's bytes are read back from the disk when the digest reaches them. That
    pays where one stream is slower than the link (a CDN's per-connection rate); where a stream
    already moves what the CPU or the disk can take (a LAN mirror, the loopback hub) it only adds
    a read of every joined byte. Measured on the 2-core VM, two 4 GB files with 8 workers: 8.2 s
    with every spare worker joining (7.7 of 8.1 GB read back), 6.5-6.8 s with none.

    So joins are probed, the way a congestion window is: the run's receive rate is sampled over
    :attr:`WINDOW` (the first window, the streams' start-up, is not judged); a probe allows one
    more joined stream, and it is kept (and the next one tried) only if the next window received
    :attr:`GAIN` times the best rate seen so far, else taken back and the gate settles. A join
    kept is watched: a window that falls :attr:`GAIN` below the best takes one back (a probe can
    pass on one window's noise, and the read-back of joined bytes comes later: on the loopback
    hub a join kept that way held the rate at 0.8-1.0 GB/s against 1.26-1.88 before). A settled
    gate probes again only once fewer files are being streamed than when it settled (files
    finished near the run's end: the link may have room again) - never on a window's noise
    alone.

    ``received()`` is the run's byte counter (bytes received so far, any thread); ``clock`` is
    a monotonic clock (tests give their own). Called under the run's condition only."""

    #: Seconds per rate sample: long enough to smooth a request's start-up and a chunk's fsync.
    WINDOW = 0.5
    #: The receive-rate gain a probed join must show to be kept.
    GAIN = 1.1

    def __init__(self, received: Callable[[], int], clock: Callable[[], float] = time.monotonic) -> None:
        self.received = received
        self.clock = clock
        self.allowed = 0  # joined streams allowed now
        self.best = 0.0  # the best window's rate, bytes/s
        self.probing = False  # a joined stream more is allowed, to be judged by the next window
        self.settled_at: int | None = None  # files being streamed when the last probe failed
        self.mark: tuple[float, int] | None = None  # (time, bytes) at the window's start
        self.warm = False  # a window has passed (the streams' start-up is not a rate to judge)

    def may_join(self, files: int, joined: int) -> bool:
        """May one more stream join a file, ``files`` being streamed by one worker each and
        ``joined`` more streams on them?"""
        self._sample(files)
        return joined < self.allowed

    def _sample(self, files: int) -> None:
        now, got = self.clock(), self.received()
        if self.mark is None:
            self.mark = (now, got)
            return
        t0, b0 = self.mark
        if now - t0 < self.WINDOW:
            return
        self.mark = (now, got)
        if self.warm:
            self._judge((got - b0) / (now - t0), files)
        self.warm = True

    def _judge(self, rate: float, files: int) -> None:
        if self.probing:  # a probe ran for a window
            self.probing = rate >= self.best * self.GAIN
            self.allowed += 1 if self.probing else -1  # it paid: try one more; else take it back
            if not self.probing:
                self.settled_at = files
        elif self.allowed and rate * self.GAIN < self.best:  # the joins kept stopped paying
            self.allowed -= 1
            self.best, self.settled_at = rate, files  # what is left is judged by what it does now
        elif self.settled_at is None or files < self.settled_at:
            self.probing, self.settled_at = True, None
            self.allowed += 1
        self.best = max(self.best, rate)


#: ``may_join(files, joined)``: may a spare worker join a file someone is streaming, ``files``
#: being streamed by one worker each and ``joined`` more streams on them?
JoinRule = Callable[[int, int], bool]


def join_rule(share: bool | None, received: Callable[[], int]) -> JoinRule | None:
    """When a run's spare workers may share a file in flight, as ``share``
    (``K3CKPT_SHARE_FILES``, read before the run) says: a :class:`JoinGate` on ``received``
    (the run's byte counter) when None, never when False, None (always) when True."""
    if share is None:
        return JoinGate(received).may_join
    return None if share else (lambda files, joined: False)


J = TypeVar("J", bound=Hashable)
Item = TypeVar("Item")


class SpreadQueue(Generic[J, Item]):
    """The queued ``(job, item)`` tasks of a run, per job (an output file), handed out so that
    workers spread over files: a worker gets the next item of the first file nobody is working
    on, and only when every file with items left is in someone's hands does it join one (the
    file with the most items left), if ``may_join`` allows (:func:`join_rule`; without one it
    always joins). While there are more files than workers each file is then written by one
    worker, item after item, in file order - so a downloaded file's sha256 is fed as the bytes
    arrive (no read-back; :class:`~k3ckpt.hub._digest.StreamDigest`).

    Not thread-safe on its own: a run calls it under its condition, and :meth:`finished` once
    each task handed out is over."""

    def __init__(self, may_join: JoinRule | None = None) -> None:
        self.queued: dict[J, collections.deque[Item]] = {}
        self.running: collections.Counter[J] = collections.Counter()
        self.count = 0
        self.may_join = may_join

    def __len__(self) -> int:
        return self.count

    def append(self, item: tuple[J, Item]) -> None:
        job, index = item
        self.queued.setdefault(job, collections.deque()).append(index)
        self.count += 1

    def popleft(self) -> tuple[J, Item] | None:
        """The next task, or None when every queued file is being streamed and ``may_join``
        keeps this worker out for now."""
        if not self.count:
            raise IndexError("no task queued")
        job = next((j for j in self.queued if not self.running[j]), None)
        if job is None:
            files = len(self.running)
            if self.may_join is not None and not self.may_join(files, sum(self.running.values()) - files):
                return None
            job = max(self.queued, key=lambda j: len(self.queued[j]))  # the first of the longest
        tasks = self.queued[job]
        index = tasks.popleft()
        if not tasks:
            del self.queued[job]
        self.count -= 1
        self.running[job] += 1
        return job, index

    def finished(self, job: J) -> None:
        """A task of ``job`` handed out by :meth:`popleft` is over."""
        self.running[job] -= 1
        if not self.running[job]:
            del self.running[job]


#: How often a worker the gate kept out asks again (seconds): a fraction of its window.
RECHECK = JoinGate.WINDOW / 5


def next_task(cond: threading.Condition, queue: TaskQueue, busy: Callable[[], bool],
              cancel: threading.Event) -> Any | None:
    """A worker's next task: waits (under ``cond``) while the queue is empty but tasks are still
    running (a running task may queue more), or while the queue hands out nothing for now; None
    when cancelled or when nothing is left."""
    with cond:
        while busy() and not cancel.is_set():
            if queue:
                task = queue.popleft()
                if task is not None:
                    return task
                cond.wait(RECHECK)
            else:
                cond.wait()
        if cancel.is_set() or not queue:
            return None
        return queue.popleft()


def run_workers(worker: Callable[[], None], workers: int, name: str, cond: threading.Condition,
                busy: Callable[[], bool], cancel: threading.Event) -> None:
    """Run ``workers`` daemon threads of ``worker`` until ``busy()`` (read under ``cond``) is false."""
    threads = [threading.Thread(target=worker, name=f"{name}-{i}", daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    try:
        with cond:
            while busy():
                cond.wait(0.5)
    except BaseException:
        # Ctrl-C: stop the workers between pieces; the journal is consistent at any moment.
        # A worker blocked in a read is not waited for beyond a moment (it is a daemon
        # thread, and once cancelled it records nothing more in any journal).
        cancel.set()
        with cond:
            cond.notify_all()
        deadline = time.monotonic() + 2.0
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        raise
    for t in threads:
        t.join()
