"""`elastic-agent` command line: torchrun's flags (both spellings) plus our own.

``parse_args`` turns argv into an :class:`AgentConfig` or raises :class:`UsageError` with one
line that says what was wrong and what to do; the CLI prints it and exits 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..coordination.rendezvous.types import RendezvousSettings
from ..coordination.transport.endpoints import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    Endpoint,
    EndpointError,
    parse_endpoint,
    with_outside_password,
)
from ..coordination.transport.job_secret import JobSecret
from ..coordination.wire.keyspace import InvalidJobIdError, validate_job_id
from ..coordination.wire.protocol import MAX_RECORD_LIST
from .diagnosis import restart_patterns
from .diagnosis.recorder import DEFAULT_ENTRIES as DEFAULT_FLIGHT_RECORDER
from .diagnosis.recorder import DEFAULT_STRAGGLER_INTERVAL
from .diagnosis.restart_patterns import PatternSettings
from .diagnosis.stacks import parse_stack_signal
from .hosting.slurm import SlurmEnvError, SlurmStep, check_one_task_per_node, gpus_per_node, read_step
from .hosting.slurm_redis import job_secret as slurm_job_secret
from .launch.probes import DEFAULT_SIGNAL as DEFAULT_STACK_SIGNAL
from .launch.worker_env import WORKER_URL_ENV
from .records.log_config import parse_local_ranks_filter, parse_std_spec
from .records.retention import DEFAULT_RETENTION_S, parse_duration


class UsageError(ValueError):
    """A bad command line. The message is one line."""


@dataclass(frozen=True)
class AgentConfig:
    endpoint: Endpoint
    job_id: str
    job_id_generated: bool
    rendezvous: RendezvousSettings
    nproc: int
    max_restarts: int
    monitor_interval: float
    role: str
    entrypoint: list[str]
    log_dir: Path
    redirects: str
    tee: str
    local_ranks_filter: frozenset[int] | None
    log_line_prefix_template: str | None
    local_addr: str | None
    shutdown_timeout: float
    signals_to_handle: tuple[int, ...]
    exit_barrier_timeout: float
    standalone: bool
    log_retention: int
    extra_env: dict[str, str] = field(default_factory=dict)
    #: No --log-dir: ``log_dir`` is a fresh private directory the user must be told about.
    log_dir_generated: bool = False
    #: torchrun's --logs-specs: a ``torchrun.logs_specs`` entry point that decides the log
    #: destinations; ``log_dir`` is then the root handed to it, not our run directory.
    logs_specs: str | None = None
    #: torchrun's --event-log-handler: ``console`` also prints every event on stderr.
    event_log_handler: str = "null"
    #: torchrun's --virtual-local-rank: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES one GPU per worker.
    virtual_local_rank: bool = False
    #: torchrun's --numa-binding mode (workers wrapped with numactl by torch's own rules).
    numa_binding: str | None = None
    #: torchrun's --duplicate-std{out,err}-filters: log_records.STDOUT/STDERR -> needles.
    duplicate_filters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: --rdzv-backend static: this node's fixed group rank, and the given master.
    static: StaticPlacement | None = None
    #: --health-check-port (else $TORCHELASTIC_HEALTH_CHECK_PORT): liveness and /metrics.
    health_check_port: int | None = None
    #: --health-check-host: the address it listens on (default loopback; 0.0.0.0 or :: all).
    health_check_host: str = "127.0.0.1"
    #: --preload: modules a warm zygote imports; workers are forked from it (issue 14).
    preload: tuple[str, ...] = ()
    #: --preload auto (the default): Python workers forked from a zygote, which imports torch
    #: when the script starts by importing it (issue 23).
    preload_auto: bool = True
    #: --retention: seconds a job's keys outlive its end (0: forever; see retention.py).
    retention_s: float = DEFAULT_RETENTION_S
    #: --stack-signal: Python workers dump every thread's stack on it (None: off, issue 13).
    stack_signal: int | None = DEFAULT_STACK_SIGNAL
    #: --flight-recorder: torch's flight recorder entries per worker, read by
    #: `elastic-console collectives` and the stall report (0: off; issue 22).
    flight_recorder: int = DEFAULT_FLIGHT_RECORDER
    #: --straggler-interval: seconds between the slow-rank checks (0: off; issue 22).
    straggler_interval: float = DEFAULT_STRAGGLER_INTERVAL
    #: --stall-timeout: seconds without progress of any rank before the job is stalled (0: off).
    stall_timeout: float = 300.0
    #: --on-stall: observe (report it), restart (the worker group, spending a restart) or stop.
    on_stall: str = "observe"
    #: --on-nan: observe (the `nan` event only) or stop (the job fails at a rank's first NaN
    #: or infinite metric; diagnosis/metrics_publish.py).
    on_nan: str = "observe"
    #: --restart-storm, --suspect-rounds, --no-progress-rounds, --exclude-suspect-nodes...
    patterns: PatternSettings = field(default_factory=PatternSettings)
    #: The srun step this agent is a task of (slurm.py), None outside SLURM: its SIGTERM and
    #: SIGUSR1 are the scheduler's, and a requeued job reopens.
    slurm: SlurmStep | None = None
    #: No Redis was given under SLURM: the step's first node hosts one (cli.py).
    slurm_redis: bool = False
    #: With ``slurm_redis``: the job's secret ($ELASTIC_JOB_SECRET, or this one-node step's
    #: own), from which that server's passwords derive (hosting/slurm_redis.py).
    job_secret: JobSecret | None = None
    #: $ELASTIC_WORKER_REDIS_URL: the workers' own credentials (None: they get none).
    worker_endpoint: Endpoint | None = None
    #: --worker-tty: auto (each worker stream a terminal when the agent's stdout is one, as
    #: torchrun's workers then write to it), on or off (pipes). Resolved at start (launch/ptys.py).
    worker_tty: str = "auto"


@dataclass(frozen=True)
class StaticPlacement:
    """torchrun's static rendezvous: the group rank and the master are given, not agreed.
    The agents still meet in Redis (events, logs, commands and the console need it) and
    check that no two claim the same rank."""

    node_rank: int
    master_addr: str
    master_port: int


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see elastic-agent --help)")


def _comma_list(value: str) -> tuple[str, ...]:
    """torchrun's comma-separated list: ``,,`` stands for a comma inside an item."""
    marker = "\0"
    return tuple(item.replace(marker, ",") for item in value.replace(",,", marker).split(","))


