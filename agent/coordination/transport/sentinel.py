"""Redis Sentinel: a client of the master that the sentinels name, followed through failovers.

``redis+sentinel://[user:pass@]host:port[,host:port...]/service[?db=N]``
(sentinel port 26379 by default; ``rediss+sentinel://`` for TLS to the sentinels and the
servers alike, with ``rediss://``'s ``ssl_*`` query parameters) names Redis Sentinels and the
service they watch (parsed in :mod:`.endpoints`). A client asks them for the master on every
(re)connect and, while it uses a connection, every ``MASTER_CHECK_S``; a connection error,
READONLY or a blocked read cut by a demotion is retried by the usual policy against whatever
master they name then. The userinfo (or ``$REDISCLI_AUTH``, or the password file) is the
master's credential, exactly as for ``redis://``. Sentinels usually run without a password;
ones with a ``requirepass`` of their own get ``sentinel_password=`` (and ``sentinel_username=``
for an ACL user) in the query (percent-encoded), masked wherever the URL is shown; to keep it
out of argv, put the whole URL in ``$ELASTIC_REDIS_URL``. What a failover loses: replication is
asynchronous, so writes the old master acknowledged but had not yet sent to a replica; and
writes a master demoted while still reachable acknowledged before clients moved (within about
``MASTER_CHECK_S`` of the switch).
"""

from __future__ import annotations

import inspect
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel
import redis.connection
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from .endpoints import _SENTINEL_AUTH_KEYS, Endpoint, _split_scheme, redact_endpoint

#: How often a connection in use asks the sentinels whether it still talks to the master.
#: A master demoted while reachable (a manual ``SENTINEL FAILOVER``, a healed partition) keeps
#: acknowledging writes until Sentinel reconfigures it, some 10 s later here, and those writes
#: are then lost with its data set; this bounds that window to about this long.
MASTER_CHECK_S = 1.0
# After a check that was slow (sentinels not answering): wait longer, so that unreachable
# sentinels cost a stall now and then, not one before every command while Redis itself works.
_MASTER_CHECK_SLOW_S = 0.5
_MASTER_CHECK_BACKOFF_S = 10.0


def _cut_by_demotion(exc: redis.ResponseError) -> bool:
    # What a blocked XREAD gets when its master turns replica under it (Redis 7.0:
    # "UNBLOCKED force unblock from blocking operation, instance state changed (master ->
    # replica?)"): the read was not refused, the server moved, so it is an outage to retry.
    text = str(exc)
    return text.startswith("UNBLOCKED") and "instance state changed" in text


_MOVED = "the sentinels name another master now (a failover)"


def _same_address(address: Any, host: Any, port: Any) -> bool:
    return (str(address[0]), int(address[1])) == (str(host), int(port))


def _next_check(started: float) -> float:
    now = time.monotonic()
    return now + (_MASTER_CHECK_BACKOFF_S if now - started > _MASTER_CHECK_SLOW_S
                  else MASTER_CHECK_S)


class _SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """A connection to the master that the sentinels name, asked again on every (re)connect
    and every ``MASTER_CHECK_S`` while in use.

    redis-py 8.1 asks them only in ``connect()``; a command retried on the connection it
    failed on is re-sent through ``send_packed_command``, which redials the address it had:
    a reader blocked on a master that died retried there forever (seen with retries=-1),
    never reaching the new master. redis-py turns READONLY from a demoted master into a
    ConnectionError; this does the same for a blocked read that the demotion cut, which
    would otherwise reach readers as a plain ResponseError and end them."""

    _check_at = 0.0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock and self.connection_pool.is_master and time.monotonic() >= self._check_at:
            self._check_master()
        if not self._sock:
            self.connect()
            self._check_at = time.monotonic() + MASTER_CHECK_S
        super().send_packed_command(command, check_health)

    def _check_master(self) -> None:
        started = time.monotonic()
        try:
            address = self.connection_pool.get_master_address()
        except redis.ConnectionError:
            # No sentinel answered, or none names a healthy master (a failover under way):
            # the connection in hand is the best guess until one does.
            address = None
        self._check_at = _next_check(started)
        if address is not None and not _same_address(address, self.host, self.port):
            # Raised, not redialled in place: the retry policy resends the command, and a
            # WATCH on this connection fails as it must instead of silently vanishing.
            self.disconnect()
            raise redis.ConnectionError(_MOVED)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not (self.connection_pool.is_master and _cut_by_demotion(exc)):
                raise
            self.disconnect()
            raise redis.ConnectionError(_MOVED) from None


class _SentinelSSLConnection(_SentinelConnection, redis.connection.SSLConnection):
    pass


