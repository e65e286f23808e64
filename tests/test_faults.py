"""The fault-injection seam (:mod:`k3ckpt.faults`): a hook is called only while installed, one
at a time per point, and removed also when the block raises."""

from __future__ import annotations

import threading

import pytest

from k3ckpt.faults import fault_point, inject
from k3ckpt.testing import inject_fault


def test_a_hook_is_called_only_while_installed() -> None:
    seen: list[str] = []
    fault_point("test.point", "before")
    with inject_fault("test.point", seen.append):
        fault_point("test.point", "inside")
        fault_point("test.other", "elsewhere")
        worker = threading.Thread(target=fault_point, args=("test.point", "from a thread"))
        worker.start()
        worker.join()
    fault_point("test.point", "after")
    assert seen == ["inside", "from a thread"]


def test_a_raising_hook_fails_the_caller_and_is_removed_on_exit() -> None:
    def boom(detail: str) -> None:
        raise OSError(28, f"{detail}: injected")

    with pytest.raises(OSError, match="x: injected"), inject("test.point", boom):
        fault_point("test.point", "x")
    fault_point("test.point", "x")  # removed: nothing raised


def test_one_hook_at_a_time_per_point() -> None:
    with inject("test.point", lambda d: None):
        with pytest.raises(ValueError, match="already installed"), inject("test.point", lambda d: None):
            pass
        with inject("test.other", lambda d: None):
            pass
    with inject("test.point", lambda d: None):  # the first was removed on exit
        pass
