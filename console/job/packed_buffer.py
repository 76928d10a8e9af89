"""PackedLogBuffer: a LogRing that keeps its older lines packed, a few bytes per line. No Textual.

Why: a rank's ring holds 2,000 lines by default and a job has 1,024 ranks or more. As tuples
of Python objects a line of 80 characters costs ~240 bytes (the tuple, the str, the list slot),
so 1,024 full rings held ~470 MiB. Log lines repeat themselves (the same words, the same
numbers' shapes), so packed and compressed they cost ~40 bytes
(``bench/console_bench.py`` gives the console's RSS; ``tests/test_packed_buffer.py`` checks a
bound per line).

How: lines are grouped in blocks of :data:`BLOCK` consecutive seqs (:data:`SMALL_BLOCK` in a
ring of :data:`SMALL_RING` lines or fewer). The newest lines, at least :data:`KEEP`
(:data:`SMALL_KEEP`) of them, stay as tuples in ``_recent``, where appends, reads of the tail (a view
following its rank) and in-place redraws (a progress bar's row is among the newest lines) cost
what they cost in :class:`~elastic_console.job.logbuffer.LogBuffer`. Once ``_recent`` holds a
block and :data:`KEEP` lines more, its oldest block is packed: ``marshal`` of its tuples (our
own objects, never bytes from outside: marshal is not for untrusted input), compressed with
LZ4 (~10 us a block of 32 lines, 0.3 us a line). zlib at level 1 packs ~30% tighter but costs
1.4 us a line: at 50k lines/s that was the margin by which the console fell behind its feed
(and a thread does not help: it waits up to 5 ms for the GIL after every block). Reading a
packed line unpacks its block; the last few blocks unpacked are kept (:data:`UNPACKED_KEPT`,
shared by every ring), so scrolling or a rescan unpacks each block once. Replacing a packed
line repacks its block (rare: see above).

Packed blocks are bytes: the cyclic GC never walks them, which also takes ~2M tuples out of
every full collection.
"""

from __future__ import annotations

import itertools
import marshal
from collections import OrderedDict, deque

import lz4.block

from .logbuffer import LogLine, LogRing

__all__ = ["BLOCK", "KEEP", "SMALL_BLOCK", "SMALL_KEEP", "SMALL_RING", "PackedLogBuffer"]

#: Lines per packed block: big enough to compress well (~2.5 KB of text), small enough that
#: unpacking one for a screenful of lines is cheap and the tuples kept per ring stay few.
BLOCK = 32
#: The newest lines never packed: a progress bar's row is redrawn in place there, cheaply.
KEEP = 8
#: Rings of SMALL_RING lines or fewer (many ranks share RANK_LINES_TOTAL: 128 lines each at
#: 32,768) use smaller blocks and keep fewer lines as tuples. A ring holds KEEP to KEEP + BLOCK
#: - 1 of its newest lines as tuples (~300 bytes each): with 32 and 8, a fifth of a 128-line
#: ring, and most of the memory of 32,768 of them (416 MiB for 4.2M lines; 271 MiB with 16
#: and 4; 244 with 8 and 4, but packing 8 lines at a time cost the reader 0.8 us a line, 12%).
#: Smaller blocks pack less tightly: a 2,000-line ring stays at 32 and 8 (32 bytes a line held
#: against 46 with 16 and 4).
SMALL_RING = 256
SMALL_BLOCK, SMALL_KEEP = 16, 4
#: Blocks unpacked and kept for reads, across every ring (a screen shows ~60 lines: 2-3 blocks).
UNPACKED_KEPT = 64
_ids = itertools.count()
# (ring id, block's first seq) -> its lines; LRU. A ring id is never reused (unlike id()).
_unpacked: OrderedDict[tuple[int, int], list[LogLine]] = OrderedDict()


def _pack(lines: list[LogLine]) -> bytes:
    try:
        raw = marshal.dumps(lines)
    except ValueError:  # tuple subclasses (LogLine) are not marshallable; the console's are plain
        raw = marshal.dumps([tuple(line) for line in lines])
    return lz4.block.compress(raw)


