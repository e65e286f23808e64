"""The seams tests use to stop or break a run at a named moment, and nothing else: the library
calls these at fixed points and, unless a test asked for something, each call is one lookup.

**Pause points** (:func:`pause_point`) freeze the whole process, for crash tests that run a
command in a child process and SIGKILL it at an exact moment. A child pauses when
``K3CKPT_TEST_PAUSE_AT`` (:mod:`k3ckpt.env`) names the point, as ``NAME`` or ``NAME:N``:

- ``after_chunk:N``, ``before_rename``: a download, after its N-th journaled chunk, or before
  it renames a finished file (:mod:`k3ckpt.hub.download`);
- ``after_piece:N``, ``before_shard_rename``: a rank-aware fetch, after the run's N-th
  journaled piece, or before a shard's rename (:mod:`k3ckpt.hub.rankfetch`);
- ``reshard_file:N``: reshard, once the run's N-th file is written (under its temporary name);
- ``unshard_shard:N``: unshard, once the N-th shard is written (not yet renamed).

**Fault points** (:func:`fault_point`) call a hook a test installed in its own process with
:func:`inject` (``k3ckpt.testing.inject_fault``); the hook may record what it is called with,
or raise to make that step fail as a real error there would. Hooks are called from the thread
that reaches the point (often a worker thread), so a hook that records must be thread-safe
(``list.append`` is). The named points:

- ``reshard.file_written`` (detail: the output file's name, e.g.
  ``model-rank-0-part-0.safetensors``): a reshard writer has written every byte of that file
  under its temporary name, just before it closes the file and hands it to its unit's finisher
  (which syncs and renames it). An exception raised here fails that file as a failed write
  would: its unit gets no ``READY`` and no file under a final name, the other units complete,
  and the run raises the first such error once every other file is done.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

from .env import K3CKPT_TEST_PAUSE_AT, K3CKPT_TEST_PAUSE_FILE

__all__ = ["fault_point", "inject", "pause_point"]

#: The installed hooks by point name; read without the lock (one dict lookup per call).
_hooks: dict[str, Callable[[str], None]] = {}
_lock = threading.Lock()


def fault_point(name: str, detail: str) -> None:
    """Call the hook :func:`inject` installed for ``name`` with ``detail``; none installed
    (production), nothing happens. What the hook raises propagates to the caller."""
    hook = _hooks.get(name)
    if hook is not None:
        hook(detail)


@contextlib.contextmanager
def inject(name: str, hook: Callable[[str], None]) -> Iterator[None]:
    """Install ``hook`` at the fault point ``name`` (see the module docstring for the points)
    while the ``with`` block runs; it is removed on exit, also when the block raises.

    Raises:
        ValueError: a hook is already installed at ``name`` (one at a time per point).
    """
    with _lock:
        if name in _hooks:
            raise ValueError(f"a hook is already installed at fault point {name!r}")
        _hooks[name] = hook
    try:
        yield
    finally:
        with _lock:
            del _hooks[name]


def pause_point(name: str, n: int | None = None) -> None:
    """Freeze the whole process at a named point when ``K3CKPT_TEST_PAUSE_AT`` names it.

    Crash tests SIGKILL a run at exact moments (between chunks, just before a rename, after the
    N-th reshard file). The hook writes ``K3CKPT_TEST_PAUSE_FILE`` (so the test knows the point
    was reached) and sends itself SIGSTOP, freezing every thread at once. A test that removes
    the file and sends SIGCONT lets the run go on (two runs into one directory: the second is
    refused while the first is held here, then the first finishes). Unset (production), it is
    one dict lookup.
    """
    import signal
    import time

    want = K3CKPT_TEST_PAUSE_AT.get()
    if not want or want != (name if n is None else f"{name}:{n}"):
        return
    marker = K3CKPT_TEST_PAUSE_FILE.get()
    if marker is not None:
        with open(marker, "w") as f:
            f.write(name)
    os.kill(os.getpid(), signal.SIGSTOP)
    # The group stop can land a moment after kill() returns; this thread must not take another
    # step past its pause point in that moment (a test SIGKILLs the process from here on, or
    # removes the file first to let it go on).
    while marker is None or marker.exists():
        time.sleep(0.01)
