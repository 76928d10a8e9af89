"""The Redis rendezvous against a real redis-server: rounds, ranks, last call, scale-up,
lost nodes, closing, leaving and timeouts."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.rendezvous.drivers import RedisRendezvous
from elastic_agent.coordination.rendezvous.types import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousProgress,
    RendezvousResult,
    RendezvousSettings,
    RendezvousTimeoutError,
)
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.keyspace import JobKeys
from tests.waiting import wait_until


class Nodes:
    """Rendezvous handles of one job, joined from threads like separate hosts."""

    def __init__(self, url: str, job: str) -> None:
        self.url, self.job = url, job
        self.handles: list[RedisRendezvous] = []

    def make(self, settings: RendezvousSettings) -> RedisRendezvous:
        h = RedisRendezvous(self.url, self.job, settings, local_addr="127.0.0.1")
        self.handles.append(h)
        return h

    def join_all(self, handles: list[RedisRendezvous], timeout: float = 20) -> list[RendezvousResult]:
        results: dict[int, RendezvousResult | BaseException] = {}

        def run(i: int) -> None:
            try:
                results[i] = handles[i].next_rendezvous()
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handles))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        assert len(results) == len(handles), "some nodes never returned"
        for r in results.values():
            if isinstance(r, BaseException):
                raise r
        return [results[i] for i in range(len(handles))]  # type: ignore[misc]

    def close(self) -> None:
        for h in self.handles:
            h.shutdown()


@pytest.fixture
def nodes(redis_url: str, job_id: str) -> Iterator[Nodes]:
    n = Nodes(redis_url, job_id)
    yield n
    n.close()


def fixed(n: int, **kw: float) -> RendezvousSettings:
    return RendezvousSettings(min_nodes=n, max_nodes=n, **kw)


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64])
def test_n_nodes_get_unique_ranks_and_one_master(nodes: Nodes, n: int) -> None:
    handles = [nodes.make(fixed(n)) for _ in range(n)]
    results = nodes.join_all(handles)
    assert sorted(r.group_rank for r in results) == list(range(n))
    assert {r.group_world_size for r in results} == {n}
    assert {r.round for r in results} == {0}
    assert len({(r.master_addr, r.master_port) for r in results}) == 1
    rank0 = next(h for h, r in zip(handles, results) if r.group_rank == 0)
    info = rank0.round_info()
    assert info is not None and info.nodes[0]["node"] == rank0.node_id
    # Group rank 0 alone holds the whole round (it announces it); the others never read it.
    assert rank0.last_round_info == info
    assert all(h.last_round_info is None for h in handles if h is not rank0)
    assert sorted(r.base_rank for r in results) == [0] * n  # (nproc 0: nodes said nothing)


def test_a_waiter_is_woken_by_the_completion(nodes: Nodes) -> None:
    # Nothing else wakes it for 30 s (one XREAD's block; no deadline or heartbeat expiry
    # sooner), so returning within t.join's 10 s means the completion woke it.
    first = nodes.make(fixed(2, last_call_timeout=60, heartbeat_timeout=60,
                             keep_alive_interval=30))
    done: list[RendezvousResult] = []
    t = threading.Thread(target=lambda: done.append(first.next_rendezvous()))
    t.start()
    wait_until(lambda: first.membership().members == [first.node_id], what="first join")
    nodes.make(fixed(2)).next_rendezvous()
    t.join(10)
    assert done, "the waiter was not woken by the completion"


def test_last_call_admits_late_nodes_then_completes(nodes: Nodes) -> None:
    # A join that waited out the 30 s last call would time out at 10 s instead.
    s = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=30, join_timeout=10)
    a, b, c = (nodes.make(s) for _ in range(3))
    results: dict[str, RendezvousResult] = {}
    threads = [threading.Thread(target=lambda h=h: results.__setitem__(h.node_id, h.next_rendezvous()))
               for h in (a, b)]
    for t in threads:
        t.start()
    wait_until(lambda: len(a.membership().members) == 2, what="two joined")
    assert not results, "min reached must open a last call, not complete at once"
    results[c.node_id] = c.next_rendezvous()  # arrives inside the last call
    for t in threads:
        t.join(15)
    assert {r.group_world_size for r in results.values()} == {3}
    assert len(results) == 3, "reaching max must complete without the last call"


def test_last_call_expires_with_min_nodes(nodes: Nodes) -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=4, last_call_timeout=0.8, join_timeout=10)
    started = time.monotonic()
    results = nodes.join_all([nodes.make(s), nodes.make(s)])
    took = time.monotonic() - started
    assert [r.group_world_size for r in results] == [2, 2]
    assert took >= 0.7, "min nodes must wait out the last call"


def test_progress_reports_joined_and_last_call(nodes: Nodes) -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.5)
    seen: list[RendezvousProgress] = []
    a = nodes.make(s)
    t = threading.Thread(target=lambda: a.next_rendezvous(progress=seen.append))
    t.start()
    wait_until(lambda: len(seen) >= 1, what="first progress")
    nodes.make(s).next_rendezvous()
    t.join(5)
    assert seen[0].joined == [a.node_id] and seen[0].last_call_left is None
    assert any(len(p.joined) == 2 and p.last_call_left is not None for p in seen)


def test_late_joiner_is_counted_then_admitted_keeping_ranks(nodes: Nodes) -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    a, b = nodes.make(s), nodes.make(s)
    first = nodes.join_all([a, b])
    ranks = {h.node_id: r.group_rank for h, r in zip((a, b), first)}
    assert a.num_nodes_waiting() == 0
    late = nodes.make(s)
    late_result: list[RendezvousResult] = []
    t = threading.Thread(target=lambda: late_result.append(late.next_rendezvous()))
    t.start()
    wait_until(lambda: a.num_nodes_waiting() == 1, what="late node counted")
    assert b.num_nodes_waiting() == 1
    second = nodes.join_all([a, b])
    t.join(5)
    assert late_result and late_result[0].round == 1 == second[0].round
    assert {r.group_world_size for r in second} == {3}
    assert {h.node_id: r.group_rank for h, r in zip((a, b), second)} == ranks
    assert late_result[0].group_rank == 2


def test_spare_beyond_max_is_not_counted(nodes: Nodes) -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=2, last_call_timeout=0.2)
    a, b = nodes.make(s), nodes.make(s)
    nodes.join_all([a, b])
    spare = nodes.make(s)

    def wait_as_spare() -> None:
        with contextlib.suppress(RendezvousClosedError):  # the fixture's shutdown ends the wait
            spare.next_rendezvous()

    t = threading.Thread(target=wait_as_spare, daemon=True)
    t.start()
    wait_until(lambda: spare.node_id in a.membership().waiting, what="spare waiting")
    assert a.num_nodes_waiting() == 0


def test_lost_node_is_declared_and_survivors_reform_without_last_call(nodes: Nodes) -> None:
    # Re-forming that waited out the 30 s last call would time out at 10 s instead.
    s = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=30, join_timeout=10,
                           heartbeat_timeout=1.0, keep_alive_interval=0.2)
    a, b, c = (nodes.make(s) for _ in range(3))
    nodes.join_all([a, b, c])
    assert a.membership().whole
    c._stop.set()  # c's host dies: its heartbeats stop, it never leaves
    wait_until(lambda: c.node_id in a.membership().lost, timeout=5, what="c declared lost")
    m = b.membership()
    assert not m.whole and m.lost == [c.node_id]
    assert a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1
    # Exactly one observer is told it is the first to see the loss.
    reports = [a.lost_since_last_check()[1], b.lost_since_last_check()[1]]
    assert sorted(map(len, reports)) == [0, 1] and c.node_id in reports[0] + reports[1]
    again = nodes.join_all([a, b])
    assert {r.group_world_size for r in again} == {2} and {r.round for r in again} == {1}
    c._client.close()


def _server_ms(r) -> int:
    secs, micros = r.time()
    return secs * 1000 + micros // 1000


def _restart_without(nodes: Nodes, s: RendezvousSettings, r, job_id: str
                     ) -> tuple[list[RedisRendezvous], RedisRendezvous, dict[str, RendezvousResult],
                                list[threading.Thread], int]:
    """Three nodes form round 0; two of them join round 1 while the third, still stopping its
    workers, beats (its heartbeat thread) and has not joined. Returns once round 1's last call
    is over (by Redis's clock) or the round completed."""
    a, b, c = (nodes.make(s) for _ in range(3))
    nodes.join_all([a, b, c])
    results: dict[str, RendezvousResult] = {}
    threads = [threading.Thread(target=lambda h=h: results.__setitem__(h.node_id,
                                                                      h.next_rendezvous()))
               for h in (a, b)]
    for t in threads:
        t.start()
    state = JobKeys(job_id).rdzv_state
    deadline = int(wait_until(lambda: int(r.hget(state, "deadline") or 0), 10, "round 1's last call"))
    wait_until(lambda: r.hget(state, "status") == b"complete" or _server_ms(r) > deadline + 500,
               10, "round 1 complete, or its last call over")
    return [a, b], c, results, threads, deadline


def test_a_reforming_round_waits_past_its_last_call_for_a_member_that_still_beats(
        nodes: Nodes, r, job_id: str) -> None:
    """A restart (a command, a failure) brings every live member of the round back, the slow
    one after its stacks and its workers' stop: completed without it at the last call, the
    round would leave it waiting and the job would re-form once more at once."""
    s = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.3, join_timeout=20,
                           heartbeat_timeout=10, keep_alive_interval=0.2)
    _, slow, results, threads, _ = _restart_without(nodes, s, r, job_id)
    assert r.hget(JobKeys(job_id).rdzv_state, "status") == b"open", (
        "the last call completed round 1 without a member that still beats")
    late = slow.next_rendezvous()
    for t in threads:
        t.join(10)
    assert len(results) == 2
    assert {x.round for x in (late, *results.values())} == {1}
    assert {x.group_world_size for x in (late, *results.values())} == {3}


