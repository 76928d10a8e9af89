"""Redis endpoints: what an endpoint string names, where its password comes from, how it is shown.

Every client starts from an :class:`Endpoint` that :func:`parse_endpoint` made, and every
message that names a server shows it through this module: the parsing and the redaction live
together because each leans on the other (a parse error shows the endpoint redacted; the
redaction learns every password the parser saw).

A password never leaves this module in clear: every message shows endpoints through
``redact_endpoint`` and other text through ``redact``, both built to fail closed (a password
may hold any character). The recommended way to give a password is outside argv, where ``ps``
cannot see it: ``$REDISCLI_AUTH`` or a password file (:func:`with_outside_password`); a
password that does come in argv is moved out of it at start (:func:`argv_without_passwords`).

The URL forms of Redis Sentinel (``redis+sentinel://``) and Redis Cluster
(``redis+cluster://``) are read here too; what they mean for a client is told in
:mod:`.sentinel` and :mod:`.cluster`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import re
import string
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.connection

DEFAULT_URL = "redis://127.0.0.1:6379"
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379

SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
#: Explicitly a Redis Cluster (no probe): see :mod:`.cluster`.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
# Query keys meant for the sentinels themselves, not for the master's connections.
_SENTINEL_AUTH_KEYS = ("sentinel_username", "sentinel_password")


class EndpointError(ValueError):
    """An endpoint string that names no Redis server."""


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
    or ``redis+sentinel://`` / ``rediss+sentinel://`` (see :mod:`.sentinel`).

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


#: Query options that authenticate (the userinfo's equivalents, and the sentinels' own).
_CREDENTIAL_QUERY_KEYS = frozenset({"username", "password", *_SENTINEL_AUTH_KEYS})


def without_credentials(url: str) -> str:
    """``url`` (a parsed endpoint's) with no user, no password and no credential query option:
    the same server, reached as whoever the server lets in without them. TLS options stay:
    they make the connection possible, they name no Redis user."""
    prefix, rest = _split_scheme(url)
    if url.startswith(SENTINEL_SCHEMES):  # a host list urlsplit may refuse
        authority, slash, path = rest.partition("/")
        rest = authority.rpartition("@")[2] + slash + path
    else:
        netloc = urlsplit(url).netloc
        rest = netloc.rpartition("@")[2] + rest[len(netloc):]
    base, mark, query = rest.partition("?")
    kept = [item for item in query.split("&") if item
            and unquote(item.partition("=")[0]).lower() not in _CREDENTIAL_QUERY_KEYS]
    return prefix + base + ("?" + "&".join(kept) if mark and kept else "")


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


def username_of(endpoint: Endpoint) -> str | None:
    """The ACL user named in the URL, if any (for messages and read-only checks)."""
    user = _url_credentials(endpoint.url)[0]
    return unquote(user) if user else None
