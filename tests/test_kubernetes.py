"""docs/kubernetes/: the manifests validate against Kubernetes' schemas, and what they run runs.

Kubernetes itself cannot run here. Instead:

* every document is validated offline, strictly (an unknown field fails), against the
  schemas kubernetes-validate ships for the oldest and newest Kubernetes the docs name;
* the Redis of redis.yaml is started from its own ConfigMap (so its settings are ones Redis
  takes) with the Secret's password set;
* each agents*.yaml Job's agent container is run as N local processes, one per pod index,
  with its own command, args and environment (tests/kube.py says what stands in for the
  cluster), against that Redis: they must form one job and finish, and the liveness probe's
  path and port must get 200 from a running agent;
* console.yaml's command line is parsed by the console's parser and served.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import re
import secrets
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.supervision.hosting.standalone import RedisServer, free_port
from elastic_console.cli import build_parser as console_parser
from tests import kube
from tests.agents import Agent, wait_until
from tests.test_agent import of_type

#: The oldest Kubernetes the manifests claim (the Jobs' batch.kubernetes.io/job-name label
#: came in 1.27) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.28.0", "1.37.0")
BIN = Path(sys.executable).parent  # the installed elastic-agent / elastic-console scripts
AGENT_MANIFESTS = sorted(p.name for p in kube.MANIFESTS.glob("agents*.yaml"))


def _validate(doc: dict) -> None:
    import kubernetes_validate

    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# -- schemas ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", kube.manifest_files(), ids=lambda p: p.name)
def test_every_manifest_validates_against_kubernetes_schemas(path: Path) -> None:
    docs = kube.documents(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        _validate(doc)


def test_the_manifests_are_there() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in kube.all_documents()}
    assert {("StatefulSet", "elastic-redis"), ("Service", "elastic-redis"),
            ("ConfigMap", "elastic-redis"), ("Job", "train"), ("Job", "train-static"),
            ("Service", "train-static"), ("Deployment", "elastic-console")} <= kinds, kinds
    assert AGENT_MANIFESTS == ["agents-static.yaml", "agents.yaml"]


def test_validation_refuses_a_broken_manifest() -> None:
    """The check above can fail: a misspelt field, a wrong type, a missing required field."""
    import kubernetes_validate

    job = kube.find("Job", "train")
    typo = copy.deepcopy(job)
    c = kube.container(typo, "agent")
    c["livenessProbe"]["httpGet"]["paht"] = c["livenessProbe"]["httpGet"].pop("path")
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["completions"] = "two"
    missing = copy.deepcopy(job)
    del kube.container(missing, "agent")["name"]
    for broken in (typo, wrong_type, missing):
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(broken)


# -- Redis ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[kube.Cluster, str]]:
    """redis.yaml's Redis, run from its ConfigMap with the password its Secret would hold, and
    the cluster's names for it; yields the stand-ins and the Redis URL (no password)."""
    volumes = tmp_path_factory.mktemp("volumes")
    password = secrets.token_hex(16)
    cl = kube.Cluster(secrets={("elastic-redis", "password"): password}, volumes=volumes)
    sts = kube.find("StatefulSet", "elastic-redis")
    # The ConfigMap volume, as the kubelet would mount it: one file per key.
    for vol in kube.pod_spec(sts)["volumes"]:
        if "configMap" in vol:
            (volumes / vol["name"]).mkdir()
            data = kube.find("ConfigMap", vol["configMap"]["name"])["data"]
            for key, text in data.items():
                (volumes / vol["name"] / key).write_text(text)
    proc = kube.local_process(sts, "redis", cl)
    assert proc.argv[0] == "redis-server"
    conf, rest = proc.argv[1], proc.argv[2:]
    assert Path(conf).is_file(), f"the Redis container's config {conf} is not in its ConfigMap"
    assert rest == ["--requirepass", password], rest
    # The password is set once it answers (a PING without it would not).
    server = RedisServer(extra_args=["--include", conf]).start()
    try:
        admin = redis.Redis(host=server.host, port=server.port)
        admin.config_set("requirepass", password)
        admin.close()
        svc = kube.find("Service", "elastic-redis")
        for port in svc["spec"]["ports"]:
            cl.names[f"elastic-redis:{port['port']}"] = f"{server.host}:{server.port}"
        yield cl, server.url
    finally:
        server.cleanup()


def test_the_redis_of_the_manifest_never_evicts(cluster: tuple[kube.Cluster, str]) -> None:
    cl, url = cluster
    client = redis.Redis.from_url(url, password=cl.secrets[("elastic-redis", "password")])
    try:
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        # Under the container's limit: Redis refuses writes before the kernel kills it.
        limit = kube.container(kube.find("StatefulSet", "elastic-redis"), "redis")[
            "resources"]["limits"]["memory"]
        assert 0 < int(client.config_get("maxmemory")["maxmemory"]) < _bytes(limit), limit
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        client.close()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url).ping()


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in binary units (``4Gi``)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert m, f"{quantity!r}: write the limit in Ki, Mi, Gi or Ti"
    return int(m.group(1)) * 1024 ** ("", "Ki", "Mi", "Gi", "Ti").index(m.group(2) or "")


# -- the agents -----------------------------------------------------------------------------

def _get(host: str, port: int, path: str) -> int:
    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.parametrize("manifest", AGENT_MANIFESTS)