def test_a_member_that_beats_and_never_comes_holds_the_round_one_heartbeat_timeout(
        nodes: Nodes, r, job_id: str) -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.3, join_timeout=20,
                           heartbeat_timeout=1.5, keep_alive_interval=0.2)
    first, slow, results, threads, deadline = _restart_without(nodes, s, r, job_id)
    for t in threads:
        t.join(10)
    assert {x.group_world_size for x in results.values()} == {2} and len(results) == 2
    completed = json.loads(r.get(JobKeys(job_id).rdzv_round_info))["completed_ms"]
    # Redis's clock: no sooner than the last call plus the heartbeat timeout (and the slow
    # node beat all along: it is not lost, only late).
    assert completed >= deadline + 1500, (completed, deadline)
    assert slow.node_id not in first[0].membership().lost


def test_a_beat_that_reaches_redis_late_judges_nobody(nodes: Nodes) -> None:
    """A beat with its summary, sent before an outage that cut every node off and delivered
    only when it ends (the kernel retransmits what the client gave up on), must not call the
    others lost: its own last beat is as stale as theirs, by Redis's clock."""
    s = RendezvousSettings(min_nodes=2, max_nodes=2, last_call_timeout=30, join_timeout=10,
                           heartbeat_timeout=1.0, keep_alive_interval=0.2)
    a, b = (nodes.make(s) for _ in range(2))
    nodes.join_all([a, b])
    for h in (a, b):
        h._stop.set()  # no beats of their own: this test sends them
    r = make_client(nodes.url)
    stale = int(r.zscore(a.keys.rdzv_heartbeats, a.node_id)) - 3000  # both cut off 3 s ago
    r.zadd(a.keys.rdzv_heartbeats, {a.node_id: stale, b.node_id: stale})
    a._renewal_done = time.monotonic()  # the client saw no outage: it decided to judge
    assert a._may_judge()
    m, newly = a.lost_since_last_check(beat=True)
    assert m.lost == [] and newly == [], "a late beat judged the others"
    assert not r.smembers(a.keys.rdzv_lost)
    assert not a._may_judge(), "judging again before the others had a heartbeat timeout to beat"
    # Once its own beats are fresh again and the others had their time, it judges.
    a._judge_after = 0.0
    a._renewal_done = time.monotonic()
    m, newly = a.lost_since_last_check(beat=True)
    assert m.lost == [b.node_id] and newly == [b.node_id]