def _both(name: str) -> list[str]:
    """torchrun accepts every multi-word flag with dashes and with underscores."""
    flag = f"--{name}"
    alt = flag.replace("-", "_").replace("__", "--", 1)
    return [flag] if alt == flag else [flag, alt]


DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="elastic-agent",
        description="Launch and supervise the workers of one host of an elastic PyTorch job, "
        "coordinated through Redis. Takes torchrun's flags.",
        allow_abbrev=False,
    )
    a = p.add_argument
    a("--redis", default=None, help="Redis endpoint: host, host:port or redis://, rediss://, "
      "unix://, redis+sentinel://h1:26379,h2:26379/SERVICE URL (default $ELASTIC_REDIS_URL, "
      "else redis://127.0.0.1:6379); a password is "
      f"best given in ${PASSWORD_ENV}")
    a(*_both("redis-password-file"), dest="redis_password_file", default=None, metavar="PATH",
      help=f"file holding the Redis password, used when the URL has none (default "
      f"${PASSWORD_FILE_ENV}, else ${PASSWORD_ENV}: both keep it out of ps, unlike the URL)")
    a(*_both("job-id"), dest="job_id", default=None,
      help="job id shared by every agent of the job (default $ELASTIC_JOB_ID; under srun "
      "slurm-$SLURM_JOB_ID.$SLURM_STEP_ID; a single-node job without one gets a generated id)")
    a("--standalone", action="store_true",
      help="single-node job on an embedded redis-server on loopback")
    a("--nnodes", default=None, help="number of nodes, N or MIN:MAX (default 1; under srun "
      "the step's node count, $SLURM_NNODES)")
    a(*_both("nproc-per-node"), dest="nproc_per_node", default=None,
      help="workers per node: N, auto, cpu or gpu (default 1; under srun the GPUs SLURM gave "
      "the node, when it gave some)")
    a(*_both("rdzv-backend"), dest="rdzv_backend", default=None,
      help="redis (the default: nodes meet in Redis, elastic) or static (torchrun's default "
      "when --node-rank/--master-addr are given: fixed group ranks and master; Redis still "
      "carries events, logs and commands)")
    a(*_both("rdzv-endpoint"), dest="rdzv_endpoint", default="",
      help="alias of --redis for torchrun command lines")
    a(*_both("rdzv-id"), dest="rdzv_id", default=None, help="alias of --job-id")
    a(*_both("rdzv-conf"), dest="rdzv_conf", default="",
      help="key=value,...: join_timeout, last_call_timeout, heartbeat_timeout, "
      "keep_alive_interval (seconds), keep_alive_max_attempt (heartbeats missed before a node "
      "is lost), as in torch's dynamic rendezvous")
    a(*_both("max-restarts"), dest="max_restarts", default="0",
      help="job-wide restarts allowed after failures (default 0)")
    a(*_both("monitor-interval"), dest="monitor_interval", default="0.1",
      help="accepted for compatibility: worker exits are events here, not polled")
    a(*_both("start-method"), dest="start_method", default="spawn",
      help="accepted for compatibility; workers are always separate processes")
    a("--role", default="default", help="worker role name")
    a("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    a(*_both("no-python"), dest="no_python", action="store_true",
      help="run the script as an executable, without python")
    a(*_both("run-path"), dest="run_path", action="store_true",
      help="run the script with runpy.run_path in a python worker (takes precedence over "
      "--no-python), as torchrun")
    a(*_both("event-log-handler"), dest="event_log_handler", default="null",
      help="torch's event log handler: null (default) or console (every event also as a "
      "JSON line on stderr); the events always go to Redis")
    a(*_both("virtual-local-rank"), dest="virtual_local_rank", action="store_true",
      help="LOCAL_RANK=0 in every worker, each seeing only its own GPU as device 0")
    a(*_both("numa-binding"), dest="numa_binding", default=None,
      choices=("node", "socket", "exclusive", "core-complex"),
      help="bind each worker to the CPUs near its GPU (torch's rules; needs GPUs and numactl)")
    a(*_both("log-dir"), dest="log_dir", default=None,
      help="directory for per-rank log files (default: a new private directory in $TMPDIR, "
      "printed at start)")
    a("-r", "--redirects", default="0",
      help="send these streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or "
      "per local rank 0:1,1:2")
    a("-t", "--tee", default="0",
      help="send these streams to log files and to the terminal (same syntax as --redirects)")
    a(*_both("worker-tty"), dest="worker_tty", default="auto", choices=("auto", "on", "off"),
      help="give each worker's stdout and stderr a terminal of its own (a pty: progress bars "
      "are drawn live, as under torchrun in a terminal): auto (the default) when the agent's "
      "own stdout is a terminal, on, or off (pipes)")
    a(*_both("local-ranks-filter"), dest="local_ranks_filter", default="",
      help="only these local ranks show on the terminal, e.g. 0,3")
    a(*_both("log-line-prefix-template"), dest="log_line_prefix_template", default=None,
      help="prefix of terminal lines, with ${role_name}, ${rank} and ${local_rank}")
    a(*_both("duplicate-stdout-filters"), dest="duplicate_stdout_filters", default=None,
      type=_comma_list, help="teed stdout lines holding any of these strings (a,b; ',,' is a "
      "comma) also go to LOG_DIR/RUN/attempt_N/filtered_stdout.log, as torchrun")
    a(*_both("duplicate-stderr-filters"), dest="duplicate_stderr_filters", default=None,
      type=_comma_list, help="the same for stderr, into filtered_stderr.log")
    a(*_both("logs-specs"), dest="logs_specs", default=None,
      help="a torchrun.logs_specs entry point that decides where worker output goes, as in "
      "torchrun (default: torch's DefaultLogsSpecs layout, written by the agent)")
    a(*_both("local-addr"), dest="local_addr", default=None,
      help="address other nodes reach this one at (default: the host's FQDN)")
    a(*_both("shutdown-timeout"), dest="shutdown_timeout", default="30",
      help="seconds between SIGTERM and SIGKILL when stopping workers (default 30)")
    a(*_both("signals-to-handle"), dest="signals_to_handle",
      default=None,
      help="signals that make the agent stop its workers and leave the job (default "
      f"{DEFAULT_SIGNALS}; under srun also SIGUSR1, sbatch --signal's usual choice)")
    a(*_both("exit-barrier-timeout"), dest="exit_barrier_timeout", default="300",
      help="seconds a finished node waits for the others (default 300)")
    a(*_both("node-rank"), dest="node_rank", default=None,
      help="this node's group rank, with --rdzv-backend static (as torchrun)")
    a(*_both("master-addr"), dest="master_addr", default=None,
      help="address of group rank 0's host, with --rdzv-backend static (default 127.0.0.1)")
    a(*_both("master-port"), dest="master_port", default=None,
      help="MASTER_PORT of the workers, with --rdzv-backend static (default 29500)")
    a(*_both("log-retention"), dest="log_retention", default="200000",
      help="log entries kept per node stream in Redis (default 200000)")
    a("--retention", default="7d", metavar="DURATION",
      help="how long the job's records stay in Redis after it ended (or after its last agent "
      "vanished): e.g. 7d, 12h, 30m, 90s; 0 keeps them forever (default 7d)")
    a(*_both("health-check-port"), dest="health_check_port", default=None, metavar="PORT",
      help="serve HTTP liveness (/healthz) and Prometheus metrics (/metrics) on this port "
      "(default $TORCHELASTIC_HEALTH_CHECK_PORT, else none)")
    a(*_both("health-check-host"), dest="health_check_host", default="127.0.0.1", metavar="HOST",
      help="address the health check listens on (default 127.0.0.1: this host only; 0.0.0.0 "
      "or :: for every interface, e.g. for a Kubernetes httpGet probe)")
    a("--preload", default="auto", metavar="MODULES",
      help="comma list of modules (e.g. torch) a warm zygote imports once per node; workers "
      "are forked from it instead of starting a new interpreter. auto (the default): Python "
      "workers are forked, the zygote importing torch first when the script's leading "
      "imports include it; off: every worker starts a new interpreter")
    a(*_both("stack-signal"), dest="stack_signal", default="SIGRTMIN+4", metavar="SIG",
      help="real-time signal on which Python workers write every thread's stack for "
      "`elastic-console stacks` (faulthandler, registered before the script runs: no ptrace, "
      "no root); SIGRTMIN+N, SIGRTMAX-N, a number, or off (default SIGRTMIN+4)")
    a(*_both("flight-recorder"), dest="flight_recorder", default=str(DEFAULT_FLIGHT_RECORDER),
      metavar="N", help="torch's flight recorder keeps each worker's newest N collectives "
      "(TORCH_FR_BUFFER_SIZE, unless set), read by `elastic-console collectives` and the "
      f"stall report; 0: off (default {DEFAULT_FLIGHT_RECORDER})")
    a(*_both("straggler-interval"), dest="straggler_interval",
      default=f"{DEFAULT_STRAGGLER_INTERVAL:g}", metavar="S",
      help="every S seconds each rank's time outside collectives is compared with the job's "
      "median; a rank persistently slower gets a `straggler` event (needs --flight-recorder; "
      f"0: off; default {DEFAULT_STRAGGLER_INTERVAL:g})")
    a(*_both("stall-timeout"), dest="stall_timeout", default="300", metavar="S",
      help="the job is stalled when no rank printed a line or used CPU for S seconds: every "
      "rank's stacks are captured and a `stalled` event names the odd ranks (0: off; "
      "default 300)")
    a(*_both("on-stall"), dest="on_stall", default="observe",
      choices=("observe", "restart", "stop"),
      help="what a stall does besides the event: observe (nothing, the default), restart "
      "(the worker group, counted against --max-restarts) or stop (the job fails)")
    a(*_both("on-nan"), dest="on_nan", default="observe", choices=("observe", "stop"),
      help="what a metric a worker prints as NaN or infinite (its loss, say; docs/METRICS.md) "
      "does besides the `nan` event naming the rank and step: observe (nothing, the default) "
      "or stop (the job fails, as --on-stall stop)")
    restart_patterns.add_arguments(a)
    a("training_script", nargs="?", help="the worker script (or module, or executable)")
    a("training_script_args", nargs=argparse.REMAINDER)
    return p