class _AsyncSentinelConnection(aioredis.sentinel.SentinelManagedConnection):
    """The asyncio twin of :class:`_SentinelConnection`."""

    _check_at = 0.0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if (self.is_connected and self.connection_pool.is_master
                and time.monotonic() >= self._check_at):
            await self._check_master()
        if not self.is_connected:
            await self.connect()
            self._check_at = time.monotonic() + MASTER_CHECK_S
        await super().send_packed_command(command, check_health)

    async def _check_master(self) -> None:
        started = time.monotonic()
        try:
            address = await self.connection_pool.get_master_address()
        except redis.ConnectionError:  # as in the sync twin
            address = None
        self._check_at = _next_check(started)
        if address is not None and not _same_address(address, self.host, self.port):
            await self.disconnect()
            raise redis.ConnectionError(_MOVED)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not (self.connection_pool.is_master and _cut_by_demotion(exc)):
                raise
            await self.disconnect()
            raise redis.ConnectionError(_MOVED) from None


class _AsyncSentinelSSLConnection(_AsyncSentinelConnection, aioredis.connection.SSLConnection):
    pass


class _SentinelRedis(redis.Redis):
    """A ``master_for`` client that closes its connections to the sentinels with its own
    (redis-py leaves those open: the Sentinel object is meant to be shared)."""

    endpoint_display = ""

    def close(self) -> None:
        try:
            super().close()
        finally:
            pool = getattr(self, "connection_pool", None)
            if pool is not None:
                pool.sentinel_manager.close()


class _AsyncSentinelRedis(aioredis.Redis):
    """The asyncio twin of :class:`_SentinelRedis`."""

    endpoint_display = ""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            await self.connection_pool.sentinel_manager.aclose()


def _sentinel_master(ep: Endpoint, kwargs: dict[str, Any], *, asynchronous: bool) -> Any:
    """A client of the master that the sentinels of ``ep`` name, asked again on every new
    connection, so a failover costs the commands in flight one retry (or a few, while the
    sentinels agree on the new master: until then there is none to name)."""
    prefix, rest = _split_scheme(ep.url)
    authority, _, path = rest.partition("/")
    userinfo, at, hostlist = authority.rpartition("@")
    service, _, query = path.partition("?")
    sentinels = []
    for item in hostlist.split(","):
        host, _, port = item.rpartition(":")
        sentinels.append((host.strip("[]"), int(port)))
    pairs = parse_qsl(query, keep_blank_values=True)
    auth = {k: v for k, v in pairs if k in _SENTINEL_AUTH_KEYS}
    rest_query = urlencode([(k, v) for k, v in pairs if k not in _SENTINEL_AUTH_KEYS])
    # redis-py's own reading of the credentials and query options, as for redis:// (URL
    # options win over ours, as in from_url); host and port come from the sentinels.
    options = redis.connection.parse_url(
        f"redis://{userinfo + '@' if at else ''}sentinel/" + (f"?{rest_query}" if rest_query else ""))
    options.pop("host", None)
    tls = prefix.startswith("rediss")
    if asynchronous:
        from redis.asyncio.retry import Retry as AsyncRetry

        sentinel_cls: Any = aioredis.sentinel.Sentinel
        redis_cls: Any = _AsyncSentinelRedis
        conn_cls: Any = _AsyncSentinelSSLConnection if tls else _AsyncSentinelConnection
        retry_cls: Any = AsyncRetry
        plain_cls: Any = aioredis.Redis
    else:
        sentinel_cls, redis_cls, plain_cls = redis.sentinel.Sentinel, _SentinelRedis, redis.Redis
        conn_cls = _SentinelSSLConnection if tls else _SentinelConnection
        retry_cls = Retry
    master_kwargs = {**kwargs, **options}
    # Redundant with the connection class's own conversion, and meant so: a READONLY that
    # escaped it would otherwise end the command instead of sending it to the new master.
    master_kwargs["retry_on_error"] = [*kwargs["retry_on_error"], redis.exceptions.ReadOnlyError]
    # A sentinel answers at once or not at all: short timeouts, and no retry of one
    # sentinel, let discovery move on to the next.
    sentinel_timeout = min(float(kwargs["socket_connect_timeout"]), 2.0)
    sentinel_kwargs: dict[str, Any] = {
        "socket_connect_timeout": sentinel_timeout,
        "socket_timeout": sentinel_timeout,
        "retry": retry_cls(NoBackoff(), 0),
        "protocol": 2,
    }
    if auth.get("sentinel_username"):
        sentinel_kwargs["username"] = auth["sentinel_username"]
    if auth.get("sentinel_password"):
        sentinel_kwargs["password"] = auth["sentinel_password"]
    if tls:
        accepted = inspect.signature(plain_cls.__init__).parameters
        sentinel_kwargs["ssl"] = True
        sentinel_kwargs.update({k: v for k, v in options.items()
                                if k.startswith("ssl_") and k in accepted})
    manager = sentinel_cls(sentinels, sentinel_kwargs=sentinel_kwargs)
    client = manager.master_for(service, redis_class=redis_cls, connection_class=conn_cls,
                                **master_kwargs)
    client.endpoint_display = redact_endpoint(f"{prefix}{hostlist}/{service}")
    return client
