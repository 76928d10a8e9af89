"""What a worker is given: the spec of a start, its environment, command line and files.

:class:`WorkerSpec` (what to run on this node, and how) and :class:`RankAssignment` (this
node's place in a rendezvous round, and the attempt) are the whole of a start's input. From
them :func:`worker_env` builds each worker's environment as torchrun does (plus the job's
Redis URL and id, and the probes' variables), :func:`error_file_path` names the file torch's
``@record`` writes, :func:`worker_argv` the command line (the probes' bootstrap for a Python
worker, numactl under ``--numa-binding``), and :func:`prepare_logs` makes each worker's log
files and clears its stale error file (or asks a ``--logs-specs`` plugin). Nothing here
starts a process: the group (:mod:`.workers`) starts what these say, and the parity tests
hold them to torchrun's own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_agent.coordination.transport.endpoints import Endpoint, without_credentials
from elastic_agent.coordination.transport.job_secret import JOB_SECRET_ENV
from elastic_agent.supervision.launch import zygote
from elastic_agent.supervision.records.log_config import plugin_destinations
from elastic_agent.supervision.records.log_files import LogPathError, open_private_dir
from elastic_agent.supervision.records.logs import NodeLogs, WorkerLogs

from . import probes
from .exits import WorkerStartError

#: The workers' own Redis URL (their ACL user's password inside, as the variable keeps it out
#: of ``ps``): handed to them as ``ELASTIC_REDIS_URL``. Without it they get the agent's
#: endpoint with no credentials (docs/SECURITY.md, "What a worker holds").
WORKER_URL_ENV = "ELASTIC_WORKER_REDIS_URL"
#: The agent's own Redis credentials, which a worker never inherits: whatever the training
#: script (or a library it loads) does with its environment, the agent's rights stay out.
#: ``$ELASTIC_JOB_SECRET`` too: it opens the SLURM-hosted Redis as the agents' user.
AGENT_SECRET_ENV = frozenset({"REDISCLI_AUTH", "ELASTIC_REDIS_PASSWORD_FILE", WORKER_URL_ENV,
                              JOB_SECRET_ENV})


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What to run on this node, and how (torch's ``WorkerSpec`` for one role).

    ``entrypoint`` is the full argv (e.g. ``[sys.executable, "-u", "train.py", *args]``).
    ``log_dir`` is the run's own directory (``<--log-dir>/<run_id>_<random>``, made by the
    agent, never shared with another agent); attempts go in ``log_dir/attempt_<n>/<local_rank>/``
    as in torch's ``DefaultLogsSpecs``. ``log_dir``'s parent is the user's; ``log_dir`` and
    everything below it are the agent's, private and checked (``log_files.open_private_dir``).
    ``extra_env`` is added to every worker's
    environment before torchrun's variables (which win).
    """

    role: str = "default"
    nproc: int
    entrypoint: Sequence[str]
    max_restarts: int = 0
    run_id: str
    #: The workers' ``ELASTIC_REDIS_URL`` (:func:`worker_redis_url`), never the agent's own.
    redis_url: str = ""
    job_id: str
    log_dir: Path
    shutdown_timeout: float = 30.0
    use_agent_store: bool = False
    extra_env: Mapping[str, str] = field(default_factory=dict)
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    #: ``--preload``: modules a warm zygote imports; its workers are forked from it.
    preload: tuple[str, ...] = ()
    #: ``--preload auto``: without ``preload``, Python workers are forked from a zygote that
    #: imported what :func:`.zygote.auto_preload` finds the script starting with (torch).
    preload_auto: bool = False
    #: torchrun's --signals-to-handle, which its launcher puts in the workers' environment.
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    #: torchrun's --logs-specs: a ``torch_compat.LogsSpecsPlugin`` whose ``reify`` decides
    #: each attempt's files and environment, instead of the layout below ``log_dir``.
    logs_specs: Any = None
    #: ``--stack-signal``: the signal Python workers dump their stacks on (None: off).
    stack_signal: int | None = probes.DEFAULT_SIGNAL
    #: ``--flight-recorder``: entries of torch's flight recorder per worker; > 0 also links a
    #: Python worker's trace thread to the agent (:mod:`.recorder`, issue 22).
    flight_recorder: int = 0
    #: ``--worker-tty``: (columns, lines) of the terminal each worker stream is (:mod:`.ptys`),
    #: or None: pipes.
    worker_tty: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, not {self.nproc}")
        if not self.entrypoint:
            raise ValueError("the entrypoint is empty")
        object.__setattr__(self, "entrypoint", tuple(str(a) for a in self.entrypoint))
        object.__setattr__(self, "log_dir", Path(self.log_dir))
        object.__setattr__(self, "extra_env", dict(self.extra_env))
        object.__setattr__(self, "preload", tuple(self.preload))


