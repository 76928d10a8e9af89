"""Elastic rendezvous native to Redis, with the contract of torch's ``RendezvousHandler``.

No torch here: ``torch_compat`` wraps :class:`RedisRendezvous` in torch's ABC.

The protocol
    A job has one rendezvous state (``JobKeys.rdzv_*``) changed only by Lua scripts, so
    every transition is atomic and timed by Redis server time. Rounds are numbered from 0.

    * A node joins the open round. Once ``min_nodes`` have joined, a last-call window of
      ``last_call_timeout`` admits more; reaching ``max_nodes`` completes the round at once.
      A later round (re-forming after a failure or a membership change) also completes as
      soon as every live node of the job has joined, since nobody else can come.
    * Completion assigns group ranks 0..N-1. A node that was in the previous round keeps its
      rank when that rank still fits; the others fill the gaps in join order. Group rank 0's
      address and the free port it picked at join time become MASTER_ADDR/MASTER_PORT.
    * A node that arrives after completion waits (``num_nodes_waiting`` counts it while the
      round has room; beyond ``max_nodes`` it waits as a spare). A member of the completed
      round that calls ``next_rendezvous`` again opens the next round.
    * Every node heartbeats into a sorted set scored with server time. A node whose
      heartbeats stop for ``heartbeat_timeout`` is lost: it is dropped from an open round and
      counted by ``num_nodes_waiting`` of a completed one, so the survivors re-form
      (torch's own handler never notices this, pytorch #111646; through torch's API,
      ``num_nodes_waiting(departures=False)``, neither does this one).
    * ``set_closed`` closes the job's rendezvous for everyone; ``shutdown`` only leaves (what
      elastic-agent's scale-down needs; torch's handler closes instead: torch_compat).

    Waiters are woken by a notify stream that every script appends to (XREAD BLOCK from the
    id the script returned, so no wake-up is lost); time-based transitions (last-call
    deadline, a heartbeat expiring) are handled by blocking exactly until the earliest one.

The modules
    * rendezvous_scripts: the Lua scripts (the protocol above, as Redis runs it) and their keys.
    * rendezvous_steps: a node's steps, as generators that yield the Redis calls they need: the
      decisions (when to wait and how long, whom to call lost, what a beat puts back), no I/O.
    * rendezvous_types: the settings, results, errors and the decoding of the scripts' replies.
    * this module: the two drivers that do the steps' I/O: :class:`RedisRendezvous` (blocking
      clients, heartbeats in a thread; torch's handler and the agent) and
      :class:`AsyncRedisRendezvous` (asyncio clients, heartbeats as a task; ``bench/fleet.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import redis

from ..transport.connection import explain_error, make_client
from ..transport.endpoints import Endpoint, parse_endpoint
from ..transport.pressure import OOM, is_oom
from ..wire.round_records import RoundInfo
from .scripts import SCRIPTS, SHAS, script_keys
from .steps import BLOCK_CHUNK_MS, RendezvousSteps, advance, command, one, script
from .types import (
    Membership,
    RendezvousConnectionError,
    RendezvousOutOfMemoryError,
    RendezvousProgress,
    RendezvousResult,
    RendezvousSettings,
    decode_membership,
    decode_round,
)

log = logging.getLogger(__name__)

BACKEND = "redis"

T = TypeVar("T")


class RedisRendezvous(RendezvousSteps):
    """One node's handle on a job's rendezvous. Thread-safe for the calls torch makes.

    ``next_rendezvous`` blocks until a round including this node completes and returns its
    group rank; it raises :class:`RendezvousClosedError` if the job's rendezvous is closed
    and :class:`RendezvousTimeoutError` after ``join_timeout``. Heartbeats start with the
    first join and stop with :meth:`shutdown` (or :meth:`stop_heartbeats`), or when the handle
    is garbage-collected: the thread holds it weakly, as torch's keep-alive timer holds its
    handler, so a handle dropped without a word goes quiet and its node is lost after the
    heartbeat timeout, like a dead host's; the clients it made are closed then too. The
    decisions are :class:`RendezvousSteps`'; this class does their I/O with blocking clients
    and beats from a thread.
    """

    def __init__(
        self,
        endpoint: Endpoint | str | None,
        job_id: str,
        settings: RendezvousSettings | None = None,
        *,
        local_addr: str | None = None,
        node_id: str | None = None,
        nproc: int = 0,
        node_rank: int | None = None,
        client: redis.Redis | None = None,
        reader: redis.Redis | None = None,
    ) -> None:
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
        super().__init__(job_id, settings, local_addr=local_addr, node_id=node_id,
                         nproc=nproc, node_rank=node_rank)
        self._client = client or make_client(self.endpoint)
        self._reader = reader or make_client(self.endpoint, blocking_ms=BLOCK_CHUNK_MS)
        self._owns_clients = client is None
        # Set before the beats start: the thread waits on the event, never on this handle.
        self._finalizer = weakref.finalize(
            self, _release, self._stop,
            (self._client, self._reader) if self._owns_clients else ())
        #: Scripts this handle has run: the first call of each sends its text (EVAL), later
        #: ones its hash. On a fresh Redis, N nodes released together would otherwise each
        #: get NOSCRIPT, load the script and call again: three commands instead of one.
        self._sent: set[str] = set()
        self._hb_thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- keys ---------------------------------------------------------------------------
    @property
    def _keys(self) -> list[str]:
        return script_keys(self.keys)

    @contextlib.contextmanager
    def _redis_errors(self) -> Iterator[None]:
        """Redis's errors as the rendezvous's: an outage is a RendezvousConnectionError, a
        write refused at maxmemory a RendezvousOutOfMemoryError (retried as an outage: a
        script is checked for memory at its first write, so a refused one changed nothing)."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise RendezvousConnectionError(str(explain_error(exc, self.endpoint.display))) from None
        except redis.ResponseError as exc:
            if not is_oom(exc):
                raise
            OOM.refused()
            raise RendezvousOutOfMemoryError(
                str(explain_error(exc, self.endpoint.display))) from None

    # -- I/O: the steps (rendezvous_steps) yield what they need; the driver does it ---
    def _drive(self, steps: Generator[Any, Any, T]) -> T:
        """Run ``steps`` with this handle's (synchronous) clients."""
        reply: Any = None
        error: BaseException | None = None
        while True:
            done, call = advance(steps, reply, error)
            if done:
                return call
            reply, error = None, None
            try:
                with self._redis_errors():
                    reply = self._dispatch(call)
            except (RendezvousConnectionError, redis.RedisError) as exc:
                error = exc  # the steps may handle it (or it comes back out of throw)

    def _dispatch(self, call: tuple[Any, ...]) -> Any:
        """Do ``call`` on this handle's clients (a coroutine when they are asyncio's)."""
        kind = call[0]
        if kind in ("script", "eval"):
            name, keys = call[1], self._keys
            if kind == "eval" or name not in self._sent:
                self._sent.add(name)
                return self._client.eval(SCRIPTS[name], len(keys), *keys, *call[2])
            # By hash, straight to the client: redis-py's Script object checks what kind of
            # client it runs on at every call, a tenth of a simulated node's CPU in the fleet.
            return self._client.evalsha(SHAS[name], len(keys), *keys, *call[2])
        if kind == "read":
            return self._reader.xread(call[1], count=1, block=call[2])
        if kind == "pipeline":
            pipe = self._client.pipeline(transaction=False)
            for _, method, args, kwargs in call[1]:
                getattr(pipe, method)(*args, **kwargs)
            return pipe.execute()
        return getattr(self._client, call[1])(*call[2], **call[3])

    def _call(self, name: str, args: list[Any]) -> Any:
        return self._drive(script(name, args))

    # -- the handler contract -----------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.job_id

    def next_rendezvous(
        self, progress: Callable[[RendezvousProgress], None] | None = None
    ) -> RendezvousResult:
        """Join the next round and block until it completes with this node in it.

        ``progress`` is called whenever the wait changes (members join, the last call
        starts), from this thread.
        """
        return self._drive(self._rendezvous_steps(progress))

    def round_info(self) -> RoundInfo | None:
        """The last completed round, every node of it: O(N) bytes, for readers and the node
        that announces the round, not for every node."""
        raw = self._drive(one(command("get", self.keys.rdzv_round_info)))
        return decode_round(raw) if raw else None

    def membership(self) -> Membership:
        """The job's rendezvous now, read atomically, every list in full: O(N), for tools
        and tests. A node's loop reads :meth:`lost_since_last_check`."""
        raw = self._call("membership", [int(self.settings.heartbeat_timeout * 1000)])
        return decode_membership(raw)

    def lost_since_last_check(self, beat: bool = False) -> tuple[Membership, list[str]]:
        """A summary of the membership (counts; at most ``NAMES`` nodes per list) plus the
        lost members that this call was first to see: O(log N) in the job's size.

        Exactly one caller across the job gets each lost node, so it alone reports it.
        A node that cannot judge now (see ``_may_judge``) calls nobody lost: ``lost`` is empty.

        ``beat``: the same call also beats, as :meth:`heartbeat` does (one script call a node
        makes every keep-alive interval instead of two); the heartbeat thread then skips the
        beat that is due, and beats by itself only when these calls stop coming.
        """
        return self._drive(self._lost_steps(beat))

    def num_nodes_waiting(self, departures: bool = True) -> int:
        """How many nodes want a new round: the agent should re-rendezvous when > 0.

        Counts late arrivals the completed round has room for, members lost or gone, and,
        when a newer round has opened without this node, everyone in it. ``departures=False``
        (torch's handler) counts only the nodes that asked to join: a member lost or gone
        frees its place for a late arrival but is nobody waiting.
        """
        return self.waiting_count(self._drive(self._summary_steps(mark_lost=False))[0],
                                  departures=departures)

    def is_closed(self) -> bool:
        return self._client.hget(self.keys.rdzv_state, "closed") == b"1"

    def set_closed(self) -> None:
        """Close the job's rendezvous for every node: no new round will start."""
        self._call("close", [])

    def shutdown(self) -> bool:
        """Leave the rendezvous (the others re-form without us: elastic-agent's scale-down),
        stop heartbeats and close the clients this handle made. torch's handler closes the
        rendezvous instead (torch_compat), as torch's c10d handler does."""
        self.stop_heartbeats()
        try:
            self._call("leave", [self.node_id, self.settings.min_nodes])
        except RendezvousConnectionError as exc:
            log.warning("could not leave the rendezvous cleanly: %s", exc)
            return False
        finally:
            self.close()
        return True

    def stop_heartbeats(self) -> None:
        """No more heartbeats, nothing said: to Redis this node is gone (a host that died)."""
        self._stop.set()
        thread = self._hb_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def close(self) -> None:
        """Stop beating and close the clients this handle made (the caller's stay open).
        Also done when the handle is garbage-collected."""
        self._finalizer()

    @property
    def use_agent_store(self) -> bool:
        # Workers build their own process group store on MASTER_ADDR:MASTER_PORT.
        return False

    # -- heartbeats ---------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Beat; if Redis lost the rendezvous while this node runs a round, put it back and
        list the job again (everything a reader needs of the rendezvous)."""
        self._drive(self._heartbeat_steps())

    def _start_heartbeats(self) -> None:
        with self._lock:
            if self._hb_thread is not None:
                return
            # The thread holds this handle weakly (see the class): a strong reference from a
            # thread that lives as long as the process would keep it, and its beats, forever.
            self._hb_thread = threading.Thread(
                target=_beat_while_held,
                args=(weakref.ref(self), self._stop, self.settings.keep_alive_interval),
                name=f"rdzv-heartbeat-{self.job_id}", daemon=True)
            self._hb_thread.start()

    def _beat_if_due(self, last_error: str) -> str:
        """One tick of the heartbeat thread; returns the failure's wording ('' if none)."""
        if not self._beat_due():
            return last_error
        try:
            self.heartbeat()
        except RendezvousOutOfMemoryError:
            return ""  # pressure.OOM reports the episode, for every writer at once
        except Exception as exc:  # the thread must outlive any refusal
            return self._heartbeat_failed(exc, last_error)
        return ""

    def _heartbeat_failed(self, exc: BaseException, last_error: str) -> str:
        """Keep trying, whatever Redis answers: an outage, or a refusal such as OOM
        (maxmemory with noeviction) that ends by itself, must not stop the beats and make
        the node look lost (and freeze its workers) once it is over. Says so once per kind
        of failure, not every interval; returns the failure's wording."""
        message = str(exc) if isinstance(exc, RendezvousConnectionError) else (
            str(explain_error(exc, self.endpoint.display)))
        if message != last_error:
            log.warning("heartbeat failed: %s", message)
        return message


