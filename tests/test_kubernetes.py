"""docs/kubernetes/: the manifests validate against Kubernetes' schemas, and what they run runs.

Kubernetes itself cannot run here. Instead:

* every document is validated offline, strictly (an unknown field fails), against the
  schemas kubernetes-validate ships for the oldest and newest Kubernetes the docs name;
* secrets.sh is run with a stand-in kubectl (tests/kube.py) and makes the Secrets;
* the Redis of redis.yaml is started from its own ConfigMap and the ACL file of its Secret
  (so its settings and users are ones Redis takes): no client gets admin rights, and the
  users are docs/SECURITY.md's roles;
* each agents*.yaml Job's agent container is run as N local processes, one per pod index,
  with its own command, args and environment (tests/kube.py says what stands in for the
  cluster), against that Redis as the Job's agent user: they must form one job and finish,
  the liveness probe's path and port must get 200 from a running agent, and a worker holds
  nothing that reaches beyond its job;
* console.yaml's command line is parsed by the console's parser and served as the viewer
  user, its token out of its output;
* the NetworkPolicies are read with Kubernetes' semantics (no CNI runs here), and every pod's
  security context and memory limit are checked.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import re
import shlex
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
            ("Service", "train-static"), ("Deployment", "elastic-console"),
            ("NetworkPolicy", "elastic-redis"), ("NetworkPolicy", "train"),
            ("NetworkPolicy", "train-static"), ("NetworkPolicy", "elastic-console")} <= kinds, (
        kinds)
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

#: The Jobs of the manifests, whose agents have a Redis user each (secrets.sh's default).
JOBS = ("train", "train-static")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[kube.Cluster, str]]:
    """redis.yaml's Redis, run from its ConfigMap and the ACL file of the Secret secrets.sh
    makes, and the cluster's names for it; yields the stand-ins and the Redis URL (no
    credentials)."""
    work = tmp_path_factory.mktemp("k8s")
    volumes = work / "volumes"
    volumes.mkdir()
    cl = kube.Cluster(secrets=kube.run_secrets_script(work), volumes=volumes)
    sts = kube.find("StatefulSet", "elastic-redis")
    cl.mount_volumes(sts)
    proc = kube.local_process(sts, "redis", cl)
    assert proc.argv[0] == "redis-server"
    # The configuration file alone: no password on the command line, none in its environment.
    (conf,) = proc.argv[1:]
    assert Path(conf).is_file(), f"the Redis container's config {conf} is not in its ConfigMap"
    assert not proc.env, proc.env
    # The file names its ACL file by the path the container mounts it at: here, its volume.
    local_conf = work / "redis.conf"
    local_conf.write_text(cl.mounted_text(kube.container(sts, "redis"), Path(conf).read_text()))
    server = RedisServer(extra_args=["--include", str(local_conf)]).start()
    try:
        svc = kube.find("Service", "elastic-redis")
        for port in svc["spec"]["ports"]:
            cl.names[f"elastic-redis:{port['port']}"] = f"{server.host}:{server.port}"
        yield cl, server.url
    finally:
        server.cleanup()


def as_user(url: str, cl: kube.Cluster, user: str, secret: str) -> redis.Redis:
    """A client of the manifests' Redis as ``user``, with the password of Secret ``secret``."""
    return redis.Redis.from_url(url, username=user,
                                password=cl.secrets[(secret, "password")])


def admin(url: str, cl: kube.Cluster) -> redis.Redis:
    return as_user(url, cl, "ec-admin", "elastic-redis-admin")


def test_the_redis_of_the_manifest_never_evicts(cluster: tuple[kube.Cluster, str]) -> None:
    cl, url = cluster
    client = admin(url, cl)
    try:
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        # Under the container's limit: Redis refuses writes before the kernel kills it.
        limit = kube.container(kube.find("StatefulSet", "elastic-redis"), "redis")[
            "resources"]["limits"]["memory"]
        assert 0 < int(client.config_get("maxmemory")["maxmemory"]) < _bytes(limit), limit
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        client.close()


