"""A real Redis Cluster of N masters on loopback, no replicas (tests/test_cluster.py and
bench/cluster_logs.py): what ``redis-cli --cluster create ... --cluster-replicas 0`` makes,
without needing redis-cli."""

from __future__ import annotations

import random

import redis
from redis.crc import key_slot

from elastic_agent.coordination.ports import port_is_free
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.waiting import wait_until

SLOTS = 16384


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and exists as well."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        if port_is_free(port) and port_is_free(port + 10000):
            return port
    raise AssertionError("no free port pair for a cluster node")


class Cluster:
    """``masters`` masters, node ``i`` owning slots ``[starts[i], starts[i + 1])`` (the even
    split redis-cli makes: 0-5460, 5461-10922, 10923-16383 for three)."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes = [RedisServer(port=cluster_port(), extra_args=["--cluster-enabled", "yes",
                                              "--cluster-config-file", "nodes.conf",
                                              "--cluster-node-timeout", "5000"])
                      for _ in range(masters)]
        self.starts = [round(i * SLOTS / masters) for i in range(masters)] + [SLOTS]

    def start(self) -> Cluster:
        for node in self.nodes:
            node.start()
        n = len(self.nodes)
        clients = [redis.Redis(port=node.port, protocol=2) for node in self.nodes]
        try:
            # Each node takes its slots, then they meet.
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "ADDSLOTS",
                                  *range(self.starts[i], self.starts[i + 1]))
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)

            def ready() -> bool:
                for c in clients:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    if ("cluster_state:ok" not in info or f"cluster_known_nodes:{n}" not in info
                            or len(c.execute_command("CLUSTER", "SLOTS")) != n):
                        return False
                return True

            wait_until(ready, 30, "the cluster to form")
        finally:
            for c in clients:
                c.close()
        return self

    def url(self, i: int) -> str:
        return self.nodes[i].url

    def owner(self, key: str) -> int:
        slot = key_slot(key.encode())
        return next(i for i in range(len(self.nodes))
                    if self.starts[i] <= slot < self.starts[i + 1])

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
