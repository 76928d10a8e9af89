"""`elastic-agent`: torchrun's command line, Redis-coordinated.

    elastic-agent --redis host --job-id job-42 --nnodes 2:4 --nproc-per-node 8 train.py
    elastic-agent --standalone --nproc-per-node 4 train.py
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import redis

from ..coordination.rendezvous.types import RendezvousConnectionError, RendezvousError
from ..coordination.transport.connection import RedisUnavailableError, connect, make_client
from ..coordination.transport.endpoints import Endpoint, argv_without_passwords, parse_endpoint, redact
from ..coordination.transport.job_secret import JOB_SECRET_ENV
from ..coordination.wire.event_records import EventType, encode_event
from ..coordination.wire.keyspace import EVENTS_MAXLEN, JobKeys
from ..coordination.wire.protocol import ProtocolError
from ..coordination.wire.text import terminal_line, terminal_lines
from .config import AgentConfig, UsageError, parse_args
from .hosting import slurm_redis
from .hosting.standalone import RedisServer, RedisServerNotFoundError, attached_consoles, start_standalone

#: Seconds a --standalone agent keeps its embedded Redis up after the job ended while a console
#: is attached, so the console can show how the job ended rather than a lost connection.
LINGER_ENV = "ELASTIC_STANDALONE_LINGER"
DEFAULT_LINGER_S = 15.0
_LINGER_POLL_S = 0.2  # a console detaching is seen this late (nothing notifies a disconnect)


def _fail(message: str, code: int) -> int:
    # Errors quote what Redis held (member names, job state): one policy for all output.
    # redact: the last guard, should a message ever quote a URL or a password in any form.
    print(terminal_line(f"elastic-agent: error: {redact(message)}", False), file=sys.stderr,
          flush=True)
    return code


class _SafeFormatter(logging.Formatter):
    """Log records quote records from Redis and worker text: escape them like any output."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(terminal_lines(redact(super().format(record)), False))


# Options whose value is a Redis endpoint, possibly with a password that ps must not show.
_ENDPOINT_FLAGS = ("--redis", "--rdzv-endpoint", "--rdzv_endpoint")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line: first, may re-exec without the password
        return _exit_now(_main(argv_without_passwords(_ENDPOINT_FLAGS)))
    return _main(argv)


def _exit_now(code: int) -> int:
    """End the ``elastic-agent`` process once its work is done, without the interpreter's
    teardown of every object (50-100 ms after a run here: part of every launch's wall time,
    and nothing of the job's). What that teardown does that matters is done first: other
    non-daemon threads joined, atexit handlers (logging's flush, the stacks directory's
    removal), stdout and stderr flushed. Returns only if a flush failed (the interpreter
    then reports it as usual)."""
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return code
    os._exit(code)


