"""Redis clients for agents and consoles: endpoint parsing, timeouts, retries, redaction.

Two kinds of client, because one setting cannot serve both:

* writers (``make_client``) fail fast on a dead socket and retry with backoff;
* blocking readers (``make_client(blocking_ms=...)``) need a socket timeout longer than their
  ``XREAD BLOCK``: redis-py 8's 5 s default turns a long block into a ``TimeoutError``.

Every client speaks RESP2 so replies have one shape on Redis 6.2 and 7.x and on every
redis-py version, and returns bytes (store values are binary).

A password never leaves this module in clear: ``redact`` is applied to every message.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

DEFAULT_URL = "redis://127.0.0.1:6379"
DEFAULT_PORT = 6379

_SCHEMES = ("redis://", "rediss://", "unix://")


class EndpointError(ValueError):
    """An endpoint string that names no Redis server."""


class RedisUnavailableError(ConnectionError):
    """Redis cannot be reached or refused us. The message says where, what, and what to try."""


@dataclass(frozen=True)
class Endpoint:
    """A parsed Redis endpoint. ``url`` holds the password; ``display`` never does."""

    url: str

    @property
    def display(self) -> str:
        return redact(self.url)

    def __str__(self) -> str:  # a stray f-string must not leak the password
        return self.display

    def __repr__(self) -> str:
        return f"Endpoint({self.display!r})"


def parse_endpoint(value: str | None) -> Endpoint:
    """Accept ``host``, ``host:port``, ``[v6]:port``, ``redis://``, ``rediss://`` or ``unix://``.

    ACL user and password go in the URL (``redis://user:pass@host:6379/0``).
    """
    if value is None or not str(value).strip():
        return Endpoint(DEFAULT_URL)
    value = str(value).strip()
    if value.startswith(_SCHEMES):
        parts = urlsplit(value)
        if parts.scheme == "unix":
            if not parts.path:
                raise EndpointError(f"invalid Redis endpoint {redact(value)!r}: unix:// needs a path")
            return Endpoint(value)
        try:
            port = parts.port
        except ValueError:
            raise EndpointError(
                f"invalid Redis endpoint {redact(value)!r}: the port is not a number from 1 to 65535"
            ) from None
        if not parts.hostname:
            raise EndpointError(f"invalid Redis endpoint {redact(value)!r}: no host")
        if parts.path not in ("", "/") and not parts.path.lstrip("/").isdigit():
            raise EndpointError(
                f"invalid Redis endpoint {redact(value)!r}: the path must be a database number"
            )
        if port is None:
            netloc = parts.netloc + f":{DEFAULT_PORT}"
            value = parts._replace(netloc=netloc).geturl()
        return Endpoint(value)
    if "://" in value:
        scheme = value.split("://", 1)[0]
        raise EndpointError(
            f"invalid Redis endpoint: scheme {scheme!r} is not one of redis://, rediss://, unix://"
        )
    host, port = _split_host_port(value)
    return Endpoint(f"redis://{_bracket(host)}:{port}")


def _split_host_port(value: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?", value)
    if m:
        host, port_s = m.group(1), m.group(2)
    elif value.count(":") == 1:
        host, port_s = value.split(":")
    elif value.count(":") == 0:
        host, port_s = value, None
    else:  # a bare IPv6 address
        host, port_s = value, None
    if not host or not re.fullmatch(r"[A-Za-z0-9_.:%-]+", host):
        raise EndpointError(f"invalid Redis endpoint {value!r}: expected host, host:port or a URL")
    if port_s is None:
        return host, DEFAULT_PORT
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise EndpointError(
            f"invalid Redis endpoint {value!r}: the port is not a number from 1 to 65535"
        )
    return host, int(port_s)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_PASSWORD_RE = re.compile(r"(?P<scheme>[a-z]+://)(?P<user>[^:@/\s]*):(?P<pw>[^@\s]*)@")
_QUERY_PASSWORD_RE = re.compile(r"(?P<k>[?&]password=)[^&\s]*")


def redact(text: str) -> str:
    """Replace every password in URLs found in ``text`` with ``***``."""
    text = _PASSWORD_RE.sub(lambda m: f"{m['scheme']}{m['user']}:***@", str(text))
    return _QUERY_PASSWORD_RE.sub(lambda m: f"{m['k']}***", text)


def with_password(url: str, password: str) -> str:
    """``url`` with its password replaced (used by tests and by --redis-password style flags)."""
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[-1]
    return parts._replace(netloc=f"{quote(user)}:{quote(password)}@{host}").geturl()


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
    return redis.Redis.from_url(ep.url, **kwargs)


def make_async_client(
    endpoint: Endpoint | str | None,
    *,
    blocking_ms: int | None = None,
    retries: int = 6,
    connect_timeout: float = 5.0,
    socket_timeout: float = 10.0,
    max_connections: int | None = None,
) -> aioredis.Redis:
    """The asyncio twin of :func:`make_client`, with the same timeouts and retry policy."""
    from redis.asyncio.retry import Retry as AsyncRetry

    ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
    kwargs = _client_kwargs(ep, blocking_ms, retries, connect_timeout, socket_timeout,
                            max_connections, AsyncRetry)
    return aioredis.Redis.from_url(ep.url, **kwargs)


def describe_endpoint(client: redis.Redis) -> str:
    """The endpoint a client talks to, password-free, for messages."""
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    scheme = "rediss" if client.connection_pool.connection_class.__name__.startswith("SSL") else "redis"
    return f"{scheme}://{_bracket(str(kw.get('host', '?')))}:{kw.get('port', DEFAULT_PORT)}"


def explain_error(exc: BaseException, where: str) -> RedisUnavailableError:
    """Turn a redis-py exception into one clear sentence: which endpoint, what failed, what to try."""
    detail = redact(str(exc)).rstrip(".") or type(exc).__name__
    if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in detail or "NOAUTH" in detail:
        hint = "check the user and password in the Redis URL"
    elif isinstance(exc, redis.exceptions.NoPermissionError) or (
            isinstance(exc, redis.ResponseError) and "NOPERM" in detail):
        hint = "the Redis user lacks a permission this command needs (check its ACL)"
    elif isinstance(exc, (redis.TimeoutError, socket.timeout)):
        hint = "check that the host is reachable and not firewalled"
    else:
        hint = ("check that redis-server is running there and that --redis points to it "
                "(or use --standalone to start one)")
    return RedisUnavailableError(f"cannot reach Redis at {where}: {detail}; {hint}")


def connect(endpoint: Endpoint | str | None, **kwargs: Any) -> redis.Redis:
    """``make_client`` and a PING, so an unreachable server is one clear error up front."""
    ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
    kwargs.setdefault("retries", 2)
    client = make_client(ep, **kwargs)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        client.close()
        raise explain_error(exc, ep.display) from None
    return client


def username_of(endpoint: Endpoint) -> str | None:
    """The ACL user named in the URL, if any (for messages and read-only checks)."""
    user = urlsplit(endpoint.url).username
    return unquote(user) if user else None
