"""TorchRedisStore next to torch's own stores and store utilities.

* The same calls on torch's ``HashStore`` and on TorchRedisStore give the same answers (the
  store contract torch's callers rely on, ``compare_set`` and ``add`` included).
* torch.distributed.elastic.utils.store (``barrier`` with rank tracing, ``synchronize``,
  ``get_all``), which torch's agents run on the rendezvous store, works on TorchRedisStore
  from many threads, and a rank that never comes is named in the timeout, as torch says it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier, get_all, synchronize

from elastic_agent.coordination.torch_compat import TorchRedisStore

WORLD = 8


@pytest.fixture
def stores(redis_url: str, job_id: str) -> Iterator[list[TorchRedisStore]]:
    """One store per rank, as each process of a job has its own connection."""
    made = [TorchRedisStore(redis_url, job_id, "peers", timeout=30) for _ in range(WORLD)]
    yield made
    for s in made:
        s.close()


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:
        return "error", type(exc).__name__


def script(store: dist.Store) -> list[tuple[str, Any]]:
    s = store
    return [outcome(f) for f in (
        lambda: s.set("a", b"1"),
        lambda: s.get("a"),
        lambda: s.add("n", 5),
        lambda: s.add("n", -2),
        lambda: s.compare_set("a", b"1", b"2"),  # matches: swapped
        lambda: s.compare_set("a", b"1", b"3"),  # does not: the current value
        lambda: s.compare_set("fresh", b"", b"x"),  # absent and expected empty: set
        lambda: s.compare_set("absent", b"y", b"z"),  # absent, expected something: expected
        lambda: s.get("fresh"),
        lambda: s.check(["a", "n"]),
        lambda: s.check(["a", "nope"]),
        lambda: s.append("a", b"tail"),
        lambda: s.get("a"),
        lambda: s.multi_set(["k1", "k2"], [b"v1", b"v2"]),
        lambda: s.multi_get(["k1", "k2", "a"]),
        lambda: s.delete_key("k1"),
        lambda: s.delete_key("k1"),
        lambda: s.check(["k1"]),
        lambda: s.get("n"),
    )]


def test_same_answers_as_torchs_hash_store(redis_url: str, job_id: str) -> None:
    ours = TorchRedisStore(redis_url, job_id, "contract", timeout=5)
    try:
        assert script(ours) == script(dist.HashStore())
    finally:
        ours.close()


def test_a_wait_that_times_out_says_timeout_like_torchs_stores(redis_url: str,
                                                               job_id: str) -> None:
    ours = TorchRedisStore(redis_url, job_id, "w", timeout=5)
    try:
        with pytest.raises(dist.DistStoreError) as info:
            ours.wait(["never"], timedelta(milliseconds=300))
        assert "timeout" in str(info.value).lower(), info.value
    finally:
        ours.close()


def run_ranks(work: Callable[[int], Any], ranks: range) -> dict[int, tuple[str, Any]]:
    results: dict[int, tuple[str, Any]] = {}

    def one(rank: int) -> None:
        try:
            results[rank] = ("ok", work(rank))
        except Exception as exc:
            results[rank] = ("error", exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    return results


def test_torch_elastic_barrier_synchronize_and_get_all(stores: list[TorchRedisStore]) -> None:
    def work(rank: int) -> Any:
        store = stores[rank]
        barrier(store, WORLD, "b/", barrier_timeout=60, rank=rank)
        return synchronize(store, f"data-{rank}".encode(), rank, WORLD, "sync/", timeout=60)

    results = run_ranks(work, range(WORLD))
    expected = [f"data-{r}".encode() for r in range(WORLD)]
    assert results == {r: ("ok", expected) for r in range(WORLD)}
    assert get_all(stores[3], 3, "sync/", WORLD) == expected


def test_torch_barrier_names_the_rank_that_never_came(stores: list[TorchRedisStore]) -> None:
    present = range(WORLD - 1)  # the last rank never arrives

    def work(rank: int) -> Any:
        barrier(stores[rank], WORLD, "late/", barrier_timeout=1, rank=rank, trace_timeout=1)

    results = run_ranks(work, present)
    assert all(kind == "error" and isinstance(exc, dist.DistStoreError)
               for kind, exc in results.values()), results
    message = str(results[0][1])
    assert f"missing_ranks=[{WORLD - 1}]" in message, message
    assert "Timed out waiting on barrier" in message