#: What no client of a job needs, each refused to every user a pod or a person's console
#: holds (CONFIG SET with the value it has: harmless if it were let through).
ADMIN_COMMANDS = (
    ["CONFIG", "SET", "maxmemory-policy", "noeviction"], ["CONFIG", "GET", "requirepass"],
    ["CONFIG", "SET", "dir", "/tmp"], ["MODULE", "LOAD", "/nonexistent.so"],
    ["DEBUG", "SLEEP", "0"], ["ACL", "SETUSER", "intruder", "on", "nopass", "+@all", "~*"],
    ["ACL", "LIST"], ["FLUSHALL"], ["SAVE"], ["BGREWRITEAOF"], ["REPLICAOF", "NO", "ONE"],
    ["SHUTDOWN", "NOSAVE"],
    ["EVAL", "return redis.call('CONFIG', 'SET', 'maxmemory-policy', 'noeviction')", "0"],
)

#: What ``+@read`` and ``+@connection`` hold beyond a console's or an agent's needs (each in
#: ``@dangerous``): a walk of the whole keyspace, other clients' addresses, dropping or stalling
#: them. Refused for want of permission, not for a bad argument: each is harmless if let
#: through (no such client, 1 ms, no such key).
DANGEROUS_READS = (
    ["KEYS", "elastic:{nothing}:*"], ["CLIENT", "LIST"], ["CLIENT", "KILL", "ID", "999999999"],
    ["CLIENT", "PAUSE", "1"], ["CLIENT", "NO-EVICT", "off"],
)

#: Each user the manifests and the README hand out, with its Secret.
USERS = {"ec-viewer": "elastic-redis-viewer", "ec-operator": "elastic-redis-operator",
         **{f"ec-agent-{job}": f"elastic-redis-agent-{job}" for job in JOBS}}


def test_no_client_of_the_manifests_redis_has_admin_rights(
        cluster: tuple[kube.Cluster, str]) -> None:
    """The default user (no credentials) may PING and nothing else; the agents', viewer's and
    operator's users run no admin command, nor KEYS or CLIENT LIST, KILL or PAUSE; protected
    configs, DEBUG and MODULE are refused even to ec-admin."""
    cl, url = cluster
    nobody = redis.Redis.from_url(url)
    try:
        assert nobody.ping()
        for command in (["GET", "x"], ["XADD", "elastic:{j}:commands", "*", "a", "b"],
                        ["CONFIG", "SET", "maxmemory-policy", "noeviction"]):
            with pytest.raises(redis.exceptions.NoPermissionError):
                nobody.execute_command(*command)
        for command in ADMIN_COMMANDS:
            with pytest.raises(redis.ResponseError):
                nobody.execute_command(*command)
    finally:
        nobody.close()
    for user, secret in USERS.items():
        client = as_user(url, cl, user, secret)
        try:
            assert client.execute_command("PING")
            for command in ADMIN_COMMANDS:
                with pytest.raises(redis.ResponseError):
                    client.execute_command(*command)
            for command in DANGEROUS_READS:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
        finally:
            client.close()
    root = admin(url, cl)
    try:
        assert root.ping()  # the server is still there: no SHUTDOWN went through
        assert root.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        # Set in the ConfigMap, not left to the image's defaults.
        conf = kube.find("ConfigMap", "elastic-redis")["data"]["redis.conf"]
        for name in ("enable-protected-configs", "enable-debug-command",
                     "enable-module-command"):
            assert re.search(rf"^{name} no$", conf, re.M), name
            assert root.config_get(name) == {name: "no"}, name
        for command in (["CONFIG", "SET", "dir", "/tmp"], ["MODULE", "LOAD", "/x.so"],
                        ["DEBUG", "SLEEP", "0"]):
            with pytest.raises(redis.ResponseError):
                root.execute_command(*command)
        assert "intruder" not in root.acl_users()
    finally:
        root.close()


def test_secrets_sh_keeps_passwords_and_refuses_a_name_that_is_no_job_name(
        tmp_path: Path) -> None:
    first = kube.run_secrets_script(tmp_path, "train")
    again = kube.run_secrets_script(tmp_path, "train", "other")
    for name in ("elastic-redis-admin", "elastic-redis-viewer", "elastic-redis-agent-train"):
        assert again[(name, "password")] == first[(name, "password")], name
    assert "user ec-agent-other " in again[("elastic-redis-acl", "users.acl")]
    assert len({v for (_, k), v in again.items() if k == "password"}) == 5  # all different
    # A name that is no DNS label could carry a glob or a space into an ACL rule.
    for bad in ("Train", "a*", "a b", "x" * 64, "-a"):
        assert kube.run_secrets_script(tmp_path, bad, fails=True) == again, bad