def _unpack(blob: bytes) -> list[LogLine]:
    return marshal.loads(lz4.block.decompress(blob))  # only ever bytes _pack made


class PackedLogBuffer(LogRing):
    """A :class:`~elastic_console.job.logbuffer.LogRing` that packs all but its newest lines.

    Same contract as :class:`~elastic_console.job.logbuffer.LogBuffer`; lines read back are equal
    to the lines appended, not the same objects (packed ones come back as plain tuples).
    """

    __slots__ = ("_base", "_block_lines", "_blocks", "_id", "_keep", "_recent", "_recent_start")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        small = self._cap <= SMALL_RING
        self._block_lines = SMALL_BLOCK if small else BLOCK
        self._keep = SMALL_KEEP if small else KEEP
        self._id = next(_ids)
        self._blocks: deque[bytes] = deque()  # packed, _block_lines each, contiguous
        self._base = 0  # seq of the first line of _blocks[0]
        self._recent: list[LogLine] = []  # lines from _recent_start up to total, as tuples
        self._recent_start = 0  # == _base + _block_lines * len(_blocks)

    # -- writing --------------------------------------------------------------------------------

    def _extend(self, lines: list[LogLine]) -> None:
        """Store them; pack whole blocks older than the newest ``_keep``."""
        n = len(lines)
        self._recent.extend(lines)
        self._total += n
        if self._total - self._start > self._cap:
            self._start = self._total - self._cap
            self._forget()
        recent, block = self._recent, self._block_lines
        while len(recent) >= block + self._keep:
            self._blocks.append(_pack(recent[:block]))
            del recent[:block]
            self._recent_start += block

    extend_list = _extend

    def _forget(self) -> None:
        """Drop the blocks (and recent lines) wholly below ``first_seq``."""
        start, blocks, block = self._start, self._blocks, self._block_lines
        while blocks and self._base + block <= start:
            blocks.popleft()
            _unpacked.pop((self._id, self._base), None)
            self._base += block
        if not blocks and self._recent_start < start:
            del self._recent[:start - self._recent_start]
            self._recent_start = self._base = start

    def _put(self, seq: int, line: LogLine) -> None:
        if seq >= self._recent_start:
            self._recent[seq - self._recent_start] = line
            return
        k, i = divmod(seq - self._base, self._block_lines)
        block = list(self._block(k))
        block[i] = line
        self._blocks[k] = _pack(block)
        _unpacked[(self._id, self._base + k * self._block_lines)] = block  # the stale copy

    # -- reading --------------------------------------------------------------------------------

    def _block(self, k: int) -> list[LogLine]:
        """The lines of packed block ``k`` (0 = the oldest held), unpacked once while used."""
        key = (self._id, self._base + k * self._block_lines)
        lines = _unpacked.get(key)
        if lines is None:
            lines = _unpacked[key] = _unpack(self._blocks[k])
            if len(_unpacked) > UNPACKED_KEPT:
                _unpacked.popitem(last=False)
        else:
            _unpacked.move_to_end(key)
        return lines

    def get(self, seq: int) -> LogLine:
        if not self._start <= seq < self._total:
            raise IndexError(f"seq {seq} not in [{self._start}, {self._total})")
        if seq >= self._recent_start:
            return self._recent[seq - self._recent_start]
        k, i = divmod(seq - self._base, self._block_lines)
        return self._block(k)[i]

    def lines_between(self, start_seq: int, end_seq: int) -> list[LogLine]:
        a = max(start_seq, self._start)
        b = min(end_seq, self._total)
        if b <= a:
            return []
        rs = self._recent_start
        if a >= rs:
            return self._recent[a - rs:b - rs]
        out: list[LogLine] = []
        seq, block = a, self._block_lines
        while seq < b and seq < rs:
            k, i = divmod(seq - self._base, block)
            take = min(block - i, b - seq, rs - seq)
            out.extend(self._block(k)[i:i + take])
            seq += take
        if seq < b:
            out.extend(self._recent[:b - rs])
        return out
