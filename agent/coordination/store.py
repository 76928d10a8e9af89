"""A key/value store on Redis with the semantics of torch's c10d ``Store``, plus barriers.

:class:`RedisStore` behaves like ``torch.distributed.TCPStore`` (set, get, add,
compare_set, wait, check, delete_key, num_keys, list_keys, multi_get, multi_set, append,
queue_push, queue_pop, queue_len), but its state lives in Redis, so it survives any single
host and needs no master process.
It does not import torch: ``agent.torch_compat.TorchRedisStore`` adapts it to
``torch.distributed.Store`` for ``init_process_group`` and torch elastic.

Layout (see ``keyspace.JobKeys``)
    One namespace is one Redis hash, ``JobKeys(job).store(namespace)``: field = store key,
    value = bytes. So ``num_keys`` is ``HLEN``, ``delete_key`` is ``HDEL``, ``add`` is
    ``HINCRBY`` and ``multi_get`` is one round trip. Every write also appends the written
    key's name (field ``k``) to the namespace's notify stream,
    ``JobKeys(job).store_notify(namespace)``, in the same Lua script, so the write and its
    notification are one atomic step. A queue is a Redis list,
    ``JobKeys(job).store_queue(namespace, queue)``, in the job's slot too; a push appends
    the queue's name (field ``q``) to the same notify stream, in the same script.

Blocking reads
    ``get``, ``wait`` and ``multi_get`` are woken by Redis, never by a polling tick: a
    script returns, atomically, which keys are missing and the notify stream's last id;
    the caller then ``XREAD BLOCK``\\ s from that id on a second client whose socket
    timeout exceeds its block time, and re-checks when an entry names a missing key.
    A write that lands after the check has a larger id than the one returned, so it is
    never missed. A blocking ``queue_pop`` works the same way (its pop and the stream's last
    id are one script).

Timeouts
    A timeout of ``0`` means "no deadline" (c10d's ``kNoTimeout``, as HashStore and FileStore
    read it). A wait that runs out raises :class:`StoreTimeoutError`, naming the keys still
    missing. Redis ends a blocked command that ran out only on its ``hz`` tick (every 100 ms
    by default), so the last block of a wait is ended by the client instead: it waits for
    the reply until the deadline and, if none came, drops that connection (its reply is
    still due) and raises; the next read opens a new one. A wait returns within a few
    milliseconds of its timeout whatever the server's ``hz`` (``bench/store_wait_bench.py``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import redis
import redis.cluster

from elastic_agent.coordination.transport.connection import (
    RedisUnavailableError,
    describe_endpoint,
    explain_error,
    make_client,
    socket_timeout_of,
)
from elastic_agent.coordination.transport.endpoints import Endpoint, parse_endpoint
from elastic_agent.coordination.transport.pressure import OOM, is_oom
from elastic_agent.coordination.wire.keyspace import NOTIFY_MAXLEN, JobKeys

T = TypeVar("T")

__all__ = [
    "DEFAULT_TIMEOUT",
    "LIST_KEYS_MAX",
    "RedisStore",
    "RedisUnavailableError",
    "StoreOutOfMemoryError",
    "StoreQueueEmptyError",
    "StoreTimeoutError",
    "StoreTooManyKeysError",
]

#: torch's default store timeout (c10d ``kDefaultTimeout``).
DEFAULT_TIMEOUT = 300.0

#: The longest single ``XREAD BLOCK``; a wait with a longer deadline loops over chunks.
#: Short enough that a half-open TCP connection is noticed, long enough to cost nothing.
BLOCK_CHUNK_MS = 30_000

#: Entries read per XREAD. A full batch means the reader lags; it then re-checks rather
#: than trusting the stream, because ``MAXLEN ~`` may have trimmed the entry it needs.
_READ_COUNT = 512

#: The most keys one ``list_keys`` returns: a namespace that holds more is refused (one
#: clear error) rather than copied into the caller's memory.
LIST_KEYS_MAX = 1_000_000

#: Fields one ``HSCAN`` step visits: ``list_keys`` pages through a namespace in steps this
#: size, so no single call holds Redis for long, whatever the namespace's size.
_LIST_KEYS_PAGE = 1000

Value = bytes | bytearray | memoryview | str
Timeout = float | int | timedelta

# -- Lua scripts: every key is passed in KEYS (cluster-safe: both share the {job} tag) -----

# KEYS[1] hash, KEYS[2] notify stream; ARGV[1] maxlen, ARGV[2..] key, value, key, value...
_SET_LUA = """
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'k', ARGV[i])
end
return 1
"""

# KEYS[1] hash, KEYS[2] notify stream; ARGV[1] maxlen, ARGV[2] key, ARGV[3] increment
_ADD_LUA = """
local v = redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'k', ARGV[2])
return v
"""

# KEYS[1] hash, KEYS[2] notify stream; ARGV[1] maxlen, ARGV[2] key, ARGV[3] suffix
_APPEND_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[2])
if not cur then cur = '' end
redis.call('HSET', KEYS[1], ARGV[2], cur .. ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'k', ARGV[2])
return 1
"""

