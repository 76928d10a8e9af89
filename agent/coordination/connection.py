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

High availability: ``redis+sentinel://[user:pass@]host:port[,host:port...]/service[?db=N]``
(sentinel port 26379 by default; ``rediss+sentinel://`` for TLS to the sentinels and the
servers alike, with ``rediss://``'s ``ssl_*`` query parameters) names Redis Sentinels and the
service they watch. A client asks them for the master on every (re)connect and, while it uses
a connection, every ``MASTER_CHECK_S``; a connection error, READONLY or a blocked read cut by a
demotion is retried by the usual policy against whatever master they name then. The userinfo
(or ``$REDISCLI_AUTH``, or the password file) is the master's credential, exactly as for
``redis://``. Sentinels usually run without a password; ones with a ``requirepass`` of their own
get ``sentinel_password=`` (and ``sentinel_username=`` for an ACL user) in the query
(percent-encoded), masked wherever the URL is shown; to keep it out of argv, put the whole URL in
``$ELASTIC_REDIS_URL``. What a failover loses: replication is asynchronous, so writes the old
master acknowledged but had not yet sent to a replica; and writes a master demoted while still
reachable acknowledged before clients moved (within about ``MASTER_CHECK_S`` of the switch).

Redis Cluster: ``redis://`` / ``rediss://`` naming any node of a cluster works, as for
``redis-cli -c``: the first client of an endpoint asks the server (``INFO cluster``, once per
process) and, on ``cluster_enabled:1``, builds redis-py's cluster client, which reads the slot
map from that node and follows MOVED. ``redis+cluster://`` / ``rediss+cluster://`` say so
without asking (for an ACL user refused INFO, or a cluster down when the process starts). The
password forms are those of ``redis://``. Every key of a job shares the hash tag ``{JOB}``, so
a job's scripts, pipelines and multi-stream XREADs stay on one node; the job index
(``elastic:jobs``) is in another slot and is only ever written by single-key commands (see
docs/PROTOCOL.md). What is per node on a cluster has helpers here: :func:`scan_batches`,
:func:`config_get_each`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import math
import os
import re
import socket
import string
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.connection
import redis.sentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from .send_path import use_lean_connections

DEFAULT_URL = "redis://127.0.0.1:6379"
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379

SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
#: Explicitly a Redis Cluster (no probe): see "Redis Cluster" below.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
# Query keys meant for the sentinels themselves, not for the master's connections.
_SENTINEL_AUTH_KEYS = ("sentinel_username", "sentinel_password")


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
    """Accept ``host``, ``host:port``, ``[v6]:port``, ``redis://``, ``rediss://``, ``unix://``,
    or ``redis+sentinel://`` / ``rediss+sentinel://`` (see the module docstring).

    ACL user and password go in the URL (``redis://user:pass@host:6379/0``) or, better, outside
    the command line (:func:`with_outside_password`). A password need not be percent-encoded:
    the userinfo runs to the last ``@``, so ``@``, ``:``, spaces, ``/`` or ``#`` in it work;
    a URL that also reads validly the standard way, naming another server or credentials, is
    refused: the host is never taken from a password. The query carries only the options in
    ``_QUERY_KEYS`` (and ``ssl_*`` over TLS). An error message shows the endpoint through
    :func:`redact_endpoint`, never as typed, and no query value.
    """
    if value is None or not str(value).strip():
        return Endpoint(DEFAULT_URL)
    value = str(value).strip()
    if value.startswith(SENTINEL_SCHEMES):
        ep = _parse_sentinel(value)
        _remember_url_password(ep.url)
        return ep
    if value.startswith(_SCHEMES):
        # A raw "/", "?", "#" or "[" in a password cuts the URL short for urlsplit: the
        # userinfo up to the last "@" is the other reading. Each is kept only if valid, and
        # when both are, they must mean the same: otherwise one of them takes a piece of a
        # password for the host (``u:pa@wo?rd@host`` read as host "wo").
        readings = [value]
        encoded = _encode_userinfo(value)
        if encoded != value:
            readings.append(encoded)
        valid: list[Endpoint] = []
        first: EndpointError | None = None
        for reading in readings:
            try:
                valid.append(_parse_url(reading))
            except EndpointError as exc:
                first = first or exc
        if not valid:
            assert first is not None
            raise first
        if len(valid) > 1 and _meaning(valid[0].url) != _meaning(valid[1].url):
            raise _ambiguous(redact_endpoint(value))
        ep = valid[0]
        _remember_url_password(ep.url)
        return ep
    shown = redact_endpoint(value)
    if "://" in value:
        scheme = value.split("://", 1)[0]
        named = f"scheme {scheme!r}" if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) else (
            "the scheme")
        raise EndpointError(
            f"invalid Redis endpoint {shown!r}: {named} is not one of redis://, rediss://, "
            f"unix://, redis+sentinel://, rediss+sentinel://, redis+cluster://, "
            f"rediss+cluster://"
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
        _check_query(parts.query, False, shown)
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
    _check_query(parts.query, parts.scheme.startswith("rediss"), shown)
    if port is None:
        netloc = parts.netloc.removesuffix(":") + f":{DEFAULT_PORT}"
        value = parts._replace(netloc=netloc).geturl()
    return Endpoint(_query_encoded(value))


def _query_encoded(url: str) -> str:
    """``url`` with its query percent-encoded (same meaning to redis-py): no raw "@" is left
    after the userinfo, so its display masks exactly the password (see redact_endpoint)."""
    base, mark, query = url.partition("?")
    if not mark or "@" not in query:
        return url
    return base + "?" + urlencode(parse_qsl(query, keep_blank_values=True), safe="/:,",
                                  quote_via=quote)


#: The query options a URL may carry, each read by redis-py: the database, credentials, the
#: connect timeout and, over TLS, ``ssl_*``. Anything else is refused, with one line: redis-py
#: passes an unknown key to the connection's constructor (a TypeError at the first command,
#: quoting the key), and a raw password cut short by a "?" in it becomes such a key. Options
#: this package sets itself are refused too: a ``socket_timeout`` or ``protocol`` from the URL
#: would override the blocking readers' timeout and the RESP2 replies every reader expects.
_QUERY_KEYS = frozenset({"db", "username", "password", "socket_connect_timeout"})
_TLS_QUERY_KEYS = frozenset(
    k for k in inspect.signature(redis.connection.SSLConnection.__init__).parameters
    if k.startswith("ssl_") and k != "ssl_ocsp_context")  # an object, not text
_SSL_CERT_REQS = ("none", "optional", "required")
_SHOWN_KEY_RE = re.compile(r"[a-z_]{1,40}")


def _check_query(query: str, tls: bool, shown: str, extra: Collection[str] = ()) -> None:
    """Raise EndpointError unless every option of ``query`` is one redis-py takes from a URL,
    with a value it can read. A key is named only if the redacted endpoint ``shown`` shows it
    too (what was not shown may be a piece of a password); a value never is. The endpoint
    comes last in the message: a masked ``password=`` query hides everything after it."""
    for key, val in parse_qsl(query, keep_blank_values=True):
        named = (f"the query option {key!r}" if _SHOWN_KEY_RE.fullmatch(key) and key in shown
                 else "a query option")
        if key in _TLS_QUERY_KEYS and not tls:
            raise EndpointError(f"invalid Redis endpoint ({named} needs TLS: a rediss:// "
                                f"URL): {shown!r}")
        if key not in _QUERY_KEYS and key not in _TLS_QUERY_KEYS and key not in extra:
            accepted = ", ".join(sorted({*_QUERY_KEYS, *extra}))
            hint = ("; a '&' in a query password is written %26"
                    if re.search(r"(?:^|&)[a-z_]*password=", query) else "")
            raise EndpointError(
                f"invalid Redis endpoint ({named} is not one a URL may carry: {accepted}, and "
                f"ssl_* options for rediss://{hint}): {shown!r}")
        parser = redis.connection.URL_QUERY_ARGUMENT_PARSERS.get(key)
        try:
            ok = bool(val) and (parser is None or parser(val) is not None)
            if key == "db":
                ok = ok and val.isdigit()
            elif key == "socket_connect_timeout":
                ok = ok and 0 < float(val) < math.inf
            elif key == "ssl_cert_reqs":
                ok = ok and val in _SSL_CERT_REQS
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise EndpointError(f"invalid Redis endpoint ({named} has no valid value): "
                                f"{shown!r}")


def _meaning(url: str) -> dict[str, Any]:
    """What redis-py connects with for ``url`` (address, credentials, options)."""
    for explicit in CLUSTER_SCHEMES:
        if url.startswith(explicit):
            url = explicit.replace("+cluster", "", 1) + url[len(explicit):]
    return redis.connection.parse_url(url)


def _ambiguous(shown: str) -> EndpointError:
    return EndpointError(
        f"invalid Redis endpoint (it reads two ways, each with another server or password: "
        f"write the password percent-encoded, '@' as %40 and '?' as %3F, or give it in "
        f"${PASSWORD_ENV}): {shown!r}")


def _parse_sentinel(value: str) -> Endpoint:
    """``value`` as a Sentinel URL, kept as typed but for a percent-encoded userinfo.

    A raw password may hold "/", "?", "#" or "@" and so end the authority early: each "@"
    is tried as the userinfo's end, the standard reading first, then from the last one. The
    reading whose rest is a valid host list, service and query wins; two valid readings that
    name different sentinels or credentials are refused (one takes a piece of a password for
    a host).
    """
    shown = redact_endpoint(value)
    prefix, rest = _split_scheme(value)
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    ends = [i for i, c in enumerate(rest) if c == "@"]
    standard = authority.rfind("@")
    readings = [standard] + [i for i in reversed(ends) if i != standard]
    first_error: EndpointError | None = None
    found: list[Endpoint] = []
    for at in readings:
        userinfo, tail = (rest[:at], rest[at + 1:]) if at >= 0 else ("", rest)
        try:
            hosts, service, query = _sentinel_tail(tail, shown, prefix.startswith("rediss"))
        except EndpointError as exc:
            first_error = first_error or exc
            continue
        cred = quote(userinfo, safe=_USERINFO_SAFE) + "@" if at >= 0 else ""
        hostlist = ",".join(f"{_bracket(h)}:{p}" for h, p in hosts)
        ep = Endpoint(_query_encoded(f"{prefix}{cred}{hostlist}/{service}"
                                     + (f"?{query}" if query else "")))
        if ep not in found:
            found.append(ep)
    if len(found) > 1:
        raise _ambiguous(shown)
    if found:
        return found[0]
    assert first_error is not None
    raise first_error


def _sentinel_tail(tail: str, shown: str, tls: bool) -> tuple[list[tuple[str, int]], str, str]:
    """``host:port[,host:port...]/service[?query]`` -> (sentinels, service, query)."""
    usage = (f"invalid Redis endpoint {shown!r}: expected "
             f"redis+sentinel://[user:password@]host:port[,host:port...]/service[?db=N]")
    if "#" in tail or "@" in tail.partition("?")[0]:
        raise EndpointError(usage)
    hostlist, slash, rest = tail.partition("/")
    service, _, query = rest.partition("?")
    if not slash or not re.fullmatch(r"[A-Za-z0-9_.:-]+", service):
        raise EndpointError(f"{usage} (the service is the name in 'sentinel monitor NAME ...')")
    hosts = []
    for item in hostlist.split(","):
        m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.%-]+)(?::(\d+))?", item)
        if m is None:
            raise EndpointError(usage)
        port = int(m.group(2)) if m.group(2) else DEFAULT_SENTINEL_PORT
        if not 0 < port < 65536:
            raise EndpointError(
                f"invalid Redis endpoint {shown!r}: the port is not a number from 1 to 65535")
        hosts.append((m.group(1).strip("[]"), port))
    _check_query(query, tls, shown, _SENTINEL_AUTH_KEYS)
    return hosts, service, query


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
# "sentinel_password=" and "ssl_password=" (a TLS key's) are secrets as much as "password=".
_QUERY_PASSWORD_RE = re.compile(r"(?P<k>[?&](?:[a-z]+_)?password=).*",
                                re.IGNORECASE | re.DOTALL)
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
    _, password, query = _url_credentials(url)
    if password:
        _remember(password)
        _remember(unquote(password))
    for key, value in parse_qsl(query):
        if key.lower().endswith("password"):
            _remember(value)


