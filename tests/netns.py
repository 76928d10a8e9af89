"""Hosts as Linux network namespaces, for tests of partitions and network outages.

``Hosts(n)`` makes ``n`` namespaces, each with one veth pair whose other end sits on a bridge
in the root namespace; the bridge carries an address of its own, so a server bound to
``hosts.bridge_addr`` in the root namespace (Redis, say) is reachable from every host, and
the test itself still reaches it through the local route while hosts are cut off.

* ``prefix(i)`` runs a command on host ``i`` (``ip netns exec`` execs: the pid is the command's).
* ``cut(i)`` / ``heal(i)``: host ``i``'s cable at the switch (its bridge port down / up):
  packets are dropped silently, as in a real partition, not refused.
* ``cut_all()`` / ``heal_all()``: the bridge itself, so no host reaches anything.

Names carry this process's pid and a random tag, so parallel runs never collide; a run that
died without cleaning up leaves names whose pid is gone, and the next run removes them.
Everything made is removed on exit, whatever happened, processes left in a namespace first.
Without root or iproute2 :class:`NetnsUnavailable` says so in one line: these tests fail
then, they never skip.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import signal
import subprocess
import time
from types import TracebackType

#: Every name made here: ``ec`` + pid (hex) + ``x`` + a random tag (the run's tag), then a
#: kind (bridge, namespace, veth) and an index.
_NAME = re.compile(r"^(ec([0-9a-f]+)x[0-9a-f]{2})[bnv]\d*$")
#: A namespace is stale only this long after it was made: a run in another pid namespace
#: (a container sharing /run/netns) has a pid that looks dead from here.
_STALE_AFTER_S = 900


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_tag(name: str) -> str | None:
    """The run tag of a name made here by a process that is gone, else None."""
    m = _NAME.match(name)
    return m.group(1) if m and not _pid_alive(int(m.group(2), 16)) else None


def remove_stale() -> None:
    """Delete what runs whose process is gone left behind: their namespaces once they are
    old (with any process still in them), then links of runs that have no namespace left
    (a namespace takes its end of each veth with it; the bridge and the other ends stay)."""
    live_tags = set()
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if not m:
            continue
        try:
            age = time.time() - os.stat(f"/run/netns/{name}").st_mtime
        except OSError:
            age = _STALE_AFTER_S
        if _dead_tag(name) and age >= _STALE_AFTER_S:
            _kill_all_in(name)
            _ip("netns", "del", name, check=False)
        else:
            live_tags.add(m.group(1))
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            tag = _dead_tag(name)
            if tag and tag not in live_tags:
                _ip("link", "del", name, check=False)


def _kill_all_in(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        if pid.isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0-10.254.255.0 that no route of the root namespace overlaps."""
    used = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            dest = line.split()[1]
        if dest == "default":
            continue
        try:
            used.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            continue
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet for the test bridge")


def _check() -> None:
    try:
        p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           timeout=30)
    except FileNotFoundError:
        raise NetnsUnavailable("the `ip` command (iproute2) is missing: these tests run "
                               "hosts as network namespaces; install iproute2") from None
    if p.returncode != 0 or os.geteuid() != 0:
        raise NetnsUnavailable(
            "network namespaces are unavailable (`ip netns` needs root and kernel support; "
            f"euid {os.geteuid()}, `ip netns list`: {p.stderr.strip() or 'ok'}): these tests "
            "run hosts as namespaces and must run as root, as CI does")


class Hosts:
    """``n`` hosts on one bridge. Use as a context manager; see the module docstring."""

    def __init__(self, n: int) -> None:
        _check()
        self.n = n
        tag = f"ec{os.getpid():x}x{random.randrange(256):02x}"
        self.bridge = f"{tag}b"
        self.namespaces = [f"{tag}n{i}" for i in range(n)]
        self.veths = [f"{tag}v{i}" for i in range(n)]
        self._made: list[tuple[str, str]] = []  # (kind, name), in creation order
        net = _free_subnet()
        hosts = list(net.hosts())
        self.prefixlen = net.prefixlen
        self.bridge_addr = str(hosts[0])
        self.addrs = [str(hosts[i + 1]) for i in range(n)]

    # -- set up and tear down -------------------------------------------------------------
    def __enter__(self) -> Hosts:
        try:
            remove_stale()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.bridge_addr}/{self.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addrs, strict=True):
            try:
                _ip("netns", "add", ns)
            except RuntimeError as exc:
                raise NetnsUnavailable(f"`ip netns add` failed: {exc}; these tests need "
                                       "network namespaces (root, as in CI)") from None
            self._made.append(("netns", ns))
            # The peer is made inside the namespace as eth0: nothing of it shows in the root.
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", veth))
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            for args in (("addr", "add", f"{addr}/{self.prefixlen}", "dev", "eth0"),
                         ("link", "set", "eth0", "up"), ("link", "set", "lo", "up")):
                _ip("-n", ns, *args)

    def close(self) -> None:
        """Remove everything made, processes left in the namespaces first. Idempotent."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _kill_all_in(name)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)  # a veth takes its peer with it
        self._made.clear()

    # -- use ------------------------------------------------------------------------------
    def prefix(self, i: int) -> list[str]:
        """Prepend to a command line to run it on host ``i``."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def cut(self, i: int) -> None:
        """Pull host ``i``'s cable: its port on the bridge goes down."""
        _ip("link", "set", self.veths[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "up")

    def cut_all(self) -> None:
        """The switch itself goes down: no host reaches the bridge address or another host."""
        _ip("link", "set", self.bridge, "down")

    def heal_all(self) -> None:
        _ip("link", "set", self.bridge, "up")