def _documented_roles() -> list[list[str]]:
    """docs/SECURITY.md's ACL lines, as ACL SETUSER arguments."""
    text = (kube.ROOT / "docs" / "SECURITY.md").read_text()
    (block,) = re.findall(r"```acl\n(.*?)```", text, re.S)
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert all(args[:2] == ["ACL", "SETUSER"] for args in lines), lines
    return [args[2:] for args in lines]


def test_the_manifests_users_are_the_documented_roles(cluster: tuple[kube.Cluster, str]) -> None:
    """Each user of the ACL file is docs/SECURITY.md's line for its role, rule for rule: the
    documented lines, applied on another server with the same passwords (JOB: a Job's ids,
    NAME-<uid>), give exactly the manifests' users (ACL LIST's canonical form)."""
    cl, url = cluster
    passwords = {"AGENT_PASSWORD": None, "OPERATOR_PASSWORD": "elastic-redis-operator",
                 "VIEWER_PASSWORD": "elastic-redis-viewer"}
    uid = "????????-????-????-????-????????????"
    root = admin(url, cl)
    expected: dict[str, str] = {}
    with RedisServer() as scratch:
        other = redis.Redis(host=scratch.host, port=scratch.port, decode_responses=True)
        try:
            for args in _documented_roles():
                role = args[0]
                if role == "ec-worker-JOB":
                    continue  # the manifests' workers get no user (the example uses no store)
                names = ([(f"ec-agent-{job}", f"{job}-{uid}", f"elastic-redis-agent-{job}")
                          for job in JOBS] if role == "ec-agent-JOB" else [(role, None, None)])
                for user, job, agent_secret in names:
                    rules = []
                    for arg in args[1:]:
                        for placeholder, secret in passwords.items():
                            if placeholder in arg:
                                arg = arg.replace(placeholder, cl.secrets[
                                    (secret or agent_secret, "password")])
                        rules.append(arg.replace("JOB", job) if job else arg)
                    other.execute_command("ACL", "SETUSER", user, *rules)
            for line in other.acl_list():
                user = line.split()[1]
                if user != "default":
                    expected[user] = line
        finally:
            other.close()
    try:
        actual = {line.split()[1]: line for line in
                  (x.decode() for x in root.execute_command("ACL", "LIST"))}
    finally:
        root.close()
    assert set(expected) == set(USERS), expected
    for user in USERS:
        assert _rules(actual.get(user, "")) == _rules(expected[user]), (
            user, actual.get(user), expected[user])
    # The default user: a client with no credentials may PING, nothing more (the readiness
    # probe), and ec-admin is for people: no pod's environment names it.
    assert actual["default"] == "user default on nopass resetchannels -@all +ping", actual
    pods = [d for _, d in kube.all_documents() if d["kind"] in ("Job", "Deployment")]
    refs = {v["valueFrom"]["secretKeyRef"]["name"] for d in pods
            for c in kube.pod_spec(d)["containers"] for v in c.get("env", ())
            if "secretKeyRef" in v.get("valueFrom", {})}
    assert refs == {"elastic-redis-viewer", *(f"elastic-redis-agent-{j}" for j in JOBS)}, refs


def _rules(line: str) -> tuple[frozenset[str], frozenset[frozenset[str]]]:
    """An ACL LIST line as its root rules and its selectors' rules, each a set: the server
    lists a role's command exceptions in an order of its own."""
    root, *selectors = line.split(" (")
    return (frozenset(root.split()),
            frozenset(frozenset(sel.rstrip(")").split()) for sel in selectors))


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


class JobPods:
    """An agents*.yaml Job's agent containers as local processes, one per pod index, with
    what only a cluster has replaced (tests/kube.py) and a free --master-port."""

    def __init__(self, manifest: str, base: kube.Cluster) -> None:
        (job,) = [d for d in kube.documents(kube.MANIFESTS / manifest) if d["kind"] == "Job"]
        self.job = job
        self.name = job["metadata"]["name"]
        self.cl = kube.Cluster(secrets=base.secrets, names={**base.names},
                               volumes=base.volumes, job_uid=str(uuid.uuid4()))
        self.cl.names.update(kube.pod_names(job, self.cl))
        self.cl.mount_volumes(job)
        self.procs = [kube.local_process(job, "agent", self.cl, i)
                      for i in range(job["spec"]["completions"])]
        # The Job's name and uid: a Job applied again is a new job, not one that "succeeded".
        self.job_id = f"{self.name}-{self.cl.job_uid}"
        # A fixed --master-port is a port of the whole host here, which other tests on this
        # shared machine may hold: a free one instead.
        master_port = free_port()
        for p in self.procs:
            p.argv = [re.sub(r"^--master-port=\d+$", f"--master-port={master_port}", a)
                      for a in p.argv]

    def start(self, i: int, tmp: Path, argv: list[str] | None = None) -> Agent:
        """Pod ``i``'s agent, with the pod's privileges (tests/kube.py: as_pod)."""
        p = self.procs[i]
        assert p.prefix, "the pod's security context is not applied"
        argv = argv or p.argv
        return Agent(argv[1:], tmp, f"pod{i}", env=p.env, command=[str(BIN / argv[0])],
                     cwd=kube.ROOT, prefix=p.prefix)