@dataclass(frozen=True, kw_only=True)
class RankAssignment:
    """This node's place in a rendezvous round, and the attempt it starts.

    ``base_rank`` is the global rank of local rank 0. ``role_base_rank`` and
    ``role_world_size`` default to the global ones (a job with a single role).
    """

    group_rank: int
    group_world_size: int
    world_size: int
    base_rank: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    attempt: int = 0
    role_base_rank: int | None = None
    role_world_size: int | None = None

    def global_rank(self, local_rank: int) -> int:
        return self.base_rank + local_rank

    def role_rank(self, local_rank: int) -> int:
        base = self.base_rank if self.role_base_rank is None else self.role_base_rank
        return base + local_rank

    @property
    def role_size(self) -> int:
        return self.world_size if self.role_world_size is None else self.role_world_size


def worker_redis_url(agent: Endpoint, workers: Endpoint | None) -> str:
    """The URL workers find in ``ELASTIC_REDIS_URL``: theirs (``$ELASTIC_WORKER_REDIS_URL``),
    else the agent's server with no user and no password (enough where the server lets
    anyone in, as a ``--standalone`` one does; elsewhere they hold no right of the agent's)."""
    return workers.url if workers is not None else without_credentials(agent.url)


def error_file_path(spec: WorkerSpec, assignment: RankAssignment, local_rank: int) -> Path:
    """``log_dir/attempt_<n>/<local_rank>/error.json``: torch's ``DefaultLogsSpecs`` layout
    (``log_dir`` is this agent's alone, so the stray scan's markers stay unique)."""
    return spec.log_dir / f"attempt_{assignment.attempt}" / str(local_rank) / "error.json"


