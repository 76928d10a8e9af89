"""The Kubernetes manifests of docs/kubernetes/, read back into local processes.

Kubernetes cannot run here, so the tests run what the manifests say a container runs: its
command, args and environment, with the values only a cluster has replaced by local ones
(:class:`Cluster`): the downward API's pod IP and the Indexed Job's pod index, the Secrets'
values, the Services' and pods' DNS names, and the volumes' mount paths. Everything else
comes from the YAML, so a manifest whose command line no longer works fails the suite.
"""

from __future__ import annotations

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


@dataclass
class Process:
    """One container as a local process: argv, the environment it adds, its directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None


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
    return Process(argv, env, c.get("workingDir"))


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