def _url_credentials(url: str) -> tuple[str | None, str | None, str]:
    """(user, password, query) of a parsed endpoint's URL; user and password still
    percent-encoded, as ``urlsplit`` gives them."""
    if not url.startswith(SENTINEL_SCHEMES):
        parts = urlsplit(url)
        return parts.username, parts.password, parts.query
    # urlsplit refuses a host list with an IPv6 address after the first host.
    authority, _, path = _split_scheme(url)[1].partition("/")
    userinfo, at, _ = authority.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return (user if at else None), (password if colon else None), path.partition("?")[2]


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


def _host_shown(tail: str, schemeless: bool, host_list: bool = False) -> str:
    # What follows the userinfo, if it reads as a host and port; else as much of it as does,
    # "***" for the rest: a password typed without its host lands here.
    authority = re.split(r"[/?#]", tail, maxsplit=1)[0]
    if host_list:  # a Sentinel URL: host:port,host:port...; all of it reads so, or none shows
        ok = all(re.fullmatch(r"(\[[0-9A-Fa-f:.]*\]|[\w.%-]+)(:\d+)?", item)
                 for item in authority.split(","))
        return tail if ok else "***"
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
    prefix, rest = _split_scheme(_mask_known(str(value)))
    if _query_password_before_at(rest):
        # "password=" before the last "@": in a query password holding an "@", or in a
        # password of the userinfo holding "?password=". Each reading hides what the other
        # would show: both are applied, and nothing after the user remains.
        return prefix + _mask_userinfo(rest.rpartition("@")[0]).removesuffix("@")
    # Else a query password first: an "@" in it must not be taken for the userinfo's end.
    userinfo, at, tail = _redact_query(rest).rpartition("@")
    host_list = prefix.startswith(SENTINEL_SCHEMES)
    return (prefix + (_mask_userinfo(userinfo) if at else "")
            + _host_shown(tail, not prefix, host_list))


