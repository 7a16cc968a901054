"""I/O scheduler: class order, FIFO within a class, the background byte cap, deadlines."""

from __future__ import annotations

import threading

import pytest

from kvstore.errors import DeadlineExceeded, InvalidArgument
from kvstore.keys import IoClass
from kvstore.scheduler import IoScheduler

pytestmark = pytest.mark.unit

RATE = 1000


class FakeTime:
    """A clock and a sleep that advances it instantly, recording each sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def start(target: object) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_grants_by_class_then_fifo() -> None:
    sched = IoScheduler(concurrency=1, background_bytes_per_s=0)
    granted: list[str] = []

    def op(name: str, io_class: IoClass) -> None:
        with sched.admit(io_class, 10):
            granted.append(name)

    threads = []
    with sched.admit(IoClass.NORMAL, 1):
        assert sched.running() == 1
        arrivals = [
            ("bg1", IoClass.BACKGROUND, 1),
            ("bg2", IoClass.BACKGROUND, 2),
            ("normal", IoClass.NORMAL, 1),
            ("crit", IoClass.CRITICAL, 1),
        ]
        for name, io_class, depth in arrivals:
            threads.append(start(lambda n=name, c=io_class: op(n, c)))
            assert sched.wait_for_depth(io_class, depth, timeout_s=10)
        assert sched.queue_depths() == {
            IoClass.CRITICAL: 1,
            IoClass.NORMAL: 1,
            IoClass.BACKGROUND: 2,
        }
    for thread in threads:
        thread.join(timeout=10)
    assert granted == ["crit", "normal", "bg1", "bg2"]
    assert sched.running() == 0
    assert set(sched.queue_depths().values()) == {0}
    assert sched.admitted_bytes(IoClass.BACKGROUND) == 20
    assert sched.admitted_bytes(IoClass.NORMAL) == 11
    assert sched.admitted_bytes(IoClass.CRITICAL) == 10


def test_concurrency_slots_are_shared() -> None:
    sched = IoScheduler(concurrency=2, background_bytes_per_s=0)
    inside = threading.Barrier(3)
    leave = threading.Event()
    third_ran = threading.Event()

    def op() -> None:
        with sched.admit(IoClass.NORMAL, 1):
            inside.wait(timeout=10)
            leave.wait(timeout=10)

    def third() -> None:
        with sched.admit(IoClass.NORMAL, 1):
            third_ran.set()

    threads = [start(op), start(op)]
    inside.wait(timeout=10)  # both run at once
    assert sched.running() == 2
    threads.append(start(third))
    assert sched.wait_for_depth(IoClass.NORMAL, 1, timeout_s=10)
    assert sched.running() == 2 and not third_ran.is_set()
    leave.set()
    for thread in threads:
        thread.join(timeout=10)
    assert third_ran.is_set()
    assert sched.running() == 0 and sched.admitted_bytes(IoClass.NORMAL) == 3


def test_background_cap_on_a_fake_clock() -> None:
    t = FakeTime()
    sched = IoScheduler(1, RATE, clock=t.clock, sleep=t.sleep)
    for _ in range(3):
        with sched.admit(IoClass.BACKGROUND, RATE):
            pass
    assert sum(t.slept) == pytest.approx(2.0)
    assert t.now == pytest.approx(2.0)
    before = len(t.slept)
    for io_class in (IoClass.CRITICAL, IoClass.NORMAL):
        with sched.admit(io_class, 50 * RATE):
            pass
    assert len(t.slept) == before  # the cap is for background only
    assert sched.admitted_bytes(IoClass.BACKGROUND) == 3 * RATE


def test_background_small_ops_average_the_rate() -> None:
    t = FakeTime()
    sched = IoScheduler(4, RATE, clock=t.clock, sleep=t.sleep)
    for _ in range(30):
        with sched.admit(IoClass.BACKGROUND, RATE // 10):
            pass
    assert t.now == pytest.approx(2.0)  # the first second's worth is the burst


def test_op_larger_than_the_burst_passes_then_throttles() -> None:
    t = FakeTime()
    sched = IoScheduler(1, RATE, clock=t.clock, sleep=t.sleep)
    with sched.admit(IoClass.BACKGROUND, 5 * RATE):
        pass
    assert t.slept == []  # a full bucket lets it through
    with sched.admit(IoClass.BACKGROUND, 1):
        pass
    assert t.now == pytest.approx(4.0 + 1 / RATE)  # then it repays its debt


def test_uncapped_background_never_sleeps() -> None:
    t = FakeTime()
    sched = IoScheduler(1, 0, clock=t.clock, sleep=t.sleep)
    for _ in range(5):
        with sched.admit(IoClass.BACKGROUND, 10**9):
            pass
    assert t.slept == []


def test_background_waiting_for_tokens_holds_no_slot() -> None:
    now = [0.0]
    sleeping = threading.Event()
    resume = threading.Event()

    def sleep(seconds: float) -> None:
        sleeping.set()
        assert resume.wait(timeout=10)
        now[0] += seconds

    sched = IoScheduler(1, RATE, clock=lambda: now[0], sleep=sleep)

    def background() -> None:
        for _ in range(2):
            with sched.admit(IoClass.BACKGROUND, RATE):
                pass

    thread = start(background)
    assert sleeping.wait(timeout=10)  # the second op waits for tokens
    assert sched.queue_depths()[IoClass.BACKGROUND] == 1 and sched.running() == 0
    with sched.admit(IoClass.CRITICAL, 10 * RATE, timeout_s=5):  # not delayed by the cap
        assert sched.running() == 1
    resume.set()
    thread.join(timeout=10)
    assert sched.admitted_bytes(IoClass.BACKGROUND) == 2 * RATE
    assert now[0] == pytest.approx(1.0)


def test_deadline_while_queued() -> None:
    sched = IoScheduler(1, 0)
    with sched.admit(IoClass.CRITICAL, 1):
        with pytest.raises(DeadlineExceeded), sched.admit(IoClass.CRITICAL, 1, timeout_s=0.01):
            pass
        assert sched.queue_depths()[IoClass.CRITICAL] == 0
    with sched.admit(IoClass.NORMAL, 1, timeout_s=0.01):  # the slot is free again
        assert sched.running() == 1
    assert sched.admitted_bytes(IoClass.CRITICAL) == 1


def test_deadline_on_the_rate_wait() -> None:
    t = FakeTime()
    sched = IoScheduler(1, RATE, clock=t.clock, sleep=t.sleep)
    with sched.admit(IoClass.BACKGROUND, RATE):
        pass
    with pytest.raises(DeadlineExceeded), sched.admit(IoClass.BACKGROUND, RATE, timeout_s=0.5):
        pass
    assert t.slept == [] and sched.queue_depths()[IoClass.BACKGROUND] == 0


def test_a_failing_body_frees_its_slot() -> None:
    sched = IoScheduler(1, 0)
    with pytest.raises(ValueError), sched.admit(IoClass.NORMAL, 1):
        raise ValueError("boom")
    assert sched.running() == 0


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument):
        IoScheduler(0, 0)
    with pytest.raises(InvalidArgument):
        IoScheduler(1, -1)
    sched = IoScheduler(1, 0)
    with pytest.raises(InvalidArgument), sched.admit(IoClass.NORMAL, -1):
        pass
