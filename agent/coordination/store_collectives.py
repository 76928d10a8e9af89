"""Collectives over a :class:`~.store.RedisStore`: a reusable barrier and an all-gather, with
torch's ``torch.distributed.elastic.utils.store`` semantics (the agent's exit barrier uses the
barrier; the store's contract tests use both). Each call is O(1) commands for its caller plus
one wait; a timeout names the ranks that never arrived (one lookup of ``world_size`` keys,
only then).
"""

from __future__ import annotations

from .store import (
    DEFAULT_TIMEOUT,
    RedisStore,
    StoreTimeoutError,
    Timeout,
    _fmt_seconds,
    _seconds,
)

__all__ = ["barrier", "synchronize"]


def barrier(
    store: RedisStore,
    world_size: int,
    key_prefix: str,
    timeout: Timeout = DEFAULT_TIMEOUT,
    rank: int | None = None,
) -> None:
    """Block until ``world_size`` callers have entered the barrier named ``key_prefix``.

    Reusable: the same ``key_prefix`` may be used for any number of consecutive barriers
    among the same ``world_size`` participants. Each arrival takes a ticket from an
    ``add`` counter; ticket ``n`` belongs to generation ``(n - 1) // world_size``, and the
    arrival that completes a generation sets its ``done`` key (and deletes the keys of the
    generation before, which every participant has left by then).

    ``rank`` is optional; with it, a timeout names the ranks that never arrived.

    Raises:
        StoreTimeoutError: the generation did not fill up within ``timeout``. A barrier
            that timed out leaves its generation open: do not reuse the prefix after it.
    """
    if world_size < 1:
        raise ValueError(f"barrier {key_prefix!r}: world_size must be at least 1")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"barrier {key_prefix!r}: rank {rank} is outside 0..{world_size - 1}")
    n = store.add(f"{key_prefix}/arrivals", 1)
    gen = (n - 1) // world_size
    if rank is not None:
        store.set(f"{key_prefix}/{gen}/rank/{rank}", b"1")
    done = f"{key_prefix}/{gen}/done"
    if n % world_size == 0:
        store.set(done, b"1")
        if gen > 0:
            old = gen - 1
            store.delete_keys([f"{key_prefix}/{old}/done"]
                              + [f"{key_prefix}/{old}/rank/{r}" for r in range(world_size)])
    try:
        store.wait([done], timeout)
    except StoreTimeoutError as exc:
        seconds = _seconds(timeout)
        if rank is not None:
            absent = _absent_ranks(store, f"{key_prefix}/{gen}/rank/", world_size)
            detail = (f"{world_size - len(absent)} of {world_size} ranks arrived; "
                      f"missing ranks: {', '.join(map(str, absent))}")
        else:
            arrived = min(world_size, store.add(f"{key_prefix}/arrivals", 0) - gen * world_size)
            detail = f"{arrived} of {world_size} ranks arrived"
        raise StoreTimeoutError(
            f"barrier {key_prefix!r}: timeout after {_fmt_seconds(seconds)} s: {detail}",
            exc.keys, seconds,
        ) from None


def synchronize(
    store: RedisStore,
    data: bytes,
    rank: int,
    world_size: int,
    key_prefix: str,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> list[bytes]:
    """All-gather: every rank passes its ``data`` and gets every rank's, in rank order.

    Reusable under the same ``key_prefix`` like :func:`barrier` (a generation per round
    of ``world_size`` calls); a round's data is deleted by the call that completes the
    next round, when every rank has read it.

    Raises:
        StoreTimeoutError: some rank did not contribute within ``timeout``; the message
            names the missing ranks.
    """
    if world_size < 1:
        raise ValueError(f"synchronize {key_prefix!r}: world_size must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"synchronize {key_prefix!r}: rank {rank} is outside 0..{world_size - 1}"
        )
    n = store.add(f"{key_prefix}/arrivals", 1)
    gen = (n - 1) // world_size
    prefix = f"{key_prefix}/{gen}/data/"
    store.set(f"{prefix}{rank}", data)
    if n % world_size == 0 and gen > 0:
        store.delete_keys([f"{key_prefix}/{gen - 1}/data/{r}" for r in range(world_size)])
    try:
        return store.multi_get([f"{prefix}{r}" for r in range(world_size)], timeout=timeout)
    except StoreTimeoutError as exc:
        seconds = _seconds(timeout)
        absent = _absent_ranks(store, prefix, world_size)
        raise StoreTimeoutError(
            f"synchronize {key_prefix!r}: timeout after {_fmt_seconds(seconds)} s: "
            f"{world_size - len(absent)} of {world_size} ranks arrived; "
            f"missing ranks: {', '.join(map(str, absent))}",
            exc.keys, seconds,
        ) from None


def _absent_ranks(store: RedisStore, prefix: str, world_size: int) -> list[int]:
    _, present = store._check([f"{prefix}{r}" for r in range(world_size)], fetch=False)
    return [r for r, here in enumerate(present) if not here]
