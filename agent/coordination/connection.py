"""Redis clients for agents and consoles: endpoint parsing, timeouts, retries, redaction.

Two kinds of client, because one setting cannot serve both:

* writers (``make_client``) fail fast on a dead socket and retry with backoff;
* blocking readers (``make_client(blocking_ms=...)``) need a socket timeout longer than their
  ``XREAD BLOCK``: redis-py 8's 5 s default turns a long block into a ``TimeoutError``.

Every client speaks RESP2 so replies have one shape on Redis 6.2 and 7.x and on every
redis-py version, and returns bytes (store values are binary).

A password never leaves this module in clear: every message shows endpoints through
``redact_endpoint`` and other text through ``redact``, both built to fail closed (a password
may hold any character). The recommended way to give a password is outside argv, where ``ps``
cannot see it: ``$REDISCLI_AUTH`` or a password file (:func:`with_outside_password`); a
password that does come in argv is moved out of it at start (:func:`argv_without_passwords`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import string
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

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
        return redact_endpoint(self.url)

    def __str__(self) -> str:  # a stray f-string must not leak the password
        return self.display

    def __repr__(self) -> str:
        return f"Endpoint({self.display!r})"


def parse_endpoint(value: str | None) -> Endpoint:
    """Accept ``host``, ``host:port``, ``[v6]:port``, ``redis://``, ``rediss://`` or ``unix://``.

    ACL user and password go in the URL (``redis://user:pass@host:6379/0``) or, better, outside
    the command line (:func:`with_outside_password`). A password need not be percent-encoded:
    the userinfo runs to the last ``@``, so ``@``, ``:``, spaces, ``/`` or ``#`` in it work.
    An error message shows the endpoint through :func:`redact_endpoint`, never as typed.
    """
    if value is None or not str(value).strip():
        return Endpoint(DEFAULT_URL)
    value = str(value).strip()
    if value.startswith(_SCHEMES):
        try:
            ep = _parse_url(value)
        except EndpointError as first:
            # A raw "/", "?", "#" or "[" in a password cuts the URL short for urlsplit; read
            # the userinfo up to the last "@" instead, and keep that reading only if it is valid.
            encoded = _encode_userinfo(value)
            if encoded == value:
                raise
            try:
                ep = _parse_url(encoded)
            except EndpointError:
                raise first from None
        _remember_url_password(ep.url)
        return ep
    shown = redact_endpoint(value)
    if "://" in value:
        scheme = value.split("://", 1)[0]
        named = f"scheme {scheme!r}" if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) else (
            "the scheme")
        raise EndpointError(
            f"invalid Redis endpoint {shown!r}: {named} is not one of redis://, rediss://, unix://"
        )
    if "@" in value:
        raise EndpointError(
            f"invalid Redis endpoint {shown!r}: a user or password needs a redis:// URL, "
            f"and the password is best given in ${PASSWORD_ENV}"
        )
    host, port = _split_host_port(value, shown)
    return Endpoint(f"redis://{_bracket(host)}:{port}")


def _parse_url(value: str) -> Endpoint:
    shown = redact_endpoint(value)
    try:
        parts = urlsplit(value)
    except ValueError:  # e.g. an unmatched "[": urlsplit's own message is no help
        raise EndpointError(f"invalid Redis endpoint {shown!r}: not a valid URL") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise EndpointError(f"invalid Redis endpoint {shown!r}: unix:// needs a path")
        # As for hosts below: what a raw password cut short must not pass for a socket path.
        if parts.netloc.rpartition("@")[2] or "@" in parts.path or "#" in value:
            raise EndpointError(
                f"invalid Redis endpoint {shown!r}: expected unix://[user:password@]/path "
                f"(an '@' or '#' in the path written %40 or %23)"
            )
        return Endpoint(value)
    try:
        port = parts.port
    except ValueError:
        raise EndpointError(
            f"invalid Redis endpoint {shown!r}: the port is not a number from 1 to 65535"
        ) from None
    if not parts.hostname:
        raise EndpointError(f"invalid Redis endpoint {shown!r}: no host")
    # Strict, so that a raw password which cut the URL short is never taken for a host, a
    # path or a fragment: parse_endpoint then reads it again up to the last "@".
    if not re.fullmatch(r"[\w.%:-]+", parts.hostname):
        raise EndpointError(f"invalid Redis endpoint {shown!r}: the host is not a name or address")
    if "#" in value:
        raise EndpointError(f"invalid Redis endpoint {shown!r}: a Redis URL has no #fragment")
    if parts.path not in ("", "/") and not parts.path.lstrip("/").isdigit():
        raise EndpointError(
            f"invalid Redis endpoint {shown!r}: the path must be a database number"
        )
    if port is None:
        netloc = parts.netloc.removesuffix(":") + f":{DEFAULT_PORT}"
        value = parts._replace(netloc=netloc).geturl()
    return Endpoint(value)


def _split_host_port(value: str, shown: str) -> tuple[str, int]:
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
        raise EndpointError(f"invalid Redis endpoint {shown!r}: expected host, host:port or a URL")
    if port_s is None:
        return host, DEFAULT_PORT
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise EndpointError(
            f"invalid Redis endpoint {shown!r}: the port is not a number from 1 to 65535"
        )
    return host, int(port_s)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- secrets ------------------------------------------------------------------------------

PASSWORD_ENV = "REDISCLI_AUTH"
PASSWORD_FILE_ENV = "ELASTIC_REDIS_PASSWORD_FILE"
_ARGV_ENV = "_ELASTIC_REDIS_ARGV"
_MAX_PASSWORD_FILE = 4096
_MIN_REMEMBERED = 4  # shorter ones would mask ordinary words and numbers everywhere

_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# A query password runs to the end: a raw "&" or space in it must not end the redaction.
_QUERY_PASSWORD_RE = re.compile(r"(?P<k>[?&]password=).*", re.IGNORECASE | re.DOTALL)
_PLAIN_USER_RE = re.compile(r"[A-Za-z0-9._~%!$&'()*+,;=-]*")
_USERINFO_SAFE = "".join(c for c in string.punctuation if c not in "/?#[]@")

# Every password this process was given, in each spelling it may take in a URL: a last line of
# defence for text that no structural rule recognises (a tuple: swapped whole, never mutated).
_known_passwords: tuple[str, ...] = ()


def _remember(password: str) -> None:
    global _known_passwords
    if len(password) < _MIN_REMEMBERED:
        return
    spellings = {password, quote(password, safe=""), quote(password, safe=_USERINFO_SAFE)}
    _known_passwords = tuple(sorted(set(_known_passwords) | spellings, key=len, reverse=True))


def _remember_url_password(url: str) -> None:
    parts = urlsplit(url)
    if parts.password:
        _remember(parts.password)
        _remember(unquote(parts.password))
    for key, value in parse_qsl(parts.query):
        if key.lower() == "password":
            _remember(value)


def _mask_known(text: str) -> str:
    for password in _known_passwords:
        text = text.replace(password, "***")
    return text


def _split_scheme(value: str) -> tuple[str, str]:
    m = _SCHEME_RE.match(value)
    return (m.group(0), value[m.end():]) if m else ("", value)


def _mask_userinfo(userinfo: str) -> str:
    # Every reading of a URL (RFC 3986, redis-py, redis-cli) ends the user at the first ":";
    # without one, redis-cli reads the whole userinfo as a password.
    user, colon, _ = userinfo.partition(":")
    if colon and _PLAIN_USER_RE.fullmatch(user):
        return f"{user}:***@"
    return "***@"


def _host_shown(tail: str, schemeless: bool) -> str:
    # What follows the userinfo, if it reads as a host and port; else as much of it as does,
    # "***" for the rest: a password typed without its host lands here.
    authority = re.split(r"[/?#]", tail, maxsplit=1)[0]
    if schemeless and authority.count(":") > 1 and re.fullmatch(r"[0-9A-Fa-f:.]+", authority):
        return tail  # a bare IPv6 address
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]*\]|[\w.%-]*)(?::(.*))?", authority, re.DOTALL)
    if m is None:
        return "***"
    if m.group(2) is None or m.group(2).isdigit():
        return tail
    return f"{m.group(1)}:***"


def _redact_query(text: str) -> str:
    return _QUERY_PASSWORD_RE.sub(lambda m: f"{m['k']}***", text)


def redact_endpoint(value: str) -> str:
    """One endpoint as typed (URL or ``host:port``, valid or not) with anything that may be a
    password replaced by ``***``.

    Fails closed: the whole userinfo up to the last ``@`` goes (but a plain user name before
    its first ``:``); after it, whatever does not read as ``host:port`` (a password typed
    without its host); a ``password=`` query value, to the end.
    """
    # Known passwords first: a structural cut inside one would leave a piece to match nothing.
    # A query password first too: an "@" in it must not be taken for the userinfo's end.
    prefix, rest = _split_scheme(_redact_query(_mask_known(str(value))))
    userinfo, at, tail = rest.rpartition("@")
    return prefix + (_mask_userinfo(userinfo) if at else "") + _host_shown(tail, not prefix)


def redact(text: str) -> str:
    """``text`` (a message, an exception) with every password in it replaced by ``***``.

    Fails closed: a password may hold any character, so no character can be trusted to end
    one; every password this process was given goes, then ``password=`` query values (to the
    end), then everything from the first ``scheme://`` to the last ``@`` after it (but a plain
    user name). Its limit: in prose, an unknown password holding ``@`` in a URL with no host after
    it cannot be told from a host and words; endpoints as typed go through
    :func:`redact_endpoint`, which masks whatever does not read as a host.
    """
    # Known passwords and query passwords first: a cut at an "@" inside one would hide the
    # rest of it from the rule that finds it.
    text = _redact_query(_mask_known(str(text)))
    m = _SCHEME_RE.search(text)
    if m is not None:
        at = text.rfind("@", m.end())
        if at >= 0:
            text = text[:m.end()] + _mask_userinfo(text[m.end():at]) + text[at + 1:]
    return text


def _encode_userinfo(value: str) -> str:
    prefix, rest = _split_scheme(value)
    userinfo, at, tail = rest.rpartition("@")
    if not at:
        return value
    # "%" stays as typed: percent-encoded text keeps its meaning.
    return prefix + quote(userinfo, safe=_USERINFO_SAFE) + "@" + tail


def with_password(url: str, password: str) -> str:
    """``url`` with its password replaced, percent-encoded (the user, if any, is kept)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else ""
    _remember(password)
    netloc = f"{user}:{quote(password, safe='')}@{hostport}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def read_password_file(path: str) -> str:
    """The password held by ``path``: its content without one final line break."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_PASSWORD_FILE + 1)
    except OSError as exc:
        raise EndpointError(
            f"cannot read the Redis password file {path!r}: {exc.strerror or type(exc).__name__}"
        ) from None
    if len(data) > _MAX_PASSWORD_FILE:
        raise EndpointError(f"the Redis password file {path!r} is over {_MAX_PASSWORD_FILE} "
                            f"bytes: it should hold one line, the password")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # its message quotes a byte of the password
        raise EndpointError(f"the Redis password file {path!r} is not UTF-8 text") from None
    password = text.removesuffix("\n").removesuffix("\r")
    if not password:
        raise EndpointError(f"the Redis password file {path!r} is empty")
    _remember(password)
    return password


def with_outside_password(endpoint: Endpoint, password_file: str | None = None,
                          environ: Mapping[str, str] | None = None) -> Endpoint:
    """``endpoint`` with the password given outside the command line, when its URL has none.

    Looked up in order: ``password_file`` (``--redis-password-file``),
    ``$ELASTIC_REDIS_PASSWORD_FILE``, ``$REDISCLI_AUTH`` (redis-cli's variable). A password
    in argv is visible to every user of the host (``ps``); these are not.
    """
    env = os.environ if environ is None else environ
    if urlsplit(endpoint.url).password:
        return endpoint
    path = password_file or env.get(PASSWORD_FILE_ENV)
    password = read_password_file(path) if path else env.get(PASSWORD_ENV, "")
    if not password:
        return endpoint
    return Endpoint(with_password(endpoint.url, password))


def argv_without_passwords(flags: Collection[str]) -> list[str]:
    """``sys.argv[1:]`` for a ``main``, once no Redis password is left in this process's argv.

    When an argument holds one (the value of one of ``flags``, or any URL with a userinfo),
    the process re-executes itself, same interpreter and options, with those arguments
    redacted and the originals in a private environment variable (readable only by the same
    user, unlike argv); the new process takes them back here. Nothing is printed. The first
    process's argv shows the password until the re-exec: ``$REDISCLI_AUTH`` has no such window.
    """
    args = list(sys.argv[1:])
    saved = os.environ.pop(_ARGV_ENV, None)
    if saved is not None:
        return _restore_argv(args, saved)
    hidden = _hide_passwords(args, flags)
    if not hidden:
        return args
    orig = list(getattr(sys, "orig_argv", ()))
    n = len(args)
    if (not sys.executable or sys.argv[0] in ("", "-") or len(orig) <= n
            or orig[len(orig) - n:] != args):
        return args  # the command line cannot be rebuilt faithfully (stdin script, edited argv)
    new_argv = [sys.executable, *orig[1:len(orig) - n], *(hidden.get(i, a) for i, a in
                                                          enumerate(args))]
    payload = json.dumps([[i, shown, args[i]] for i, shown in hidden.items()])
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        os.execve(sys.executable, new_argv, {**os.environ, _ARGV_ENV: payload})
    except OSError:
        return args
    raise AssertionError("unreachable: execve returned")  # pragma: no cover


def _hide_passwords(args: list[str], flags: Collection[str]) -> dict[int, str]:
    hidden: dict[int, str] = {}
    after_flag = False
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if after_flag:
            shown = redact_endpoint(arg)
        elif eq and flag in flags:
            shown = f"{flag}={redact_endpoint(value)}"
        else:
            shown = redact(arg)
        after_flag = arg in flags
        if shown != arg:
            hidden[i] = shown
    return hidden


def _restore_argv(args: list[str], saved: str) -> list[str]:
    try:
        entries = json.loads(saved[:1_000_000])
        for i, shown, original in entries:
            # Only where the argument is still the one we redacted: a stale or foreign
            # variable must not rewrite an unrelated command line.
            if (type(i) is int and 0 <= i < len(args) and args[i] == shown
                    and isinstance(original, str)):
                args[i] = original
    except (ValueError, TypeError, RecursionError):
        pass
    return args


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
    if "without any password configured" in detail:
        hint = f"this server takes no password: drop it from the URL or unset ${PASSWORD_ENV}"
    elif "NOAUTH" in detail or "Authentication required" in detail:
        hint = f"this server needs a password: give it in ${PASSWORD_ENV} (or in the URL)"
    elif isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in detail:
        hint = (f"check the user and password (in the Redis URL, ${PASSWORD_ENV} or the "
                f"password file)")
    elif isinstance(exc, redis.exceptions.NoPermissionError) or (
            isinstance(exc, redis.ResponseError) and "NOPERM" in detail):
        hint = "the Redis user lacks a permission this command needs (check its ACL)"
    elif isinstance(exc, (redis.TimeoutError, socket.timeout)):
        hint = "check that the host is reachable and not firewalled"
    else:
        hint = ("check that redis-server is running there and that --redis points to it "
                "(or use --standalone to start one)")
    return RedisUnavailableError(f"cannot reach Redis at {redact(where)}: {detail}; {hint}")


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
