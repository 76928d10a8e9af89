"""GcPolicy: full collections only at quiet moments, young ones small (no Textual)."""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Iterator

import pytest

from elastic_console.tui.gc_policy import YOUNG_THRESHOLDS, GcPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def restore_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_settle_freezes_survivors_and_stops_automatic_full_collections(restore_gc: None) -> None:
    keep = [[i] for i in range(1000)]  # survivors of a "history load"
    policy = GcPolicy()
    policy.settle()
    assert gc.get_freeze_count() >= len(keep)
    young0, young1, full = gc.get_threshold()
    assert (young0, young1) == YOUNG_THRESHOLDS and full >= 1_000_000


def test_a_full_collection_waits_for_a_quiet_keyboard(restore_gc: None) -> None:
    clock = Clock()
    policy = GcPolicy(idle_s=2.0, min_interval_s=30.0, max_interval_s=300.0, clock=clock)
    assert not policy.tick()  # just started
    for _ in range(10):  # someone typing for 100 s: a key every 10 s... and every second
        for _ in range(10):
            clock.now += 1.0
            policy.saw_input()
            assert not policy.tick()
    clock.now += 1.0  # one quiet second: not yet
    assert not policy.tick()
    clock.now += 1.0  # two: now
    assert policy.tick() and policy.full_collections == 1 and policy.last_pause_s >= 0
    clock.now += 10.0  # quiet, but the last one is only 10 s old
    assert not policy.tick()
    clock.now += 20.0
    assert policy.tick() and policy.full_collections == 2


def test_garbage_is_bounded_even_if_the_keyboard_never_rests(restore_gc: None) -> None:
    clock = Clock()
    policy = GcPolicy(idle_s=2.0, min_interval_s=30.0, max_interval_s=300.0, clock=clock)
    policy.settle()
    ran = 0
    for _ in range(700):  # 700 s with a key every second
        clock.now += 1.0
        policy.saw_input()
        ran += policy.tick()
    assert ran == 2  # at 300 s and 600 s

    # what it collects is real cyclic garbage that the counters alone would leave alone now
    class Node:
        def __init__(self) -> None:
            self.me = self

    for _ in range(100):
        Node()
    clock.now += 300.0
    before = sum(1 for o in gc.get_objects() if type(o) is Node)
    assert before > 0
    assert policy.tick()
    assert sum(1 for o in gc.get_objects() if type(o) is Node) == 0


def test_young_collections_run_on_ticks_even_when_the_counters_stand_still(
        restore_gc: None) -> None:
    """Full rings: every new line frees an old one, so the allocation counter stands still
    and Python would never collect generation 0; the ticks do, so it stays small."""
    ring: deque[tuple[int, int, str, str]] = deque(maxlen=50_000)
    for i in range(50_000):
        ring.append((i, i, "out", f"old line {i}"))
    policy = GcPolicy(clock=Clock())
    policy.settle()
    generations: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        largest = 0
        for tick in range(20):  # 2 s of ticks, 5,000 lines each
            for i in range(5_000):
                ring.append((tick, i, "out", f"new line {tick} {i}"))
            largest = max(largest, len(gc.get_objects(0)))
            assert not policy.tick()
    finally:
        gc.callbacks.remove(record)
    assert largest < 10_000, largest  # one tick's lines, not the 100,000 appended
    assert generations.count(1) == 2 and generations.count(0) >= 18  # gen 1 every 10th tick
    assert policy.young_collections == 20 and policy.full_collections == 0


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def test_freed_heap_memory_goes_back_to_the_system_on_settle(restore_gc: None) -> None:
    """What the history load freed (many small heap blocks) is not kept by the process."""
    import ctypes

    # Keep glibc from trimming by itself, so what comes back is settle's doing.
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold = -1
    libc.mallopt(m_trim_threshold, 1 << 30)
    try:
        before = _rss_mib()
        blocks = [bytes(600) + i.to_bytes(4, "little") for i in range(200_000)]  # ~120 MiB
        grown = _rss_mib()
        del blocks
        freed_kept = _rss_mib()
        GcPolicy(clock=Clock()).settle()
        after = _rss_mib()
    finally:
        libc.mallopt(m_trim_threshold, 128 * 1024)
    assert grown - before > 80, (before, grown)
    assert freed_kept - before > 60, "glibc returned it by itself: the test proves nothing"
    assert after - before < 30, (before, grown, freed_kept, after)
