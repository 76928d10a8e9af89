"""Redis Cluster: recognising a cluster node, its client, and the commands that are per node.

``redis://`` / ``rediss://`` naming any node of a cluster works, as for ``redis-cli -c``: the
first client of an endpoint asks the server (``INFO cluster``, once per process) and, on
``cluster_enabled:1``, builds redis-py's cluster client, which reads the slot map from that
node and follows MOVED. ``redis+cluster://`` / ``rediss+cluster://`` say so without asking (for
an ACL user refused INFO, or a cluster down when the process starts). The password forms are
those of ``redis://``. Every key of a job shares the hash tag ``{JOB}``, so a job's scripts,
pipelines and multi-stream XREADs stay on one node; the job index (``elastic:jobs``) is in
another slot and is only ever written by single-key commands (see docs/PROTOCOL.md). What is
per node on a cluster has helpers here: :func:`scan_batches`, :func:`config_get_each`; each
works on a single server too.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from .endpoints import CLUSTER_SCHEMES, Endpoint, EndpointError, parse_endpoint, redact

#: How long the cluster probe waits for a server that does not answer: it runs once per
#: endpoint and process, synchronously, before the first client exists.
_PROBE_TIMEOUT_S = 2.0
# Endpoint URL -> whether it is a cluster node; only answers are remembered, not outages.
_cluster_endpoints: dict[str, bool] = {}
_UNREACHABLE_CLUSTER = "Redis Cluster cannot be connected"


def is_cluster_endpoint(endpoint: Endpoint | str | None,
                        connect_timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether ``endpoint`` is a node of a Redis Cluster, so that any node's address works as
    it does for ``redis-cli -c``. ``redis+cluster://`` says so without asking; a ``redis://``
    or ``rediss://`` server is asked once per process (``INFO cluster``: ``cluster_enabled``).

    An unreachable server, or one that refuses the login, is taken for a single server and
    not remembered: its client then reports the outage as it always did, and the next client
    asks again. A user whose ACL refuses ``INFO`` and ``CLUSTER INFO`` is taken for a user of
    a single server: ``redis+cluster://`` is the way to say otherwise."""
    ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
    if ep.url.startswith(CLUSTER_SCHEMES):
        return True
    if not ep.url.startswith(("redis://", "rediss://")):
        return False  # unix sockets and Sentinel name single servers
    known = _cluster_endpoints.get(ep.url)
    if known is not None:
        return known
    timeout = min(connect_timeout, _PROBE_TIMEOUT_S)
    try:
        probe = redis.Redis.from_url(ep.url, socket_connect_timeout=timeout,
                                     socket_timeout=_PROBE_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                                     protocol=2)
    except (redis.RedisError, ValueError):
        return False  # a URL redis-py refuses: the real client says why
    try:
        try:
            found = str(probe.info("cluster").get("cluster_enabled", 0)) == "1"
        except redis.exceptions.AuthenticationError:
            raise
        except redis.ResponseError:  # INFO refused by an ACL: CLUSTER INFO may be allowed
            try:
                probe.execute_command("CLUSTER", "INFO")
                found = True
            except redis.exceptions.AuthenticationError:
                raise
            except redis.ResponseError:  # "cluster support disabled", or refused too
                found = False
    except (redis.RedisError, OSError):
        return False
    finally:
        probe.close()
    _cluster_endpoints[ep.url] = found
    return found


def _cluster_unreachable(exc: BaseException) -> bool:
    # redis-py raises RedisClusterException, which is no RedisError, when no node answers:
    # callers ride out outages by catching ConnectionError, so it becomes one.
    return (isinstance(exc, redis.exceptions.RedisClusterException)
            and str(exc).startswith(_UNREACHABLE_CLUSTER))


class _ClusterRedis(redis.cluster.RedisCluster):
    """A cluster client whose "no node answers" is a ConnectionError (see above)."""

    endpoint_display = ""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except redis.exceptions.RedisClusterException as exc:
            if not _cluster_unreachable(exc):
                raise
            raise redis.ConnectionError(redact(str(exc))) from None


class _AsyncClusterRedis(aioredis.cluster.RedisCluster):
    """The asyncio twin of :class:`_ClusterRedis`."""

    endpoint_display = ""

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        reading = self._initialize
        try:
            client = await super().initialize(*args, **kwargs)
        except redis.exceptions.RedisClusterException as exc:
            if not _cluster_unreachable(exc):
                raise
            raise redis.ConnectionError(redact(str(exc))) from None
        if reading:
            # Reading the slot map and the command table leaves idle connections to the node
            # asked (two: its startup entry's and its entry's in the map) that the client may
            # never use again: closed, each reconnects if used (issue 21: connections count).
            nodes = self.nodes_manager.nodes_cache
            with contextlib.suppress(Exception):
                for name, node in self.nodes_manager.startup_nodes.items():
                    if nodes.get(name) is not node:
                        await node.disconnect()
                for node in nodes.values():
                    await node.disconnect_free_connections()
        return client

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except redis.exceptions.RedisClusterException as exc:
            if not _cluster_unreachable(exc):
                raise
            raise redis.ConnectionError(redact(str(exc))) from None