def test_a_late_summary_behind_a_late_beat_of_the_same_node_judges_nobody(nodes: Nodes) -> None:
    """Both of a node's calls held up by one outage (Redis restarted, the network healed) run
    one after the other when it ends: the heartbeat thread's beat, then the loop's beat with
    its summary, decided before the outage. The first makes the node's beat in Redis fresh;
    the second must still judge nobody: the others had no time to beat again (seen in
    tests/test_partition.py's Redis restart: the group-rank-0 node called both others lost
    about one run in four)."""
    s = RendezvousSettings(min_nodes=2, max_nodes=2, last_call_timeout=30, join_timeout=10,
                           heartbeat_timeout=1.0, keep_alive_interval=0.2)
    a, b = (nodes.make(s) for _ in range(2))
    nodes.join_all([a, b])
    for h in (a, b):
        h._stop.set()  # no beats of their own: this test sends them
    r = make_client(nodes.url)
    now = int(r.zscore(a.keys.rdzv_heartbeats, a.node_id))
    # Cut off 3 s ago; a's client last saw its beat run then.
    r.zadd(a.keys.rdzv_heartbeats, {a.node_id: now - 3000, b.node_id: now - 3000})
    a._beat_server_ms = now - 3000
    a._renewal_done = time.monotonic()  # the client saw no outage: it decided to judge
    assert a._may_judge()
    sent = a._beat_server_ms
    # The thread's beat, run first (its reply not back yet when the summary was sent).
    r.zadd(a.keys.rdzv_heartbeats, {a.node_id: now})
    a._beat_server_ms = sent
    m, newly = a.lost_since_last_check(beat=True)
    assert m.lost == [] and newly == [], "a summary behind its node's own late beat judged"
    assert not r.smembers(a.keys.rdzv_lost)
    # In the normal course (the client saw its previous beat run a moment ago) it judges.
    a._judge_after = 0.0
    a._renewal_done = time.monotonic()
    m, newly = a.lost_since_last_check(beat=True)
    assert m.lost == [b.node_id] and newly == [b.node_id]


