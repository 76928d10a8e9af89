"""No Redis given under SLURM: the step's first node hosts the job's, the others find it.

The first node of ``SLURM_STEP_NODELIST`` starts the ``--standalone`` redis-server, bound to
the address SLURM itself reaches that node at (``NodeAddr``), on a port every node derives
from the job and step ids (slurm.py): nothing has to be exchanged before Redis exists. The
other nodes retry until it answers (bounded), then run as with ``--redis``.

That server is reachable from the cluster's network, so it starts only with the job's secret
``S`` (``$ELASTIC_JOB_SECRET``, which the batch script exports and srun hands to every task;
coordination/transport/job_secret.py) and a config file, 0600 in its private directory
(argv, which ``ps`` shows, holds no password):

* the ``default`` user is off: a connection that has not authenticated can do nothing;
* ``agent`` (password derived from ``S``): the agents and a console; the job's keys only,
  no admin or dangerous command (CONFIG, MODULE, DEBUG, REPLICAOF, SHUTDOWN, FLUSHALL, ACL,
  SAVE, MONITOR, KEYS, INFO, CLIENT LIST ...), no pub/sub;
* ``worker`` (derived from ``S`` too): the workers' ``ELASTIC_REDIS_URL``, the torch store's
  keys only;
* ``owner`` (a random password this process alone knows): ``SHUTDOWN``, ``INFO`` and
  ``CLIENT LIST``, for the hosting agent's own checks and its end;
* ``enable-protected-configs``, ``enable-debug-command`` and ``enable-module-command`` are
  ``no``, so even a user who got every right could not move the server's files, debug it or
  load a module. A Redis older than 7 has none of these settings: it is refused for any bind
  beyond loopback.

Whoever takes the derived port first would otherwise become the job's Redis. The hosting
agent checks the server answering is its own child (as ``owner``: ``INFO``'s ``process_id``);
the other nodes log in as ``agent`` (never with ``S``) and read a proof, a value derived from
``S`` that the hosting agent writes once its server is up, before they write anything. A
squatter gets a password that opens nothing but this job's server (which it prevented from
starting) and never sees the job's records.

That host is a single point of failure, as torchrun's c10d store host is: if it dies, the
job's coordination dies with it, and nothing is kept for a requeue. Elastic jobs should use a
real Redis (or Sentinel) through ``--redis`` / ``$ELASTIC_REDIS_URL`` (README.md).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import signal
import socket
import sys
import time
from collections.abc import Mapping

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from elastic_agent.coordination.ports import port_is_free
from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.transport.endpoints import redact_endpoint, with_password
from elastic_agent.coordination.transport.job_secret import (
    AGENT_USER,
    EXPORT_LINE,
    JOB_SECRET_ENV,
    PROOF_LABEL,
    WORKER_USER,
    JobSecret,
    JobSecretError,
    read_job_secret,
)
from elastic_agent.coordination.wire.keyspace import JobKeys, console_client_name

from .slurm import REDIS_PORT_ENV, SlurmEnvError, SlurmStep, node_address, redis_port
from .standalone import RedisServer, find_redis_server, redis_version

#: Seconds the other nodes wait for the first node's Redis to answer: srun starts the tasks
#: of a step within a second or two of each other; a node that waits longer is told why.
FIND_TIMEOUT_S = 60.0
#: Seconds the hosting agent keeps its Redis up after its job ended, while the other agents
#: still hold connections (they publish their last records after the exit barrier).
PEERS_LEAVE_TIMEOUT_S = 15.0
OWNER_USER = "owner"
#: Seconds the hosting agent keeps asking whether the server answering is its child, while
#: the child runs.
OWN_CHECK_S = 10.0
#: The file, in the server's private directory, that holds the ``agent`` password when the
#: secret is this node's own (a one-node step): a console on the node reads it.
AGENT_PASSWORD_FILE = "agent.password"
_LIST_BELOW = 64
_SCHEDULER_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                      signal.SIGUSR2}
_PROOF_MAX_BYTES = 256
_TAKE_PORT = (f"set ${REDIS_PORT_ENV} to a free port in the batch script, or give --redis")


def job_secret(step: SlurmStep, env: Mapping[str, str]) -> JobSecret:
    """The secret of the Redis this step will host: ``$ELASTIC_JOB_SECRET``; on a one-node
    step without one, a fresh secret of this node's own (its server then binds loopback:
    nobody else needs to reach it). SlurmEnvError (one line) when a step of several nodes
    has none: the server would have no credentials the nodes share."""
    try:
        secret = read_job_secret(env)
    except JobSecretError as exc:
        raise SlurmEnvError(str(exc)) from None
    if secret is not None:
        return secret
    if step.nnodes > 1:
        raise SlurmEnvError(
            f"no Redis given and no ${JOB_SECRET_ENV}: the step's first node would host the "
            f"job's Redis for {step.nnodes} nodes without a shared secret; add "
            f"'{EXPORT_LINE}' to the batch script before srun, or give --redis "
            "(or $ELASTIC_REDIS_URL)")
    return JobSecret.generate()


def endpoint(step: SlurmStep, env: Mapping[str, str], loopback: bool = False) -> tuple[str, int]:
    """(address, port) of the job's Redis on the step's first node (``loopback``: this
    node's 127.0.0.1, for a server nobody else reaches)."""
    if loopback:
        return "127.0.0.1", redis_port(step, env)
    first = step.first_node
    if first is None:
        raise RuntimeError("SLURM_STEP_NODELIST is not set, so the node hosting the job's "
                           "Redis is unknown: give --redis")
    return node_address(first), redis_port(step, env)


def _url(user: str, password: str, addr: str, port: int) -> str:
    host = f"[{addr}]" if ":" in addr else addr
    return with_password(f"redis://{user}@{host}:{port}", password)


def agent_url(addr: str, port: int, secret: JobSecret, job_id: str) -> str:
    """The agents' URL, credentials included (never shown: see endpoints.redact)."""
    return _url(AGENT_USER, secret.derive(AGENT_USER, job_id), addr, port)


def worker_url(addr: str, port: int, secret: JobSecret, job_id: str) -> str:
    """The workers' ``ELASTIC_REDIS_URL``: the ``worker`` user, the torch store's keys only."""
    return _url(WORKER_USER, secret.derive(WORKER_USER, job_id), addr, port)


def _sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def server_config(job_id: str, secret: JobSecret, owner_password: str,
                  version: tuple[int, int, int] | None) -> str:
    """The config file of the job's server: its ACL users (passwords as SHA-256 hashes, so
    the file itself opens nothing) and, from Redis 7, the settings that lock CONFIG's
    protected values, DEBUG and MODULE for every user."""
    keys = JobKeys(job_id)
    # Every log shard's stream (JobKeys.logs: ``elastic:log:{JOB/TAG}:NODE``) in one pattern,
    # as docs/SECURITY.md's agent role: a job id holds no glob character (validate_job_id).
    logs = f"~elastic:log:{{{job_id}/*}}:*"
    modern = (version or (0,)) >= (7,)
    # Scripts by name, not @scripting: SCRIPT FLUSH/KILL and FUNCTION are not the agents'
    # (each spelling valid on Redis 6.2 and 7; FUNCTION, in @write, exists from 7).
    scripting = "+eval +evalsha +script|load +script|exists"
    common = (f"resetchannels -@all +@read +@write +@connection +@transaction +time {scripting} "
              "-@dangerous -@admin" + (" -function" if modern else ""))
    lines = [
        "user default off resetpass resetkeys resetchannels -@all",
        f"user {OWNER_USER} on #{_sha256(owner_password)} resetkeys resetchannels -@all "
        "+ping +info +client|list +shutdown",
        f"user {AGENT_USER} on #{_sha256(secret.derive(AGENT_USER, job_id))} resetkeys "
        f"~{keys.prefix}* {logs} ~elastic:jobs {common}",
        f"user {WORKER_USER} on #{_sha256(secret.derive(WORKER_USER, job_id))} resetkeys "
        f"~{keys.prefix}store:* ~{keys.prefix}store-queue:* {common}",
    ]
    if modern:
        lines += ["enable-protected-configs no", "enable-debug-command no",
                  "enable-module-command no"]
    return "\n".join(lines) + "\n"


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def host(step: SlurmStep, addr: str, port: int, secret: JobSecret, job_id: str,
         binary: str | None = None) -> RedisServer:
    """Start the job's Redis on this, the first, node, check it is the one answering and
    write the proof. Raises RuntimeError (one line, with what to do) when it cannot: another
    process on the port, no redis-server, one older than 7 for a bind beyond loopback."""
    try:
        bind = addr if ":" in addr else socket.gethostbyname(addr)  # (an IPv6 NodeAddr)
    except OSError as exc:
        raise RuntimeError(f"cannot resolve {addr!r}, the address SLURM gives node "
                           f"{step.first_node} ({exc}): give --redis") from None
    binary = binary or find_redis_server()
    version = redis_version(binary)
    if (version or (0,)) < (7,) and not _is_loopback(bind):
        shown = "an unknown version" if version is None else ".".join(map(str, version))
        raise RuntimeError(
            f"{binary} is Redis {shown}: older than 7, it cannot lock down a server that the "
            f"cluster's network reaches ({bind}:{port}); install Redis 7 or newer "
            "(apt-get install redis-server) on the nodes, or give --redis")
    owner = secrets.token_hex(32)
    server = RedisServer(port=port, host=bind, binary=binary, owner=(OWNER_USER, owner),
                         config=server_config(job_id, secret, owner, version))
    where = f"{step.first_node or 'this node'} port {port}"
    # SLURM signals every process of the step (scancel's SIGTERM, --signal's SIGUSR1), this
    # server too: it would be gone while the agents record how the job ended. Blocked in the
    # forking thread, the signals stay blocked in redis-server (the mask survives exec, and
    # Redis installs handlers without unblocking): it ends by the SIGKILL of its agent's
    # end (PR_SET_PDEATHSIG, see standalone.py) or by SLURM's after KillWait.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SCHEDULER_SIGNALS)
    try:
        server.start()
    except RuntimeError as exc:
        server.cleanup()
        if not port_is_free(port, bind):  # another socket holds it
            raise RuntimeError(f"another process holds {where}, where this job's Redis "
                               f"would run: {_TAKE_PORT}") from None
        raise RuntimeError(f"the job's Redis could not start on {where} "
                           f"({' '.join(str(exc).split())[:300]}): {_TAKE_PORT}") from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    if not _own_within(server, OWN_CHECK_S):
        server.kill()
        server.cleanup()
        raise RuntimeError(f"another process holds {where}, where this job's Redis would "
                           f"run (the server answering there is not this agent's): "
                           f"{_TAKE_PORT}")
    try:
        _write_proof(agent_url(bind, port, secret, job_id), secret, job_id)
    except (redis.RedisError, OSError) as exc:
        server.kill()
        server.cleanup()
        raise RuntimeError(f"the job's Redis on {where} refused the agents' user "
                           f"({type(exc).__name__}): give --redis") from None
    if secret.generated:
        server.private_file(AGENT_PASSWORD_FILE, secret.derive(AGENT_USER, job_id) + "\n")
    return server


def _own_within(server: RedisServer, timeout: float) -> bool:
    """``server.is_own()``, asked again while its child runs (an overloaded node may answer
    a check late), ``timeout`` at most."""
    deadline = time.monotonic() + timeout
    while not server.is_own():
        if server.proc is None or server.proc.poll() is not None or (
                time.monotonic() > deadline):
            return False
        time.sleep(0.1)  # nothing to wait on but the next answer
    return True


def _client(url: str) -> redis.Redis:
    """A one-shot client for the checks: no retry, short timeouts, RESP2, no cluster probe."""
    return redis.Redis.from_url(url, protocol=2, socket_timeout=5, socket_connect_timeout=2,
                                retry=Retry(NoBackoff(), 0))


def _write_proof(url: str, secret: JobSecret, job_id: str) -> None:
    client = _client(url)
    try:
        client.set(JobKeys(job_id).host_proof, secret.derive(PROOF_LABEL, job_id))
    finally:
        client.close()


def wait_for(url: str, first_node: str, job_id: str, secret: JobSecret,
             timeout: float = FIND_TIMEOUT_S) -> None:
    """Block until the first node's Redis answers and proves it is the job's: it takes the
    ``agent`` password (``url``'s) and holds the proof only the job's secret gives.
    RuntimeError (one line) when it refuses, holds another proof, or after ``timeout``."""
    shown = redact_endpoint(url)
    key = JobKeys(job_id).host_proof
    want = secret.derive(PROOF_LABEL, job_id).encode()
    other = (f"the Redis on {first_node} ({shown}) is not this job's Redis ({{why}}): another "
             f"process holds the port, or the nodes were given different ${JOB_SECRET_ENV}; "
             f"{_TAKE_PORT}")
    client = _client(url)
    deadline = time.monotonic() + timeout
    answered = False
    try:
        while True:
            try:
                proof = client.get(key)
                answered = True
            except (redis.AuthenticationError, redis.ResponseError) as exc:
                # NOAUTH, WRONGPASS, NOPERM: a server without this job's users.
                raise RuntimeError(other.format(why=f"it refused the job's credentials: "
                                                    f"{type(exc).__name__}")) from None
            except (redis.RedisError, OSError):
                proof = None  # not up yet: it is being started by another node
            if proof is not None:
                if isinstance(proof, bytes) and len(proof) <= _PROOF_MAX_BYTES and (
                        hmac.compare_digest(proof, want)):
                    return
                raise RuntimeError(other.format(why="it does not know the job's secret"))
            if time.monotonic() > deadline:
                if answered:
                    raise RuntimeError(other.format(
                        why=f"it gave no proof of the job's secret within {timeout:g} s"))
                raise RuntimeError(f"the job's Redis on {first_node} ({shown}) did not answer "
                                   f"within {timeout:g} s: see that node's output, or give "
                                   "--redis")
            time.sleep(0.1)  # nothing to wait on: the server or its proof is still to come
    finally:
        client.close()


def announce(step: SlurmStep, job_id: str, server: RedisServer, shared: bool) -> None:
    """The hosting node's lines: where the job's Redis is and the exact command to attach."""
    # Built here, not through redact_endpoint: it holds no password, and the redaction
    # would mask a user name given without one.
    url = f"redis://{AGENT_USER}@{server.url.removeprefix('redis://')}"
    how = (f"with the batch script's ${JOB_SECRET_ENV} in the environment (the console "
           f"derives the '{AGENT_USER}' user's password from it)" if shared else
           "from this node (the password file is readable by this user only)")
    command = f"elastic-console attach {job_id} --redis {url}"
    if not shared:
        command = (f"ELASTIC_REDIS_PASSWORD_FILE={server.directory}/{AGENT_PASSWORD_FILE} "
                   + command)
    print(f"[elastic-agent] no Redis given: this node ({step.first_node}) hosts the job's on "
          f"{server.url} (ACL users only); it is a single point of failure for the job "
          f"(give --redis for a real one)."
          f"\n[elastic-agent] watch this job {how}:\n"
          f"    {command}", file=sys.stderr, flush=True)


def wait_for_peers_to_leave(server: RedisServer, job_id: str,
                            timeout: float = PEERS_LEAVE_TIMEOUT_S) -> None:
    """After the hosting agent's job ended: until no other agent holds a connection (they
    write their last records after ours), ``timeout`` at most. Consoles do not count: the
    standalone linger (cli.py) is theirs."""
    client = make_client(server.admin_url, retries=0)
    console = console_client_name(job_id)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            # INFO's count costs O(1) however many agents are still connected; the list
            # (O(connections)) only once few are left, to leave consoles out.
            connected = int(client.info("clients").get("connected_clients", 0))
            if connected <= 1 or (connected <= _LIST_BELOW and sum(
                    1 for c in client.client_list() if c.get("name") != console) <= 1):
                return  # this client alone, or with consoles
            time.sleep(0.1)  # nothing notifies a disconnect
    except (redis.RedisError, OSError):
        pass
    finally:
        client.close()