# TCPStore's compareSet: a missing key is set only when ``expected`` is empty; otherwise
# ``expected`` itself is returned. An existing key is replaced only when it equals
# ``expected``. The reply is the value the key holds afterwards (or ``expected``).
# KEYS[1] hash, KEYS[2] notify stream; ARGV[1] maxlen, ARGV[2] key, ARGV[3] expected,
# ARGV[4] desired
_COMPARE_SET_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[2])
if (not cur and ARGV[3] == '') or (cur and cur == ARGV[3]) then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'k', ARGV[2])
  return ARGV[4]
end
if not cur then return ARGV[3] end
return cur
"""

# The check and the stream's last id come from one atomic step: a write after it gets a
# larger id, so an XREAD from that id cannot miss it.
# KEYS[1] hash, KEYS[2] notify stream; ARGV[1] '1' to return values (else 1/0 presence),
# ARGV[2..] keys. Reply: {last_id, value-or-false | 1/0 ...}
_CHECK_LUA = """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local out = {'0-0'}
if #last > 0 then out[1] = last[1][1] end
for i = 2, #ARGV do
  if ARGV[1] == '1' then
    out[i] = redis.call('HGET', KEYS[1], ARGV[i])
  else
    out[i] = redis.call('HEXISTS', KEYS[1], ARGV[i])
  end
end
return out
"""

# One HSCAN step that returns the fields only: the values (possibly large) stay in Redis.
# KEYS[1] hash; ARGV[1] cursor, ARGV[2] count. Reply: {next_cursor, field, field, ...}
_LIST_KEYS_LUA = """
local page = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local out = {page[1]}
local items = page[2]
for i = 1, #items, 2 do out[#out + 1] = items[i] end
return out
"""

# KEYS[1] queue list, KEYS[2] notify stream; ARGV[1] maxlen, ARGV[2] queue name, ARGV[3] value
_QUEUE_PUSH_LUA = """
redis.call('RPUSH', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'q', ARGV[2])
return 1
"""

# The pop, and when the queue is empty the notify stream's last id, in one step (as
# _CHECK_LUA): a push after it gets a larger id. KEYS[1] queue list, KEYS[2] notify stream.
# Reply: {1, value} or {0, last_id}.
_QUEUE_POP_LUA = """
local v = redis.call('LPOP', KEYS[1])
if v then return {1, v} end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last > 0 then return {0, last[1][1]} end
return {0, '0-0'}
"""


class StoreTimeoutError(TimeoutError):
    """A blocking store operation ran past its deadline.

    ``keys`` are the keys still missing when it gave up; ``timeout`` is in seconds.
    """

    def __init__(self, message: str, keys: Sequence[str] = (), timeout: float = 0.0) -> None:
        super().__init__(message)
        self.keys = list(keys)
        self.timeout = timeout


class StoreOutOfMemoryError(StoreTimeoutError):
    """Redis refused a store write for lack of memory until the store's deadline."""


class StoreQueueEmptyError(LookupError):
    """``queue_pop(block=False)`` found the queue empty (torch's ``QueueEmptyError``)."""


class StoreTooManyKeysError(ValueError):
    """``list_keys`` was refused: the namespace holds more keys than one call returns."""


def _seconds(timeout: Timeout) -> float:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"a store timeout is seconds or a timedelta, not {type(timeout).__name__}")
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"a store timeout cannot be negative (got {seconds} s)")
    return seconds


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds:.1f}" if round(seconds, 1) == seconds else f"{seconds:g}"


