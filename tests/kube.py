"""The Kubernetes manifests of docs/kubernetes/, read back into local processes.

Kubernetes cannot run here, so the tests run what the manifests say a container runs: its
command, args and environment, with the values only a cluster has replaced by local ones
(:class:`Cluster`): the downward API's pod IP and the Indexed Job's pod index, the Secrets'
values, the Services' and pods' DNS names, and the volumes' mount paths. Everything else
comes from the YAML, so a manifest whose command line no longer works fails the suite.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "docs" / "kubernetes"

# Kubernetes' expansion of command, args and env values: $(NAME) when NAME is defined, $$
# for a literal $, anything else left as it is (k8s.io/kubernetes third_party/forked/golang
# expansion).
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def manifest_files() -> list[Path]:
    return sorted(MANIFESTS.glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in manifest_files():
        for doc in documents(path):
            yield path, doc


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one document of ``kind`` (and ``name``) among the manifests."""
    found = [d for _, d in all_documents() if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in docs/kubernetes, got {len(found)}"
    return found[0]


def expand(value: str, env: Mapping[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)
    return _REF.sub(sub, value)


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec(doc)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{doc['metadata']['name']} has no container {name!r}"
    return found[0]


def named_port(c: dict[str, Any], port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in c.get("ports", ()) if p.get("name") == port]
    assert len(found) == 1, f"container {c['name']} has no port named {port!r}"
    return found[0]


@dataclass
class Cluster:
    """What a cluster would provide, here: pod ``i``'s IP is 127.0.0.(i+1) (every 127/8
    address is this host's loopback, so each pod keeps ports of its own), Secrets' values,
    the addresses behind DNS names (``host:port`` or ``host`` -> local) and a directory
    standing for each volume mount."""

    secrets: dict[tuple[str, str], str] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    volumes: Path | None = None
    #: The Job's uid, as its pods' controller-uid label says (a fresh one per Job object).
    job_uid: str = "00000000-0000-0000-0000-000000000000"

    @staticmethod
    def pod_ip(index: int) -> str:
        return f"127.0.0.{index + 1}"

    def resolve(self, value: str) -> str:
        """``value`` with every DNS name of :attr:`names` replaced (whole names only)."""
        for name in sorted(self.names, key=len, reverse=True):
            value = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", self.names[name], value)
        return value

    def mounted(self, c: dict[str, Any], value: str) -> str:
        """A path under one of the container's volume mounts, moved under :attr:`volumes`."""
        for m in c.get("volumeMounts", ()):
            root = m["mountPath"].rstrip("/")
            if value == root or value.startswith(root + "/"):
                assert self.volumes is not None, f"{value} is on a volume: give Cluster.volumes"
                return str(self.volumes / m["name"]) + value[len(root):]
        return value

    def mounted_text(self, c: dict[str, Any], text: str) -> str:
        """``text`` (a configuration file) with every path on one of the container's volume
        mounts moved under :attr:`volumes`."""
        return re.sub(r"(?<![\w.-])/[\w./-]+", lambda m: self.mounted(c, m.group(0)), text)

    def mount_volumes(self, doc: dict[str, Any]) -> None:
        """Make ``doc``'s pod volumes under :attr:`volumes`, as the kubelet would mount them:
        a ConfigMap's or a Secret's keys as files (the Secret's from :attr:`secrets`), an
        emptyDir empty. Volume claims (a StatefulSet's data) are not made: a test gives
        the server a directory of its own."""
        assert self.volumes is not None, "give Cluster.volumes"
        for vol in pod_spec(doc).get("volumes", ()):
            where = self.volumes / vol["name"]
            where.mkdir(exist_ok=True)
            if "configMap" in vol:
                for key, text in find("ConfigMap", vol["configMap"]["name"])["data"].items():
                    (where / key).write_text(text)
            elif "secret" in vol:
                name = vol["secret"]["secretName"]
                keys = [k for (secret, k) in self.secrets if secret == name]
                assert keys, f"volume {vol['name']}: no Secret {name} (run secrets.sh)"
                for key in keys:
                    (where / key).write_text(self.secrets[(name, key)])
                    (where / key).chmod(vol["secret"].get("defaultMode", 0o644))
            else:
                assert "emptyDir" in vol, f"volume {vol['name']}: no local stand-in"


@dataclass
class Process:
    """One container as a local process: argv, the environment it adds, its directory, and
    the command that runs it with the container's privileges (:func:`as_pod`)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    prefix: list[str] = field(default_factory=list)


def as_pod(doc: dict[str, Any], c: dict[str, Any]) -> list[str]:
    """``setpriv`` arguments that run a process with what the container's security context
    leaves it: no capabilities (``drop: [ALL]``), no_new_privs (``allowPrivilegeEscalation:
    false``). Its user stays the suite's: this machine's interpreter (root's pyenv) is not
    reachable by another user, so ``runAsUser`` is checked in the manifests only."""
    ctx = {**pod_spec(doc).get("securityContext", {}), **c.get("securityContext", {})}
    prefix = []
    if ctx.get("capabilities", {}).get("drop") == ["ALL"]:
        prefix += ["--inh-caps=-all", "--bounding-set=-all"]
    if ctx.get("allowPrivilegeEscalation") is False:
        prefix.append("--no-new-privs")
    return ["setpriv", *prefix, "--"] if prefix else []


def local_process(doc: dict[str, Any], container_name: str, cluster: Cluster,
                  index: int = 0) -> Process:
    """What Kubernetes would run for pod ``index`` of ``doc`` (a Job, Deployment or
    StatefulSet), with the cluster's values replaced by ``cluster``'s."""
    c = container(doc, container_name)
    env: dict[str, str] = {}
    if doc["kind"] == "Job" and doc["spec"].get("completionMode") == "Indexed":
        env["JOB_COMPLETION_INDEX"] = str(index)  # the Job controller adds it to every container
    for var in c.get("env", ()):
        if "value" in var:
            env[var["name"]] = cluster.resolve(expand(var["value"], env))
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = cluster.secrets[(ref["name"], ref["key"])]
        elif "fieldRef" in source:
            env[var["name"]] = _field(doc, source["fieldRef"]["fieldPath"], cluster, index)
        else:
            raise AssertionError(f"env {var['name']}: no local stand-in for {source}")
    argv = [cluster.mounted(c, cluster.resolve(expand(a, env)))
            for a in (*c.get("command", ()), *c.get("args", ()))]
    # A flag's value after '=' may be a path on a volume too.
    argv = [a if "=" not in a else a.split("=", 1)[0] + "=" + cluster.mounted(c, a.split("=", 1)[1])
            for a in argv]
    return Process(argv, env, c.get("workingDir"), as_pod(doc, c))


def _field(doc: dict[str, Any], path: str, cluster: Cluster, index: int) -> str:
    if path == "status.podIP":
        return cluster.pod_ip(index)
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if label and doc["kind"] == "Job":  # the labels the Job controller puts on its pods
        pod_labels = {"batch.kubernetes.io/job-name": doc["metadata"]["name"],
                      "batch.kubernetes.io/controller-uid": cluster.job_uid}
        if label.group(1) in pod_labels:
            return pod_labels[label.group(1)]
    raise AssertionError(f"fieldRef {path}: no local stand-in")


def pod_names(doc: dict[str, Any], cluster: Cluster) -> dict[str, str]:
    """An Indexed Job's pods' DNS names (``JOB-i.SUBDOMAIN``, with a headless Service of that
    name) -> their local pod IPs."""
    spec = pod_spec(doc)
    sub = spec.get("subdomain")
    if not sub:
        return {}
    name = doc["metadata"]["name"]
    return {f"{name}-{i}.{sub}": cluster.pod_ip(i) for i in range(doc["spec"]["completions"])}


def pod_labels(doc: dict[str, Any], cluster: Cluster, index: int = 0) -> dict[str, str]:
    """The labels pod ``index`` of ``doc`` carries: its template's, plus those its controller
    adds (a Job's name, uid and completion index; a StatefulSet's pod name)."""
    labels = dict(doc["spec"]["template"]["metadata"].get("labels", {}))
    name = doc["metadata"]["name"]
    if doc["kind"] == "Job":
        labels.update({"batch.kubernetes.io/job-name": name, "job-name": name,
                       "batch.kubernetes.io/controller-uid": cluster.job_uid,
                       "controller-uid": cluster.job_uid})
        if doc["spec"].get("completionMode") == "Indexed":
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
    elif doc["kind"] == "StatefulSet":
        labels["statefulset.kubernetes.io/pod-name"] = f"{name}-{index}"
    return labels


# -- NetworkPolicy, as the API server's semantics say (the CNI enforces them; none runs here) --

def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector: every matchLabels pair and every matchExpressions requirement."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for req in selector.get("matchExpressions", ()):
        key, op, values = req["key"], req["operator"], req.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _port_matches(rule_ports: list[dict[str, Any]] | None, port: int, protocol: str,
                  named: dict[str, int]) -> bool:
    if not rule_ports:  # no ports: every port
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        first = named.get(want) if isinstance(want, str) else want
        if first is not None and first <= port <= p.get("endPort", first):
            return True
    return False


def admits(src: dict[str, str], dst: dict[str, str], port: int, *, named: dict[str, int],
           protocol: str = "TCP") -> bool:
    """Whether the manifests' NetworkPolicies let a pod labelled ``src`` connect to ``port``
    of a pod labelled ``dst``, both in the manifests' namespace (``named``: dst's container
    ports by name). A pod no Ingress policy selects admits everything; a selected pod admits
    what one rule of one selecting policy allows. Traffic from the pod's own node (the
    kubelet's probes) and ``kubectl port-forward`` are not subject to policies at all."""
    selecting = [d for _, d in all_documents() if d["kind"] == "NetworkPolicy"
                 and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
                 and _selects(d["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or ():
            peers = rule.get("from") or ()
            for peer in peers:
                # Only pod selectors in the policy's namespace are read here; a namespace or
                # an address block would need what this stand-in does not model.
                assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: {peer}"
            from_ok = not peers or any(_selects(p["podSelector"], src) for p in peers)
            if from_ok and _port_matches(rule.get("ports"), port, protocol, named):
                return True
    return False


# -- secrets.sh, run with a kubectl that keeps Secrets in a directory -----------------------

_KUBECTL = r"""#!{python}
# kubectl as secrets.sh uses it, keeping each Secret as a JSON file (key -> base64) in
# $KUBECTL_STUB_DIR: get secret NAME [-o jsonpath={{.data.KEY}}], create secret generic
# NAME --from-literal=K=V --from-file=K=PATH [--dry-run=client -o yaml], apply -f -.
import base64, json, os, re, sys
import yaml
store = os.environ["KUBECTL_STUB_DIR"]
args = sys.argv[1:]
def path(name):
    return os.path.join(store, name + ".json")
def load(name):
    with open(path(name)) as f:
        return json.load(f)
def save(name, data):
    with open(path(name), "w") as f:
        json.dump(data, f)
if args[:2] == ["get", "secret"]:
    if not os.path.exists(path(args[2])):
        sys.exit(f'Error from server (NotFound): secrets "{{args[2]}}" not found')
    if args[3:4] == ["-o"]:
        key = re.fullmatch(r"jsonpath=\{{\.data\.([\w.-]+)\}}", args[4]).group(1)
        sys.stdout.write(load(args[2])[key])
    else:
        print(args[2])
elif args[:3] == ["create", "secret", "generic"]:
    name, data, dry = args[3], {{}}, False
    for a in args[4:]:
        if a.startswith("--from-literal="):
            k, v = a.split("=", 2)[1:]
            data[k] = base64.b64encode(v.encode()).decode()
        elif a.startswith("--from-file="):
            k, f = a.split("=", 2)[1:]
            data[k] = base64.b64encode(open(f, "rb").read()).decode()
        elif a == "--dry-run=client":
            dry = True
        elif a not in ("-o", "yaml"):
            sys.exit(f"kubectl stub: {{a}}?")
    if dry:
        print(yaml.safe_dump({{"apiVersion": "v1", "kind": "Secret",
                              "metadata": {{"name": name}}, "data": data}}))
    elif os.path.exists(path(name)):
        sys.exit(f'error: failed to create secret secrets "{{name}}" already exists')
    else:
        save(name, data)
elif args == ["apply", "-f", "-"]:
    doc = yaml.safe_load(sys.stdin)
    assert doc["kind"] == "Secret", doc
    save(doc["metadata"]["name"], doc["data"])
else:
    sys.exit(f"kubectl stub: {{args}}?")
"""


def run_secrets_script(work: Path, *names: str,
                       fails: bool = False) -> dict[tuple[str, str], str]:
    """Run docs/kubernetes/secrets.sh (with ``names``) against a stand-in kubectl; the
    Secrets it leaves, by (name, key). Run again on the same ``work`` to add names. With
    ``fails``, the script must exit 2 with one line on stderr."""
    import base64
    import json
    import subprocess
    import sys

    bin_dir, store = work / "bin", work / "secrets"
    bin_dir.mkdir(exist_ok=True)
    store.mkdir(exist_ok=True)
    stub = bin_dir / "kubectl"
    stub.write_text(_KUBECTL.format(python=sys.executable))
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "KUBECTL_STUB_DIR": str(store)}
    done = subprocess.run(["bash", str(MANIFESTS / "secrets.sh"), *names], env=env,
                          capture_output=True, text=True, timeout=60)
    if fails:
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    else:
        assert done.returncode == 0, done.stderr
    found: dict[tuple[str, str], str] = {}
    for f in store.glob("*.json"):
        for key, value in json.loads(f.read_text()).items():
            found[(f.stem, key)] = base64.b64decode(value).decode()
    return found