def test_the_agents_of_the_manifest_form_one_job_and_finish(
        manifest: str, cluster: tuple[kube.Cluster, str], tmp_path: Path) -> None:
    base, url = cluster
    (job,) = [d for d in kube.documents(kube.MANIFESTS / manifest) if d["kind"] == "Job"]
    assert job["spec"]["completionMode"] == "Indexed"
    n = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == n >= 2
    cl = kube.Cluster(secrets=base.secrets, names={**base.names}, volumes=base.volumes,
                      job_uid=str(uuid.uuid4()))
    cl.names.update(kube.pod_names(job, cl))
    spec = kube.pod_spec(job)
    if spec.get("subdomain"):  # pods found by name need the headless Service of that name
        svc = kube.find("Service", spec["subdomain"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    procs = [kube.local_process(job, "agent", cl, i) for i in range(n)]
    argv0 = procs[0].argv
    assert argv0[0] == "elastic-agent", argv0
    # The Job's name and uid: a Job applied again is a new job, not one that "succeeded".
    job_id = f"{job['metadata']['name']}-{cl.job_uid}"
    assert f"--job-id={job_id}" in argv0, argv0
    # A fixed --master-port is a port of the whole host here, which other tests on this
    # shared machine may hold: a free one instead (the only flag changed).
    master_port = free_port()
    for p in procs:
        p.argv = [re.sub(r"^--master-port=\d+$", f"--master-port={master_port}", a)
                  for a in p.argv]
    c = kube.container(job, "agent")
    probe = c["livenessProbe"]["httpGet"]
    probe_port = kube.named_port(c, probe["port"])
    assert f"--health-check-port={probe_port}" in argv0, (probe_port, argv0)
    # The image holds the repository under workingDir: here, this checkout.
    scripts = [a for a in argv0 if a.endswith(".py")]
    assert scripts and (kube.ROOT / scripts[0]).is_file(), argv0
    script = BIN / argv0[0]
    agents: list[Agent] = []
    try:
        # Pod 0 first: it waits in the rendezvous for the others, and its probe must pass.
        for i, p in enumerate(procs):
            agents.append(Agent(p.argv[1:], tmp_path, f"pod{i}", env=p.env,
                                command=[str(script)], cwd=kube.ROOT))
            if i == 0:
                wait_until(lambda: _probe_ok(cl.pod_ip(0), probe_port, probe["path"])
                           or _exited(agents[0]), 60, "the liveness probe of pod 0 to get 200")
        # All done, or one failed (the others would wait for it until their join timeout).
        wait_until(lambda: all(a.proc.poll() == 0 for a in agents)
                   or any(a.proc.poll() not in (None, 0) for a in agents), 150,
                   "every agent to exit 0, or one to fail")
        codes = [a.proc.poll() for a in agents]
        assert codes == [0] * n, "\n".join(a.output[-3000:] for a in agents)
    finally:
        for a in agents:
            _end(a)
    r = redis.Redis.from_url(url, password=cl.secrets[("elastic-redis", "password")])
    try:
        joined = {e.node: e.data["addr"] for e in of_type(r, job_id, "node_joined")}
        started = of_type(r, job_id, "workers_started")
        succeeded = of_type(r, job_id, "job_succeeded")
    finally:
        r.close()
    # One job of n nodes, each known by its pod IP (--local-addr from status.podIP).
    assert sorted(joined.values()) == [cl.pod_ip(i) for i in range(n)], joined
    ranks = {rank: e.node for e in started for rank in e.data["ranks"]}
    nproc = int(next(a for a in argv0 if a.startswith("--nproc-per-node=")).split("=")[1])
    assert sorted(ranks) == list(range(n * nproc)), started
    if "--rdzv-backend=static" in argv0:  # the pod index is the node rank
        for rank, node in ranks.items():
            assert joined[node] == cl.pod_ip(rank // nproc), (rank, node, joined)
    assert succeeded, "no job_succeeded event"
    outputs = "".join(a.output for a in agents)
    assert f"rank 0/{n * nproc}" in outputs, outputs[-3000:]


def _end(process: Agent) -> None:
    """Kill what is left of it and close its output file."""
    process.kill()
    with contextlib.suppress(AssertionError):
        process.wait(10)


def _exited(agent: Agent) -> bool:
    """An agent that ended while it should be waiting for the others fails the test now."""
    if agent.proc.poll() is not None:
        raise AssertionError(f"pod 0's agent exited {agent.proc.returncode}:\n"
                             f"{agent.output[-3000:]}")
    return False


def _probe_ok(host: str, port: int, path: str) -> bool:
    try:
        return _get(host, port, path) == 200
    except OSError:
        return False


# -- the console ----------------------------------------------------------------------------

def test_the_console_of_the_manifest_serves_on_loopback(
        cluster: tuple[kube.Cluster, str], tmp_path: Path) -> None:
    cl, _ = cluster
    deploy = kube.find("Deployment", "elastic-console")
    proc = kube.local_process(deploy, "console", cl)
    assert proc.argv[0] == "elastic-console"
    args = console_parser().parse_args(proc.argv[1:])
    assert args.command == "serve"
    # kubectl port-forward reaches the pod's loopback: nothing else in the cluster should.
    assert args.host == "127.0.0.1"
    c = kube.container(deploy, "console")
    assert args.port == kube.named_port(c, "http")
    # Served for real, on a free port (this host's 8765 may be taken).
    port = free_port()
    argv = [re.sub(r"^--port=\d+$", f"--port={port}", a) for a in proc.argv]
    assert argv != proc.argv
    server = Agent(argv[1:], tmp_path, "console", env=proc.env,
                   command=[str(BIN / argv[0])])
    try:
        m = wait_until(lambda: re.search(r"at (http://127\.0\.0\.1:\d+/([\w-]+)/)",
                                         server.output), 60, "the console to print its URL")
        assert _get("127.0.0.1", port, f"/{m.group(2)}/") == 200
        assert _get("127.0.0.1", port, "/") == 403  # the token is the way in
    finally:
        _end(server)