@pytest.mark.parametrize("manifest", AGENT_MANIFESTS)
def test_the_agents_of_the_manifest_form_one_job_and_finish(
        manifest: str, cluster: tuple[kube.Cluster, str], tmp_path: Path) -> None:
    base, url = cluster
    pods = JobPods(manifest, base)
    job, cl, procs, job_id = pods.job, pods.cl, pods.procs, pods.job_id
    assert job["spec"]["completionMode"] == "Indexed"
    n = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == n >= 2
    spec = kube.pod_spec(job)
    if spec.get("subdomain"):  # pods found by name need the headless Service of that name
        svc = kube.find("Service", spec["subdomain"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    argv0 = procs[0].argv
    assert argv0[0] == "elastic-agent", argv0
    assert f"--job-id={job_id}" in argv0, argv0
    # The agents' credentials are the Job's agent user's (secrets.sh), never an admin's: with
    # the default user allowed only PING, a job that runs has run as that user.
    env = procs[0].env
    assert env["ELASTIC_REDIS_URL"] == f"redis://ec-agent-{pods.name}@{cl.names['elastic-redis:6379']}"
    assert env["REDISCLI_AUTH"] == cl.secrets[(f"elastic-redis-agent-{pods.name}", "password")]
    c = kube.container(job, "agent")
    probe = c["livenessProbe"]["httpGet"]
    probe_port = kube.named_port(c, probe["port"])
    assert f"--health-check-port={probe_port}" in argv0, (probe_port, argv0)
    # The image holds the repository under workingDir: here, this checkout.
    scripts = [a for a in argv0 if a.endswith(".py")]
    assert scripts and (kube.ROOT / scripts[0]).is_file(), argv0
    agents: list[Agent] = []
    try:
        # Pod 0 first: it waits in the rendezvous for the others, and its probe must pass.
        for i in range(n):
            agents.append(pods.start(i, tmp_path))
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
    r = admin(url, cl)
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


#: A training script that tries what a hostile one would with the Redis credentials it can
#: find: its own environment's, and the agent's, read from an ancestor's /proc/PID/environ
#: (a worker runs as the agent's user). It prints one line: what each attempt got.
PROBE = r"""
import json, os, sys
import redis

if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)  # one failure first: the agents' restart runs under their ACL user too

def attempt(url, password):
    client = redis.Redis.from_url(url, password=password or None, socket_timeout=10)
    out = {}
    for what, command in (
            ("config_set", ["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
            ("stop_other_job", ["XADD", "elastic:{%s}:commands" % sys.argv[1], "*",
                                "type", "stop"]),
            ("read_other_job", ["XRANGE", "elastic:{%s}:events" % sys.argv[1], "-", "+"])):
        try:
            client.execute_command(*command)
            out[what] = "done"
        except redis.RedisError as exc:
            out[what] = type(exc).__name__
    client.close()
    return out

report = {"env": dict(os.environ)}
report["own"] = attempt(os.environ["ELASTIC_REDIS_URL"], os.environ.get("REDISCLI_AUTH"))
pid, found = os.getppid(), {}
while pid > 1:  # every ancestor: the keeper and zygote, the agent
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        break
    for name in (b"ELASTIC_REDIS_URL", b"REDISCLI_AUTH"):
        found.setdefault(name, env.get(name))
        found[name] = found[name] or env.get(name)
report["agents"] = (attempt(found[b"ELASTIC_REDIS_URL"].decode(),
                            found[b"REDISCLI_AUTH"].decode())
                    if found.get(b"REDISCLI_AUTH") else None)
print("PROBE " + json.dumps(report), flush=True)
"""


def test_a_worker_holds_no_credential_beyond_its_job(
        cluster: tuple[kube.Cluster, str], tmp_path: Path) -> None:
    """agents.yaml's pod 0, its script replaced by a probe (and --nnodes=1, so that it runs
    alone): the worker's environment holds no Redis password (none of the Secrets' values
    at all), what it has reaches nothing, and even the agent's own credential, which a
    script running as the agent's user can read from the agent's memory, runs no admin
    command and touches no other job."""
    base, _ = cluster
    pods = JobPods("agents.yaml", base)
    argv = pods.procs[0].argv
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    # Another Job's, whose id begins with this Job's name. (A run of this same Job applied
    # again, train-<another uid>, is within the agent user's keys: that is the user's scope.)
    other_job = f"train-static-{uuid.uuid4()}"
    argv = [("--nnodes=1" if a.startswith("--nnodes=") else a) for a in argv[:script]]
    agent = pods.start(0, tmp_path, [*argv, str(probe), other_job])
    try:
        code = agent.wait(120)
    finally:
        _end(agent)
    out = agent.output
    assert code == 0, out[-3000:]
    (line,) = [x for x in out.splitlines() if "PROBE " in x]
    report = json.loads(line.split("PROBE ", 1)[1])
    env = report["env"]
    assert not {"REDISCLI_AUTH", "ELASTIC_REDIS_PASSWORD_FILE"} & set(env), sorted(env)
    secrets_held = [name for (name, _), value in base.secrets.items()
                    if any(value in v for v in env.values())]
    assert not secrets_held, secrets_held
    assert env["ELASTIC_REDIS_URL"] == f"redis://{base.names['elastic-redis:6379']}", env
    # With what it holds: Redis's default user, PING only.
    assert report["own"] == {"config_set": "NoPermissionError",
                             "stop_other_job": "NoPermissionError",
                             "read_other_job": "NoPermissionError"}, report["own"]
    # With the agent's credential, read from the agent's /proc (same user): its job only.
    # The agent itself lacked no right, restart included (the first attempt failed).
    assert "restarting (1/" in out and "no permissions" not in out, out[-3000:]
    assert report["agents"] == {"config_set": "NoPermissionError",
                                "stop_other_job": "NoPermissionError",
                                "read_other_job": "NoPermissionError"}, report["agents"]


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

def test_the_console_of_the_manifest_serves_as_a_viewer_its_token_out_of_its_log(
        cluster: tuple[kube.Cluster, str], tmp_path: Path) -> None:
    cl, url = cluster
    deploy = kube.find("Deployment", "elastic-console")
    cl.mount_volumes(deploy)
    proc = kube.local_process(deploy, "console", cl)
    assert proc.argv[0] == "elastic-console"
    args = console_parser().parse_args(proc.argv[1:])
    assert args.command == "serve"
    # kubectl port-forward reaches the pod's loopback: nothing else in the cluster should.
    assert args.host == "127.0.0.1"
    c = kube.container(deploy, "console")
    assert args.port == kube.named_port(c, "http")
    # The token goes to a file on one of the pod's own volumes (an emptyDir, read with
    # kubectl exec), not to its log, which whoever may read pods/log reads.
    assert args.token_file, "serve prints its token to the pod's log"
    token_file = Path(args.token_file)
    (volume,) = [v for v in kube.pod_spec(deploy)["volumes"]
                 if token_file.parent == cl.volumes / v["name"]]
    assert "emptyDir" in volume, volume
    # It reads Redis as the viewer.
    env = proc.env
    assert env["ELASTIC_REDIS_URL"] == f"redis://ec-viewer@{cl.names['elastic-redis:6379']}"
    assert env["REDISCLI_AUTH"] == cl.secrets[("elastic-redis-viewer", "password")]
    # Served for real, on a free port (this host's 8765 may be taken).
    port = free_port()
    argv = [re.sub(r"^--port=\d+$", f"--port={port}", a) for a in proc.argv]
    assert argv != proc.argv
    assert proc.prefix, "the pod's security context is not applied"
    server = Agent(argv[1:], tmp_path, "console", env=env, command=[str(BIN / argv[0])],
                   prefix=proc.prefix)
    try:
        wait_until(lambda: re.search(r"serving .* at http://127\.0\.0\.1:\d+/", server.output),
                   60, "the console to say where it serves")
        token = token_file.read_text().strip()
        assert re.fullmatch(r"[\w-]{32}", token), token
        assert token_file.stat().st_mode & 0o777 == 0o600
        assert _get("127.0.0.1", port, f"/{token}/") == 200
        assert _get("127.0.0.1", port, "/") == 403  # the token is the way in
        assert token not in server.output, server.output  # the pod's log
        server.proc.terminate()  # as the kubelet stops a container
        assert server.wait(30) == 0, server.output
    finally:
        _end(server)
    assert not token_file.exists(), "a dead token was left behind"
    # The viewer reads every job and sends no command: not even through a browser given
    # --allow-commands by mistake.
    viewer = as_user(url, cl, "ec-viewer", "elastic-redis-viewer")
    job = f"train-{uuid.uuid4()}"
    try:
        assert viewer.xrange(f"elastic:{{{job}}}:events") == []
        with pytest.raises(redis.exceptions.NoPermissionError):
            viewer.xadd(f"elastic:{{{job}}}:commands", {"type": "stop"})
    finally:
        viewer.close()


# -- network policies and pods' privileges ----------------------------------------------------

def _ports(doc: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in kube.pod_spec(doc)["containers"]
            for p in c.get("ports", ()) if "name" in p}


def test_the_network_policies_admit_only_the_jobs_own_pods() -> None:
    """Read as Kubernetes reads them: Redis only from the agents' and the consoles' pods; a
    Job's pods (the health port, rank 0's master port, gloo's ports) only from that Job's
    pods; the console's from nothing (kubectl port-forward and the kubelet's probes are not
    subject to policies)."""
    cl = kube.Cluster()
    redis_sts = kube.find("StatefulSet", "elastic-redis")
    redis_pod = kube.pod_labels(redis_sts, cl)
    jobs = {name: [kube.pod_labels(kube.find("Job", name), cl, i) for i in (0, 1)]
            for name in JOBS}
    deploy = kube.find("Deployment", "elastic-console")
    console = kube.pod_labels(deploy, cl)
    strangers = [{"app": "someone-else"}, {"app.kubernetes.io/name": "jupyter"}, {}]
    port = _ports(redis_sts)["redis"]
    for src in (*(pods[1] for pods in jobs.values()), console):
        assert kube.admits(src, redis_pod, port, named=_ports(redis_sts)), src
    for src in strangers:
        assert not kube.admits(src, redis_pod, port, named=_ports(redis_sts)), src
    for name, pods in jobs.items():
        job = kube.find("Job", name)
        named = _ports(job)
        others = [p[1] for other, p in jobs.items() if other != name]
        for target in (named["health"], named.get("master", 29500), 41234):
            assert kube.admits(pods[1], pods[0], target, named=named), (name, target)
            for src in (*others, console, redis_pod, *strangers):
                assert not kube.admits(src, pods[0], target, named=named), (name, target, src)
    for src in (jobs["train"][0], redis_pod, *strangers):
        assert not kube.admits(src, console, _ports(deploy)["http"], named=_ports(deploy))


WORKLOADS = [d for _, d in kube.all_documents() if d["kind"] in ("Job", "Deployment",
                                                                   "StatefulSet")]


@pytest.mark.parametrize("doc", WORKLOADS, ids=lambda d: d["metadata"]["name"])
def test_every_pod_runs_unprivileged_with_a_memory_limit(doc: dict) -> None:
    spec = kube.pod_spec(doc)
    assert spec.get("automountServiceAccountToken") is False  # no pod talks to the API
    assert not (spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"))
    pod = spec.get("securityContext", {})
    assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) > 0, pod
    assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, pod
    for c in (*spec.get("initContainers", ()), *spec["containers"]):
        sc = c.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("capabilities") == {"drop": ["ALL"]}, c["name"]
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        assert not sc.get("privileged") and sc.get("runAsUser", 1) > 0, c["name"]
        resources = c.get("resources", {})
        limit = resources.get("limits", {}).get("memory")
        assert limit, f"{doc['metadata']['name']}/{c['name']} has no memory limit"
        assert _bytes(limit) >= _bytes(resources.get("requests", {}).get("memory", "0"))
        # A read-only root: what the agents and consoles write (their temporary files, an
        # agent's log directory) goes to a volume of the pod's own.
        if doc["kind"] != "StatefulSet":
            mounts = {m["mountPath"] for m in c.get("volumeMounts", ())}
            assert "/tmp" in mounts, c["name"]
