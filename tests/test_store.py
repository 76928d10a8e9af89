"""RedisStore, barrier and synchronize against a real redis-server (the conftest fixtures)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis

from elastic_agent.coordination.ports import free_port
from elastic_agent.coordination.store import (
    RedisStore,
    StoreQueueEmptyError,
    StoreTimeoutError,
    StoreTooManyKeysError,
)
from elastic_agent.coordination.store_collectives import barrier, synchronize
from elastic_agent.coordination.transport.connection import RedisUnavailableError, make_client
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.waiting import client_ids, wait_until


def blocked_xreads(r: redis.Redis) -> int:
    """How many clients are blocked in XREAD right now (the store's blocking wait)."""
    return sum(1 for c in r.client_list() if c.get("cmd") == "xread" and "b" in c.get("flags", ""))


class Worker(threading.Thread):
    """Runs ``fn`` in a thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc

    def outcome(self, timeout: float = 10.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "worker thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def store(redis_url: str, job_id: str) -> Iterator[RedisStore]:
    s = RedisStore(redis_url, job_id, "test", timeout=5)
    yield s
    s.close()


# -- basic operations ------------------------------------------------------------------


def test_set_get_bytes_and_str(store: RedisStore) -> None:
    store.set("a", b"\x00\xffbinary")
    store.set("b", "text é")
    store.set(b"c", bytearray(b"ba"))
    assert store.get("a") == b"\x00\xffbinary"
    assert store.get("b") == "text é".encode()
    assert store.get("c") == b"ba"
    store.set("a", b"")  # an empty value is a value: the key exists
    assert store.get("a") == b""
    assert store.check(["a"])


def test_bad_values_and_keys_raise_type_error(store: RedisStore) -> None:
    with pytest.raises(TypeError, match="'k'"):
        store.set("k", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'m'"):
        store.multi_set(["m"], [None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="key must be str or bytes"):
        store.set(3, b"v")  # type: ignore[arg-type]
    assert store.num_keys() == 0


def test_add(store: RedisStore) -> None:
    assert store.add("n", 1) == 1
    assert store.add("n", 41) == 42
    assert store.add("n", -2) == 40
    assert store.add("n", 0) == 40
    assert store.get("n") == b"40"
    store.set("s", "17")  # a value set as text is an integer too, as in TCPStore
    assert store.add("s", 1) == 18


def test_add_on_non_integer_is_value_error_naming_key(store: RedisStore) -> None:
    store.set("word", b"hello")
    with pytest.raises(ValueError, match="'word'"):
        store.add("word", 1)
    assert store.get("word") == b"hello"
    with pytest.raises(TypeError, match="'n'"):
        store.add("n", 1.5)  # type: ignore[arg-type]


def test_compare_set_four_cases(store: RedisStore) -> None:
    # missing key, expected empty: set desired
    assert store.compare_set("k1", b"", b"first") == b"first"
    assert store.get("k1") == b"first"
    # missing key, expected non-empty: nothing set, expected returned
    assert store.compare_set("k2", b"x", b"y") == b"x"
    assert not store.check(["k2"])
    # current == expected: set desired
    assert store.compare_set("k1", "first", "second") == b"second"
    assert store.get("k1") == b"second"
    # current != expected: unchanged, current returned
    assert store.compare_set("k1", b"nope", b"third") == b"second"
    assert store.get("k1") == b"second"


def test_append(store: RedisStore) -> None:
    store.append("log", b"ab")
    store.append("log", "cd")
    assert store.get("log") == b"abcd"


def test_delete_num_keys_check(store: RedisStore) -> None:
    assert store.num_keys() == 0
    store.multi_set(["a", "b", "c"], [b"1", b"2", b"3"])
    assert store.num_keys() == 3
    assert store.check(["a", "b"])
    assert not store.check(["a", "zz"])
    assert store.check([])
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert not store.check(["a"])
    assert store.num_keys() == 2
    assert store.delete_keys(["b", "c", "missing"]) == 2
    assert store.num_keys() == 0


def test_multi_set_and_multi_get(store: RedisStore) -> None:
    store.multi_set(["x", "y"], [b"1", "2"])
    assert store.multi_get(["y", "x", "y"]) == [b"2", b"1", b"2"]
    assert store.multi_get([]) == []
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])


def test_namespaces_are_separate(redis_url: str, job_id: str) -> None:
    with RedisStore(redis_url, job_id, "one") as a, RedisStore(redis_url, job_id, "two") as b:
        a.set("k", b"a")
        assert not b.check(["k"])
        b.set("k", b"b")
        assert a.get("k") == b"a"
        assert a.num_keys() == b.num_keys() == 1


def test_keys_live_under_the_job_prefix(store: RedisStore, r: redis.Redis, job_id: str) -> None:
    store.set("a", b"1")
    store.add("n", 1)
    store.append("l", b"x")
    store.compare_set("c", b"", b"v")
    keys = JobKeys(job_id)
    pattern = keys.all_key_patterns()[0]
    found = {k.decode() for k in r.scan_iter(match=pattern)}
    assert found == {keys.store("test"), keys.store_notify("test")}
    everywhere = {k.decode() for k in r.scan_iter(match="*") if job_id.encode() in k}
    assert everywhere == found
    assert all(k.startswith(f"elastic:{{{job_id}}}:") for k in found)
    assert r.hgetall(keys.store("test")) == {b"a": b"1", b"n": b"1", b"l": b"x", b"c": b"v"}
    assert r.type(keys.store_notify("test")) == b"stream"


# -- blocking waits --------------------------------------------------------------------


def test_get_blocks_until_another_thread_sets(
    store: RedisStore, redis_url: str, job_id: str, r: redis.Redis
) -> None:
    # Its own deadline is a minute away and one XREAD blocks for 30 s: returning within
    # outcome()'s 10 s means the write woke it.
    waiter = Worker(lambda: store.get("late", timeout=60))
    waiter.start()
    wait_until(lambda: blocked_xreads(r) >= 1, what="the get blocking in XREAD")
    assert waiter.is_alive()
    with RedisStore(redis_url, job_id, "test") as other:
        other.set("late", b"here")
    assert waiter.outcome(10) == b"here"


def test_unrelated_writes_do_not_end_a_wait(store: RedisStore, r: redis.Redis) -> None:
    waiter = Worker(lambda: store.wait(["target"], timeout=5))
    waiter.start()
    wait_until(lambda: blocked_xreads(r) >= 1, what="the wait blocking")
    for i in range(20):
        store.set(f"noise{i}", b"x")
    wait_until(lambda: blocked_xreads(r) >= 1, what="the wait blocking again")
    assert waiter.is_alive()
    store.set("target", b"1")
    waiter.outcome()


def test_wait_for_several_keys_set_by_several_threads(store: RedisStore) -> None:
    keys = [f"k{i}" for i in range(5)]
    waiter = Worker(lambda: store.wait(keys, timedelta(seconds=5)))
    waiter.start()
    setters = [Worker(lambda k=k: store.set(k, k)) for k in keys]
    for s in setters:
        s.start()
    for s in setters:
        s.outcome()
    waiter.outcome()
    assert store.multi_get(keys) == [k.encode() for k in keys]


def test_multi_get_blocks_until_all_exist(store: RedisStore, r: redis.Redis) -> None:
    store.set("a", b"1")
    waiter = Worker(lambda: store.multi_get(["a", "b"]))
    waiter.start()
    wait_until(lambda: blocked_xreads(r) >= 1, what="multi_get blocking")
    store.set("b", b"2")
    assert waiter.outcome() == [b"1", b"2"]


def test_get_timeout_names_the_key(store: RedisStore, job_id: str) -> None:
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.get("never", timeout=0.3)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 2.0
    assert isinstance(info.value, TimeoutError)
    assert str(info.value) == (
        f"timeout after 0.3 s waiting for key(s) 'never' in store namespace 'test' "
        f"of job '{job_id}'"
    )
    assert info.value.keys == ["never"]


def test_wait_timeout_names_only_missing_keys(store: RedisStore) -> None:
    store.set("here", b"1")
    with pytest.raises(StoreTimeoutError, match=r"waiting for key\(s\) 'a', 'b' in") as info:
        store.wait(["a", "here", "b"], timeout=timedelta(seconds=0.2))
    assert "'here'" not in str(info.value)


def test_multi_get_timeout_names_keys(store: RedisStore) -> None:
    store.set("x", b"1")
    with pytest.raises(StoreTimeoutError, match=r"'y'") as info:
        store.multi_get(["x", "y"], timeout=0.2)
    assert info.value.keys == ["y"]


def test_set_timeout(store: RedisStore) -> None:
    store.set_timeout(0.2)
    assert store.timeout == timedelta(seconds=0.2)
    assert store.timeout_seconds == 0.2
    with pytest.raises(StoreTimeoutError, match=r"after 0\.2 s"):
        store.get("missing")
    store.set_timeout(timedelta(milliseconds=150))
    assert store.timeout_seconds == 0.15
    with pytest.raises(StoreTimeoutError, match=r"after 0\.15 s"):
        store.wait(["missing"])
    with pytest.raises(ValueError, match="negative"):
        store.set_timeout(-1)


def test_zero_timeout_waits_without_deadline(store: RedisStore, r: redis.Redis) -> None:
    waiter = Worker(lambda: store.get("k", timeout=0))
    waiter.start()
    wait_until(lambda: blocked_xreads(r) >= 1, what="the get blocking")
    store.set("k", b"v")
    assert waiter.outcome() == b"v"


def test_long_wait_loops_over_block_chunks(
    redis_url: str, job_id: str, r: redis.Redis
) -> None:
    # A reader whose socket timeout is 1.1 s can block only ~0.1 s per XREAD: the wait
    # must chain blocks (re-sending its last id) until the key shows up.
    writer = make_client(redis_url)
    reader = redis.Redis.from_url(redis_url, socket_timeout=1.1, protocol=2)
    store = RedisStore.from_clients(writer, reader, job_id, "chunks", timeout=10)
    before = int(r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))
    waiter = Worker(lambda: store.get("k"))
    waiter.start()
    wait_until(
        lambda: int(r.info("commandstats")["cmdstat_xread"]["calls"]) >= before + 3,
        what="three XREAD chunks",
    )
    assert waiter.is_alive()
    store.set("k", b"v")
    assert waiter.outcome() == b"v"
    store.close()  # leaves the caller's clients open
    assert writer.ping()
    writer.close()
    reader.close()


def test_clone_shares_the_namespace(store: RedisStore) -> None:
    twin = store.clone()
    try:
        twin.set("k", b"v")
        assert store.get("k") == b"v"
        assert twin.timeout == store.timeout
    finally:
        twin.close()


def test_redis_unreachable_is_one_clear_error(job_id: str) -> None:
    port = free_port()  # nothing listens there
    store = RedisStore(f"127.0.0.1:{port}", job_id, "test", timeout=1)
    with pytest.raises(RedisUnavailableError) as info:
        store.set("k", b"v")
    message = str(info.value)
    assert message.startswith(f"cannot reach Redis at redis://127.0.0.1:{port}: ")
    assert "redis-server is running" in message
    store.close()


def test_blocking_wait_on_unreachable_redis_is_not_a_timeout(job_id: str) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    store = RedisStore.from_clients(make_client(url, retries=0),
                                    make_client(url, retries=0, blocking_ms=1000),
                                    job_id, "test", timeout=1)
    with pytest.raises(RedisUnavailableError, match=f"127.0.0.1:{port}"):
        store.get("k")


# -- barrier and synchronize -----------------------------------------------------------


def test_barrier_four_threads_reused(redis_url: str, job_id: str, r: redis.Redis) -> None:
    stores = [RedisStore(redis_url, job_id, "bar", timeout=10) for _ in range(4)]
    passed: list[tuple[int, int]] = []
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        for generation in range(2):
            barrier(stores[rank], 4, "sync", timeout=10, rank=rank)
            with lock:
                passed.append((generation, rank))

    workers = [Worker(lambda rank=rank: rank_main(rank)) for rank in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.outcome()
    # Nobody passed the second barrier before everybody passed the first.
    generations = [g for g, _ in passed]
    assert generations == sorted(generations)
    assert sorted(passed) == [(g, rank) for g in range(2) for rank in range(4)]
    assert stores[0].get("sync/arrivals") == b"8"
    # Completing generation 1 cleaned up generation 0.
    fields = {f.decode() for f in r.hkeys(JobKeys(job_id).store("bar"))}
    assert not any(f.startswith("sync/0/") for f in fields)
    assert "sync/1/done" in fields
    for s in stores:
        s.close()


def test_barrier_timeout_names_missing_ranks(store: RedisStore) -> None:
    workers = [
        Worker(lambda rank=rank: barrier(store, 4, "b", timeout=0.5, rank=rank))
        for rank in (0, 2)
    ]
    for w in workers:
        w.start()
    for w in workers:
        with pytest.raises(StoreTimeoutError) as info:
            w.outcome()
        assert str(info.value) == (
            "barrier 'b': timeout after 0.5 s: 2 of 4 ranks arrived; missing ranks: 1, 3"
        )


def test_barrier_timeout_without_ranks_counts_arrivals(store: RedisStore) -> None:
    with pytest.raises(StoreTimeoutError, match=r"1 of 3 ranks arrived$"):
        barrier(store, 3, "anon", timeout=0.2)


def test_barrier_of_one_returns_at_once(private_redis: RedisServer, job_id: str) -> None:
    # "At once": the only caller completes its generation itself, so it never blocks on the
    # server (a server of the test's own, so that no other client's XREAD is counted).
    r = make_client(private_redis.url)
    with RedisStore(private_redis.url, job_id, "test", timeout=5) as store:
        for _ in range(2):
            barrier(store, 1, "solo", rank=0)
        assert store.check(["solo/1/done"]) and not store.check(["solo/0/done"])
    xreads = r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)
    r.close()
    assert xreads == 0, f"a barrier of one waited in XREAD {xreads} times"


def test_synchronize_gathers_in_rank_order_twice(store: RedisStore) -> None:
    world = 3

    def rank_main(rank: int) -> list[list[bytes]]:
        return [
            synchronize(store, f"r{rank}g{g}".encode(), rank, world, "gather", timeout=10)
            for g in range(2)
        ]

    workers = [Worker(lambda rank=rank: rank_main(rank)) for rank in reversed(range(world))]
    for w in workers:
        w.start()
    expected = [[f"r{rank}g{g}".encode() for rank in range(world)] for g in range(2)]
    for w in workers:
        assert w.outcome() == expected
    # The round-0 data was deleted by the call that completed round 1.
    assert not store.check(["gather/0/data/0"])
    assert store.check(["gather/1/data/0"])


def test_synchronize_timeout_names_missing_ranks(store: RedisStore) -> None:
    with pytest.raises(StoreTimeoutError) as info:
        synchronize(store, b"x", 1, 3, "sy", timeout=0.2)
    assert str(info.value) == (
        "synchronize 'sy': timeout after 0.2 s: 1 of 3 ranks arrived; missing ranks: 0, 2"
    )


# -- list_keys -------------------------------------------------------------------------


def test_list_keys_lists_exactly_the_namespace(redis_url: str, job_id: str) -> None:
    with RedisStore(redis_url, job_id, "mine") as mine, \
            RedisStore(redis_url, job_id, "other") as other:
        assert mine.list_keys() == []
        mine.multi_set(["a", "b/c", "é"], [b"1", b"", b"3"])
        mine.add("n", 1)
        mine.queue_push("q", b"a queue is no key")
        other.set("elsewhere", b"x")
        assert sorted(mine.list_keys()) == sorted(["a", "b/c", "é", "n"])
        assert other.list_keys() == ["elsewhere"]
        mine.delete_key("a")
        assert sorted(mine.list_keys()) == sorted(["b/c", "é", "n"])


def test_list_keys_pages_through_a_big_namespace(private_redis: RedisServer,
                                                 job_id: str) -> None:
    # More keys than one HSCAN step visits: the listing is several short calls, never one
    # HKEYS/HGETALL that holds Redis for the whole namespace.
    r = make_client(private_redis.url)
    names = [f"rank/{i}" for i in range(2500)]
    with RedisStore(private_redis.url, job_id, "big", timeout=5) as store:
        store.multi_set(names, [b"v" * 100] * len(names))
        r.config_resetstat()
        listed = store.list_keys()
    stats = r.info("commandstats")
    r.close()
    assert len(listed) == len(names) and set(listed) == set(names)
    assert int(stats["cmdstat_hscan"]["calls"]) >= 3, stats.get("cmdstat_hscan")
    assert "cmdstat_hkeys" not in stats and "cmdstat_hgetall" not in stats


def test_list_keys_refuses_more_than_its_bound(store: RedisStore, job_id: str) -> None:
    store.multi_set([f"k{i}" for i in range(11)], [b"v"] * 11)
    assert len(store.list_keys(max_keys=11)) == 11
    with pytest.raises(StoreTooManyKeysError) as info:
        store.list_keys(max_keys=10)
    assert str(info.value).startswith(
        f"store namespace 'test' of job '{job_id}' holds 11 keys, more than the 10 one "
        "list_keys call returns")


# -- queues ----------------------------------------------------------------------------


def test_queue_is_first_in_first_out(store: RedisStore) -> None:
    assert store.queue_len("q") == 0
    store.queue_push("q", b"one")
    store.queue_push("q", "two")
    store.queue_push(b"q", bytearray(b"\x00three"))
    assert store.queue_len("q") == 3
    assert [store.queue_pop("q") for _ in range(3)] == [b"one", b"two", b"\x00three"]
    assert store.queue_len("q") == 0


def test_queue_pop_without_blocking_on_an_empty_queue(store: RedisStore, job_id: str) -> None:
    started = time.monotonic()
    with pytest.raises(StoreQueueEmptyError) as info:
        store.queue_pop("empty", block=False)
    assert time.monotonic() - started < 1.0  # at once, not after the store's 5 s
    assert str(info.value) == f"queue 'empty' in store namespace 'test' of job '{job_id}' is empty"
    store.queue_push("empty", b"x")
    assert store.queue_pop("empty", block=False) == b"x"


def test_queue_pop_times_out(store: RedisStore) -> None:
    store.set_timeout(0.2)
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.queue_pop("q")
    assert 0.2 <= time.monotonic() - started < 2.0
    assert "waiting for a value in queue 'q'" in str(info.value)
    assert info.value.keys == ["q"]
    with pytest.raises(StoreTimeoutError, match=r"after 0\.1 s"):
        store.queue_pop("q", timeout=timedelta(milliseconds=100))


def test_blocked_queue_pop_is_woken_by_a_push(
    store: RedisStore, redis_url: str, job_id: str, r: redis.Redis
) -> None:
    # Its deadline is a minute away and one XREAD blocks for 30 s: returning within
    # outcome()'s 10 s means the push woke it, not a poll.
    waiter = Worker(lambda: store.queue_pop("jobs", timeout=60))
    waiter.start()
    wait_until(lambda: blocked_xreads(r) >= 1, what="the pop blocking in XREAD")
    with RedisStore(redis_url, job_id, "test") as other:
        other.set("jobs", b"a key of the same name is no push")
        wait_until(lambda: blocked_xreads(r) >= 1, what="the pop blocking again")
        assert waiter.is_alive()
        other.queue_push("jobs", b"work")
    assert waiter.outcome(10) == b"work"
    assert store.queue_len("jobs") == 0


def test_each_pushed_value_goes_to_one_pop(store: RedisStore, r: redis.Redis) -> None:
    waiters = [Worker(lambda: store.queue_pop("shared", timeout=10)) for _ in range(3)]
    for w in waiters:
        w.start()
    wait_until(lambda: blocked_xreads(r) >= 3, what="three pops blocking")
    for value in (b"a", b"b", b"c"):
        store.queue_push("shared", value)
    assert sorted(w.outcome() for w in waiters) == [b"a", b"b", b"c"]


def test_zero_timeout_pop_waits_without_deadline(store: RedisStore, r: redis.Redis) -> None:
    waiter = Worker(lambda: store.queue_pop("q", timeout=0))
    waiter.start()
    wait_until(lambda: blocked_xreads(r) >= 1, what="the pop blocking")
    store.queue_push("q", b"v")
    assert waiter.outcome() == b"v"


def test_queues_are_no_keys_and_live_in_the_job_slot(store: RedisStore, r: redis.Redis,
                                                     job_id: str) -> None:
    store.queue_push("q", b"v")
    store.set("k", b"1")
    assert not store.check(["q"])
    assert store.num_keys() == 1 and store.list_keys() == ["k"]
    keys = JobKeys(job_id)
    queue_key = keys.store_queue("test", "q")
    assert queue_key.startswith(f"elastic:{{{job_id}}}:")  # the job's hash tag: its slot
    assert r.type(queue_key) == b"list" and r.lrange(queue_key, 0, -1) == [b"v"]
    # No namespace and queue name another's key, nor a namespace's own keys.
    assert keys.store_queue("a:1", "b") != keys.store_queue("a", "1:b")
    assert queue_key not in {keys.store("test"), keys.store_notify("test")}
    with RedisStore(store.endpoint, job_id, "elsewhere") as other:
        assert other.queue_len("q") == 0


# -- short waits end on the client's clock ---------------------------------------------


@pytest.fixture
def hz10_redis() -> Iterator[RedisServer]:
    """Redis's default hz, set explicitly: a blocked command's own timeout fires on its tick."""
    server = RedisServer(extra_args=["--hz", "10"]).start()
    yield server
    server.cleanup()


def _overshoots_ms(call: Callable[[float], Any], seconds: float, n: int) -> list[float]:
    late = []
    for _ in range(n):
        started = time.perf_counter()
        with pytest.raises(StoreTimeoutError):
            call(seconds)
        late.append((time.perf_counter() - started - seconds) * 1000)
    return late


def test_short_waits_end_near_their_timeout_whatever_the_hz(hz10_redis: RedisServer,
                                                            job_id: str) -> None:
    # With hz 10 the server ends a blocked XREAD up to 100 ms late (waits of 10 ms came back
    # after ~100 ms, of 50 ms after ~100 ms). The bound is generous for a loaded machine and
    # still far below that; bench/store_wait_bench.py has the figures.
    r = make_client(hz10_redis.url)
    assert r.config_get("hz") == {"hz": "10"}
    with RedisStore(hz10_redis.url, job_id, "short", timeout=5) as store:
        calls: dict[str, Callable[[float], Any]] = {
            "wait": lambda s: store.wait(["never"], s),
            "get": lambda s: store.get("never", timeout=s),
            "multi_get": lambda s: store.multi_get(["never", "nor"], timeout=s),
            "queue_pop": lambda s: store.queue_pop("never", timeout=s),
        }
        for name, call in calls.items():
            for seconds in (0.01, 0.05):
                late = sorted(_overshoots_ms(call, seconds, 9))
                assert late[len(late) // 2] < 30, (name, seconds, late)
        # Each wait dropped its connection at the deadline: closed, not leaked (the store
        # holds its writer's and its reader's), and the next read reconnects.
        mine = str(r.client_id())
        wait_until(lambda: len([c for c in r.client_list() if str(c["id"]) != mine]) <= 2,
                   what="the dropped connections closed")
        store.set("here", b"v")
        assert store.get("here", timeout=0.05) == b"v"
        waiter = Worker(lambda: store.get("later", timeout=30))
        waiter.start()
        wait_until(lambda: blocked_xreads(r) >= 1, what="a get blocking after the drops")
        store.set("later", b"w")
        assert waiter.outcome() == b"w"
    r.close()


def test_a_wait_that_ran_out_drops_its_blocked_connection(hz10_redis: RedisServer,
                                                          job_id: str) -> None:
    # At its deadline the wait's XREAD is still blocked on the server (its reply comes on
    # the next hz tick): that connection cannot carry another command, so it is closed.
    r = make_client(hz10_redis.url)
    with RedisStore(hz10_redis.url, job_id, "drop", timeout=5) as store:
        waiter = Worker(lambda: store.wait(["never"], 0.5))
        waiter.start()
        blocked = wait_until(lambda: [c["id"] for c in r.client_list()
                                      if c.get("cmd") == "xread" and "b" in c["flags"]],
                             what="the wait blocking in XREAD")
        with pytest.raises(StoreTimeoutError):
            waiter.outcome()
        wait_until(lambda: blocked[0] not in client_ids(r), what="the blocked connection closed")
        assert store.check([]) and not store.check(["never"])  # the store goes on
    r.close()
