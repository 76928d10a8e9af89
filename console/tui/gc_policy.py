"""When Python's cyclic garbage collector may pause the console. No Textual.

At 50k lines/s the console allocates a few hundred thousand container objects a second, most
of them Textual's per-frame Strips, which refer to themselves through their own caches and so
are freed only by the cyclic collector. Every collection stops the event loop, keys included,
for as long as it walks its generation:

* young collections (generations 0 and 1) run on a schedule, not only on the allocation
  counters: generation 0 at every :meth:`GcPolicy.tick` (10 times a second), generation 1 at
  every ``YOUNG1_EVERY``-th. The counters alone cannot be trusted here: Python counts
  allocations *minus deallocations* of container objects, and once the per-rank rings are full
  every new line (a tuple, tracked until a collection looks at it) comes with an old line
  freed, so the count stands still while the young generation grows without bound; the first
  collection after that walked 300k-400k objects (~175 ms). On the schedule each young
  collection walks what 0.1 s (or 1 s) left, a few milliseconds' work. The counters
  (``YOUNG_THRESHOLDS``) stay as a backstop for bursts between two ticks;
* full collections walk everything that outlived the young ones (100-200 ms with 1,024 ranks),
  so they are not left to the allocation counters, which fire at a random moment, often in the
  middle of someone typing. :meth:`GcPolicy.tick` runs one when the user has not touched the
  keyboard or mouse for ``idle_s`` and the last one is ``min_interval_s`` old, or regardless
  once it is ``max_interval_s`` old, which bounds the garbage (memory) held meanwhile.

What survived the history load never dies (the rings' lists, Textual's widgets): ``settle``
moves it to the permanent generation (``gc.freeze``) so no collection walks it again.

Freed is not returned: the history load decodes a few hundred thousand lines at once (~100 MiB
of replies, batches and strings, freed once folded), and glibc keeps the freed heap for the
process. ``settle`` and every full collection hand it back (``malloc_trim``): at 1,024 ranks
that was the difference between 310 MiB and under 300 (``bench/console_bench.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable

__all__ = ["YOUNG1_EVERY", "YOUNG_THRESHOLDS", "GcPolicy", "return_freed_memory"]

#: Generation 0 every 10,000 net allocations, generation 1 every 50 of those (a backstop).
YOUNG_THRESHOLDS = (10_000, 50)
#: Every tick collects generation 0; every YOUNG1_EVERY-th tick generation 1 as well.
YOUNG1_EVERY = 10
#: The allocation counters never trigger a full collection by themselves.
_NO_AUTOMATIC_FULL = 1_000_000_000


def _load_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_trim()


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``); False where
    there is no such call (musl, macOS): nothing is lost but the RSS figure."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class GcPolicy:
    """Young collections on a schedule, full ones at quiet moments (see the module doc)."""

    def __init__(self, idle_s: float = 2.0, min_interval_s: float = 30.0,
                 max_interval_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self._clock = clock
        self.last_input = clock()
        self.last_full = clock()
        self.full_collections = 0
        self.young_collections = 0
        self.last_pause_s = 0.0

    def settle(self) -> None:
        """After the history load: freeze the survivors and take over full collections."""
        gc.collect()
        gc.freeze()
        gc.set_threshold(*YOUNG_THRESHOLDS, _NO_AUTOMATIC_FULL)
        return_freed_memory()
        self.last_full = self._clock()

    def saw_input(self) -> None:
        """A key or a mouse button: the user is there, do not pause now."""
        self.last_input = self._clock()

    def due(self) -> bool:
        """Whether a full collection should run now."""
        now = self._clock()
        since = now - self.last_full
        if since >= self.max_interval_s:
            return True
        return since >= self.min_interval_s and now - self.last_input >= self.idle_s

    def tick(self) -> bool:
        """Called 10 times a second: a young collection, or a full one if it is due. True
        if a full collection ran."""
        if not self.due():
            self.young_collections += 1
            gc.collect(1 if self.young_collections % YOUNG1_EVERY == 0 else 0)
            return False
        t0 = time.perf_counter()
        gc.collect()
        return_freed_memory()
        self.last_pause_s = time.perf_counter() - t0
        self.last_full = self._clock()
        self.full_collections += 1
        return True
