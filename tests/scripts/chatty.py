"""A worker that prints CHATTY_LINES lines of CHATTY_WIDTH characters, then exits 0."""

import os
import sys

lines = int(os.environ.get("CHATTY_LINES", "100000"))
width = int(os.environ.get("CHATTY_WIDTH", "80"))
rank = os.environ.get("RANK", "?")
pad = "x" * width
out = sys.stdout
for i in range(lines):
    out.write(f"rank {rank} line {i} {pad}\n")
out.flush()