def _main(argv: list[str]) -> int:
    handler = logging.StreamHandler()
    handler.setFormatter(_SafeFormatter("[elastic-agent] %(levelname)s %(name)s: %(message)s"))
    level = os.environ.get("ELASTIC_LOG_LEVEL", "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        return _fail(f"ELASTIC_LOG_LEVEL={level!r} is not a level: use DEBUG, INFO, WARNING or ERROR", 2)
    logging.basicConfig(level=level, handlers=[handler])
    try:
        cfg = parse_args(argv)
        linger = _linger_seconds(os.environ.get(LINGER_ENV))
        # Read (config.py) and never needed again: no child of the agent inherits it, not
        # only the workers (worker_env.py), but the zygote, redis-server, py-spy...
        os.environ.pop(JOB_SECRET_ENV, None)
    except UsageError as exc:
        return _fail(str(exc), 2)
    server: RedisServer | None = None
    nodes: list[str] = []
    try:
        if cfg.slurm_redis:
            try:
                cfg, server = _slurm_endpoint(cfg)
            except (RedisServerNotFoundError, RuntimeError) as exc:
                return _fail(str(exc), 1)
        if cfg.standalone:
            try:
                server = start_standalone()
            except (RedisServerNotFoundError, RuntimeError) as exc:
                return _fail(str(exc), 1)
            cfg = dataclasses.replace(cfg, endpoint=parse_endpoint(server.url))
            print(f"[elastic-agent] standalone Redis on {server.url}; watch this job with:\n"
                  f"    elastic-console attach {cfg.job_id} --redis {server.url}",
                  file=sys.stderr, flush=True)
        code = _run(cfg, nodes.append)
        if server is not None and nodes:
            if cfg.slurm_redis:
                slurm_redis.wait_for_peers_to_leave(server, cfg.job_id)
            _linger_for_consoles(server, cfg.endpoint, cfg.job_id, nodes[0], linger)
        return code
    finally:
        if server is not None:
            if cfg.slurm_redis:
                server.kill()  # it ignores SIGTERM (slurm_redis.host); nothing to save
            server.cleanup()


def _slurm_endpoint(cfg: AgentConfig) -> tuple[AgentConfig, RedisServer | None]:
    """Under srun with no Redis given: host the job's on the step's first node, or wait
    for it on the others (slurm_redis.py). The agents use its ``agent`` user, the workers
    its ``worker`` user. Raises RuntimeError saying what to do."""
    step, secret = cfg.slurm, cfg.job_secret
    assert step is not None and secret is not None
    # A secret of this node's own (a one-node step without one): nobody else can log in,
    # so nobody else needs to reach the server either.
    local = secret.generated
    addr, port = slurm_redis.endpoint(step, os.environ, loopback=local)
    server = None
    if step.is_first_node or local:
        server = slurm_redis.host(step, addr, port, secret, cfg.job_id)
        addr = server.host  # the address it bound (NodeAddr resolved)
        slurm_redis.announce(step, cfg.job_id, server, shared=not local)
    else:
        slurm_redis.wait_for(slurm_redis.agent_url(addr, port, secret, cfg.job_id),
                             str(step.first_node), cfg.job_id, secret)
    return dataclasses.replace(
        cfg, endpoint=parse_endpoint(slurm_redis.agent_url(addr, port, secret, cfg.job_id)),
        worker_endpoint=parse_endpoint(slurm_redis.worker_url(addr, port, secret, cfg.job_id)),
    ), server


def _linger_seconds(value: str | None) -> float:
    if value is None or value.strip() == "":
        return DEFAULT_LINGER_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise UsageError(f"{LINGER_ENV}={value!r}: give the seconds to keep the embedded Redis "
                         "up for an attached console after the job ended (0..3600)")
    return seconds


def _linger_for_consoles(server: RedisServer, endpoint: Endpoint, job_id: str, node: str,
                         linger: float) -> None:
    """After the job ended, before the embedded Redis stops with this agent: a console still
    attached is told how the job ended and that its Redis stops (a ``redis_stopping`` event),
    and keeps the server up to ``linger`` seconds, or until it detaches. Without this it
    would only see a lost connection, indistinguishable from an outage. The job's records
    through ``endpoint`` (the agent's); the consoles counted through the server's admin
    (its owner, under SLURM: the agents' user may not list clients)."""
    if linger <= 0:
        return
    client = make_client(endpoint, retries=0)
    admin = client if server.admin_url == endpoint.url else make_client(server.admin_url,
                                                                        retries=0)

    def stop_lingering(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # a second request to stop the agent ends the wait at once

    previous = signal.signal(signal.SIGTERM, stop_lingering)
    try:
        keys = JobKeys(job_id)
        final = client.hget(keys.meta, "final_state")
        if final is None or not _still_watched(admin, job_id):
            return  # the job did not end (the agent was signalled), or nobody watches
        client.xadd(keys.events, encode_event(EventType.REDIS_STOPPING, node, {
            "final_state": final.decode(errors="replace"), "linger_s": linger}),
            maxlen=EVENTS_MAXLEN, approximate=True)
        print(f"[elastic-agent] a console is attached: the embedded Redis stops when it "
              f"detaches, in {linger:g} s at the latest", file=sys.stderr, flush=True)
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline and attached_consoles(admin, job_id):
            time.sleep(_LINGER_POLL_S)
    except (redis.RedisError, OSError, KeyboardInterrupt):
        pass  # the server stops next whatever happened here
    finally:
        signal.signal(signal.SIGTERM, previous)
        client.close()
        admin.close()


def _still_watched(client: redis.Redis, job_id: str, checks: int = 3,
                   interval: float = 0.1) -> bool:
    """A console of the job is attached: one is there on each of a few looks (a console
    that is just leaving is not waited for)."""
    for i in range(checks):
        if i:
            time.sleep(interval)  # nothing notifies a disconnect: look again
        if not attached_consoles(client, job_id):
            return False
    return True


def _run(cfg: AgentConfig, on_agent: Callable[[str], None] | None = None) -> int:
    """Run the agent; ``on_agent`` learns its node id once it exists."""
    from .elastic_agent import ElasticAgent  # after argument checks: keep --help fast
    from .launch.exits import WorkerStartError

    try:
        connect(cfg.endpoint).close()
    except RedisUnavailableError as exc:
        return _fail(str(exc), 1)
    if cfg.log_dir_generated:
        print(f"[elastic-agent] per-rank logs in {cfg.log_dir}", file=sys.stderr, flush=True)
    try:
        agent = ElasticAgent(cfg)
        if on_agent is not None:
            on_agent(agent.node_id)
        return asyncio.run(agent.run())
    except WorkerStartError as exc:
        return _fail(str(exc), 1)
    except RendezvousConnectionError as exc:
        return _fail(str(exc), 1)
    except (RendezvousError, ProtocolError) as exc:
        return _fail(str(exc), 1)
    except RedisUnavailableError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