#: The largest value of a numeric flag unless it states its own: seconds (timeouts and
#: intervals) up to a week, counts up to a billion. NaN, the infinities and 1e308 seconds
#: pass a "not below the minimum" check and then overflow (or never end) deep in a timer.
SECONDS_MAX = 7 * 86_400
COUNT_MAX = 1_000_000_000


def _number(value: str, flag: str, kind: type = int, minimum: float = 0,
            maximum: float | None = None) -> float:
    """Every numeric flag's one check: a finite ``kind`` from ``minimum`` to ``maximum``."""
    top = maximum if maximum is not None else COUNT_MAX if kind is int else SECONDS_MAX
    what = (f"{'a whole number' if kind is int else 'a number of seconds'} from {minimum:g} "
            f"to {int(top):,}")
    shown = value if len(value) <= 40 else value[:40] + "..."
    try:
        n = kind(value)
    except ValueError:  # also an int of thousands of digits
        raise UsageError(f"{flag} {shown!r} is not {what}") from None
    if n < minimum:
        raise UsageError(f"{flag} must be at least {minimum:g}, not {shown}")
    if not n <= top:  # NaN fails it too
        raise UsageError(f"{flag} {shown!r} is not {what}")
    return n


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(x.strip().isdigit() for x in parts):
        raise UsageError(f"--nnodes {value!r} is not N or MIN:MAX (e.g. 2 or 2:4)")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1 or hi < lo or hi > MAX_RECORD_LIST:
        raise UsageError(f"--nnodes {value!r}: need 1 <= MIN <= MAX <= {MAX_RECORD_LIST}")
    return lo, hi