def _key_name(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bytes):
        return key.decode("utf-8")
    raise TypeError(f"a store key must be str or bytes, not {type(key).__name__} ({key!r})")


def _value_bytes(key: str, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(
        f"the value of store key {key!r} must be bytes or str, not {type(value).__name__}"
    )


def _quoted(keys: Sequence[str]) -> str:
    return ", ".join(repr(k) for k in keys)


class RedisStore:
    """A c10d-style key/value store in one Redis hash, woken by a notify stream.

    Args:
        endpoint: where Redis is (an ``Endpoint`` or anything ``connection.make_client``
            accepts: ``host``, ``host:port``, ``redis://...``).
        job_id: the job the store belongs to (its keys are ``elastic:{job_id}:store:...``).
        namespace: the store's name within the job; stores with different namespaces
            share nothing.
        timeout: default deadline in seconds (or a ``timedelta``) of ``get``, ``wait`` and
            ``multi_get``; ``0`` waits without a deadline.

    The store is safe to share between threads: each blocking wait holds its own
    connection of the reader client's pool. Redis errors that outlive the clients' retries
    are raised as :class:`~elastic_agent.coordination.transport.connection.RedisUnavailableError`.
    """

    def __init__(
        self,
        endpoint: Endpoint | str | None,
        job_id: str,
        namespace: str,
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> None:
        ep = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
        writer = make_client(ep)
        reader = make_client(ep, blocking_ms=BLOCK_CHUNK_MS)
        self._setup(writer, reader, job_id, namespace, timeout, ep, owns_clients=True)

    @classmethod
    def from_clients(
        cls,
        writer: redis.Redis,
        reader: redis.Redis | None,
        job_id: str,
        namespace: str,
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> RedisStore:
        """A store on clients the caller already has (and keeps: ``close`` leaves them open).

        ``reader`` serves blocking reads; its socket timeout bounds the block time (a
        client from ``make_client(ep, blocking_ms=...)`` is right). ``None`` uses
        ``writer`` for them too, with blocks kept under its socket timeout. Both clients
        must return bytes (``decode_responses=False``).
        """
        store = cls.__new__(cls)
        store._setup(writer, writer if reader is None else reader, job_id, namespace, timeout, None,
                     owns_clients=False)
        return store

    def _setup(
        self,
        writer: redis.Redis,
        reader: redis.Redis,
        job_id: str,
        namespace: str,
        timeout: Timeout,
        endpoint: Endpoint | None,
        *,
        owns_clients: bool,
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"a store namespace must be a non-empty string, not {namespace!r}")
        keys = JobKeys(job_id)
        self._job_id = job_id
        self._namespace = namespace
        self._hash = keys.store(namespace)
        self._notify = keys.store_notify(namespace)
        self._endpoint = endpoint
        self._writer = writer
        self._reader = reader
        self._owns_clients = owns_clients
        self._where = describe_endpoint(writer)
        self._timeout = _seconds(timeout)
        self._chunk_ms = _block_chunk_ms(reader)
        self._set_script = writer.register_script(_SET_LUA)
        self._add_script = writer.register_script(_ADD_LUA)
        self._append_script = writer.register_script(_APPEND_LUA)
        self._compare_set_script = writer.register_script(_COMPARE_SET_LUA)
        self._check_script = writer.register_script(_CHECK_LUA)
        self._list_keys_script = writer.register_script(_LIST_KEYS_LUA)
        self._queue_push_script = writer.register_script(_QUEUE_PUSH_LUA)
        self._queue_pop_script = writer.register_script(_QUEUE_POP_LUA)

    # -- identity and lifetime -----------------------------------------------------------

    @property
    def job_id(self) -> str:
        return self._job_id

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def endpoint(self) -> Endpoint | None:
        """The endpoint the store was built for; ``None`` when built ``from_clients``."""
        return self._endpoint

    @property
    def timeout(self) -> timedelta:
        """The default deadline of blocking operations (``timedelta(0)``: none)."""
        return timedelta(seconds=self._timeout)

    @property
    def timeout_seconds(self) -> float:
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default deadline (seconds or ``timedelta``; ``0`` waits without one)."""
        self._timeout = _seconds(timeout)

    def clone(self) -> RedisStore:
        """A new store on the same endpoint, job and namespace, with its own connections.

        A store built ``from_clients`` has no endpoint of its own: its clone shares the
        caller's clients (they are thread-safe connection pools).
        """
        if self._endpoint is not None:
            return RedisStore(self._endpoint, self._job_id, self._namespace, self._timeout)
        return RedisStore.from_clients(
            self._writer, self._reader, self._job_id, self._namespace, self._timeout
        )

    def close(self) -> None:
        """Close the store's own clients (not those passed to ``from_clients``)."""
        if self._owns_clients:
            self._writer.close()
            self._reader.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RedisStore({self._where!r}, job_id={self._job_id!r}, "
                f"namespace={self._namespace!r})")

    # -- writes ------------------------------------------------------------------------

    def set(self, key: str | bytes, value: Value) -> None:
        """Set ``key`` to ``value`` (bytes, or str encoded as UTF-8), waking its waiters."""
        name = _key_name(key)
        data = _value_bytes(name, value)
        self._write(name, lambda: self._set_script(keys=[self._hash, self._notify],
                                                   args=[NOTIFY_MAXLEN, name, data]))

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[Value]) -> None:
        """Set every key to the value at the same position, atomically."""
        names = [_key_name(k) for k in keys]
        if len(names) != len(values):
            raise ValueError(
                f"multi_set got {len(names)} keys but {len(values)} values"
            )
        if not names:
            return
        args: list[Any] = [NOTIFY_MAXLEN]
        for name, value in zip(names, values, strict=True):
            args += [name, _value_bytes(name, value)]
        self._write(names[0], lambda: self._set_script(keys=[self._hash, self._notify],
                                                       args=args))

    def add(self, key: str | bytes, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (a missing key counts as 0); return it.

        Raises ``ValueError`` naming the key when its value is not an integer.
        """
        name = _key_name(key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(
                f"the amount added to store key {name!r} must be an int, "
                f"not {type(amount).__name__}"
            )
        try:
            return int(self._write(name, lambda: self._add_script(
                keys=[self._hash, self._notify], args=[NOTIFY_MAXLEN, name, amount])))
        except redis.ResponseError as exc:
            if "not an integer" in str(exc) or "overflow" in str(exc):
                raise ValueError(
                    f"cannot add to store key {name!r}: its value is not a 64-bit integer "
                    f"({self._describe()})"
                ) from None
            raise

    def append(self, key: str | bytes, value: Value) -> None:
        """Append ``value`` to the bytes at ``key`` (creating it when missing)."""
        name = _key_name(key)
        data = _value_bytes(name, value)
        self._write(name, lambda: self._append_script(keys=[self._hash, self._notify],
                                                      args=[NOTIFY_MAXLEN, name, data]))

    def compare_set(self, key: str | bytes, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; TCPStore's exact semantics.

        * key missing, ``expected == b""``: set ``desired``, return ``desired``;
        * key missing, ``expected`` non-empty: change nothing, return ``expected``;
        * key holds ``expected``: set ``desired``, return ``desired``;
        * otherwise: change nothing, return the current value.
        """
        name = _key_name(key)
        exp = _value_bytes(name, expected)
        des = _value_bytes(name, desired)
        return bytes(self._write(name, lambda: self._compare_set_script(
            keys=[self._hash, self._notify], args=[NOTIFY_MAXLEN, name, exp, des])))

    def delete_key(self, key: str | bytes) -> bool:
        """Delete ``key``; ``True`` if it existed."""
        name = _key_name(key)
        with self._errors():
            return bool(self._writer.hdel(self._hash, name))

    def delete_keys(self, keys: Sequence[str | bytes]) -> int:
        """Delete several keys in one round trip; return how many existed."""
        names = [_key_name(k) for k in keys]
        if not names:
            return 0
        with self._errors():
            return int(self._writer.hdel(self._hash, *names))

    # -- reads -------------------------------------------------------------------------

    def get(self, key: str | bytes, *, timeout: Timeout | None = None) -> bytes:
        """The value of ``key``, waiting until it exists.

        ``timeout`` (seconds or ``timedelta``) defaults to the store's; running out raises
        :class:`StoreTimeoutError` naming the key.
        """
        value = self._await([_key_name(key)], timeout, fetch=True)[0]
        assert value is not None
        return value

    def multi_get(
        self, keys: Sequence[str | bytes], *, timeout: Timeout | None = None
    ) -> list[bytes]:
        """The values of ``keys`` in order, waiting until all of them exist."""
        values = self._await([_key_name(k) for k in keys], timeout, fetch=True)
        return [v for v in values if v is not None]

    def wait(self, keys: Sequence[str | bytes], timeout: Timeout | None = None) -> None:
        """Return once every key exists; raise :class:`StoreTimeoutError` at the deadline.

        ``timeout`` defaults to the store's; ``0`` waits without a deadline.
        """
        self._await([_key_name(k) for k in keys], timeout, fetch=False)

    def check(self, keys: Sequence[str | bytes]) -> bool:
        """Whether every key exists, without waiting."""
        names = [_key_name(k) for k in keys]
        if not names:
            return True
        _, present = self._check(names, fetch=False)
        return all(present)

    def num_keys(self) -> int:
        """How many keys the namespace holds (its queues are not keys: see ``queue_push``)."""
        with self._errors():
            return int(self._writer.hlen(self._hash))

    def list_keys(self, max_keys: int = LIST_KEYS_MAX) -> list[str]:
        """The names of the namespace's keys, in no particular order (not its queues).

        Read in ``HSCAN`` steps of about 1,000 fields, values left in Redis, so a big
        namespace never holds Redis in one long call. A namespace of more than ``max_keys``
        keys (default :data:`LIST_KEYS_MAX`) raises :class:`StoreTooManyKeysError` rather
        than filling the caller's memory. A key written or deleted during the scan may be
        listed or not (``HSCAN``'s guarantee); every key present throughout is listed once.
        A key name that is not UTF-8 (written by something else than a store) is listed
        with its bad bytes as ``\\x..`` escapes.
        """
        with self._errors():
            held = int(self._writer.hlen(self._hash))
        if held > max_keys:
            raise self._too_many_keys(held, max_keys)
        names: dict[str, None] = {}  # HSCAN may return a field twice while Redis rehashes
        cursor: bytes | int = 0
        while True:
            with self._errors():
                reply = self._list_keys_script(keys=[self._hash],
                                               args=[cursor, _LIST_KEYS_PAGE])
            cursor = reply[0]
            for field in reply[1:]:
                names[bytes(field).decode("utf-8", "backslashreplace")] = None
            if len(names) > max_keys:  # it grew while we read
                raise self._too_many_keys(len(names), max_keys)
            if cursor in (b"0", 0, "0"):
                return list(names)

    def _too_many_keys(self, held: int, max_keys: int) -> StoreTooManyKeysError:
        return StoreTooManyKeysError(
            f"{self._describe()} holds {held} keys, more than the {max_keys} one list_keys "
            f"call returns; read known keys with multi_get, or pass a larger max_keys")

    # -- queues ------------------------------------------------------------------------

    def queue_push(self, queue: str | bytes, value: Value) -> None:
        """Append ``value`` to ``queue`` (created when missing), waking a blocked pop.

        A queue is not a key: ``get``, ``check``, ``wait``, ``num_keys`` and ``list_keys``
        do not see it, as in torch's HashStore. A queue still holding values when its
        namespace is dropped stays until the job's records expire.
        """
        name = _key_name(queue)
        data = _value_bytes(name, value)
        self._write(name, lambda: self._queue_push_script(
            keys=[self._queue_key(name), self._notify], args=[NOTIFY_MAXLEN, name, data]))

    def queue_pop(self, queue: str | bytes, block: bool = True, *,
                  timeout: Timeout | None = None) -> bytes:
        """Take the oldest value of ``queue``.

        ``block=False`` raises :class:`StoreQueueEmptyError` at once on an empty queue;
        otherwise it waits for a push until ``timeout`` (default the store's; ``0`` waits
        without a deadline), then raises :class:`StoreTimeoutError`. Each value goes to
        exactly one pop.
        """
        name = _key_name(queue)
        list_key = self._queue_key(name)
        seconds = self._timeout if timeout is None else _seconds(timeout)
        deadline = None if seconds == 0 else time.monotonic() + seconds
        while True:
            with self._errors():
                found, payload = self._queue_pop_script(keys=[list_key, self._notify])
            if found:
                return bytes(payload)
            if not block:
                raise StoreQueueEmptyError(f"queue {name!r} in {self._describe()} is empty")
            if _past(deadline) or self._block_until_written(
                    {name.encode("utf-8")}, payload, deadline, field=b"q"):
                raise StoreTimeoutError(
                    f"timeout after {_fmt_seconds(seconds)} s waiting for a value in queue "
                    f"{name!r} in {self._describe()}", [name], seconds)

    def queue_len(self, queue: str | bytes) -> int:
        """How many values ``queue`` holds (0 for a queue never pushed to)."""
        with self._errors():
            return int(self._writer.llen(self._queue_key(_key_name(queue))))

    def _queue_key(self, name: str) -> str:
        return JobKeys(self._job_id).store_queue(self._namespace, name)

    # -- internals ---------------------------------------------------------------------

    def _describe(self) -> str:
        return f"store namespace {self._namespace!r} of job {self._job_id!r}"

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn connection failures that outlived the clients' retries into one sentence."""
        try:
            yield
        except StoreTimeoutError:
            raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise explain_error(exc, self._where) from exc
        except redis.ResponseError as exc:
            text = str(exc)
            if text.startswith(("NOPERM", "NOAUTH", "WRONGPASS")):
                raise explain_error(exc, self._where) from exc
            raise

    def _write(self, name: str, call: Callable[[], T]) -> T:
        """Run a write script, retrying while Redis refuses it for lack of memory (each
        script is checked at its first write, so a refused one changed nothing) until the
        store's deadline; then :class:`StoreOutOfMemoryError`."""
        deadline = None if self._timeout == 0 else time.monotonic() + self._timeout
        delay = 0.05
        while True:
            try:
                with self._errors():
                    result = call()
            except redis.ResponseError as exc:
                if not is_oom(exc):
                    raise
                OOM.refused()  # reported once per episode for the whole process
                if deadline is not None and time.monotonic() >= deadline:
                    raise StoreOutOfMemoryError(
                        f"Redis refused to write key {name!r} in {self._describe()} for "
                        f"{_fmt_seconds(self._timeout)} s: it is out of memory (maxmemory)",
                        [name], self._timeout) from None
                self._pause(delay)
                delay = min(delay * 2, 1.0)
                continue
            OOM.accepted()
            return result

    def _pause(self, seconds: float) -> None:
        """The backoff between refused writes (nothing signals that memory was freed).
        Subclasses whose waits can be abandoned override it to notice that."""
        time.sleep(seconds)

    def _check(self, names: list[str], *, fetch: bool) -> tuple[bytes, list[Any]]:
        with self._errors():
            reply = self._check_script(
                keys=[self._hash, self._notify], args=["1" if fetch else "0", *names]
            )
        last_id = reply[0]
        found = list(reply[1:])
        if len(found) < len(names):  # Lua drops trailing nils from a table
            found += [None] * (len(names) - len(found))
        if fetch:
            return last_id, found
        return last_id, [bool(x) for x in found]

    def _await(self, names: list[str], timeout: Timeout | None, *,
               fetch: bool) -> list[bytes | None]:
        if not names:
            return []
        seconds = self._timeout if timeout is None else _seconds(timeout)
        deadline = None if seconds == 0 else time.monotonic() + seconds
        while True:
            last_id, found = self._check(names, fetch=fetch)
            missing = [n for n, v in zip(names, found, strict=True) if v is None or v is False]
            if not missing:
                return [bytes(v) if isinstance(v, (bytes, bytearray)) else None for v in found]
            if _past(deadline) or self._block_until_written(
                    {n.encode("utf-8") for n in missing}, last_id, deadline):
                raise StoreTimeoutError(
                    f"timeout after {_fmt_seconds(seconds)} s waiting for key(s) "
                    f"{_quoted(missing)} in {self._describe()}",
                    missing, seconds,
                )

    def _block_until_written(self, wanted: set[bytes], last_id: bytes,
                             deadline: float | None, field: bytes = b"k") -> bool:
        """Read the notify stream from ``last_id`` until an entry's ``field`` (``k`` a key,
        ``q`` a queue) names a wanted one, a block chunk ends, or the deadline passes; the
        caller then looks again. ``True`` (timed out) when the deadline passed and nothing
        it waits for was written since ``last_id``: the caller raises without another look,
        which would only cost a round trip past the deadline."""
        while True:
            block_ms = self._chunk_ms
            last_block = False
            if deadline is not None:
                remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    return True
                if remaining_ms <= block_ms:
                    block_ms, last_block = remaining_ms, True
            with self._errors():
                # Always an explicit id (never '$'): a retried XREAD re-sends it and sees
                # every entry written while the connection was down.
                if last_block:
                    assert deadline is not None
                    reply = self._xread_until(last_id, block_ms, deadline)
                else:
                    reply = self._reader.xread({self._notify: last_id}, count=_READ_COUNT,
                                               block=block_ms)
            if not reply or not reply[0][1]:
                return _past(deadline)
            entries = reply[0][1]
            last_id = entries[-1][0]
            if len(entries) >= _READ_COUNT:
                return False  # a trim may have cut what it waits for: look again
            for _entry_id, fields in entries:
                if fields.get(field) in wanted:
                    return False

    def _xread_until(self, last_id: bytes, block_ms: int, deadline: float) -> Any:
        """The XREAD of a wait's last block, over by ``deadline`` (monotonic) whatever the
        server's ``hz``: see the module's Timeouts. ``None`` when it ran out."""
        node = _deadline_client(self._reader, self._notify)
        if node is None:  # a client whose connections are not ours to hold (a bridge)
            return self._reader.xread({self._notify: last_id}, count=_READ_COUNT,
                                      block=block_ms)
        pool = node.connection_pool
        conn = pool.get_connection()
        try:
            return conn.retry.call_with_retry(
                lambda: self._xread_on(node, conn, last_id, deadline),
                lambda _error: conn.disconnect())
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.MovedError,
                redis.exceptions.AskError, redis.exceptions.TryAgainError,
                redis.exceptions.ClusterDownError):
            if node is self._reader:
                raise
            # A cluster's node failed or gave the slot away: the cluster client follows
            # that (its retries, a new slot map); this one block may end late.
            remaining_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            return self._reader.xread({self._notify: last_id}, count=_READ_COUNT,
                                      block=remaining_ms)
        finally:
            pool.release(conn)

    def _xread_on(self, node: redis.Redis, conn: Any, last_id: bytes,
                  deadline: float) -> Any:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        # The server's own block is the whole remaining time, so it never answers early.
        conn.send_command("XREAD", "COUNT", _READ_COUNT, "BLOCK",
                          max(1, math.ceil(remaining * 1000)), "STREAMS", self._notify, last_id)
        if not conn.can_read(timeout=max(0.0, deadline - time.monotonic())):
            # Still blocked at the deadline: the reply will come, so this connection cannot
            # carry another command. Dropped; the pool reconnects it on its next use.
            conn.disconnect()
            return None
        return node.parse_response(conn, "XREAD")


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _deadline_client(reader: Any, key: str) -> redis.Redis | None:
    """The plain client whose pool serves ``key``'s blocking reads: ``reader`` itself or, on
    a cluster, the client of the node that holds ``key``'s slot. ``None`` for anything else
    (the agent's bridge to its asyncio client), whose blocks end on the server's clock."""
    kind = type(reader)  # not isinstance: a bridge passes for the client it stands for
    if issubclass(kind, redis.cluster.RedisCluster):
        try:
            return reader.get_redis_connection(reader.get_node_from_key(key))
        except (redis.RedisError, redis.exceptions.RedisClusterException):
            return None  # no slot map yet: the cluster client's own read finds one
    if issubclass(kind, redis.Redis) and reader.connection is None:  # not single-connection
        return reader
    return None


def _block_chunk_ms(reader: redis.Redis) -> int:
    """The longest XREAD BLOCK this reader can send without its socket timing out first."""
    socket_timeout = socket_timeout_of(reader)
    if socket_timeout is None:
        return BLOCK_CHUNK_MS
    # Keep a margin for the reply to travel; a tiny socket timeout still blocks briefly.
    return max(50, min(BLOCK_CHUNK_MS, int((float(socket_timeout) - 1.0) * 1000)))
