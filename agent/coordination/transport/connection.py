"""Redis clients for agents and consoles: timeouts, retries, one connection, what errors mean.

Two kinds of client, because one setting cannot serve both:

* writers (``make_client``) fail fast on a dead socket and retry with backoff;
* blocking readers (``make_client(blocking_ms=...)``) need a socket timeout longer than their
  ``XREAD BLOCK``: redis-py 8's 5 s default turns a long block into a ``TimeoutError``.

Every client speaks RESP2 so replies have one shape on Redis 6.2 and 7.x and on every
redis-py version, and returns bytes (store values are binary).

The endpoint comes from :mod:`.endpoints` (parsing, passwords, redaction: no message here
shows a password); a Sentinel service's client is built in :mod:`.sentinel`, a Redis
Cluster's in :mod:`.cluster`, and :func:`make_client` picks one by the endpoint. An asyncio
client may be held to one connection (:func:`priority`, :class:`_OneConnectionGate`), and
:func:`explain_error` turns any failure into one sentence that says where, what and what to try.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
import socket
from collections import deque
from collections.abc import Iterator
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .cluster import _AsyncClusterRedis, _cluster_client, _ClusterRedis, is_cluster_endpoint
from .endpoints import (
    DEFAULT_PORT,
    PASSWORD_ENV,
    SENTINEL_SCHEMES,
    Endpoint,
    _bracket,
    parse_endpoint,
    redact,
)
from .send_path import use_lean_connections
from .sentinel import _AsyncSentinelRedis, _sentinel_master, _SentinelRedis


class RedisUnavailableError(ConnectionError):
    """Redis cannot be reached or refused us. The message says where, what, and what to try."""


def _client_kwargs(
    ep: Endpoint,
    blocking_ms: int | None,
    retries: int,
    connect_timeout: float,
    socket_timeout: float,
    max_connections: int | None,
    retry_cls: Any,
) -> dict[str, Any]:
    timeout = socket_timeout if blocking_ms is None else blocking_ms / 1000.0 + 10.0
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout,
        "socket_timeout": timeout,
        "socket_keepalive": True,
        "retry": retry_cls(ExponentialBackoff(cap=1.0, base=0.05), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, socket.timeout],
        "health_check_interval": 30,
        "protocol": 2,
        "decode_responses": False,
    }
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if ep.url.startswith("unix://"):
        for k in ("socket_keepalive", "health_check_interval"):
            kwargs.pop(k)
    return kwargs


def make_client(
    endpoint: Endpoint | str | None,
    *,
    blocking_ms: int | None = None,
    retries: int = 6,
    connect_timeout: float = 5.0,
    socket_timeout: float = 10.0,
    max_connections: int | None = None,
) -> redis.Redis:
    """A client for ``endpoint``.

    ``blocking_ms``: the longest ``BLOCK`` this client will send; its socket timeout is set
    well past it so a quiet stream is not mistaken for a dead server.
    ``retries``: how many times a command is retried on a connection error, with exponential
    backoff from 50 ms up to 1 s (negative: forever, for readers that must ride out an outage).
    """
    ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
    kwargs = _client_kwargs(ep, blocking_ms, retries, connect_timeout, socket_timeout,
                            max_connections, Retry)
    if ep.url.startswith(SENTINEL_SCHEMES):
        return _sentinel_master(ep, kwargs, asynchronous=False)
    if is_cluster_endpoint(ep, connect_timeout):
        return _cluster_client(ep, kwargs, asynchronous=False)
    return redis.Redis.from_url(ep.url, **kwargs)


_timeout = getattr(asyncio, "timeout", None)  # Python 3.11 on


async def wait_set(event: asyncio.Event, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` s passed (None: no limit). Under a deadline
    rather than ``wait_for``, which on Python 3.11 runs the wait as a task of its own: one
    more task and turn of the loop for every wake of every reader."""
    if _timeout is None:  # Python 3.10
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        return
    with contextlib.suppress(TimeoutError):
        async with _timeout(timeout):
            await event.wait()


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was asked to stop.

    redis-py's asyncio client can swallow a cancellation that lands at the wrong moment of a
    command (seen with 8.1 in about one XREAD in a hundred, cancelled at random times): the
    command returns as if nothing happened and the task, still marked as cancelling, runs on;
    a loop of reads then never ends (a Ctrl-C that did not stop ``logs --follow``). Every loop
    of awaited Redis calls calls this once per turn, so a stop request is honoured within one
    call's timeout. A task that caught a cancellation on purpose must ``uncancel()`` it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def make_async_client(
    endpoint: Endpoint | str | None,
    *,
    blocking_ms: int | None = None,
    retries: int = 6,
    connect_timeout: float = 5.0,
    socket_timeout: float = 10.0,
    max_connections: int | None = None,
    client_name: str | None = None,
    one_connection: bool = False,
) -> aioredis.Redis:
    """The asyncio twin of :func:`make_client`, with the same timeouts and retry policy.

    ``client_name``: each connection names itself so (``CLIENT SETNAME``) when the server
    lets it; a user whose ACL refuses it stays anonymous rather than unable to connect.
    ``one_connection``: the client never holds more than one connection (per master of a
    Redis Cluster): concurrent commands and pipelines take turns on it, those sent under
    :func:`priority` first (see :class:`_OneConnectionGate`)."""
    from redis.asyncio.retry import Retry as AsyncRetry

    ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
    kwargs = _client_kwargs(ep, blocking_ms, retries, connect_timeout, socket_timeout,
                            max_connections, AsyncRetry)
    if ep.url.startswith(SENTINEL_SCHEMES):
        client = _sentinel_master(ep, kwargs, asynchronous=True)
    elif is_cluster_endpoint(ep, connect_timeout):
        client = _cluster_client(ep, kwargs, asynchronous=True)
        if client_name is not None:
            _name_cluster_connections(client, client_name)
        if one_connection:
            _gate_cluster_client(client, _OneConnectionGate())
        return client
    else:
        client = aioredis.Redis.from_url(ep.url, **kwargs)
    use_lean_connections(client.connection_pool)
    if client_name is not None:
        _name_connections(client.connection_pool, client_name)
    if one_connection:
        _gate_pool(client.connection_pool, _OneConnectionGate())
    return client


