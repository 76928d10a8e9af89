"""The `redis` rendezvous handler as torch's own handler contract reads it, reached through
torch's registry as torchrun reaches it: ``shutdown`` closes the rendezvous, ``num_nodes_waiting``
counts only nodes that asked to join, a dropped handler stops beating, and the plugin finds its
Redis in ``$ELASTIC_REDIS_URL`` and its password where ``elastic-agent`` finds it."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_agent.coordination.rendezvous.drivers import RedisRendezvous
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.waiting import wait_until


class Handlers:
    """torch handlers of one job, each a node, joined from threads like separate hosts."""

    def __init__(self, redis_url: str, job: str) -> None:
        self.endpoint, self.job = redis_url.removeprefix("redis://"), job
        self.made: list[RendezvousHandler] = []

    def make(self, min_nodes: int = 2, max_nodes: int = 2, endpoint: str | None = None,
             **conf: str) -> RendezvousHandler:
        conf = {"last_call_timeout": "0.3", "join_timeout": "20", **conf}
        handler = get_rendezvous_handler(RendezvousParameters(
            backend="redis", endpoint=self.endpoint if endpoint is None else endpoint,
            run_id=self.job, min_nodes=min_nodes, max_nodes=max_nodes, local_addr="127.0.0.1",
            **conf))
        self.made.append(handler)
        return handler

    def form(self, handlers: list[RendezvousHandler]) -> list[int]:
        """Every handler's next_rendezvous, together; their group ranks."""
        ranks: dict[int, int | BaseException] = {}

        def run(i: int) -> None:
            try:
                ranks[i] = handlers[i].next_rendezvous().rank
            except BaseException as exc:
                ranks[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handlers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(ranks) == len(handlers), "some nodes never returned"
        for rank in ranks.values():
            if isinstance(rank, BaseException):
                raise rank
        return [ranks[i] for i in range(len(handlers))]  # type: ignore[misc]

    def in_background(self, handler: RendezvousHandler) -> threading.Thread:
        """``handler.next_rendezvous()`` in a daemon thread (a node waiting to join)."""
        def run() -> None:
            # Closed by the test's end: the wait is all that mattered.
            with contextlib.suppress(Exception):
                handler.next_rendezvous()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        for h in self.made:
            h.shutdown()


@pytest.fixture
def handlers(redis_url: str, job_id: str) -> Iterator[Handlers]:
    made = Handlers(redis_url, job_id)
    yield made
    made.close()


def core(handler: RendezvousHandler) -> RedisRendezvous:
    return handler.core  # type: ignore[attr-defined]


# -- shutdown ----------------------------------------------------------------------------

def test_shutdown_closes_the_rendezvous_for_every_node(handlers: Handlers, r) -> None:
    """torch's c10d handler closes the rendezvous in shutdown() (torchrun calls it when its
    agent ends): the others see it closed, not a membership change to restart for."""
    a, b = handlers.make(), handlers.make()
    handlers.form([a, b])
    beats = core(a)._hb_thread
    assert beats is not None and beats.is_alive()
    connections = {str(core(a)._client.client_id()), str(core(a)._reader.client_id())}
    assert a.shutdown() is True
    assert handlers.make().is_closed()  # a fresh handler on the same run id
    assert b.is_closed()
    assert b.num_nodes_waiting() == 0
    assert not beats.is_alive()
    assert not connections & {str(c["id"]) for c in r.client_list()}, "its clients stayed open"


def test_shutdown_says_false_when_redis_is_gone(private_redis: RedisServer, job_id: str) -> None:
    made = Handlers(private_redis.url, job_id)
    a = made.make(1, 1)
    made.form([a])
    private_redis.stop()
    started = time.monotonic()
    assert a.shutdown() is False
    assert time.monotonic() - started < 20  # the clients' retries, not a hang
    assert not core(a)._hb_thread.is_alive()  # type: ignore[union-attr]


def test_elastic_agent_still_leaves_on_shutdown(handlers: Handlers) -> None:
    """The core under the handler is what elastic-agent drives: its shutdown() leaves (its
    elastic scale-down relies on it), the job stays open and the others see the departure."""
    a, b = handlers.make(1, 3), handlers.make(1, 3)
    handlers.form([a, b])
    assert core(b).shutdown()
    assert not a.is_closed()
    assert core(a).membership().left == [core(b).node_id]
    assert core(a).num_nodes_waiting() == 1  # elastic-agent's count: re-form without b
    assert a.num_nodes_waiting() == 0  # torch's: nobody asked to join


# -- num_nodes_waiting -------------------------------------------------------------------

def test_a_late_joiner_with_room_is_counted(handlers: Handlers) -> None:
    a, b = handlers.make(2, 3), handlers.make(2, 3)
    handlers.form([a, b])
    assert a.num_nodes_waiting() == 0
    handlers.in_background(handlers.make(2, 3))
    wait_until(lambda: a.num_nodes_waiting() == 1, what="late node counted")
    assert b.num_nodes_waiting() == 1


def test_a_late_joiner_without_room_is_not_counted(handlers: Handlers) -> None:
    a, b = handlers.make(), handlers.make()
    handlers.form([a, b])
    spare = handlers.make()
    handlers.in_background(spare)
    wait_until(lambda: core(spare).node_id in core(a).membership().waiting, what="spare waiting")
    assert a.num_nodes_waiting() == 0


def test_a_lost_node_is_not_counted_but_frees_its_place(handlers: Handlers) -> None:
    """torch's handler never counts a node whose keep-alives stopped (its survivors do not
    restart for it); it drops it from the participants, so a node that comes to replace it
    is counted as a late arrival with room."""
    conf = {"heartbeat_timeout": "1", "keep_alive_interval": "0.2"}
    a, b = handlers.make(**conf), handlers.make(**conf)
    handlers.form([a, b])
    core(b).stop_heartbeats()  # b's host dies: no beats, no word
    wait_until(lambda: core(a).membership().lost == [core(b).node_id], timeout=5,
               what="b lost")
    assert a.num_nodes_waiting() == 0
    assert core(a).num_nodes_waiting() >= 1  # elastic-agent re-forms without it
    handlers.in_background(handlers.make(**conf))
    wait_until(lambda: a.num_nodes_waiting() == 1, what="the replacement counted")


def test_a_newer_round_counts_its_members(handlers: Handlers) -> None:
    """A node whose workers failed calls next_rendezvous again and opens a round: the others
    count it as waiting and restart to join it, as torch's agents do."""
    a, b = handlers.make(), handlers.make()
    handlers.form([a, b])
    handlers.in_background(a)
    wait_until(lambda: b.num_nodes_waiting() >= 1, what="the newer round counted")


# -- the keep-alive thread ---------------------------------------------------------------

def test_a_dropped_handler_stops_beating_and_its_node_is_lost(handlers: Handlers,
                                                              r) -> None:
    conf = {"heartbeat_timeout": "3", "keep_alive_interval": "0.5"}
    a, b = handlers.make(**conf), handlers.make(**conf)
    handlers.form([a, b])
    handlers.made.remove(a)
    node = core(a).node_id
    beats = core(a)._hb_thread
    assert beats is not None and beats.is_alive()
    connections = {str(core(a)._client.client_id()), str(core(a)._reader.client_id())}
    collected = weakref.ref(core(a))
    del a
    gc.collect()
    assert collected() is None, "the core outlived its handler"
    dropped = time.monotonic()
    wait_until(lambda: node in core(b).membership().lost, timeout=3 + 2, what="the node lost")
    assert time.monotonic() - dropped >= 2  # lost by its heartbeats' age, not by a word
    beats.join(2)
    assert not beats.is_alive()
    assert not connections & {str(c["id"]) for c in r.client_list()}, "its clients stayed open"


def test_use_agent_store_is_false(handlers: Handlers) -> None:
    """As torch's abstract handler (only c10d's says True): torch's agent then builds the
    workers' store on MASTER_ADDR:MASTER_PORT instead of handing them the rendezvous's."""
    assert handlers.make(1, 1).use_agent_store is False


# -- the endpoint ------------------------------------------------------------------------

def test_no_endpoint_means_elastic_redis_url(private_redis: RedisServer, job_id: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate launch gives no --rdzv-endpoint on one machine: the plugin reads
    $ELASTIC_REDIS_URL, as elastic-agent does, never the default port."""
    assert private_redis.port != 6379
    monkeypatch.setenv("ELASTIC_REDIS_URL", private_redis.url)
    made = Handlers(private_redis.url, job_id)
    try:
        a = made.make(1, 1, endpoint="")
        assert made.form([a]) == [0]
        other = make_client(private_redis.url)
        assert other.hget(JobKeys(job_id).rdzv_state, "status") == b"complete"
        other.close()
    finally:
        made.close()


def test_the_password_comes_from_rediscli_auth(private_redis: RedisServer, job_id: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    password = "s3cret with space"
    admin = make_client(private_redis.url)
    admin.config_set("requirepass", password)
    admin.close()
    monkeypatch.setenv("ELASTIC_REDIS_URL", private_redis.url)
    monkeypatch.setenv("REDISCLI_AUTH", password)
    made = Handlers(private_redis.url, job_id)
    try:
        for endpoint in ("", private_redis.url.removeprefix("redis://")):
            a = made.make(1, 1, endpoint=endpoint)
            assert made.form([a]) == [0]
            assert password not in repr(core(a).endpoint)
            made.close()
            made.made.clear()
            made.job = job_id + "b"
    finally:
        made.close()


# -- --rdzv-conf -------------------------------------------------------------------------

def test_keep_alive_max_attempt_sets_the_heartbeat_timeout(handlers: Handlers) -> None:
    """torch's dynamic rendezvous calls a node dead after keep_alive_max_attempt missed
    keep-alives: the heartbeat timeout is that many intervals, unless given itself."""
    h = handlers.make(1, 1, keep_alive_interval="0.5", keep_alive_max_attempt="4")
    assert core(h).settings.heartbeat_timeout == 2.0
    h = handlers.make(1, 1, keep_alive_interval="0.5", keep_alive_max_attempt="4",
                      heartbeat_timeout="3")
    assert core(h).settings.heartbeat_timeout == 3.0
    with pytest.raises(ValueError, match="keep_alive_max_attempt='many' is not a whole number"):
        handlers.make(1, 1, keep_alive_max_attempt="many")