def worker_env(spec: WorkerSpec, assignment: RankAssignment, local_rank: int,
               base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The complete environment of one worker, as torchrun 2.13 builds it, plus ours.

    ``base_env`` (default ``os.environ``) is inherited; ``OMP_NUM_THREADS=1`` is added when
    ``nproc > 1`` and the user has not set it (torchrun's run.py); then
    ``spec.extra_env``; then torchrun's variables (``LocalElasticAgent._start_workers`` and
    ``DefaultLogsSpecs.reify``) and ``ELASTIC_REDIS_URL`` / ``ELASTIC_JOB_ID``.
    The agent's Redis credentials (:data:`AGENT_SECRET_ENV`) are not inherited.
    """
    env = _inherited(spec, base_env)
    env.update({
        "RANK": str(assignment.global_rank(local_rank)),
        "LOCAL_RANK": "0" if spec.virtual_local_rank else str(local_rank),
        "GROUP_RANK": str(assignment.group_rank),
        "ROLE_RANK": str(assignment.role_rank(local_rank)),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.nproc),
        "WORLD_SIZE": str(assignment.world_size),
        "GROUP_WORLD_SIZE": str(assignment.group_world_size),
        "ROLE_WORLD_SIZE": str(assignment.role_size),
        "MASTER_ADDR": assignment.master_addr,
        "MASTER_PORT": str(assignment.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(assignment.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(spec.use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": str(error_file_path(spec, assignment, local_rank)),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": spec.signals_to_handle,
        "ELASTIC_REDIS_URL": spec.redis_url,
        "ELASTIC_JOB_ID": spec.job_id,
    })
    if stacks_on(spec):
        env.update(probes.worker_vars(spec.stack_signal,
                                      stacks_fifo(spec, assignment, local_rank)))
    if recorder_on(spec):
        env[zygote.RECORDER_ENV] = str(recorder_socket(spec, assignment, local_rank))
    if spec.virtual_local_rank:
        # torch's LocalElasticAgent: each worker sees only its own GPU, as device 0.
        visible = (base_env if base_env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible is not None else None
        env["CUDA_VISIBLE_DEVICES"] = (gpus[local_rank].strip() if gpus is not None
                                       and local_rank < len(gpus) else str(local_rank))
    return env


def zygote_env(spec: WorkerSpec, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The workers' environment without the launcher's per-rank variables."""
    env = _inherited(spec, base_env)
    return {k: v for k, v in env.items() if k not in zygote.LAUNCHER_VARS}


def _inherited(spec: WorkerSpec, base_env: Mapping[str, str] | None) -> dict[str, str]:
    """What every worker (and the zygote they fork from) starts from: the agent's
    environment minus its Redis credentials, plus ``extra_env`` and torchrun's default
    ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items()
           if k not in AGENT_SECRET_ENV}
    env.update(spec.extra_env)
    if spec.nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    return env


def worker_argv(spec: WorkerSpec, local_rank: int) -> list[str]:
    """The worker's command line: the entrypoint, wrapped in numactl by torch's own rules
    under ``--numa-binding`` (torch imported only then); a Python worker is started through
    the stack handler's bootstrap (:func:`.stacks.boot_argv`)."""
    entrypoint = (probes.boot_argv(spec.entrypoint) if stacks_on(spec) or recorder_on(spec)
                  else spec.entrypoint)
    if spec.numa_binding is None:
        return list(entrypoint)
    from elastic_agent.coordination.torch_compat import numa_bound_argv

    return numa_bound_argv(entrypoint, local_rank, spec.numa_binding)


def stacks_on(spec: WorkerSpec) -> bool:
    """Whether the workers answer stack dumps (``--stack-signal``, a Python entrypoint)."""
    return spec.stack_signal is not None and probes.is_python_entrypoint(spec.entrypoint)


def recorder_on(spec: WorkerSpec) -> bool:
    """Whether the workers' flight recorders are linked to the agent (``--flight-recorder``,
    a Python entrypoint)."""
    return spec.flight_recorder > 0 and probes.is_python_entrypoint(spec.entrypoint)


def recorder_socket(spec: WorkerSpec, assignment: RankAssignment, local_rank: int) -> Path:
    """The rank's recorder socket, beside its stack FIFO."""
    return probes.socket_path(f"{spec.log_dir}|{assignment.attempt}|{local_rank}")


def stacks_fifo(spec: WorkerSpec, assignment: RankAssignment, local_rank: int) -> Path:
    """The rank's stack FIFO, in the agent's private runtime directory (never in the log
    tree, whose layout is torch's)."""
    return probes.fifo_path(f"{spec.log_dir}|{assignment.attempt}|{local_rank}")


def prepare_logs(spec: WorkerSpec, assignment: RankAssignment, logs: NodeLogs,
                 base_env: Mapping[str, str] | None = None,
                 ) -> tuple[list[tuple[Path, WorkerLogs]], dict[int, dict[str, str]]]:
    """Each local rank's error file path and open log sink, and (--logs-specs) the
    environments the plugin's reify left, by local rank (else none); WorkerStartError if
    any cannot be made (the ones already open are closed)."""
    if spec.logs_specs is not None:
        return _prepare_plugin_logs(spec, assignment, logs, base_env)
    prepared: list[tuple[Path, WorkerLogs]] = []
    try:
        for local_rank in range(spec.nproc):
            err = error_file_path(spec, assignment, local_rank)
            dir_fd = open_private_dir(err.parent, base=spec.log_dir.parent)
            try:
                # A stale file would be read as this attempt's failure. unlink never
                # follows a symlink: it removes the link, not its target.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(err.name, dir_fd=dir_fd)
            except OSError as exc:
                raise LogPathError(f"cannot remove the stale error file {err}: "
                                   f"{exc.strerror or exc}") from exc
            finally:
                os.close(dir_fd)
            wlogs = logs.open_worker(
                directory=err.parent, role=spec.role, rank=assignment.global_rank(local_rank),
                local_rank=local_rank, attempt=assignment.attempt)
            prepared.append((err, wlogs))
    except OSError as exc:
        for _, wlogs in prepared:
            wlogs.close()
        raise WorkerStartError(str(exc)) from exc
    return prepared, {}


def _prepare_plugin_logs(spec: WorkerSpec, assignment: RankAssignment, logs: NodeLogs,
                         base_env: Mapping[str, str] | None,
                         ) -> tuple[list[tuple[Path, WorkerLogs]], dict[int, dict[str, str]]]:
    """--logs-specs: the plugin's ``reify`` sees every worker's environment (and may
    change it, as torch's default sets the error file) and names each stream's file;
    the workers get the environments it leaves."""
    envs = {lr: worker_env(spec, assignment, lr, base_env) for lr in range(spec.nproc)}
    try:
        plan = spec.logs_specs.reify(envs)
    except Exception as exc:  # a third party's plugin may raise anything
        raise WorkerStartError(f"--logs-specs {spec.logs_specs.name}: its reify failed "
                               f"({type(exc).__name__}: {exc})") from None
    prepared: list[tuple[Path, WorkerLogs]] = []
    try:
        for lr in range(spec.nproc):
            err = Path(plan.error_files.get(lr) or envs[lr].get(
                "TORCHELASTIC_ERROR_FILE") or os.devnull)
            envs[lr]["TORCHELASTIC_ERROR_FILE"] = "" if str(err) == os.devnull else str(err)
            if str(err) != os.devnull:
                with contextlib.suppress(FileNotFoundError):
                    if not err.is_symlink():
                        err.unlink()  # a stale file would be read as this attempt's
            wlogs = logs.open_worker(
                directory=err.parent, role=spec.role, rank=assignment.global_rank(lr),
                local_rank=lr, attempt=assignment.attempt,
                destinations=plugin_destinations(plan, lr))
            prepared.append((err, wlogs))
    except OSError as exc:
        for _, wlogs in prepared:
            wlogs.close()
        raise WorkerStartError(str(exc)) from exc
    return prepared, envs
