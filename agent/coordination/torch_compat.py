"""Adapters between elastic_console and ``torch.distributed``: the only module that imports torch.

``elastic-agent`` must start, launch and supervise workers without torch installed, so
nothing else in the package imports torch (an import-linter contract enforces it) and
nothing imports this module at import time: callers import it lazily, inside the function
that needs it.

:class:`TorchRedisStore`
    :class:`~elastic_agent.coordination.store.RedisStore` as a ``torch.distributed.Store``,
    for ``init_process_group(store=...)``, ``PrefixStore`` and torch elastic.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import redis
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_agent.coordination.rendezvous.drivers import RedisRendezvous
from elastic_agent.coordination.rendezvous.types import RendezvousSettings
from elastic_agent.coordination.store import (
    DEFAULT_TIMEOUT,
    RedisStore,
    StoreQueueEmptyError,
    StoreTimeoutError,
)
from elastic_agent.coordination.transport.connection import RedisUnavailableError, explain_error
from elastic_agent.coordination.transport.endpoints import (
    Endpoint,
    EndpointError,
    parse_endpoint,
    with_outside_password,
)

from .rendezvous import types as rendezvous_types

log = logging.getLogger(__name__)

__all__ = ["LogPlan", "LogsSpecsPlugin", "TorchRedisStore"]


@contextlib.contextmanager
def _as_torch_errors() -> Iterator[None]:
    """Raise our errors as the ``DistError`` subclasses torch's code paths catch.

    Both are ``RuntimeError``\\ s: ``_store_based_barrier`` and torch elastic catch that
    (and ``DistStoreError``) around ``wait``; the message is kept word for word.
    """
    try:
        yield
    except StoreTimeoutError as exc:
        raise dist.DistStoreError(str(exc)) from exc
    except StoreQueueEmptyError as exc:
        raise dist.QueueEmptyError(str(exc)) from exc
    except RedisUnavailableError as exc:
        raise dist.DistNetworkError(str(exc)) from exc


# A store handed to C++ (PrefixStore, a process group, a clone torch asked for) is used
# through pybind11's trampoline, which finds the Python overrides through the Python
# object. C++ holding the store does not keep that object alive: once Python drops it,
# every call from C++ fails with "pure virtual function". So every open store is held
# here until close().
_OPEN: set[TorchRedisStore] = set()
_OPEN_LOCK = threading.Lock()


def _timedelta(timeout: timedelta | float | int) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


class TorchRedisStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in Redis (see ``RedisStore``).

    ``TorchRedisStore(redis_store)`` wraps an existing :class:`RedisStore`;
    ``TorchRedisStore(endpoint, job_id, namespace, timeout=300.0)`` builds one.

    Works with ``dist.init_process_group("gloo", store=s, rank=r, world_size=n)`` and
    inside ``dist.PrefixStore``. The default deadline is the c10d ``timeout`` of the store
    (``set_timeout``; ``timedelta(0)`` waits forever, as c10d's ``kNoTimeout``). Timeouts
    raise ``torch.distributed.DistStoreError`` and an unreachable Redis
    ``torch.distributed.DistNetworkError``, both with our message.

    The store stays alive (for C++ holders) until :meth:`close`.
    """

    def __init__(
        self,
        store_or_endpoint: RedisStore | Endpoint | str | None,
        job_id: str | None = None,
        namespace: str | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        if isinstance(store_or_endpoint, RedisStore):
            if job_id is not None or namespace is not None:
                raise TypeError("TorchRedisStore(RedisStore) takes no job_id or namespace")
            self._store = store_or_endpoint
        else:
            if job_id is None or namespace is None:
                raise TypeError("TorchRedisStore(endpoint, job_id, namespace) needs all three")
            self._store = RedisStore(store_or_endpoint, job_id, namespace, _timedelta(timeout))
        # The C++ base keeps the timeout torch reads and sets (Store::timeout_).
        super().set_timeout(self._store.timeout)
        with _OPEN_LOCK:
            _OPEN.add(self)

    @property
    def redis_store(self) -> RedisStore:
        """The wrapped :class:`RedisStore`."""
        return self._store

    def close(self) -> None:
        """Close the Redis clients and let the store be garbage-collected."""
        with _OPEN_LOCK:
            _OPEN.discard(self)
        self._store.close()

    def __repr__(self) -> str:
        return f"TorchRedisStore({self._store!r})"

    def _deadline(self) -> timedelta:
        # Read the C++ value each time: C++ code may set it without going through Python.
        return self.timeout

    # -- c10d Store interface (names as the pybind11 trampoline looks them up) -----------

    def set(self, key: str, value: bytes | str) -> None:
        with _as_torch_errors():
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        with _as_torch_errors():
            return self._store.get(key, timeout=self._deadline())

    def add(self, key: str, value: int) -> int:
        with _as_torch_errors():
            return self._store.add(key, value)

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        with _as_torch_errors():
            return self._store.compare_set(key, expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        with _as_torch_errors():
            self._store.wait(keys, self._deadline() if timeout is None else timeout)

    def check(self, keys: Sequence[str]) -> bool:
        with _as_torch_errors():
            return self._store.check(keys)

    def num_keys(self) -> int:
        with _as_torch_errors():
            return self._store.num_keys()

    def getNumKeys(self) -> int:  # the name C++ looks up
        return self.num_keys()

    def delete_key(self, key: str) -> bool:
        with _as_torch_errors():
            return self._store.delete_key(key)

    def deleteKey(self, key: str) -> bool:  # the name C++ looks up
        return self.delete_key(key)

    # torch's trampoline for Python stores forwards neither listKeys nor the queue calls, so
    # a PrefixStore over this store raises torch's NotImplementedError for them; called on
    # this object they work (docs/TORCHRUN.md).

    def list_keys(self) -> list[str]:
        """Every key of the namespace (paged, bounded: ``RedisStore.list_keys``); keys
        written through a ``PrefixStore`` carry its prefix, as with HashStore."""
        with _as_torch_errors():
            return self._store.list_keys()

    def listKeys(self) -> list[str]:  # the C++ name, should torch ever look it up
        return self.list_keys()

    def queue_push(self, key: str, value: bytes | str) -> None:
        with _as_torch_errors():
            self._store.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest value; ``block=False`` on an empty queue raises
        ``torch.distributed.QueueEmptyError``, a blocking pop ``DistStoreError`` after the
        store's timeout (as HashStore and TCPStore)."""
        with _as_torch_errors():
            return self._store.queue_pop(key, block, timeout=self._deadline())

    def queue_len(self, key: str) -> int:
        with _as_torch_errors():
            return self._store.queue_len(key)

    def append(self, key: str, value: bytes | str) -> None:
        with _as_torch_errors():
            self._store.append(key, value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with _as_torch_errors():
            return self._store.multi_get(keys, timeout=self._deadline())

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        with _as_torch_errors():
            self._store.multi_set(keys, values)

    def has_extended_api(self) -> bool:
        # append, multi_get and multi_set are native here (one round trip each).
        return True

    def set_timeout(self, timeout: timedelta | float) -> None:  # type: ignore[override]
        td = _timedelta(timeout)
        super().set_timeout(td)
        self._store.set_timeout(td)

    def clone(self) -> TorchRedisStore:
        """A store on new connections to the same namespace (torch clones one per thread)."""
        twin = TorchRedisStore(self._store.clone())
        twin.set_timeout(self._deadline())
        return twin


# -- rendezvous ---------------------------------------------------------------------------

def _settings_from(params: RendezvousParameters) -> RendezvousSettings:
    """``--rdzv-conf`` values arrive as strings; times may be fractional seconds. torch's
    ``keep_alive_max_attempt`` (keep-alives missed before a node is dead) sets the heartbeat
    timeout to that many intervals unless ``heartbeat_timeout`` is given, as in elastic-agent.
    Other keys are left alone, as torch's own handlers leave the keys they do not read."""
    def given(key: str) -> str | None:
        value = params.get(key, None)
        return None if value is None or value == "" else str(value)

    def seconds(key: str, default: float) -> float:
        value = given(key)
        if value is None:
            return default
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"--rdzv-conf {key}={value!r} is not a number of seconds") from None

    d = RendezvousSettings()
    interval = seconds("keep_alive_interval", d.keep_alive_interval)
    timeout = seconds("heartbeat_timeout", d.heartbeat_timeout)
    attempts = given("keep_alive_max_attempt")
    if attempts is not None and given("heartbeat_timeout") is None:
        try:
            timeout = int(attempts) * interval
        except ValueError:
            raise ValueError(f"--rdzv-conf keep_alive_max_attempt={attempts!r} is not a "
                             "whole number") from None
    return RendezvousSettings(
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=seconds("join_timeout", d.join_timeout),
        last_call_timeout=seconds("last_call_timeout", d.last_call_timeout),
        heartbeat_timeout=timeout,
        keep_alive_interval=interval,
    )


class RedisRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` over :class:`RedisRendezvous`, meaning what torch's c10d
    handler means (docs/TORCHRUN.md lists where it differs, and why).

    ``next_rendezvous`` returns a store for the round (namespace ``r<round>`` of the job) and
    group rank 0's MASTER_ADDR/MASTER_PORT. ``shutdown`` closes the rendezvous for every node
    and ``num_nodes_waiting`` counts only the nodes that asked to join, as torch's agents
    expect; ``elastic-agent`` drives the same core with its own meanings (it leaves on
    shutdown and re-forms when a node is lost or gone). Errors are torch's rendezvous error
    classes. The handler owns its core: dropped without ``shutdown``, both are collected and
    the node's heartbeats stop, as torch's keep-alive timer stops with its handler.
    """

    def __init__(self, core: RedisRendezvous, store_timeout: float = 300.0) -> None:
        self._core = core
        self._store_timeout = store_timeout

    @property
    def core(self) -> RedisRendezvous:
        return self._core

    def get_backend(self) -> str:
        return self._core.get_backend()

    @property
    def use_agent_store(self) -> bool:
        # False, as torch's abstract handler: torch's agent then lets the workers build their
        # own store on MASTER_ADDR:MASTER_PORT (only c10d's handler shares its TCPStore).
        return self._core.use_agent_store

    @contextlib.contextmanager
    def _torch_errors(self) -> Iterator[None]:
        """Our rendezvous errors (and Redis's, from a plain read) as torch's classes, worded
        for torchrun's flags."""
        try:
            yield
        except rendezvous_types.RendezvousClosedError as exc:
            raise RendezvousClosedError(_for_torchrun(exc)) from None
        except rendezvous_types.RendezvousTimeoutError as exc:
            raise RendezvousTimeoutError(_for_torchrun(exc)) from None
        except rendezvous_types.RendezvousConnectionError as exc:
            raise RendezvousConnectionError(_for_torchrun(exc)) from None
        except rendezvous_types.RendezvousError as exc:
            raise RendezvousError(_for_torchrun(exc)) from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise RendezvousConnectionError(
                str(explain_error(exc, self._core.endpoint.display))) from None

    def next_rendezvous(self) -> RendezvousInfo:
        with self._torch_errors():
            result = self._core.next_rendezvous()
        store = TorchRedisStore(RedisStore(self._core.endpoint, self._core.job_id,
                                           f"r{result.round}", self._store_timeout))
        return RendezvousInfo(
            store, result.group_rank, result.group_world_size,
            RendezvousStoreInfo(result.master_addr, result.master_port),
        )

    def is_closed(self) -> bool:
        with self._torch_errors():
            return self._core.is_closed()

    def set_closed(self) -> None:
        with self._torch_errors():
            self._core.set_closed()

    def num_nodes_waiting(self) -> int:
        """Late arrivals the completed round has room for, and everyone in a newer round
        this node is not in: the nodes that asked to join. A member lost or gone is not one
        (torch's agents never restart for it, pytorch #111646), though it frees its place."""
        with self._torch_errors():
            return self._core.num_nodes_waiting(departures=False)

    def get_run_id(self) -> str:
        return self._core.get_run_id()

    def shutdown(self) -> bool:
        """As torch's c10d handler: stop beating and close the rendezvous for every node
        (torchrun calls this when its agent ends: the others see the job closed, not a
        membership change to restart for). False if Redis could not be told."""
        self._core.stop_heartbeats()
        try:
            self._core.set_closed()
        except (rendezvous_types.RendezvousError, redis.RedisError) as exc:
            message = (_for_torchrun(exc) if isinstance(exc, rendezvous_types.RendezvousError)
                       else str(explain_error(exc, self._core.endpoint.display)))
            log.warning("node %s could not close the rendezvous of %r: %s",
                        self._core.node_id, self._core.job_id, message)
            return False
        finally:
            self._core.close()
        return True


def _for_torchrun(exc: BaseException) -> str:
    # The core speaks elastic-agent's flags; torchrun's user knows the job id as --rdzv-id.
    return str(exc).replace("--job-id", "--rdzv-id")


#: Where the plugin finds Redis when torchrun got no ``--rdzv-endpoint`` (``accelerate
#: launch`` on one machine passes none): elastic-agent's variable.
URL_ENV = "ELASTIC_REDIS_URL"


def _endpoint_from(params: RendezvousParameters) -> Endpoint:
    """``--rdzv-endpoint``, else ``$ELASTIC_REDIS_URL``, else ``redis://127.0.0.1:6379``;
    the password from elastic-agent's sources outside argv when the URL has none
    (``$ELASTIC_REDIS_PASSWORD_FILE``, ``$REDISCLI_AUTH``)."""
    given = (params.endpoint or "").strip()
    source = "--rdzv-endpoint" if given else f"${URL_ENV}"
    try:
        return with_outside_password(parse_endpoint(given or os.environ.get(URL_ENV)))
    except EndpointError as exc:
        raise ValueError(f"{source}: {exc}") from None


def create_handler(params: RendezvousParameters) -> RedisRendezvousHandler:
    """The ``redis`` backend's creator: ``--rdzv-endpoint`` (or ``$ELASTIC_REDIS_URL``) is the
    Redis endpoint (host, host:port or a URL), ``--rdzv-id`` the job id."""
    core = RedisRendezvous(_endpoint_from(params), params.run_id, _settings_from(params),
                           local_addr=params.local_addr)
    return RedisRendezvousHandler(core)


def numa_bound_argv(argv: Sequence[str], gpu_index: int, mode: str) -> list[str]:
    """``argv`` as torchrun 2.13 starts the worker of ``gpu_index`` under
    ``--numa-binding mode``: prefixed with numactl and the CPUs torch picks for that GPU."""
    from torch.numa.binding import AffinityMode, NumaOptions, _maybe_wrap_command_args_with_numa_binding

    return list(_maybe_wrap_command_args_with_numa_binding(
        tuple(argv), gpu_index=gpu_index, numa_options=NumaOptions(affinity_mode=AffinityMode(mode))))


def cuda_device_count() -> int:
    """GPUs torch can see (for ``--nproc-per-node gpu|auto``)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- --logs-specs: a torchrun.logs_specs plugin decides where worker output goes ---------

@dataclass(frozen=True)
class LogPlan:
    """What a ``torch.distributed.elastic.multiprocessing.LogsSpecs`` decided for one attempt
    (its ``LogsDest``), as plain data: local rank -> path. A stdout/stderr path of ``""``
    means the agent's own stream (torch's console), :data:`os.devnull` nothing; a rank in
    ``tee_*`` also goes to the console, prefixed. ``error_files``: ``TORCHELASTIC_ERROR_FILE``.
    """

    stdouts: dict[int, str]
    stderrs: dict[int, str]
    tee_stdouts: dict[int, str]
    tee_stderrs: dict[int, str]
    error_files: dict[int, str]
    filtered_stdout: str = ""
    filtered_stderr: str = ""


class LogsSpecsPlugin:
    """An instance of a ``torchrun.logs_specs`` entry point's class, made as torchrun makes it
    (``log_dir``, ``redirects``, ``tee``, ``local_ranks_filter``)."""

    def __init__(self, name: str, log_dir: str | None, redirects: str, tee: str,
                 local_ranks_filter: set[int] | None) -> None:
        from importlib import metadata

        from torch.distributed.elastic.multiprocessing import LogsSpecs, Std

        (entry,) = metadata.entry_points(group=LOGS_SPECS_GROUP, name=name)
        cls = entry.load()
        if not (isinstance(cls, type) and issubclass(cls, LogsSpecs)):
            raise TypeError(f"{entry.value} is not a LogsSpecs class")
        self.name = name
        self._specs = cls(log_dir=log_dir, redirects=Std.from_str(redirects),
                          tee=Std.from_str(tee), local_ranks_filter=local_ranks_filter)

    @property
    def root_log_dir(self) -> str:
        return str(self._specs.root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogPlan:
        """The plugin's destinations for one attempt; ``envs`` are the workers' environments
        by local rank, which the plugin may change (torch's default sets the error file)."""
        dest = self._specs.reify(envs)
        return LogPlan(
            stdouts={int(k): str(v) for k, v in dest.stdouts.items()},
            stderrs={int(k): str(v) for k, v in dest.stderrs.items()},
            tee_stdouts={int(k): str(v) for k, v in dest.tee_stdouts.items()},
            tee_stderrs={int(k): str(v) for k, v in dest.tee_stderrs.items()},
            error_files={int(k): str(v) for k, v in dest.error_files.items()},
            filtered_stdout=str(dest.filtered_stdout or ""),
            filtered_stderr=str(dest.filtered_stderr or ""))


#: The entry point group torchrun's ``--logs-specs`` names a plugin of.
LOGS_SPECS_GROUP = "torchrun.logs_specs"
