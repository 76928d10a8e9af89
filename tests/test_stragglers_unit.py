"""The straggler decision at its edges (diagnosis/stragglers.py): the 1.3x threshold, the
two windows in a row, the minimum median, and what group rank 0 does with members of the set
that no agent of the round wrote. The figures are literals: the docs promise 1.3, two windows
and 0.02, so a changed constant fails here rather than passing against itself."""

from __future__ import annotations

import asyncio
import logging
import math

from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.diagnosis import stragglers
from elastic_agent.supervision.diagnosis.stragglers import (
    StragglerWatch,
    member_share,
    named_after,
    slow_ranks,
)

MEDIAN = 0.5


def test_the_documented_constants():
    assert stragglers.THRESHOLD == 1.3
    assert stragglers.WINDOWS == 2
    assert stragglers.MIN_MEDIAN == 0.02


def test_1_29_times_the_median_is_not_slow_and_1_3_is():
    top = [(1, MEDIAN * 1.3), (2, MEDIAN * 1.29), (3, MEDIAN * 1.5), (4, MEDIAN)]
    assert slow_ranks(MEDIAN, top) == {1: 1.3, 3: 1.5}
    assert slow_ranks(MEDIAN, [(2, MEDIAN * 1.299)]) == {}
    assert slow_ranks(MEDIAN, [(1, MEDIAN * 1.1), (2, MEDIAN * 1.2)]) == {}


def test_no_rank_is_slow_while_the_median_is_below_the_minimum():
    # every rank waiting (a hang, stall.py's business): ratios are noise, nothing is decided
    assert slow_ranks(0.019, [(1, 0.019 * 10)]) == {}
    assert slow_ranks(0.02, [(1, 0.02 * 1.5)]) == {1: 1.5}


def test_one_slow_window_is_not_enough_two_in_a_row_are():
    streak, named = named_after({}, {3: 1.4})
    assert named == {} and streak == {3: 1}
    streak, named = named_after(streak, {3: 1.5})
    assert named == {3: 1.5} and streak == {3: 2}
    streak, named = named_after(streak, {3: 1.6, 5: 1.4})
    assert named == {3: 1.6} and streak == {3: 3, 5: 1}


def test_a_window_without_the_rank_ends_its_streak():
    streak, _ = named_after({}, {3: 1.4})
    streak, named = named_after(streak, {})  # fast again for a window
    assert named == {} and streak == {}
    streak, named = named_after(streak, {3: 1.4})
    assert named == {}  # one window again: not yet


def test_members_outside_the_world_and_odd_scores_are_refused():
    assert member_share(b"3", 0.5, 4) == (3, 0.5)
    assert member_share("0", 0.0, 1) == (0, 0.0)
    for member, score in ((b"4", 0.5), (b"424242", 0.9), (b"-1", 0.5), (b"x", 0.5),
                          (b"3.0", 0.5), (b"", 0.5), (b"1" * 40, 0.5), (b"3", math.inf),
                          (b"3", -math.inf), (b"3", math.nan), (b"3", 1.5), (b"3", -0.1),
                          (b"3", "x"), (b"3", None)):
        assert member_share(member, score, 4) is None, (member, score)


# -- group rank 0's decision against a real Redis ---------------------------------------------

def _decisions(redis_url: str, job_id: str, world: int,
               windows: list[dict[str, float]]) -> tuple[list[dict], StragglerWatch]:
    """Each window's shares written into the round's set, then one decision: the events."""
    emitted: list[dict] = []

    def emit(etype: str, **data: object) -> None:
        assert etype == EventType.STRAGGLER
        emitted.append(data)

    async def run() -> StragglerWatch:
        client = make_async_client(parse_endpoint(redis_url))
        watch = StragglerWatch(client, job_id, 5.0, emit)
        watch.world = world
        key = JobKeys(job_id).stragglers(0)
        try:
            for shares in windows:
                await client.zadd(key, shares)
                await watch.decide(0)
        finally:
            await client.delete(key)
            await client.aclose()
        return watch

    return emitted, asyncio.run(run())


def _even(world: int, **odd: float) -> dict[str, float]:
    shares = {str(r): MEDIAN for r in range(world)}
    shares.update({k.lstrip("r"): v for k, v in odd.items()})
    return shares


def test_the_watch_names_a_rank_at_1_3_after_two_windows_with_the_threshold(redis_url, job_id):
    window = _even(8, r5=MEDIAN * 1.3)
    events, _ = _decisions(redis_url, job_id, 8, [window, window])
    assert len(events) == 1, events
    (ev,) = events
    assert ev["threshold"] == 1.3 and ev["median_share"] == MEDIAN
    assert [(x["rank"], x["ratio"]) for x in ev["ranks"]] == [(5, 1.3)]


def test_the_watch_names_nobody_at_1_29_or_after_one_window(redis_url, job_id):
    below = _even(8, r5=MEDIAN * 1.29)
    assert _decisions(redis_url, job_id, 8, [below, below, below])[0] == []
    once = _even(8, r5=MEDIAN * 1.4)
    assert _decisions(redis_url, job_id, 8, [once, _even(8), once])[0] == []


def test_the_watch_names_nobody_while_the_median_is_below_the_minimum(redis_url, job_id):
    hung = {str(r): 0.01 for r in range(8)} | {"5": 0.2}  # 20x the median, but all wait
    assert _decisions(redis_url, job_id, 8, [hung, hung, hung])[0] == []


def test_forged_members_are_dropped_and_counted(redis_url, r, job_id, caplog):
    """The review's line on a one-rank job: ``ZADD stragglers:0 0.1 0 0.1 1 0.9 424242``. Rank
    424242 is no rank of the job: never named; the members no agent writes are removed and
    counted, with one warning line."""
    caplog.set_level(logging.WARNING, logger=stragglers.__name__)
    forged = {"0": 0.1, "1": 0.1, "424242": 0.9}
    events, watch = _decisions(redis_url, job_id, 1, [forged, forged, forged])
    assert events == []
    assert watch.dropped == 6  # "1" and "424242", written again before each decision
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dropped 2 member(s)" in warnings[0], warnings
    # A real rank's forged score and an outsider: dropped before the median is read again,
    # so the real straggler is still named, the drops counted in its event.
    window = _even(4, r3=MEDIAN * 1.6) | {"4": math.inf, "424242": 0.99}
    events, watch = _decisions(redis_url, job_id, 5, [window, window])
    assert [[x["rank"] for x in ev["ranks"]] for ev in events] == [[3]], events
    assert events[0]["dropped"] == 4 and watch.dropped == 4
    assert events[0]["median_share"] == MEDIAN