# -- one connection per client ----------------------------------------------------------------

_PRIORITY: contextvars.ContextVar[bool] = contextvars.ContextVar("elastic_redis_priority",
                                                                 default=False)


@contextlib.contextmanager
def priority() -> Iterator[None]:
    """Commands sent from this context go ahead of the others waiting for a one-connection
    client (``make_async_client(one_connection=True)``): the agent's heartbeats and
    rendezvous calls are not held up behind a queue of log batches."""
    token = _PRIORITY.set(True)
    try:
        yield
    finally:
        _PRIORITY.reset(token)


class _OneConnectionGate:
    """Lets one command (or pipeline) at a time use a client's connection: waiters marked
    with :func:`priority` first, each kind in arrival order. A connection pool lets every
    concurrent command open a connection of its own; the agent has many concurrent tasks and
    4,096 agents would hold ten thousands of connections."""

    def __init__(self) -> None:
        self._busy = False
        self._high: deque[asyncio.Future[None]] = deque()
        self._low: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if not self._busy:
            self._busy = True
            return
        fut = asyncio.get_running_loop().create_future()
        (self._high if _PRIORITY.get() else self._low).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed over just as the waiter was cancelled: pass it on
            raise

    def release(self) -> None:
        for queue in (self._high, self._low):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)  # handed over: still busy
                    return
        self._busy = False