def test_the_heartbeat_thread_stays_quiet_while_the_loop_beats_with_its_summary(
        nodes: Nodes) -> None:
    """One script call per node and interval: while the node's loop beats with its summary
    every interval, the heartbeat thread sends nothing, whatever the two phases; once the
    loop stops, the thread beats again."""
    s = RendezvousSettings(min_nodes=1, max_nodes=1, heartbeat_timeout=4.0,
                           keep_alive_interval=0.4)
    h = nodes.make(s)
    nodes.join_all([h])
    # The join beat: the thread's next beat is an interval after it, not at its first tick
    # (nodes released together would all beat at once in the middle of their forming).
    assert not h._beat_due()
    beats: list[float] = []
    own = h.heartbeat
    h.heartbeat = lambda: (beats.append(time.monotonic()), own())[1]  # type: ignore[method-assign]
    # The loop's beats just after the thread's ticks: the phase at which a tick finds the
    # last beat nearly an interval old (the loop's own calls make its period a little longer).
    wait_until(lambda: beats, timeout=5, what="a beat of the thread")
    start = beats[-1] + 0.02
    beats.clear()
    for k in range(12):  # the loop: a summary with the beat in it, an interval apart
        time.sleep(max(0.0, start + 0.4 * k - time.monotonic()))
        h.lost_since_last_check(beat=True)
    assert beats == [], f"{len(beats)} beats of the thread while the loop beat every interval"
    wait_until(lambda: len(beats) >= 2, timeout=5, what="the thread beating on its own again")


def _join_and_hang(url: str, job: str, s: RendezvousSettings) -> None:
    RedisRendezvous(url, job, s, local_addr="127.0.0.1").next_rendezvous()