def _beat_while_held(ref: weakref.ref[RedisRendezvous], stop: threading.Event,
                     interval: float) -> None:
    """The heartbeat thread: a beat when due at every tick, until ``stop`` is set or the
    handle is collected. The handle is held only for the tick's own call."""
    last_error = ""
    while not stop.wait(interval):
        node = ref()
        if node is None:
            return
        last_error = node._beat_if_due(last_error)
        del node  # not held while waiting for the next tick


def _release(stop: threading.Event, clients: tuple[redis.Redis, ...]) -> None:
    """A handle's end (:meth:`RedisRendezvous.close`, or its collection): no more beats,
    its own clients closed. Holds nothing of the handle itself (``weakref.finalize``)."""
    stop.set()
    for client in clients:
        with contextlib.suppress(Exception):  # closing a client that is gone already
            client.close()


class AsyncRedisRendezvous(RedisRendezvous):
    """The same rendezvous on an asyncio loop: the same steps and scripts, driven with
    asyncio clients (``client``; ``reader`` blocking longer than ``BLOCK_CHUNK_MS``), and
    heartbeats as a task instead of a thread. The calls a node makes are coroutines here.

    For many nodes in one process (``bench/fleet.py`` packs 2,048 into each), where a thread
    per node and a hop between threads per call would be the bench measuring itself. An agent
    (one node) keeps :class:`RedisRendezvous` in a thread, over its two connections
    (``supervision/redis_bridge.py``), as torch's handler contract is synchronous.
    """

    def __init__(self, endpoint: Endpoint | str | None, job_id: str,
                 settings: RendezvousSettings | None = None, *, client: Any, reader: Any,
                 **kwargs: Any) -> None:
        super().__init__(endpoint, job_id, settings, client=client, reader=reader, **kwargs)
        self._hb_task: asyncio.Task[None] | None = None

    async def _adrive(self, steps: Generator[Any, Any, T]) -> T:
        reply: Any = None
        error: BaseException | None = None
        while True:
            done, call = advance(steps, reply, error)
            if done:
                return call
            reply, error = None, None
            try:
                with self._redis_errors():
                    reply = await self._dispatch(call)
            except (RendezvousConnectionError, redis.RedisError) as exc:
                error = exc

    async def next_rendezvous(  # type: ignore[override]
            self, progress: Callable[[RendezvousProgress], None] | None = None
    ) -> RendezvousResult:
        return await self._adrive(self._rendezvous_steps(progress))

    async def heartbeat(self) -> None:  # type: ignore[override]
        await self._adrive(self._heartbeat_steps())

    async def lost_since_last_check(  # type: ignore[override]
            self, beat: bool = False) -> tuple[Membership, list[str]]:
        return await self._adrive(self._lost_steps(beat))

    async def shutdown(self) -> bool:  # type: ignore[override]
        """Leave the rendezvous and stop the heartbeats (the clients are the caller's)."""
        self.stop_heartbeats()
        try:
            await self._adrive(script("leave", [self.node_id, self.settings.min_nodes]))
        except RendezvousConnectionError as exc:
            log.warning("could not leave the rendezvous cleanly: %s", exc)
            return False
        return True

    def stop_heartbeats(self) -> None:
        """No more heartbeats, nothing said: to Redis this node is gone (a host that died)."""
        self._stop.set()
        if self._hb_task is not None:
            self._hb_task.cancel()

    def _start_heartbeats(self) -> None:
        if self._hb_task is None:
            self._hb_task = asyncio.get_running_loop().create_task(
                self._heartbeat_task(), name=f"rdzv-heartbeat-{self.node_id}")

    async def _heartbeat_task(self) -> None:
        last_error = ""
        while not self._stop.is_set():
            await asyncio.sleep(self.settings.keep_alive_interval)  # a beat is due
            if not self._beat_due():
                continue
            try:
                await self.heartbeat()
                last_error = ""
            except RendezvousOutOfMemoryError:
                last_error = ""  # pressure.OOM reports the episode
            except Exception as exc:  # the beats must outlive any refusal
                last_error = self._heartbeat_failed(exc, last_error)