def _gate_pool(pool: Any, gate: _OneConnectionGate) -> None:
    """Put ``gate`` in front of ``pool`` (any asyncio pool: plain, SSL, Sentinel): with one
    holder at a time the pool never opens a second connection.

    The one connection stays out of the pool between commands while it is connected: the
    pool's own checkout (a lock, metrics, a connect through the retry policy, a probe for
    stray data) cost about a third of a command's CPU in redis-py 8, and 2,048 agents in one
    bench process pay it every command. What the probe guards against cannot happen here:
    redis-py disconnects a connection whose reply was not read (an error or a cancellation
    mid-command), and a connection that is not connected goes back through the pool."""
    get, put = pool.get_connection, pool.release
    held: list[Any] = []  # the connection kept out of the pool, once there is one

    async def get_connection(*args: Any, **kwargs: Any) -> Any:
        await gate.acquire()
        try:
            if held:
                connection = held[0]
                if connection.is_connected and not _should_reconnect(connection):
                    return connection
                held.clear()
                await put(connection)  # the pool reconnects it (or a fresh one) below
            connection = await get(*args, **kwargs)
        except BaseException:
            gate.release()  # redis-py's own release of a failed connection is not gated
            raise
        held.append(connection)
        return connection

    async def release(connection: Any) -> None:
        if not held or held[0] is not connection:
            await put(connection)  # the pool's own, from inside a failed get: not gated
            return
        try:
            if not connection.is_connected or _should_reconnect(connection):
                held.clear()
                await put(connection)
        finally:
            gate.release()

    pool.get_connection = get_connection
    pool.release = release


def _should_reconnect(connection: Any) -> bool:
    check = getattr(connection, "should_reconnect", None)  # redis-py >= 6 (maintenance)
    return bool(check()) if check is not None else False


def _gate_cluster_client(client: Any, gate: _OneConnectionGate) -> None:
    """:func:`_gate_pool` for an asyncio cluster client, which has no pool: one command or
    pipeline at a time, so each master it talks to has at most one connection of it."""
    execute, make_pipeline = client.execute_command, client.pipeline

    async def execute_command(*args: Any, **kwargs: Any) -> Any:
        await gate.acquire()
        try:
            return await execute(*args, **kwargs)
        finally:
            gate.release()

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make_pipeline(*args, **kwargs)
        run = pipe.execute

        async def gated(*a: Any, **kw: Any) -> Any:
            await gate.acquire()
            try:
                return await run(*a, **kw)
            finally:
                gate.release()

        pipe.execute = gated
        return pipe

    client.execute_command = execute_command
    client.pipeline = pipeline


def _name_connections(pool: Any, name: str) -> None:
    """Make every connection ``pool`` opens from now on name itself ``name``, if allowed.
    redis-py's own ``client_name`` fails the connection when SETNAME is refused."""
    pool.connection_class = _named_class(pool.connection_class, name)


def _named_class(base: Any, name: str) -> Any:
    class Named(base):  # type: ignore[misc,valid-type]
        async def on_connect_check_health(self, check_health: bool = True) -> None:
            await super().on_connect_check_health(check_health)
            with contextlib.suppress(redis.ResponseError):
                await self.send_command("CLIENT", "SETNAME", name, check_health=False)
                await self.read_response()

    Named.__name__ = Named.__qualname__ = f"Named{base.__name__}"
    return Named


def _name_cluster_connections(client: Any, name: str) -> None:
    """:func:`_name_connections` for every node of an asyncio cluster client, present and
    future (nodes are made from the client's connection settings as the slot map names them)."""
    named = _named_class(client.connection_kwargs["connection_class"], name)
    client.connection_kwargs["connection_class"] = named
    client.nodes_manager.connection_kwargs["connection_class"] = named
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = named


def socket_timeout_of(client: Any) -> float | None:
    """The socket timeout of ``client``'s connections (``None``: none)."""
    if isinstance(client, redis.cluster.RedisCluster):
        kw = client.nodes_manager.connection_kwargs
    elif isinstance(client, aioredis.cluster.RedisCluster):
        kw = client.connection_kwargs
    else:
        kw = client.connection_pool.connection_kwargs
    return kw.get("socket_timeout")


def describe_endpoint(client: redis.Redis) -> str:
    """The endpoint a client talks to, password-free, for messages."""
    if isinstance(client, (_SentinelRedis, _AsyncSentinelRedis, _ClusterRedis,
                           _AsyncClusterRedis)):
        return client.endpoint_display
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    scheme = "rediss" if client.connection_pool.connection_class.__name__.startswith("SSL") else "redis"
    return f"{scheme}://{_bracket(str(kw.get('host', '?')))}:{kw.get('port', DEFAULT_PORT)}"