def test_dead_member_is_dropped_from_an_open_round(nodes: Nodes) -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=2, heartbeat_timeout=0.6,
                           keep_alive_interval=0.1)
    ctx = multiprocessing.get_context("fork")
    dead = ctx.Process(target=_join_and_hang, args=(nodes.url, nodes.job, s))
    dead.start()
    probe = nodes.make(s)
    wait_until(lambda: len(probe.membership().members) == 1, what="the doomed node joined")
    dead_id = probe.membership().members[0]
    os.kill(dead.pid, signal.SIGKILL)  # its host dies mid-rendezvous
    dead.join()
    wait_until(lambda: dead_id not in probe.membership().live, timeout=5, what="dead is stale")
    a, b = nodes.make(s), nodes.make(s)
    results = nodes.join_all([a, b])
    assert {r.group_world_size for r in results} == {2}
    info = a.round_info()
    assert info is not None and dead_id not in [n["node"] for n in info.nodes]


def test_closed_rendezvous_refuses_joins(nodes: Nodes) -> None:
    a = nodes.make(fixed(1))
    a.next_rendezvous()
    assert not a.is_closed()
    a.set_closed()
    assert a.is_closed()
    with pytest.raises(RendezvousClosedError, match="closed"):
        nodes.make(fixed(1)).next_rendezvous()


def test_closing_wakes_a_waiting_node(nodes: Nodes) -> None:
    waiter = nodes.make(fixed(2))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            waiter.next_rendezvous()
        except RendezvousClosedError as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: waiter.membership().members == [waiter.node_id], what="joined")
    nodes.make(fixed(2)).set_closed()
    t.join(2)
    assert errors and not t.is_alive()


def test_leaving_does_not_close_the_job(nodes: Nodes) -> None:
    s = RendezvousSettings(min_nodes=1, max_nodes=3, last_call_timeout=0.2)
    a, b = nodes.make(s), nodes.make(s)
    nodes.join_all([a, b])
    b.shutdown()
    assert not a.is_closed()
    m = a.membership()
    assert m.left == [b.node_id] and not m.whole
    assert a.num_nodes_waiting() == 1
    again = a.next_rendezvous()
    assert again.round == 1 and again.group_world_size == 1 and again.group_rank == 0


def test_join_timeout_says_who_is_missing(nodes: Nodes) -> None:
    a = nodes.make(RendezvousSettings(min_nodes=2, max_nodes=2, join_timeout=0.5))
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="1 of at least 2 nodes joined"):
        a.next_rendezvous()
    assert time.monotonic() - started < 3


def test_unreachable_redis_is_one_clear_error(job_id: str) -> None:
    h = RedisRendezvous(f"127.0.0.1:{free_port()}", job_id, fixed(1))
    with pytest.raises(RendezvousConnectionError, match=r"cannot reach Redis at redis://127\.0\.0\.1"):
        h.next_rendezvous()
    h._stop.set()


def test_key_slot_follows_the_cluster_spec() -> None:
    # The spec's own examples: CRC16/XMODEM of "123456789" is 0x31C3, and only what is
    # between the braces of a hash tag is hashed.
    assert key_slot(b"123456789") == 0x31C3
    assert key_slot(b"{user1000}.following") == key_slot(b"{user1000}.followers") \
        == key_slot(b"user1000")


def job_slots(r, job: str) -> set[int]:
    keys = list(r.scan_iter(match=f"*{job}*"))
    assert keys and all(k.decode().startswith(JobKeys(job).prefix) for k in keys), keys
    return {key_slot(k) for k in keys}


def test_every_key_is_in_the_jobs_hash_slot(nodes: Nodes, redis_url: str, r, job_id: str) -> None:
    # Two job ids share a slot 1 time in 16384: pick a second job that does not.
    other = next(o for o in (f"slot{i}-{uuid.uuid4().hex[:8]}" for i in range(100))
                 if key_slot(o.encode()) != key_slot(job_id.encode()))
    other_nodes = Nodes(redis_url, other)
    try:
        nodes.join_all([nodes.make(fixed(2)), nodes.make(fixed(2))])
        other_nodes.join_all([other_nodes.make(fixed(1))])
        slots, other_slots = job_slots(r, job_id), job_slots(r, other)
    finally:
        other_nodes.close()
    assert slots == {key_slot(job_id.encode())}, "a job's keys must all hash to its id's slot"
    assert other_slots == {key_slot(other.encode())}
    assert slots != other_slots


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max nodes"):
        RendezvousSettings(min_nodes=3, max_nodes=2)
    with pytest.raises(ValueError, match="keep_alive_interval"):
        RendezvousSettings(heartbeat_timeout=1, keep_alive_interval=2)


