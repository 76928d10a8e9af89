"""PackedLogBuffer: the same ring as LogBuffer in a fifth of the memory (issue 15, point 4).

The memory figure of the whole console is bench/console_bench.py's; here the ring itself: it
behaves as LogBuffer under every operation (a random model, with redraws and clears), a full
ring of realistic lines costs a fraction of LogBuffer's, and a scan unpacks each block once.
"""

from __future__ import annotations

import random
import sys
import tracemalloc
from pathlib import Path

import pytest

from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_console.job import packed_buffer
from elastic_console.job.logbuffer import LogBuffer
from elastic_console.job.packed_buffer import (
    BLOCK,
    KEEP,
    SMALL_BLOCK,
    SMALL_KEEP,
    SMALL_RING,
    PackedLogBuffer,
)
from elastic_console.job.state import JobView

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from log_view_bench import make_pool

T0 = 1_700_000_000_000
POOL = make_pool(4096)


def realistic(n: int, start: int = 0) -> list[tuple[int, int, str, str]]:
    """Lines as the console holds them: plain tuples, each text its own str (as decoded)."""
    out = []
    for i in range(start, start + n):
        stream, text = POOL[i % len(POOL)]
        out.append((T0 + i // 5, 3, stream, text.encode().decode()))
    return out


def test_it_behaves_as_logbuffer_under_appends_redraws_and_clears() -> None:
    rnd = random.Random(11)
    for cap in (1, KEEP, BLOCK - 1, BLOCK, BLOCK + KEEP + 1, 2 * BLOCK + 1, 128, SMALL_RING,
                SMALL_RING + 1, 300):
        packed, plain = PackedLogBuffer(cap), LogBuffer(cap)
        made = 0
        for _ in range(400):
            op = rnd.random()
            if op < 0.6:
                k = rnd.choice([1, 2, 5, BLOCK, 2 * BLOCK + 3, cap, cap + 7])
                new = realistic(k, made)
                made += k
                if k == 1 and rnd.random() < 0.5:
                    packed.append(new[0])
                    plain.append(new[0])
                else:
                    assert packed.extend(new) == plain.extend(new) == k
            elif op < 0.9 and plain:
                # A redraw anywhere held: the newest rows (recent tuples) and old (packed) ones.
                seq = rnd.choice([plain.total_appended - 1,
                                  rnd.randrange(plain.first_seq, plain.total_appended)])
                line = (T0, 3, "out", f"redrawn {made}")
                made += 1
                edits = plain.edits
                assert packed.replace(seq, line) and plain.replace(seq, line)
                assert packed.edited_since(edits) == plain.edited_since(edits) == [seq]
            elif op < 0.93:
                packed.clear()
                plain.clear()
            if rnd.random() < 0.3:  # other rings' reads pushed this one's unpacked blocks out
                packed_buffer._unpacked.clear()
            assert not packed.replace(plain.first_seq - 1, (T0, 3, "out", "gone"))
            assert (packed.total_appended, packed.first_seq, len(packed)) == \
                   (plain.total_appended, plain.first_seq, len(plain))
            assert list(packed) == list(plain)
            if plain:
                a, b = sorted(rnd.randrange(plain.first_seq - 3, plain.total_appended + 3)
                              for _ in range(2))
                assert packed.lines_between(a, b) == plain.lines_between(a, b)
                i = rnd.randrange(len(plain))
                assert packed[i] == plain[i] and packed[-1] == plain[-1]
                assert packed[i::7] == plain[i::7]
                with pytest.raises(IndexError):
                    packed.get(plain.total_appended)


def test_a_full_ring_costs_a_fraction_of_logbuffers() -> None:
    cost = {}
    for ring in (LogBuffer, PackedLogBuffer):
        tracemalloc.start()
        buf = ring(2000)
        for start in range(0, 6000, 5):  # turned over twice, five lines a batch
            buf.extend(realistic(5, start))
        cost[ring] = tracemalloc.get_traced_memory()[0] / len(buf)
        tracemalloc.stop()
        del buf
    # ~240 bytes a line as tuples; ~40 packed (the newest lines stay tuples).
    assert cost[PackedLogBuffer] < 60 and cost[PackedLogBuffer] * 4 < cost[LogBuffer], cost


def test_a_small_ring_keeps_few_lines_as_tuples() -> None:
    # 32,768 ranks share RANK_LINES_TOTAL: 128 lines a ring. With 32-line blocks and 8 kept,
    # a fifth of such a ring stayed tuples, most of the console's memory at that size.
    small, big = PackedLogBuffer(128), PackedLogBuffer(SMALL_RING + 1)
    most = {small: 0, big: 0}
    for start in range(1000):  # a line at a time, as a rank of a big job prints
        for ring in most:
            ring.extend(realistic(1, start))
            most[ring] = max(most[ring], len(ring._recent))
    assert most[small] == SMALL_KEEP + SMALL_BLOCK - 1
    assert most[big] == KEEP + BLOCK - 1  # a bigger ring keeps the bigger blocks
    assert list(small) == realistic(1000)[-128:]


def test_a_scan_unpacks_each_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = PackedLogBuffer(4000)
    buf.extend(realistic(4000))
    unpacked: list[bytes] = []
    real = packed_buffer._unpack
    monkeypatch.setattr(packed_buffer, "_unpack", lambda blob: unpacked.append(blob) or real(blob))
    seqs = range(buf.first_seq, buf.total_appended)
    assert [buf.get(s) for s in seqs] == buf.lines_between(0, 4000) == realistic(4000)
    packed_blocks = len(buf._blocks)
    assert packed_blocks >= 4000 // BLOCK - 2 and len(unpacked) <= packed_blocks * 2
    # The unpacked blocks kept for reads are bounded, whatever was read.
    assert len(packed_buffer._unpacked) <= packed_buffer.UNPACKED_KEPT < packed_blocks


def test_the_job_view_keeps_each_ranks_lines_packed() -> None:
    view = JobView("job-1", scrollback=500)
    sent = realistic(1200)
    for seq, start in enumerate(range(0, 1200, 6), 1):
        view.apply_logs(LogBatch(node="n0", rank=3, local_rank=3, attempt=0, stream="out",
                                 seq=seq, lines=[t for _, _, _, t in sent[start:start + 6]],
                                 id=f"{T0 + start}-0"))
    ring = view.logs[3]
    assert isinstance(ring, PackedLogBuffer) and ring._blocks
    assert [line[3] for line in ring] == [t for _, _, _, t in sent[-500:]]
    assert [line[3] for line in view.tail(3, rank=3)] == [t for _, _, _, t in sent[-3:]]