def _usable_cpus() -> int:
    """The CPUs this process may run on (affinity, taskset, cpusets), as torch counts them
    for ``--nproc-per-node cpu|auto`` (``torch._utils.cpu_count``), not the host's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_nproc(value: str) -> int:
    if value.isdigit() and 0 < int(value) <= MAX_RECORD_LIST:  # records list at most that many
        return int(value)
    if value == "cpu":
        return _usable_cpus()
    if value in ("gpu", "auto"):
        from ..coordination.torch_compat import cuda_device_count  # torch only when asked for GPUs

        gpus = cuda_device_count()
        if gpus:
            return gpus
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: no CUDA device is visible on this host")
        return _usable_cpus()
    raise UsageError(f"--nproc-per-node {value[:40]!r} is not a positive number, auto, cpu or "
                     f"gpu (a number: at most {MAX_RECORD_LIST})")


_RDZV_KEYS = ("join_timeout", "last_call_timeout", "heartbeat_timeout", "keep_alive_interval")
# torch's keys that have no counterpart here, and why: refused by name, never dropped.
_TORCH_ONLY_RDZV_KEYS = {
    "close_timeout": "a closed round here ends at once, there is nothing to wait for",
    "read_timeout": "it is the etcd/c10d store's read timeout; Redis reads have their own",
    "timeout": "it is the c10d store's timeout; use join_timeout for the rendezvous",
    "is_host": "it places torch's c10d TCPStore; nodes meet in Redis here",
    "store_type": "it picks torch's c10d store; nodes meet in Redis here",
    "use_libuv": "it configures torch's c10d TCPStore; nodes meet in Redis here",
    "local_addr": "use --local-addr",
}


def parse_rdzv_conf(value: str) -> dict[str, float]:
    """torch's ``--rdzv-conf`` keys that mean something here, in our settings' names.
    ``keep_alive_max_attempt`` (torch: heartbeats missed before a node is dead) becomes
    ``heartbeat_timeout`` = attempts x ``keep_alive_interval`` unless that is given."""
    out: dict[str, float] = {}
    attempts: float | None = None
    for item in filter(None, (x.strip() for x in value.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise UsageError(f"--rdzv-conf item {item!r} is not key=value")
        key = key.strip()
        if key in _TORCH_ONLY_RDZV_KEYS:
            raise UsageError(f"--rdzv-conf {key}: not used by elastic-agent "
                             f"({_TORCH_ONLY_RDZV_KEYS[key]}); remove it")
        if key == "keep_alive_max_attempt":
            attempts = float(_number(raw.strip(), f"--rdzv-conf {key}", int, 1))
            continue
        if key not in _RDZV_KEYS:
            raise UsageError(f"--rdzv-conf {key}: unknown key; known: "
                             f"{', '.join((*_RDZV_KEYS, 'keep_alive_max_attempt'))}")
        out[key] = float(_number(raw.strip(), f"--rdzv-conf {key}", float, 0.001))
    if attempts is not None and "heartbeat_timeout" not in out:
        out["heartbeat_timeout"] = attempts * out.get(
            "keep_alive_interval", RendezvousSettings.keep_alive_interval)
    return out


def check_logs_specs(name: str | None) -> str | None:
    """--logs-specs must name an installed ``torchrun.logs_specs`` entry point (looked up
    without importing it: loading it imports torch, which the agent does when it starts)."""
    if name is None:
        return None
    from importlib import metadata

    found = sorted(e.name for e in metadata.entry_points(group="torchrun.logs_specs"))
    if name not in found:
        raise UsageError(f"--logs-specs: no torchrun.logs_specs entry point named {name!r} "
                         f"is installed (installed: {', '.join(found) or 'none'})")
    return name


_EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")


def parse_event_log_handler(value: str) -> str:
    """torch's handler names (``torch.distributed.elastic.events.handlers``); a handler
    registered in the launcher's own process cannot exist for a separate agent."""
    if value not in _EVENT_LOG_HANDLERS:
        raise UsageError(f"--event-log-handler {value!r}: elastic-agent knows "
                         f"{', '.join(_EVENT_LOG_HANDLERS)} (every event is in Redis anyway: "
                         "elastic-console events JOB --json)")
    return "null" if value == "dynamic_rendezvous" else value  # torch: a NullHandler too


