"""A job's secret: the credentials of the Redis a SLURM job hosts itself, shared by its sides.

Under ``srun`` with no Redis given, the step's first node starts one (see
``supervision/hosting/slurm_redis.py``). It starts only with a per-job secret ``S``, which the
batch script exports (``export ELASTIC_JOB_SECRET=$(openssl rand -hex 32)``) and SLURM hands
to every task of the step in its environment, readable only by the job's user and root. No
password on that server is ``S`` itself: each is derived, ``HMAC-SHA256(S, label NUL job)``
in hex, so one job's passwords open nothing of another job's, and a server that is not the
job's (a squatter on the derived port) never sees ``S``:

* ``agent`` (:data:`AGENT_USER`): the agents' and a console's ACL user;
* ``worker`` (:data:`WORKER_USER`): the workers' (the torch store's keys only);
* ``proof`` (:data:`PROOF_LABEL`): no user; the value the hosting agent writes once its
  server is up, which the other nodes read back before they write anything, so a server that
  does not know ``S`` is never taken for the job's.

The console derives the ``agent`` password the same way (:func:`with_job_secret`), so a user
with ``S`` in the environment attaches with ``--redis redis://agent@HOST:PORT``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from urllib.parse import unquote

from ..wire.keyspace import InvalidJobIdError, validate_job_id
from .endpoints import Endpoint, EndpointError, _remember, _url_credentials, with_password

#: The variable the batch script exports and every task of the step inherits.
JOB_SECRET_ENV = "ELASTIC_JOB_SECRET"
AGENT_USER = "agent"
WORKER_USER = "worker"
PROOF_LABEL = "proof"
#: 128 bits as hex at least (``openssl rand -hex 32`` gives 64 characters); at most what any
#: sane secret needs, so a hostile value costs nothing to refuse.
MIN_SECRET_CHARS = 32
MAX_SECRET_CHARS = 1024
#: How to make one, for every message that asks for a secret.
EXPORT_LINE = f"export {JOB_SECRET_ENV}=$(openssl rand -hex 32)"


class JobSecretError(EndpointError):
    """``$ELASTIC_JOB_SECRET`` is set but unusable. The message is one line and never quotes it."""


class JobSecret:
    """``S``, held so that no repr, f-string or log line can show it. ``generated``: made by
    this process (:meth:`generate`), so known to nobody else."""

    __slots__ = ("_value", "generated")

    def __init__(self, value: str, generated: bool = False) -> None:
        self._value = value
        self.generated = generated
        _remember(value)  # masked in every message, should one ever quote it

    @classmethod
    def generate(cls) -> JobSecret:
        """A fresh secret, for a Redis only this process's node uses (a one-node step)."""
        return cls(secrets.token_hex(32), generated=True)

    def derive(self, label: str, job_id: str) -> str:
        """``HMAC-SHA256(S, label NUL job)`` in hex: a password (or the proof) of one job."""
        msg = f"{label}\0{validate_job_id(job_id)}".encode()
        password = hmac.new(self._value.encode(), msg, hashlib.sha256).hexdigest()
        _remember(password)
        return password

    def __repr__(self) -> str:
        return "JobSecret(***)"

    __str__ = __repr__


def read_job_secret(environ: Mapping[str, str] | None = None) -> JobSecret | None:
    """``$ELASTIC_JOB_SECRET`` (None when unset or empty); JobSecretError when it is too short,
    too long or not printable ASCII."""
    env = os.environ if environ is None else environ
    raw = env.get(JOB_SECRET_ENV, "")
    value = raw.strip()
    if not value:
        return None
    if not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
        raise JobSecretError(
            f"${JOB_SECRET_ENV} holds {len(value)} characters, not {MIN_SECRET_CHARS} to "
            f"{MAX_SECRET_CHARS}: make it with {EXPORT_LINE}")
    if not all(33 <= ord(c) < 127 for c in value):
        raise JobSecretError(f"${JOB_SECRET_ENV} holds characters other than printable ASCII: "
                             f"make it with {EXPORT_LINE}")
    return JobSecret(value)


def with_job_secret(endpoint: Endpoint, job_id: str | None,
                    environ: Mapping[str, str] | None = None) -> Endpoint:
    """``endpoint`` with the ``agent`` password of ``job_id`` derived from
    ``$ELASTIC_JOB_SECRET``, when its URL names the user ``agent`` and holds no password
    (a password in the URL wins). Unchanged otherwise: no job, no secret, another user.
    JobSecretError for an unusable secret."""
    user, password, _ = _url_credentials(endpoint.url) if "://" in endpoint.url else (
        None, None, "")
    if job_id is None or password or user is None or unquote(user) != AGENT_USER:
        return endpoint
    secret = read_job_secret(environ)
    if secret is None:
        return endpoint
    try:
        derived = secret.derive(AGENT_USER, job_id)
    except InvalidJobIdError:
        return endpoint  # the command refuses the job id itself, with its own line
    return Endpoint(with_password(endpoint.url, derived))
