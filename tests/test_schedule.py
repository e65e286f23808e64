"""How the fetch runs hand tasks to workers (``k3ckpt.hub.schedule``): one worker per file
first, and a spare worker joins a file in flight only while that is shown to raise the
receive rate (its bytes are read back from the disk to hash the file in order)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from k3ckpt.hub.schedule import JoinGate, SpreadQueue, join_rule, next_task

W = JoinGate.WINDOW
FAST = 1e9  # bytes/s


class Run:
    """A run's byte counter and clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0
        self.bytes = 0

    def window(self, rate: float) -> None:
        """One more window received at ``rate``."""
        self.now += W
        self.bytes += int(rate * W)

    def gate(self) -> JoinGate:
        return JoinGate(lambda: self.bytes, clock=lambda: self.now)


def windows(run: Run, gate: JoinGate, rates: list[float], files: int = 2,
            joined: Callable[[JoinGate], int] = lambda g: 0) -> list[int]:
    """The joined streams allowed after each window at ``rates``."""
    allowed = []
    for rate in rates:
        run.window(rate)
        gate.may_join(files, joined(gate))
        allowed.append(gate.allowed)
    return allowed


def test_no_join_before_the_streams_have_shown_a_rate() -> None:
    """The first window is the streams' start-up: nothing is judged, nobody joins."""
    run = Run()
    gate = run.gate()
    assert not gate.may_join(2, 0)  # the first call only starts the clock
    run.window(FAST)
    assert not gate.may_join(2, 0)  # the start-up window
    run.window(FAST)
    assert gate.may_join(2, 0) and not gate.may_join(2, 1)  # a probe: one joined stream


def test_a_join_that_raises_the_rate_is_kept_and_the_next_one_tried() -> None:
    run = Run()
    gate = run.gate()
    gate.may_join(2, 0)
    # start-up, base rate (probe 1), +20 % (kept, probe 2), +20 % (kept, probe 3), flat (back to 2)
    assert windows(run, gate, [FAST, FAST, 1.2 * FAST, 1.44 * FAST, 1.44 * FAST]) == [0, 1, 2, 3, 2]
    assert gate.may_join(2, 1) and not gate.may_join(2, 2)


def test_a_join_that_does_not_pay_is_taken_back_and_not_tried_again_on_noise() -> None:
    """A settled gate stays shut through any rate swing while as many files are streamed."""
    run = Run()
    gate = run.gate()
    gate.may_join(2, 0)
    assert windows(run, gate, [FAST, FAST, 1.05 * FAST]) == [0, 1, 0]
    assert windows(run, gate, [0.5 * FAST, 0.2 * FAST, 1.5 * FAST]) == [0, 0, 0]
    assert not gate.may_join(2, 0)


def test_a_kept_join_whose_rate_falls_away_is_taken_back() -> None:
    """A probe can pass on one window's noise, and its joined bytes are read back later: a join
    kept is taken back, one per window, once the rate falls a GAIN below the best - and it is
    kept through smaller swings."""
    run = Run()
    gate = run.gate()
    gate.may_join(2, 0)
    # start-up, base (probe 1), +20 % (kept, probe 2), +20 % (kept, probe 3), flat (back to 2)
    assert windows(run, gate, [FAST, FAST, 1.2 * FAST, 1.44 * FAST, 1.44 * FAST]) == [0, 1, 2, 3, 2]
    assert windows(run, gate, [1.36 * FAST, 1.44 * FAST]) == [2, 2]  # within a GAIN of the best
    assert windows(run, gate, [1.2 * FAST, 1.2 * FAST, 1.0 * FAST, 0.8 * FAST]) == [1, 1, 0, 0]
    assert not gate.may_join(2, 0)  # settled: no probe while as many files are streamed


def test_a_settled_gate_probes_again_once_fewer_files_are_streamed() -> None:
    """Files finishing near the run's end leave the link room: the gate tries a join again."""
    run = Run()
    gate = run.gate()
    gate.may_join(3, 0)
    assert windows(run, gate, [FAST, FAST, FAST], files=3) == [0, 1, 0]
    assert windows(run, gate, [FAST], files=3) == [0]
    assert windows(run, gate, [0.6 * FAST], files=2) == [1]


def test_join_rule_follows_k3ckpt_share_files() -> None:
    assert join_rule(True, lambda: 0) is None  # always
    never = join_rule(False, lambda: 0)
    assert never is not None and not never(1, 0)
    auto = join_rule(None, lambda: 0)
    assert auto is not None and not auto(1, 0)  # a gate: shut until it has seen a rate


def queue_of(tasks: dict[str, int], may_join: Callable[[int, int], bool] | None) -> SpreadQueue[str, int]:
    q: SpreadQueue[str, int] = SpreadQueue(may_join)
    for job, n in tasks.items():
        for i in range(n):
            q.append((job, i))
    return q


def test_spread_queue_gives_every_file_its_own_worker_before_any_joins() -> None:
    asked: list[tuple[int, int]] = []

    def shut(files: int, joined: int) -> bool:
        asked.append((files, joined))
        return False

    q = queue_of({"a": 3, "b": 2}, shut)
    assert [q.popleft(), q.popleft()] == [("a", 0), ("b", 0)]
    assert asked == []  # nobody had to join yet
    assert q.popleft() is None and asked == [(2, 0)]  # both files are streamed: kept out
    q.finished("a")
    assert q.popleft() == ("a", 1)  # a's worker goes on with a, in order
    assert len(q) == 2


def test_spread_queue_joins_the_file_with_most_left_when_allowed() -> None:
    q = queue_of({"a": 3, "b": 1}, lambda files, joined: joined < 1)
    assert [q.popleft(), q.popleft()] == [("a", 0), ("b", 0)]
    assert q.popleft() == ("a", 1)  # the one joined stream allowed
    assert q.popleft() is None  # a second one is not


def test_next_task_waits_for_the_gate_and_returns_once_it_opens() -> None:
    opened = threading.Event()
    q = queue_of({"a": 2}, lambda files, joined: opened.is_set())
    cond, cancel = threading.Condition(), threading.Event()
    assert next_task(cond, q, lambda: True, cancel) == ("a", 0)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(next_task(cond, q, lambda: True, cancel)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and got == []  # kept out: it waits rather than ends
    opened.set()  # no notify: the worker asks again on its own
    t.join(5)
    assert got == [("a", 1)]