def test_joining_lists_the_job_in_the_index(nodes: Nodes, r, job_id: str) -> None:
    from elastic_agent.coordination.wire.keyspace import JOBS_INDEX

    nodes.make(fixed(1)).next_rendezvous()
    assert r.zscore(JOBS_INDEX, job_id) is not None
    assert r.hget(JobKeys(job_id).meta, "max_nodes") == b"1"


def test_heartbeats_outlive_a_refusal_such_as_oom(private_redis, job_id: str) -> None:
    """maxmemory with noeviction makes every write (the heartbeat script's too) fail with
    OOM; once memory is back the same node beats again, never having left its round."""
    from elastic_agent.coordination.transport.connection import make_client

    handle = RedisRendezvous(private_redis.url, job_id,
                             fixed(1, keep_alive_interval=0.05, heartbeat_timeout=5),
                             local_addr="127.0.0.1")
    admin = make_client(private_redis.url)
    try:
        handle.next_rendezvous()
        wait_until(lambda: handle.renewed_at is not None, 5, "a first heartbeat")
        admin.config_set("maxmemory-policy", "noeviction")

        def refused() -> int:  # this private server's count of writes refused with OOM
            return admin.info("errorstats").get("errorstat_OOM", {}).get("count", 0)

        before = refused()
        admin.config_set("maxmemory", "1")
        wait_until(lambda: refused() > before, 5, "a heartbeat refused with OOM")
        stalled = handle.renewed_at
        wait_until(lambda: refused() >= before + 3, 5, "several heartbeats refused")
        assert handle.renewed_at == stalled, "a refused beat counted as a renewal"
        refused_since = time.monotonic()
        admin.config_set("maxmemory", "0")
        wait_until(lambda: (handle.renewed_at or 0) > refused_since, 5,
                   "heartbeats after the OOM ended")
        assert handle._hb_thread is not None and handle._hb_thread.is_alive()
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
        handle.shutdown()


def test_a_node_with_beats_far_apart_still_judges() -> None:
    """Beats a keep-alive interval apart are never 'held up', whatever the heartbeat timeout
    allows: with keep_alive_interval=6 and heartbeat_timeout=10 (half the timeout is 5 s, less
    than the beats' own spacing) a node that only ever ran its loop would judge nobody."""
    s = RendezvousSettings(min_nodes=1, max_nodes=2, heartbeat_timeout=10.0,
                           keep_alive_interval=6.0)
    assert 1.5 * s.keep_alive_interval < s.held_gap <= s.heartbeat_timeout
    loose = RendezvousSettings(min_nodes=1, max_nodes=2, heartbeat_timeout=30.0,
                               keep_alive_interval=5.0)  # torch's own defaults
    assert loose.held_gap >= 2.25 * loose.keep_alive_interval
    default = RendezvousSettings(min_nodes=1, max_nodes=2)
    assert default.held_gap == default.heartbeat_timeout / 2


def test_scripts_survive_a_flushed_script_cache(private_redis, job_id: str) -> None:
    """Scripts go by hash after a handle's first call of each; a Redis that lost its script
    cache (a restart with the data kept, SCRIPT FLUSH, a failover to a replica that never
    ran them) answers NOSCRIPT, and the call goes again with the script's text."""
    handle = RedisRendezvous(private_redis.url, job_id, fixed(1), local_addr="127.0.0.1")
    admin = make_client(private_redis.url)
    try:
        handle.next_rendezvous()
        handle.lost_since_last_check(True)  # every script the loop uses: sent, known by hash
        admin.script_flush()
        before = admin.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0)
        m, _ = handle.lost_since_last_check(True)
        assert m.is_member and m.round == 0
        after = admin.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0)
        assert after == before + 1  # by hash first, then the text, once
        m, _ = handle.lost_since_last_check(True)  # and by hash again: Redis has it now
        assert admin.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0) == after
    finally:
        admin.close()
        handle.shutdown()


