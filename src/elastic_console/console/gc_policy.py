"""When Python's cyclic garbage collector may pause the console. No Textual.

At 50k lines/s the console allocates a few hundred thousand container objects a second, most
of them Textual's per-frame Strips, which refer to themselves through their own caches and so
are freed only by the cyclic collector. Every collection stops the event loop, keys included,
for as long as it walks its generation:

* young collections (generations 0 and 1) are made frequent and small: ``YOUNG_THRESHOLDS``
  keep each under ~30 ms at that rate (bench/console_bench.py --trace-stalls);
* full collections walk everything that outlived the young ones (100-200 ms with 1,024 ranks),
  so they are not left to the allocation counters, which fire at a random moment, often in the
  middle of someone typing. :meth:`GcPolicy.tick` runs one when the user has not touched the
  keyboard or mouse for ``idle_s`` and the last one is ``min_interval_s`` old, or regardless
  once it is ``max_interval_s`` old, which bounds the garbage (memory) held meanwhile.

What survived the history load never dies (the rings' lists, Textual's widgets): ``settle``
moves it to the permanent generation (``gc.freeze``) so no collection walks it again.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

__all__ = ["YOUNG_THRESHOLDS", "GcPolicy"]

#: Generation 0 every 10,000 net allocations, generation 1 every 50 of those.
YOUNG_THRESHOLDS = (10_000, 50)
#: The allocation counters never trigger a full collection by themselves.
_NO_AUTOMATIC_FULL = 1_000_000_000


class GcPolicy:
    """Full collections at quiet moments (see the module docstring)."""

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
        self.last_pause_s = 0.0

    def settle(self) -> None:
        """After the history load: freeze the survivors and take over full collections."""
        gc.collect()
        gc.freeze()
        gc.set_threshold(*YOUNG_THRESHOLDS, _NO_AUTOMATIC_FULL)
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
        """Run a full collection if one is due (called a few times a second). True if it ran."""
        if not self.due():
            return False
        t0 = time.perf_counter()
        gc.collect()
        self.last_pause_s = time.perf_counter() - t0
        self.last_full = self._clock()
        self.full_collections += 1
        return True