def explain_error(exc: BaseException, where: str) -> RedisUnavailableError:
    """Turn a redis-py exception into one clear sentence: which endpoint, what failed, what to try."""
    detail = redact(str(exc)).rstrip(".") or type(exc).__name__
    if isinstance(exc, (redis.sentinel.MasterNotFoundError,
                        aioredis.sentinel.MasterNotFoundError)):
        detail, hint = _explain_no_master(detail)
    elif "without any password configured" in detail:
        hint = f"this server takes no password: drop it from the URL or unset ${PASSWORD_ENV}"
    elif "NOAUTH" in detail or "Authentication required" in detail:
        hint = f"this server needs a password: give it in ${PASSWORD_ENV} (or in the URL)"
    elif isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in detail:
        hint = (f"check the user and password (in the Redis URL, ${PASSWORD_ENV} or the "
                f"password file)")
    elif isinstance(exc, redis.exceptions.AskError):  # MOVED too: a cluster seen as one server
        kind = "MOVED" if isinstance(exc, redis.exceptions.MovedError) else "ASK"
        detail = f"{kind} {detail}"  # redis-py keeps only "<slot> <host:port>"
        hint = ("this server is a node of a Redis Cluster, which was not recognised (its "
                "INFO refused?): name it redis+cluster://host:port")
    elif isinstance(exc, redis.exceptions.NoPermissionError) or (
            isinstance(exc, redis.ResponseError) and "NOPERM" in detail):
        hint = "the Redis user lacks a permission this command needs (check its ACL)"
    elif isinstance(exc, (redis.TimeoutError, socket.timeout)):
        hint = "check that the host is reachable and not firewalled"
    elif isinstance(exc, redis.OutOfMemoryError):
        # Not a reachability problem (and the message's "script: ..., on @user_script:N"
        # looks like a password to redact()): say what it is.
        return RedisUnavailableError(
            f"Redis at {redact(where)} is out of memory (maxmemory reached) and refuses "
            "writes; free memory on the server or raise its maxmemory")
    else:
        hint = ("check that redis-server is running there and that --redis points to it "
                "(or use --standalone to start one)")
    return RedisUnavailableError(f"cannot reach Redis at {redact(where)}: {detail}; {hint}")


def _explain_no_master(detail: str) -> tuple[str, str]:
    # redis-py names each sentinel that failed by the repr of its client (hundreds of
    # characters of settings) and each error by its kind only ("network:ConnectionError").
    failures = re.findall(r"host=([^,)>]+),port=(\d+).*?\)> - (\w+):(\w+)", detail)
    service = re.search(r"for ('[^']*')", detail)
    said = f"no sentinel named a master for {service.group(1) if service else 'the service'}"
    if not failures:
        return said, ("the sentinels answered but know no healthy master for this service: "
                      "check the service name (as in 'sentinel monitor NAME ...'), or a "
                      "failover is under way")
    said += " (" + ", ".join(f"{h}:{p}: {kind} error" for h, p, kind, _ in failures) + ")"
    if any(kind == "auth" for _, _, kind, _ in failures):
        return said, ("the sentinels refused the login: their password goes in the URL as "
                      "sentinel_password= (the userinfo and $REDISCLI_AUTH are the master's)")
    return said, ("check that the sentinels run at those addresses (port 26379 unless given) "
                  "and, for rediss+sentinel://, the TLS settings")


def connect(endpoint: Endpoint | str | None, **kwargs: Any) -> redis.Redis:
    """``make_client`` and a PING, so an unreachable server is one clear error up front."""
    ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
    kwargs.setdefault("retries", 2)
    try:
        # Inside: a cluster client reads the slot map as it is made, and may fail there.
        client = make_client(ep, **kwargs)
    except (redis.RedisError, OSError) as exc:
        raise explain_error(exc, ep.display) from None
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        client.close()
        raise explain_error(exc, ep.display) from None
    return client