def test_a_big_round_wakes_nobody_for_its_last_call_and_still_completes(
        nodes: Nodes, r, job_id: str) -> None:
    """Past NAMES members, setting the last-call deadline wakes no waiter (that was N/2 joins
    more per round): the join that set it wakes at it and completes the round for everyone."""
    n = 20
    s = RendezvousSettings(min_nodes=n, max_nodes=2 * n, last_call_timeout=0.5)
    started = time.monotonic()
    results = nodes.join_all([nodes.make(s) for _ in range(n)])
    assert sorted(x.group_rank for x in results) == list(range(n))
    assert time.monotonic() - started >= 0.5  # the last call ran out: nobody else came
    kinds = [f[b"e"] for _, f in r.xrange(JobKeys(job_id).rdzv_notify)]
    assert b"deadline" not in kinds and kinds.count(b"complete") == 1


def test_a_round_opened_is_read_from_the_notify_stream(nodes: Nodes, r, job_id: str) -> None:
    """The agents' watch re-forms on the notify stream's "open" alone (no summary first):
    every other kind of entry leaves it watching."""
    from elastic_agent.coordination.rendezvous.types import opens_a_round

    a, b = nodes.make(fixed(2)), nodes.make(fixed(2))
    nodes.join_all([a, b])
    notify = JobKeys(job_id).rdzv_notify
    since = r.xrevrange(notify, count=1)[0][0]
    assert not opens_a_round(r.xrange(notify))  # the first round: only its completion
    def ask() -> None:  # a asks for round 1 (and is shut down waiting for it)
        with contextlib.suppress(RendezvousClosedError):
            a.next_rendezvous()

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    wait_until(lambda: opens_a_round(r.xrange(notify, min=b"(" + since)), 10, "an open entry")
    assert not opens_a_round([(b"1-0", {b"e": b"complete"}), (b"2-0", {b"e": b"left"})])
    assert not opens_a_round([(b"1-0", {})])
    a.shutdown()
    asking.join(10)


def test_group_rank_0_sends_the_whole_round_only_when_redis_lost_it(
        nodes: Nodes, r, job_id: str) -> None:
    """Group rank 0 holds the round (O(N) bytes) to put its record back; its beats say so
    in one byte, and the round itself goes out only after a beat found the record gone."""
    n = 32
    handles = [nodes.make(fixed(n)) for _ in range(n)]
    results = nodes.join_all(handles)
    rank0 = next(h for h, x in zip(handles, results) if x.group_rank == 0)
    other = next(h for h, x in zip(handles, results) if x.group_rank == 1)
    record = r.get(JobKeys(job_id).rdzv_round_info)
    assert record is not None and len(record) > 2000

    def sent(h: RedisRendezvous) -> int:  # bytes Redis read for one beat of h
        before = int(r.info("stats")["total_net_input_bytes"])
        h.heartbeat()
        return int(r.info("stats")["total_net_input_bytes"]) - before

    assert sent(rank0) < sent(other) + 200  # not the round's 2 KB and more
    r.delete(JobKeys(job_id).rdzv_round_info)
    other.heartbeat()
    assert r.get(JobKeys(job_id).rdzv_round_info) is None  # only its holder can put it back
    assert sent(rank0) > len(record)
    assert r.get(JobKeys(job_id).rdzv_round_info) == record


def test_a_state_another_writer_broke_is_one_clear_error(nodes: Nodes, r, job_id: str) -> None:
    handle = nodes.make(fixed(1))
    nodes.join_all([handle])
    r.hset(JobKeys(job_id).rdzv_state, "round", "not a number")
    with pytest.raises(RendezvousError, match=r"unreadable.*new --job-id"):
        handle.lost_since_last_check(True)