def check_virtual_local_rank(nproc: int, environ: Mapping[str, str]) -> None:
    """torch raises in the middle of the launch when a worker has no GPU in the parent's
    CUDA_VISIBLE_DEVICES: say it before anything starts."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and nproc > len(visible.split(",")):
        raise UsageError(f"--virtual-local-rank: {nproc} workers but CUDA_VISIBLE_DEVICES="
                         f"{visible!r} names {len(visible.split(','))} GPU(s); lower "
                         "--nproc-per-node or widen CUDA_VISIBLE_DEVICES")


def check_numa_binding(mode: str | None) -> str | None:
    """torch binds a worker to the CPUs near the GPU of its local rank: without a GPU there
    is nothing to bind to (torch would fail each worker's launch)."""
    if mode is None:
        return None
    try:
        from ..coordination.torch_compat import cuda_device_count  # torch only when asked
    except ImportError:
        raise UsageError(f"--numa-binding {mode}: needs torch (pip install torch)") from None
    if not cuda_device_count():
        raise UsageError(f"--numa-binding {mode}: no CUDA device is visible on this host, "
                         "and NUMA binding places each worker near its GPU; drop the flag")
    if not shutil.which("numactl"):
        raise UsageError(f"--numa-binding {mode}: torch binds workers with numactl, which is "
                         "not installed (apt-get install numactl)")
    return mode


def parse_static(ns: argparse.Namespace, min_nodes: int, max_nodes: int
                 ) -> StaticPlacement | None:
    """torchrun's backend choice: ``static`` is its default, so a torchrun command line with
    --node-rank or --master-addr and no --rdzv-backend means a static rendezvous."""
    backend = ns.rdzv_backend
    given = [f for f, v in (("--node-rank", ns.node_rank), ("--master-addr", ns.master_addr),
                            ("--master-port", ns.master_port)) if v is not None]
    if backend is None:
        backend = "static" if given else "redis"
    if backend == "redis":
        if given:
            raise UsageError(f"{given[0]} is only used with --rdzv-backend static (as in "
                             "torchrun); with redis the rendezvous picks ranks and master")
        return None
    if backend != "static":
        raise UsageError(f"--rdzv-backend {backend!r}: elastic-agent meets in Redis (redis) "
                         "or with fixed ranks (static); for c10d/etcd command lines drop the "
                         "flag and point --redis (or --rdzv-endpoint) at a Redis server")
    if min_nodes != max_nodes:
        raise UsageError(f"--rdzv-backend static needs a fixed --nnodes, not "
                         f"{min_nodes}:{max_nodes}")
    node_rank = int(_number(ns.node_rank or "0", "--node-rank"))
    if node_rank >= max_nodes:
        raise UsageError(f"--node-rank {node_rank} must be below --nnodes {max_nodes}")
    if max_nodes > 1 and ns.master_addr is None:
        raise UsageError("--rdzv-backend static with several nodes needs --master-addr (the "
                         "host of --node-rank 0)")
    port = int(_number(ns.master_port or "29500", "--master-port", int, 1))
    if port > 65535:
        raise UsageError(f"--master-port {port} is not a port (1..65535)")
    return StaticPlacement(node_rank, ns.master_addr or "127.0.0.1", port)


def parse_signals(value: str) -> tuple[int, ...]:
    sigs = []
    for name in filter(None, (x.strip() for x in value.split(","))):
        sig = getattr(signal, name.upper(), None)
        if not isinstance(sig, signal.Signals):
            raise UsageError(f"--signals-to-handle: {name!r} is not a signal name like SIGTERM")
        sigs.append(int(sig))
    return tuple(sigs)


def parse_local_ranks(value: str) -> frozenset[int] | None:
    try:
        return parse_local_ranks_filter(value)
    except ValueError as exc:
        raise UsageError(f"--local-ranks-filter: {exc}") from None


def check_std_spec(value: str, flag: str) -> str:
    try:
        parse_std_spec(value)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    return value


# What torchrun's run_script_path does in the worker: argv as the script would see it, then
# runpy.run_path as __main__.
RUN_PATH_BOOTSTRAP = ("import runpy, sys; sys.argv = sys.argv[1:]; "
                      "runpy.run_path(sys.argv[0], run_name='__main__')")


def parse_preload(ns: argparse.Namespace) -> tuple[tuple[str, ...], bool]:
    """--preload: its module names (dotted identifiers; refused with --no-python/--run-path),
    and whether ``auto`` (the default) chooses them from the script instead."""
    if ns.preload.strip().lower() in ("auto", "off"):
        return (), ns.preload.strip().lower() == "auto" and not (ns.no_python or ns.run_path)
    names = tuple(m.strip() for m in ns.preload.split(",") if m.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise UsageError(f"--preload: {name!r} is not a module name")
    if names and (ns.no_python or ns.run_path):
        flag = "--run-path" if ns.run_path else "--no-python"
        raise UsageError(f"--preload cannot be used with {flag}: workers are forked from a "
                         "python zygote")
    return names, False


def build_entrypoint(ns: argparse.Namespace) -> list[str]:
    script = ns.training_script
    if not script:
        raise UsageError("no training script given: elastic-agent [options] SCRIPT [ARGS...]")
    args = list(ns.training_script_args)
    if ns.run_path:  # torchrun: takes precedence over --no-python
        if ns.module:
            raise UsageError("--run-path and -m cannot be used together")
        if not Path(script).is_file():
            raise UsageError(f"training script {script!r} does not exist")
        return [sys.executable, "-u", "-c", RUN_PATH_BOOTSTRAP, script, *args]
    if ns.no_python and ns.module:
        raise UsageError("--no-python and -m cannot be used together")
    if ns.no_python:
        return [script, *args]
    if ns.module:
        return [sys.executable, "-u", "-m", script, *args]
    if not Path(script).exists():
        raise UsageError(f"training script {script!r} does not exist")
    return [sys.executable, "-u", script, *args]


#: torchrun's flags whose default comes from ``PET_<DEST>`` (torch's ``argparse_util.env``)
#: and its switches that ``PET_<DEST>=1`` turns on (``check_env``); torch 2.13's lists, which
#: tests/test_torchrun_flags.py compares with torch's own parser.
PET_VALUES = ("duplicate_stderr_filters", "duplicate_stdout_filters", "event_log_handler",
              "local_addr", "local_ranks_filter", "log_dir", "master_addr", "master_port",
              "max_restarts", "monitor_interval", "nnodes", "node_rank", "nproc_per_node",
              "rdzv_backend", "rdzv_conf", "rdzv_endpoint", "rdzv_id", "redirects", "role",
              "shutdown_timeout", "signals_to_handle", "start_method", "tee")
PET_SWITCHES = ("module", "no_python", "run_path", "standalone", "virtual_local_rank")


def apply_pet_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """torchrun's ``PET_*`` variables: a flag not on the command line takes its value from
    ``PET_<DEST>`` (``PET_NPROC_PER_NODE=4``), a switch is on when ``PET_<DEST>`` is a
    non-zero number. The command line wins."""
    by_option = parser._option_string_actions
    for names, switch in ((PET_VALUES, False), (PET_SWITCHES, True)):
        for dest in names:
            raw = environ.get(f"PET_{dest.upper()}")
            action = by_option.get("--" + dest.replace("_", "-")) or by_option.get("--" + dest)
            if raw is None or action is None:
                continue
            if not switch:
                parser.set_defaults(**{action.dest: raw})  # argparse applies `type` to it
                continue
            try:
                parser.set_defaults(**{action.dest: bool(int(raw))})
            except ValueError:
                raise UsageError(f"PET_{dest.upper()}={raw!r}: a switch is 0 or 1, as for "
                                 f"torchrun") from None


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> AgentConfig:
    env = os.environ if environ is None else environ
    parser = build_parser()
    apply_pet_defaults(parser, env)
    ns = parser.parse_args(argv)
    if ns.log_line_prefix_template is None:  # torchrun has only the variable, no flag
        ns.log_line_prefix_template = env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    slurm, slurm_error = _slurm_step(env)
    if ns.nnodes is None and slurm is not None:
        _check_slurm_tasks(slurm)
        ns.nnodes = str(slurm.nnodes)
    elif ns.nnodes is None and slurm_error is not None:
        raise UsageError(f"{slurm_error} (or give --nnodes)")
    min_nodes, max_nodes = parse_nnodes(ns.nnodes or "1:1")
    if ns.nproc_per_node is None:
        ns.nproc_per_node = _slurm_gpus(env) if slurm is not None else "1"
    if ns.signals_to_handle is None:
        ns.signals_to_handle = DEFAULT_SIGNALS + (",SIGUSR1" if slurm is not None else "")
    redis_given = bool(ns.redis or ns.rdzv_endpoint or env.get("ELASTIC_REDIS_URL"))
    try:
        endpoint = with_outside_password(
            parse_endpoint(ns.redis or ns.rdzv_endpoint or env.get("ELASTIC_REDIS_URL")),
            ns.redis_password_file, env)
    except EndpointError as exc:
        raise UsageError(f"--redis: {exc}") from None
    try:
        worker_endpoint = (parse_endpoint(env[WORKER_URL_ENV])
                           if env.get(WORKER_URL_ENV, "").strip() else None)
    except EndpointError as exc:
        raise UsageError(f"${WORKER_URL_ENV}: {exc}") from None
    job_id = ns.job_id or ns.rdzv_id or env.get("ELASTIC_JOB_ID")
    if job_id in (None, "", "none") and slurm is not None:
        job_id = slurm.elastic_job_id
    elif job_id in (None, "", "none") and slurm_error is not None:
        raise UsageError(f"{slurm_error} (or give --job-id)")
    if job_id in (None, "", "none"):  # torchrun's --rdzv-id default is "none"
        if max_nodes > 1 and not ns.standalone:
            raise UsageError(
                "a multi-node job needs --job-id (or $ELASTIC_JOB_ID), the same on every node"
            )
        job_id, generated = f"job-{uuid.uuid4().hex[:8]}", True
    else:
        generated = False
    try:
        validate_job_id(job_id)
    except InvalidJobIdError as exc:
        raise UsageError(f"--job-id: {exc}") from None
    if ns.standalone:
        min_nodes = max_nodes = 1
    logs_specs = check_logs_specs(ns.logs_specs)
    static = parse_static(ns, min_nodes, max_nodes)
    conf = parse_rdzv_conf(ns.rdzv_conf)
    try:
        settings = RendezvousSettings(min_nodes=min_nodes, max_nodes=max_nodes, **conf)
    except ValueError as exc:
        raise UsageError(f"--rdzv-conf: {exc}") from None
    cfg = AgentConfig(
        endpoint=endpoint,
        worker_endpoint=worker_endpoint,
        job_id=job_id,
        job_id_generated=generated,
        rendezvous=settings,
        nproc=parse_nproc(ns.nproc_per_node),
        max_restarts=int(_number(ns.max_restarts, "--max-restarts")),
        monitor_interval=float(_number(ns.monitor_interval, "--monitor-interval", float)),
        role=ns.role,
        entrypoint=build_entrypoint(ns),
        log_dir=Path(ns.log_dir) if ns.log_dir else Path(),
        log_dir_generated=not ns.log_dir,
        redirects=check_std_spec(ns.redirects, "--redirects"),
        tee=check_std_spec(ns.tee, "--tee"),
        local_ranks_filter=parse_local_ranks(ns.local_ranks_filter),
        log_line_prefix_template=ns.log_line_prefix_template,
        local_addr=ns.local_addr,
        shutdown_timeout=float(_number(ns.shutdown_timeout, "--shutdown-timeout", float)),
        signals_to_handle=parse_signals(ns.signals_to_handle),
        exit_barrier_timeout=float(_number(ns.exit_barrier_timeout, "--exit-barrier-timeout",
                                           float)),
        standalone=ns.standalone,
        log_retention=int(_number(ns.log_retention, "--log-retention", int, 100)),
        event_log_handler=parse_event_log_handler(ns.event_log_handler),
        virtual_local_rank=ns.virtual_local_rank,
        numa_binding=check_numa_binding(ns.numa_binding),
        static=static,
        duplicate_filters={stream: needles for stream, needles in (
            ("out", ns.duplicate_stdout_filters), ("err", ns.duplicate_stderr_filters))
            if needles is not None},
        health_check_port=None if ns.health_check_port is None else int(
            _number(ns.health_check_port, "--health-check-port", int, 0, 65_535)),
        health_check_host=ns.health_check_host,  # checked when it binds (HealthServer.start)
        worker_tty=ns.worker_tty,
    )
    preload, preload_auto = parse_preload(ns)
    cfg = replace(cfg, preload=preload, preload_auto=preload_auto)
    try:
        cfg = replace(cfg, retention_s=parse_duration(ns.retention))
    except ValueError as exc:
        raise UsageError(f"--retention: {exc}") from None
    try:
        cfg = replace(cfg, stack_signal=parse_stack_signal(ns.stack_signal))
    except ValueError as exc:
        raise UsageError(f"--stack-signal: {exc}") from None
    entries = _number(ns.flight_recorder, "--flight-recorder", int)
    if not 0 <= entries <= 1_000_000:
        raise UsageError(f"--flight-recorder {ns.flight_recorder!r}: a number of entries from "
                         "0 (off) to 1000000")
    interval = float(_number(ns.straggler_interval, "--straggler-interval", float))
    if not (interval == 0 or 0.5 <= interval <= 86_400):
        raise UsageError(f"--straggler-interval {ns.straggler_interval!r}: 0 (off) or 0.5 to "
                         "86400 seconds")
    cfg = replace(cfg, flight_recorder=entries, straggler_interval=interval)
    stall_timeout = float(_number(ns.stall_timeout, "--stall-timeout", float, 0, 1e9))
    if not 0 <= stall_timeout <= 1e9:  # (NaN and infinity fail this too)
        raise UsageError(f"--stall-timeout {ns.stall_timeout!r} is not a number of seconds")
    cfg = replace(cfg, stall_timeout=stall_timeout, on_stall=ns.on_stall, on_nan=ns.on_nan,
                  slurm=slurm,
                  slurm_redis=slurm is not None and not redis_given and not ns.standalone)
    if cfg.slurm_redis and slurm is not None:  # checked before anything starts: exit 2
        try:
            cfg = replace(cfg, job_secret=slurm_job_secret(slurm, env))
        except SlurmEnvError as exc:
            raise UsageError(str(exc)) from None
    try:
        cfg = replace(cfg, patterns=restart_patterns.settings_from(ns))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if cfg.virtual_local_rank:
        check_virtual_local_rank(cfg.nproc, env)
    # Made last, so a rejected command line leaves no directory behind.
    base = default_log_dir() if cfg.log_dir_generated else cfg.log_dir
    if logs_specs is not None:  # the plugin makes its own run directory below the root
        return replace(cfg, log_dir=base, logs_specs=logs_specs)
    return replace(cfg, log_dir=run_log_dir(base, job_id))


def _slurm_step(env: Mapping[str, str]) -> tuple[SlurmStep | None, str | None]:
    """The srun step (None outside one), or the one-line reason its variables are unusable:
    that is an error only where a value would come from them (explicit flags win)."""
    try:
        return read_step(env), None
    except SlurmEnvError as exc:
        return None, str(exc)


def _check_slurm_tasks(step: SlurmStep) -> None:
    try:
        check_one_task_per_node(step)
    except SlurmEnvError as exc:
        raise UsageError(str(exc)) from None


def _slurm_gpus(env: Mapping[str, str]) -> str:
    try:
        gpus = gpus_per_node(env)
    except SlurmEnvError as exc:
        raise UsageError(str(exc)) from None
    return str(gpus) if gpus else "1"


def default_log_dir() -> Path:
    """A new directory for per-rank logs when ``--log-dir`` is not given, as torchrun does.

    ``mkdtemp`` picks an unpredictable name and creates it 0700, atomically: a fixed shared
    path (``/tmp/elastic-agent-logs``) could be created first by another user, who would
    then own the tree the agent writes into. Raises UsageError if it cannot be made.
    """
    try:
        return Path(tempfile.mkdtemp(prefix="elastic-agent-"))
    except OSError as exc:
        raise UsageError(f"cannot create a log directory in the temporary directory "
                         f"({exc.strerror or exc}); set TMPDIR or pass --log-dir") from None


def run_log_dir(base: Path, run_id: str) -> Path:
    """``<base>/<run_id>_<random>``: torch's ``DefaultLogsSpecs`` layout, one new directory per
    agent run, so agents sharing a host and a log directory never share a file.

    ``base`` is the user's (created private if missing, as torchrun creates it); the run
    directory is ``mkdtemp``'s: private, unpredictable and made atomically. Raises UsageError.
    """
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{run_id}_", dir=base))
    except OSError as exc:
        raise UsageError(f"--log-dir {str(base)!r}: cannot create the run's log directory "
                         f"there ({exc.strerror or exc})") from None