def _cluster_client(ep: Endpoint, kwargs: dict[str, Any], *, asynchronous: bool) -> Any:
    """A cluster client started from ``ep``'s node, with the same timeouts and retry policy
    as a single server's: redis-py retries a cluster command at the cluster level (following
    MOVED and re-reading the slot map), its node connections do not retry on their own."""
    url = ep.url
    for explicit in CLUSTER_SCHEMES:
        if url.startswith(explicit):
            url = explicit.replace("+cluster", "", 1) + url[len(explicit):]
    kwargs = dict(kwargs)
    retry = kwargs.pop("retry")
    if retry.get_retries() < 0:
        # redis-py's cluster loop counts attempts up front: "forever" is a very large count.
        retry = type(retry)(ExponentialBackoff(cap=1.0, base=0.05), 1 << 40)
    cls: Any = _AsyncClusterRedis if asynchronous else _ClusterRedis
    try:
        client = cls.from_url(url, retry=retry, **kwargs)
    except redis.exceptions.RedisClusterException as exc:
        if _cluster_unreachable(exc):  # the sync client reads the slot map at once
            raise redis.ConnectionError(redact(str(exc))) from None
        raise EndpointError(f"invalid Redis Cluster endpoint {ep.display!r}: "
                            f"{redact(str(exc))}") from None
    client.endpoint_display = ep.display
    return client


def is_cluster(client: Any) -> bool:
    """Whether ``client`` (from :func:`make_client` or :func:`make_async_client`) talks to a
    Redis Cluster."""
    return isinstance(client, (redis.cluster.RedisCluster, aioredis.cluster.RedisCluster))


async def give_ttls(client: Any, pattern: str, ms: int, renew_from_ms: int | None = None) -> int:
    """Give the keys matching ``pattern`` that have no TTL one of ``ms``; with
    ``renew_from_ms``, also extend (never shorten) those whose TTL is at least that (a lease
    being renewed). Keys with another TTL are someone else's choice and left alone. Returns
    how many keys were looked at."""
    n = 0
    async for batch in scan_batches(client, pattern):
        n += await give_key_ttls(client, batch, ms, renew_from_ms)
    return n


async def give_key_ttls(client: Any, keys: list[Any], ms: int,
                        renew_from_ms: int | None = None) -> int:
    """:func:`give_ttls` for named ``keys`` (a job's log streams, which the job's set lists:
    on a cluster they are in other slots than the job's). Two pipelined round trips per
    node; returns ``len(keys)``."""
    if not keys:
        return 0
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    ttls = await pipe.execute(raise_on_error=False)
    pipe = client.pipeline(transaction=False)
    for key, ttl in zip(keys, ttls):
        if ttl == -1:
            pipe.pexpire(key, ms)
        elif renew_from_ms is not None and isinstance(ttl, int) and ttl >= renew_from_ms:
            pipe.pexpire(key, ms, gt=True)
    await pipe.execute(raise_on_error=False)
    return len(keys)


async def scan_batches(client: Any, pattern: str, count: int = 1000) -> AsyncIterator[list[Any]]:
    """The keys matching ``pattern``, a batch per SCAN call, on a single server or a cluster.

    On a cluster SCAN is per node: a pattern with a hash tag (``elastic:{JOB}:*``, a whole
    job) is scanned on the primary that owns the tag's slot, any other on every primary."""
    if not isinstance(client, aioredis.cluster.RedisCluster):
        cursor = 0
        while True:
            cursor, keys = await client.scan(cursor, match=pattern, count=count)
            if keys:
                yield keys
            if int(cursor) == 0:
                return
    await client.initialize()
    tagged = _tagged_prefix(pattern)
    nodes = [client.get_node_from_key(tagged)] if tagged else client.get_primaries()
    for node in nodes:
        cursor = 0
        while True:
            cursors, keys = await client.scan(cursor, match=pattern, count=count,
                                              target_nodes=node)
            if keys:
                yield keys
            cursor = int(next(iter(cursors.values()), 0)) if isinstance(cursors, dict) else (
                int(cursors))
            if cursor == 0:
                break


def _tagged_prefix(pattern: str) -> str | None:
    """The literal start of a SCAN pattern (escapes resolved, up to its first wildcard) if it
    holds a whole hash tag: every key the pattern matches then hashes to that tag's slot."""
    literal = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            literal.append(pattern[i + 1])
            i += 2
            continue
        if ch in "*?[":
            break
        literal.append(ch)
        i += 1
    text = "".join(literal)
    start = text.find("{")
    end = text.find("}", start + 1) if start >= 0 else -1
    return text if start >= 0 and end > start + 1 else None


async def execute_on_node_of(client: Any, key: str, *args: Any) -> Any:
    """``args``, a command whose keys redis-py cannot find (``ACL WHOAMI``, ``ACL DRYRUN``), on
    the server, or on a cluster on the primary that owns ``key``'s slot (each node has its
    own ACL, and that one decides about ``key``)."""
    if not isinstance(client, aioredis.cluster.RedisCluster):
        return await client.execute_command(*args)
    await client.initialize()
    return await client.execute_command(*args, target_nodes=client.get_node_from_key(key))


async def config_get_each(client: Any, pattern: str) -> list[dict[Any, Any]]:
    """``CONFIG GET pattern`` of the server, or of every primary of a cluster (each node has
    its own settings: one with the wrong eviction policy is enough to lose keys)."""
    if not isinstance(client, aioredis.cluster.RedisCluster):
        return [await client.config_get(pattern)]
    await client.initialize()
    reply = await client.config_get(pattern, target_nodes=client.get_primaries())
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        return list(reply.values())
    return [reply]