def _query_password_before_at(rest: str) -> bool:
    q = _QUERY_PASSWORD_RE.search(rest)
    return q is not None and q.start() < rest.rfind("@")


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
    text = _mask_known(str(text))
    m = _SCHEME_RE.search(text)
    if m is not None and _query_password_before_at(text[m.end():]):
        # As in redact_endpoint: both readings of "password=" before the last "@" at once.
        return text[:m.end()] + _mask_userinfo(text[m.end():].rpartition("@")[0]).removesuffix("@")
    text = _redact_query(text)
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
    _remember(password)
    if url.startswith(SENTINEL_SCHEMES):  # a host list urlsplit may refuse: see _url_credentials
        prefix, rest = _split_scheme(url)
        authority, slash, path = rest.partition("/")
        userinfo, at, hosts = authority.rpartition("@")
        user = userinfo.partition(":")[0] if at else ""
        return f"{prefix}{user}:{quote(password, safe='')}@{hosts}{slash}{path}"
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] if at else ""
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
    if _url_credentials(endpoint.url)[1]:
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


# -- Redis Cluster ----------------------------------------------------------------------------

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


def _name_cluster_connections(client: Any, name: str) -> None:
    """:func:`_name_connections` for every node of an asyncio cluster client, present and
    future (nodes are made from the client's connection settings as the slot map names them)."""
    named = _named_class(client.connection_kwargs["connection_class"], name)
    client.connection_kwargs["connection_class"] = named
    client.nodes_manager.connection_kwargs["connection_class"] = named
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = named


def is_cluster(client: Any) -> bool:
    """Whether ``client`` (from :func:`make_client` or :func:`make_async_client`) talks to a
    Redis Cluster."""
    return isinstance(client, (redis.cluster.RedisCluster, aioredis.cluster.RedisCluster))


def socket_timeout_of(client: Any) -> float | None:
    """The socket timeout of ``client``'s connections (``None``: none)."""
    if isinstance(client, redis.cluster.RedisCluster):
        kw = client.nodes_manager.connection_kwargs
    elif isinstance(client, aioredis.cluster.RedisCluster):
        kw = client.connection_kwargs
    else:
        kw = client.connection_pool.connection_kwargs
    return kw.get("socket_timeout")


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


# -- Sentinel -------------------------------------------------------------------------------


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


def username_of(endpoint: Endpoint) -> str | None:
    """The ACL user named in the URL, if any (for messages and read-only checks)."""
    user = _url_credentials(endpoint.url)[0]
    return unquote(user) if user else None
