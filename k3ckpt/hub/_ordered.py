"""In-stream digests of a node directory's file: its sha256, in file order, and each tensor's,
computed from the bytes as they are received and written - the finished file is not read back.

A node file is its header bytes (planned, in memory) followed by its tensors' bytes, contiguous
in file order (a safetensors buffer has no holes). Its tasks (:class:`~k3ckpt.hub._pieces.Task`)
cover that buffer in order, so the file's sha256 is the header's bytes, then each task's bytes,
task after task: the in-order scheme of a downloaded file's chunks
(:class:`~k3ckpt.hub._digest.StreamDigest`), with tasks as the chunks. The worker writing the
task next in line feeds the digest the very buffers it writes; a task completed ahead of its turn
is hashed from the ``.part`` when its turn comes. That is rare: workers spread over files
(:class:`~k3ckpt.hub.schedule.SpreadQueue`), so while there are more files than workers each
file's tasks are written by one worker, in order. A task's tensors are hashed as they stream by
its own hasher (:class:`~k3ckpt.hub._workers.TensorHasher`) and recorded here once the task is
complete (and, with a manifest, matched).

A request that fails, or a task whose bytes do not match the manifest, gives back what it fed
(:meth:`TaskFeed.void`): its retry's bytes are hashed instead.
"""

from __future__ import annotations

import threading

from ._digest import StreamDigest
from ._pieces import OutputJob, OutputPlan, PieceFailed

#: ``(the file's sha256, each tensor's sha256 by name)``.
FileDigests = tuple[str, dict[str, str]]


def task_ranges(plan: OutputPlan) -> list[tuple[int, int]]:
    """``(start, length)`` in the file of each of ``plan``'s tasks (a task of zero-byte tensors
    only: zero bytes where the previous one ended)."""
    pos, out = len(plan.prefix), []
    for t in plan.tasks:
        start, stop = (t.tensors[0][1], t.tensors[-1][2]) if t.tensors else (pos, pos)
        out.append((start, stop - start))
        pos = stop
    return out


class TaskChunks:
    """An output file's tasks as the chunks of its :class:`StreamDigest` (a ``PartFile``):
    ``done`` holds the tasks complete and checked."""

    def __init__(self, job: OutputJob) -> None:
        self.job = job
        self.ranges = task_ranges(job.plan)
        self.done: set[int] = set()
        self.dfd: int | None = None  # the .part is written through the page cache

    @property
    def fd(self) -> int | None:
        return self.job.fd

    @property
    def lock(self) -> threading.Lock:
        return self.job.lock

    @property
    def nchunks(self) -> int:
        return len(self.ranges)

    def chunk(self, i: int) -> tuple[int, int]:
        return self.ranges[i]


class StreamedFile:
    """The digests of one output file, fed while its tasks run (see the module doc)."""

    def __init__(self, job: OutputJob) -> None:
        self.chunks = TaskChunks(job)
        self.digest = StreamDigest(job.plan.size)
        self.digest.feed(memoryview(job.plan.prefix))
        self.tensors: dict[str, str] = {}

    def feed_for(self, k: int) -> TaskFeed:
        """What task ``k``'s bytes are fed to, in order, as they are written."""
        return TaskFeed(self, k)

    def task_done(self, feed: TaskFeed, tensors: dict[str, str]) -> None:
        """Task ``feed.k`` is complete and checked, with these tensor digests: move the file's
        digest past it (and past the tasks after it that completed ahead of their turn)."""
        with self.chunks.lock:
            self.chunks.done.add(feed.k)
            self.tensors.update(tensors)
        if feed.owner:
            feed.owner = False
            self.digest.commit(feed.k)
        self.digest.advance(self.chunks)

    def result(self) -> FileDigests:
        """``(the file's sha256, its tensors' sha256)`` once every task is done (waits for a
        thread still hashing tasks it found in line).

        Raises:
            PieceFailed: a task is not done, or the bytes hashed are not the file's size (never
                expected: the file then does not get its final name).
        """
        d = self.digest
        d.advance(self.chunks, wait=True)
        if d.next != self.chunks.nchunks or d.hashed != d.size:
            raise PieceFailed(f"{self.chunks.job.part}: {d.hashed} of {d.size} bytes hashed in order "
                              f"({d.next} of {self.chunks.nchunks} tasks)")
        with self.chunks.lock:
            return d.sha256.hexdigest(), dict(self.tensors)


class TaskFeed:
    """Task ``k``'s bytes on their way to the file's digest. They are fed as they are written
    once every byte before the task is hashed (the claim is taken at the first buffer that finds
    it so, after hashing from the ``.part`` what the task wrote before); before that, the task's
    bytes are hashed later, from the ``.part``, in turn."""

    def __init__(self, streamed: StreamedFile, k: int) -> None:
        self.streamed = streamed
        self.k = k
        self.start = streamed.chunks.ranges[k][0]
        self.pos = self.start  # the task's bytes before it are written (by this attempt or a resumed run)
        self.owner = False

    def at(self, pos: int) -> None:
        """The next bytes fed are those at ``pos`` (a request's first byte: its retry starts there again)."""
        self.pos = pos

    def feed(self, data: memoryview) -> None:
        digest = self.streamed.digest
        if not self.owner and digest.claim(self.k):
            self.owner = True
            if self.pos > self.start:
                digest.hash_written(self.streamed.chunks, self.start, self.pos - self.start)
        if self.owner:
            digest.feed(data)
        self.pos += len(data)

    def void(self) -> None:
        """What this task fed is void (its request is retried, or its bytes are fetched again):
        the digest is as it was at the task's start, and open to whoever is next in line."""
        if self.owner:
            self.owner = False
            self.streamed.digest.rollback()
